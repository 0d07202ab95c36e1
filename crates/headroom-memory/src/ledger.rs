//! The ledger of reservations held on one device. A [`Reservation`] is taken at admission and
//! given back when it is dropped, on completion, cancellation and failure alike, so no path can
//! leak one.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use crate::footprint::human_bytes;

#[derive(Debug)]
struct Inner {
    capacity_bytes: u64,
    held_bytes: u64,
    next_id: u64,
    held: BTreeMap<u64, (String, u64)>,
}

impl Inner {
    /// Takes `bytes` if `keep_free` is still free after them; the refusal names `device`.
    fn take(&mut self, device: &str, bytes: u64, keep_free: u64) -> Result<(), Insufficient> {
        let free = self.capacity_bytes.saturating_sub(self.held_bytes).saturating_sub(keep_free);
        if bytes > free {
            return Err(Insufficient {
                device: device.to_string(),
                wanted: human_bytes(bytes),
                free: human_bytes(free),
                capacity: human_bytes(self.capacity_bytes),
                wanted_bytes: bytes,
                free_bytes: free,
            });
        }
        self.held_bytes += bytes;
        Ok(())
    }
}

/// Shared, thread-safe; cloning gives another handle on the same ledger.
#[derive(Debug, Clone)]
pub struct Ledger {
    inner: Arc<Mutex<Inner>>,
    pub device: String,
}

/// Why a reservation was not granted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{device}: {wanted} requested but {free} of {capacity} is free")]
pub struct Insufficient {
    pub device: String,
    pub wanted: String,
    pub free: String,
    pub capacity: String,
    pub wanted_bytes: u64,
    pub free_bytes: u64,
}

/// Memory held for one request; returned to the ledger when dropped.
#[derive(Debug)]
pub struct Reservation {
    ledger: Ledger,
    id: u64,
    bytes: u64,
}

impl Reservation {
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Takes `bytes` more if the ledger still has `keep_free` free after them, atomically (a
    /// request's KV cache growing past its reservation under overcommit).
    pub fn try_grow(&mut self, bytes: u64, keep_free: u64) -> Result<(), Insufficient> {
        let mut inner = self.ledger.lock();
        inner.take(&self.ledger.device, bytes, keep_free)?;
        if let Some(held) = inner.held.get_mut(&self.id) {
            held.1 += bytes;
        }
        self.bytes += bytes;
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut inner = self.ledger.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.held.remove(&self.id).is_some() {
            inner.held_bytes -= self.bytes;
        }
    }
}

impl Ledger {
    pub fn new(device: impl Into<String>, capacity_bytes: u64) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                capacity_bytes,
                held_bytes: 0,
                next_id: 0,
                held: BTreeMap::new(),
            })),
            device: device.into(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Grants `bytes` if they fit in what is free, atomically.
    pub fn try_reserve(&self, owner: &str, bytes: u64) -> Result<Reservation, Insufficient> {
        self.try_reserve_keeping(owner, bytes, 0)
    }

    /// Grants `bytes` if `keep_free` is still free after them, atomically.
    pub fn try_reserve_keeping(&self, owner: &str, bytes: u64, keep_free: u64) -> Result<Reservation, Insufficient> {
        let mut inner = self.lock();
        inner.take(&self.device, bytes, keep_free)?;
        let id = inner.next_id;
        inner.next_id += 1;
        inner.held.insert(id, (owner.to_string(), bytes));
        Ok(Reservation {
            ledger: self.clone(),
            id,
            bytes,
        })
    }

    /// Changes the capacity (a new reserve setting, or a competing workload on the `sim` device).
    /// Reservations already held stay valid; new ones see the new capacity.
    pub fn set_capacity(&self, capacity_bytes: u64) {
        self.lock().capacity_bytes = capacity_bytes;
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.lock().capacity_bytes
    }

    pub fn held_bytes(&self) -> u64 {
        self.lock().held_bytes
    }

    pub fn free_bytes(&self) -> u64 {
        let inner = self.lock();
        inner.capacity_bytes.saturating_sub(inner.held_bytes)
    }

    pub fn reservations(&self) -> Vec<(String, u64)> {
        self.lock().held.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_returns_the_bytes() {
        let ledger = Ledger::new("sim", 100);
        let a = ledger.try_reserve("a", 60).unwrap();
        assert!(ledger.try_reserve("b", 50).is_err());
        drop(a);
        assert_eq!(ledger.held_bytes(), 0);
        assert!(ledger.try_reserve("b", 50).is_ok());
    }

    #[test]
    fn a_reservation_grows_while_the_kept_room_stays_free() {
        let ledger = Ledger::new("sim", 100);
        let mut a = ledger.try_reserve("a", 40).unwrap();
        a.try_grow(30, 20).unwrap();
        assert_eq!((a.bytes(), ledger.held_bytes()), (70, 70));
        let err = a.try_grow(20, 20).unwrap_err();
        assert_eq!(err.free_bytes, 10);
        drop(a);
        assert_eq!(ledger.held_bytes(), 0, "the grown bytes go back with the reservation");
    }

    #[test]
    fn a_panicking_holder_still_returns_its_reservation() {
        let ledger = Ledger::new("sim", 100);
        let l2 = ledger.clone();
        let result = std::thread::spawn(move || {
            let _r = l2.try_reserve("doomed", 80).unwrap();
            panic!("worker thread failed mid-request");
        })
        .join();
        assert!(result.is_err());
        assert_eq!(ledger.held_bytes(), 0);
    }
}
