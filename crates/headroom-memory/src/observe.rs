//! Observations of real memory: host RAM (sysinfo), GPU memory through NVML (free, used, total,
//! and what other processes hold), and a counting allocator for measuring the host peak of a
//! request. Every source is optional: no driver or no NVML gives `None`, never a panic.

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    pub total_bytes: u64,
    pub available_bytes: u64,
    /// Resident memory of this process.
    pub process_bytes: u64,
}

pub fn host_memory() -> Option<HostMemory> {
    use sysinfo::{Pid, ProcessRefreshKind, ProcessesToUpdate, System as SysinfoSystem};
    let mut sys = SysinfoSystem::new().ok()?;
    sys.refresh_memory();
    let pid = Pid::from_u32(std::process::id());
    sys.refresh_processes_specifics(
        ProcessesToUpdate::Some(&[pid]),
        true,
        ProcessRefreshKind::nothing().with_memory(),
    );
    let total = sys.total_memory();
    if total == 0 {
        return None;
    }
    Some(HostMemory {
        total_bytes: total,
        available_bytes: sys.available_memory(),
        process_bytes: sys.process(pid).map(|p| p.memory()).unwrap_or(0),
    })
}

/// This process's resident memory now and at its peak (Linux: VmRSS and VmHWM of
/// /proc/self/status; mapped file pages the process has touched count, as they do for the OS).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessResident {
    pub now_bytes: u64,
    pub peak_bytes: u64,
}

pub fn process_resident() -> Option<ProcessResident> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let kib: u64 = status.lines().find(|l| l.starts_with(name))?.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib * 1024)
    };
    Some(ProcessResident { now_bytes: field("VmRSS:")?, peak_bytes: field("VmHWM:")? })
}

/// Starts a new peak (VmHWM) from the current resident memory, so a later reading's peak
/// belongs to what ran in between. False where the kernel does not allow it.
pub fn reset_resident_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuMemory {
    pub index: u32,
    pub name: String,
    pub total_bytes: u64,
    pub free_bytes: u64,
    pub used_bytes: u64,
    /// Memory held by processes other than this one (other programs' VRAM counts against us).
    pub other_processes_bytes: u64,
}

/// Reads NVML for one GPU. `None` when there is no NVIDIA driver or NVML library.
pub fn gpu_memory(index: u32) -> Option<GpuMemory> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let device = nvml.device_by_index(index).ok()?;
    let info = device.memory_info().ok()?;
    let me = std::process::id();
    let other_processes_bytes = device
        .running_compute_processes()
        .unwrap_or_default()
        .iter()
        .chain(device.running_graphics_processes().unwrap_or_default().iter())
        .filter(|p| p.pid != me)
        .map(|p| match p.used_gpu_memory {
            nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) => bytes,
            nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
        })
        .sum();
    Some(GpuMemory {
        index,
        name: device.name().unwrap_or_default(),
        total_bytes: info.total,
        free_bytes: info.free,
        used_bytes: info.used,
        other_processes_bytes,
    })
}

/// A global allocator that counts bytes in use and the peak since the last reset. Install it in a
/// binary with `#[global_allocator] static A: CountingAllocator = CountingAllocator::new();`.
pub struct CountingAllocator {
    current: AtomicU64,
    peak: AtomicU64,
}

impl CountingAllocator {
    pub const fn new() -> Self {
        Self {
            current: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }
    pub fn current_bytes(&self) -> u64 {
        self.current.load(Ordering::Relaxed)
    }
    pub fn peak_bytes(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
    /// Starts a new peak window at the current level.
    pub fn reset_peak(&self) {
        self.peak.store(self.current_bytes(), Ordering::Relaxed);
    }
    fn add(&self, bytes: u64) {
        let now = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }
    fn sub(&self, bytes: u64) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }
}

impl Default for CountingAllocator {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every call is forwarded to the system allocator unchanged; only counters are added.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            self.add(layout.size() as u64);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            self.add(layout.size() as u64);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        self.sub(layout.size() as u64);
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            self.sub(layout.size() as u64);
            self.add(new_size as u64);
        }
        p
    }
}

/// One point of the memory time series.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub unix_ms: u64,
    pub host: Option<HostMemory>,
    pub gpu: Option<GpuMemory>,
}

impl Sample {
    pub fn now(gpu_index: Option<u32>) -> Self {
        Self {
            unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_millis() as u64)
                .unwrap_or(0),
            host: host_memory(),
            gpu: gpu_index.and_then(gpu_memory),
        }
    }
}

/// Samples memory on a background thread at a fixed rate and keeps the most recent points.
pub struct MemorySampler {
    series: Arc<Mutex<VecDeque<Sample>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MemorySampler {
    pub fn start(interval: Duration, keep: usize, gpu_index: Option<u32>) -> Self {
        let series = Arc::new(Mutex::new(VecDeque::with_capacity(keep)));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, st) = (series.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("memory-sampler".into())
            .spawn(move || {
                while !st.load(Ordering::Relaxed) {
                    let sample = Sample::now(gpu_index);
                    {
                        let mut q = s.lock().unwrap_or_else(|p| p.into_inner());
                        if q.len() == keep {
                            q.pop_front();
                        }
                        q.push_back(sample);
                    }
                    std::thread::sleep(interval);
                }
            })
            .expect("spawn memory sampler thread");
        Self {
            series,
            stop,
            thread: Some(thread),
        }
    }

    pub fn recent(&self) -> Vec<Sample> {
        self.series
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .cloned()
            .collect()
    }
}

impl Drop for MemorySampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_memory_is_read() {
        let host = host_memory().expect("sysinfo reads /proc/meminfo");
        assert!(host.total_bytes > host.available_bytes / 2);
        assert!(host.process_bytes > 0);
    }

    #[test]
    fn no_gpu_gives_none_not_a_panic() {
        // On machines without NVML this is None; with a GPU it is a real reading.
        if let Some(gpu) = gpu_memory(0) {
            assert!(gpu.total_bytes >= gpu.free_bytes);
        }
        assert!(gpu_memory(999).is_none());
    }

    #[test]
    fn sampler_collects_a_series() {
        let sampler = MemorySampler::start(Duration::from_millis(5), 3, None);
        std::thread::sleep(Duration::from_millis(60));
        let series = sampler.recent();
        assert!(!series.is_empty() && series.len() <= 3);
        assert!(series[0].host.is_some());
    }
}
