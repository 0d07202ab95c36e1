//! Fault injection for the `sim` device: the faults set at run time and how each one bites.
//! The compute is real (ndarray); only the device's failures are simulated.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

use headroom_memory::{Ledger, Reservation, MIB};

use crate::protocol::Fault;

#[derive(Default)]
struct Faults {
    oom_next_allocation: bool,
    oom_after_tokens: Option<u32>,
    reset_after_tokens: Option<u32>,
    hung: bool,
    slowdown: f64,
    competing: Option<Reservation>,
    compile_ms: Option<u64>,
}

pub struct FaultState {
    faults: Mutex<Faults>,
    hang: Condvar,
    ledger: Option<Ledger>,
    /// The simulated device: held while a (simulated) compilation runs, as cubecl holds its
    /// device client, and taken by every device query.
    device: Mutex<()>,
}

pub enum TokenVerdict {
    Continue,
    Reset,
}

impl FaultState {
    pub fn new(ledger: Option<Ledger>) -> Self {
        Self {
            faults: Mutex::new(Faults { slowdown: 1.0, ..Default::default() }),
            hang: Condvar::new(),
            ledger,
            device: Mutex::new(()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set(&self, fault: &Fault) -> Result<(), String> {
        let mut f = self.lock();
        match *fault {
            Fault::OomNextAllocation => f.oom_next_allocation = true,
            Fault::OomAfterTokens { tokens } => f.oom_after_tokens = Some(tokens),
            Fault::Reset { after_tokens } => f.reset_after_tokens = after_tokens,
            Fault::Hang => f.hung = true,
            Fault::Slowdown { factor } => {
                if !(factor.is_finite() && factor >= 1.0) {
                    return Err(format!("slowdown factor must be >= 1, got {factor}"));
                }
                f.slowdown = factor;
            }
            Fault::Compile { ms } => f.compile_ms = Some(ms),
            Fault::Compete { mib } => {
                // Replace, not add: the knob says how much the other program holds now.
                f.competing = None;
                if mib > 0 {
                    let ledger = self.ledger.as_ref().ok_or("no simulated VRAM to compete for")?;
                    f.competing = Some(
                        ledger
                            .try_reserve("competing workload", mib * MIB)
                            .map_err(|e| format!("the competing workload does not fit: {e}"))?,
                    );
                }
            }
            Fault::Clear => *f = Faults { slowdown: 1.0, ..Default::default() },
        }
        Ok(())
    }

    pub fn take_oom_next_allocation(&self) -> bool {
        std::mem::take(&mut self.lock().oom_next_allocation)
    }

    pub fn take_oom_after_tokens(&self) -> Option<u32> {
        self.lock().oom_after_tokens.take()
    }

    /// A pending simulated compilation: holds the device for its time (once).
    pub fn compile_if_pending(&self) {
        let Some(ms) = self.lock().compile_ms.take() else { return };
        let _device = self.device.lock().unwrap_or_else(|p| p.into_inner());
        tracing::info!(ms, "simulated kernel compilation holds the device");
        std::thread::sleep(Duration::from_millis(ms));
    }

    /// Waits for the device (a query made while a compilation holds it waits).
    pub fn with_device<T>(&self, f: impl FnOnce() -> T) -> T {
        let _device = self.device.lock().unwrap_or_else(|p| p.into_inner());
        f()
    }

    pub fn competing_bytes(&self) -> u64 {
        self.lock().competing.as_ref().map_or(0, Reservation::bytes)
    }

    /// Blocks forever once a hang is injected (the router kills the process).
    pub fn block_if_hung(&self) {
        let mut f = self.lock();
        while f.hung {
            f = self.hang.wait(f).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Stretches a token's time by the slowdown factor.
    pub fn slow_down(&self, took: Duration) {
        let factor = self.lock().slowdown;
        if factor > 1.0 {
            std::thread::sleep(took.mul_f64(factor - 1.0));
        }
    }

    /// Called after each token: applies hangs and counts down to a reset.
    pub fn after_token(&self) -> TokenVerdict {
        self.block_if_hung();
        let mut f = self.lock();
        match f.reset_after_tokens.as_mut() {
            Some(0) => TokenVerdict::Reset,
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    TokenVerdict::Reset
                } else {
                    TokenVerdict::Continue
                }
            }
            None => TokenVerdict::Continue,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn competing_workload_holds_and_releases_ledger_memory() {
        let ledger = Ledger::new("sim", 100 * MIB);
        let faults = FaultState::new(Some(ledger.clone()));
        faults.set(&Fault::Compete { mib: 60 }).unwrap();
        assert_eq!(ledger.free_bytes(), 40 * MIB);
        faults.set(&Fault::Compete { mib: 30 }).unwrap();
        assert_eq!(ledger.free_bytes(), 70 * MIB);
        assert!(faults.set(&Fault::Compete { mib: 200 }).is_err());
        faults.set(&Fault::Clear).unwrap();
        assert_eq!(ledger.free_bytes(), 100 * MIB);
    }

    #[test]
    fn reset_counts_down_tokens() {
        let faults = FaultState::new(None);
        faults.set(&Fault::Reset { after_tokens: Some(2) }).unwrap();
        assert!(matches!(faults.after_token(), TokenVerdict::Continue));
        assert!(matches!(faults.after_token(), TokenVerdict::Reset));
        assert!(faults.set(&Fault::Slowdown { factor: 0.5 }).is_err());
        assert!(faults.take_oom_after_tokens().is_none());
    }
}
