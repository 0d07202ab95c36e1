//! One warm CPU worker and the queue in front of it, for one model or shared by several. Models
//! whose CPU path runs the same model folder (their own, or a `fallback` they name alike) use
//! one worker process: its weights are in host RAM once, and one queue holds the slots of all
//! their requests, so a failover of one model never meets the worker busy with another's
//! request (the wave-1 loss, which two queues in front of one worker would bring back).
//!
//! The first model's supervisor starts the worker and restarts it when it dies; the others
//! borrow it ([`crate::SupervisorConfig::cpu_share`]). The first model's dispatcher makes the
//! queue; every dispatcher adds the room its GPU lane may fail over into it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock};

use headroom_worker::WorkerOptions;

use crate::dispatch::LaneQueue;
use crate::worker::Worker;

/// What a CPU worker runs: its options and the model folder (or GGUF file) it loads.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct CpuRun {
    pub(crate) options: WorkerOptions,
    pub(crate) model_dir: PathBuf,
}

/// A CPU worker and its queue; cloning gives another handle to the same ones.
#[derive(Clone)]
pub struct SharedCpu {
    pub(crate) inner: Arc<SharedCpuInner>,
}

impl std::fmt::Debug for SharedCpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedCpu").field("model_dir", &self.model_dir()).field("users", &self.users()).finish()
    }
}

pub(crate) struct SharedCpuInner {
    pub(crate) worker: RwLock<Option<Arc<Worker>>>,
    /// What the worker runs now (a settings change replaces it).
    pub(crate) running: RwLock<CpuRun>,
    /// One replacement of the worker at a time, whichever model asks.
    pub(crate) replacing: tokio::sync::Mutex<()>,
    /// The queue in front of the worker, made by the first dispatcher that starts on it.
    lane: OnceLock<Arc<LaneQueue>>,
    /// Models using the worker.
    users: AtomicUsize,
    /// Test-only: each dispatcher keeps its own queue in front of the shared worker.
    lane_per_model: AtomicBool,
}

impl SharedCpu {
    pub(crate) fn new(run: CpuRun) -> Self {
        Self {
            inner: Arc::new(SharedCpuInner {
                worker: RwLock::new(None),
                running: RwLock::new(run),
                replacing: tokio::sync::Mutex::new(()),
                lane: OnceLock::new(),
                users: AtomicUsize::new(1),
                lane_per_model: AtomicBool::new(false),
            }),
        }
    }

    /// Test-only: a share of no worker, running `model_dir` with the CPU worker's defaults.
    #[doc(hidden)]
    pub fn for_test(model_dir: &std::path::Path) -> Self {
        Self::new(CpuRun { options: WorkerOptions::new(headroom_worker::Device::Cpu), model_dir: model_dir.to_path_buf() })
    }

    /// Another model uses the worker from now on.
    pub(crate) fn join(&self) {
        self.inner.users.fetch_add(1, Ordering::SeqCst);
    }

    /// How many served models use this CPU worker.
    pub fn users(&self) -> usize {
        self.inner.users.load(Ordering::SeqCst)
    }

    /// The model folder the worker runs now.
    pub fn model_dir(&self) -> PathBuf {
        self.inner.running.read().unwrap().model_dir.clone()
    }

    pub(crate) fn running(&self) -> CpuRun {
        self.inner.running.read().unwrap().clone()
    }

    pub(crate) fn worker(&self) -> Option<Arc<Worker>> {
        self.inner.worker.read().unwrap().clone()
    }

    /// The queue in front of the worker: the one the first dispatcher made (`make` makes it).
    pub(crate) fn lane(&self, make: impl FnOnce() -> Arc<LaneQueue>) -> Arc<LaneQueue> {
        if self.lane_per_model() {
            return make();
        }
        self.inner.lane.get_or_init(make).clone()
    }

    /// Whether these are the same worker.
    pub fn same_as(&self, other: &SharedCpu) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Test-only: switches back on the defect the shared queue fixes (each model's dispatcher
    /// sends to the shared worker through its own queue, so their requests overfill its slots),
    /// for dispatchers started from now on; also `HEADROOM_TEST_DEFECT=cpu-lane-per-model`.
    #[doc(hidden)]
    pub fn queue_per_model_for_test(&self) {
        self.inner.lane_per_model.store(true, Ordering::SeqCst);
    }

    fn lane_per_model(&self) -> bool {
        self.inner.lane_per_model.load(Ordering::SeqCst) || headroom_model::test_defect("cpu-lane-per-model")
    }
}
