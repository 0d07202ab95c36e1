//! The request path: journal → admission → a bounded GPU or CPU queue → the supervisor's run
//! (with failover) → journal. No accepted request is lost: each is written to the journal before
//! `submit` returns, every step is appended, and [`Dispatcher::start`] re-runs what a crash left
//! unfinished.
//!
//! The files: `request` (admission into a lane, launch, completion), `execute` (from the queue to
//! the end, with failover through the CPU queue), `lanes` (queues and rates), `budgets` (GPU and
//! host memory), `recovery` (journal writes), `status` (the typed snapshot, placements),
//! `settings`, `metrics`, `ticket` (what the client holds); this one holds the dispatcher's
//! state, its start (re-running what a crash left) and cancellation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_memory::{Admission, Allowances, Budget, Ledger, MemoryConfig, Planner, RequestShape, Reservation};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::events::EventKind;
use crate::metrics::{FailoverLabels, Metrics, OutcomeLabels};
use headroom_worker::{Device, FailureKind};

use crate::journal::{Accepted, EndCause, Journal, JournalError, NewRequest, Recovery, RequestState, Transition};
use crate::settings::{Settings, SettingsFile, RESTART_SETTINGS};
use crate::degraded::{degradation, Degradation};
use crate::supervisor::{AttemptError, CancelSignal, Progress, RunOutcome, RunRequest, StreamedToken, Supervisor, Target};
use crate::{Error, Lane};

mod budgets;
mod execute;
mod lanes;
mod metrics;
mod recovery;
mod request;
mod settings;
mod share;
mod status;
mod ticket;

use budgets::GpuWait;
pub(crate) use lanes::LaneQueue;
pub use lanes::{QueueConfig, QueueStatus};
use recovery::journal_failure;
use request::Start;
pub use settings::{SettingsError, SettingsUpdate};
pub use share::GpuShare;
pub use status::{GpuKv, Placement, ServiceStatus, WorkerSnapshot, WorkerState};
use ticket::{Ended, Finished};
pub use ticket::{Completion, StreamEvent, Submission, SubmitError, Ticket, WaitNotice};

struct Inner {
    supervisor: Supervisor,
    journal: Journal,
    memory: MemoryConfig,
    planner: Planner,
    gpu: LaneQueue,
    cpu: Arc<LaneQueue>,
    /// What the settings screen changed last (applied), and where it persists.
    settings: Mutex<Settings>,
    settings_file: Option<SettingsFile>,
    /// One settings change at a time.
    updating_settings: tokio::sync::Mutex<()>,
    /// Host RAM held by CPU-path requests, so redirects never exhaust it. Several models share
    /// one (the first's: see [`Dispatcher::share_gpu`]): the host is one machine.
    host_ledger: std::sync::RwLock<Ledger>,
    /// GPU memory the router has granted to requests it started, from the moment it grants it:
    /// the worker's memory samples arrive a second apart, and admissions in between must see
    /// what earlier ones took. Its capacity is unbounded; the budget check decides.
    gpu_ledger: Ledger,
    /// Makes "check the GPU budget, then reserve" one step for concurrent admissions.
    gpu_grant: Mutex<()>,
    in_flight: Mutex<HashMap<String, InFlight>>,
    metrics: Metrics,
    /// Why the last journal write failed, until one succeeds again.
    journal_fault: Mutex<Option<String>>,
    /// Test-only: defects switched back on, for the negative controls of the tests that
    /// guard against them.
    defects: Mutex<Vec<Defect>>,
    /// The GPU shared with other models' dispatchers, if it is (see [`GpuShare`]).
    share: Mutex<Option<share::Membership>>,
}

/// A fixed defect that a test switches back on, to show that its check catches it.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Defect {
    /// A request failing over from the GPU goes straight to the CPU worker, busy or not,
    /// instead of waiting in the CPU queue.
    FailoverBypassesCpuQueue,
    /// Admission does not check the CPU worker's context limit.
    NoCpuLaneCheck,
    /// Admission counts a prompt with the served model's tokens even when the CPU worker holds
    /// a fallback model, whose own tokenizer may make more of it.
    FallbackCountedAsServed,
    /// Journal write errors are dropped.
    IgnoreJournalErrors,
    /// A split GPU worker is charged each request's KV cache for the whole model, not for the
    /// layers it holds.
    SplitChargedWhole,
    /// A GPU request that finds the model unloaded (keep_alive) goes to the CPU instead of
    /// loading it again.
    UnloadedModelRedirects,
    /// Admission on a GPU shared by several models counts this model alone, and never evicts.
    GpuShareIgnored,
    /// Each of several models keeps its own host RAM ledger: their CPU-path grants and CPU
    /// workers' weights are not counted against each other.
    HostShareIgnored,
    /// On a shared GPU, a model whose worker is restarting (after a failure, or when the GPU
    /// resumes) counts nothing, so another model loads meanwhile and ends beside it.
    RestartingModelUncounted,
    /// A CPU worker shared by several models counts its host RAM once per model.
    SharedCpuCountedTwice,
    /// A request preempted on the GPU that does not allow the CPU ends there, instead of
    /// waiting in the GPU queue to resume.
    PreemptedGpuOnlyEnds,
}

/// A request that has been launched and has not ended.
struct InFlight {
    done: watch::Receiver<Finished>,
    cancel: CancelSignal,
}

/// Why a request could not join a queue.
struct LaneRefusal {
    reason: String,
    retry_after_s: u64,
    estimated_delay_ms: Option<u64>,
}

/// What cancelling a request by id did.
#[derive(Debug, Clone, PartialEq)]
pub enum CancelOutcome {
    /// It was queued or running; it is being stopped.
    Cancelled,
    /// It had already ended in this state.
    AlreadyEnded(RequestState),
}

#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

/// What the journal keeps of a request, to run it again after a restart.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct StoredBody {
    run: RunRequest,
    allow: Allowances,
}

impl Dispatcher {
    /// Wraps a started supervisor and an opened journal, and re-runs what the journal shows a
    /// crash left unfinished (its clients collect results by id or idempotency key).
    /// `settings` are the ones in force at start (the supervisor was started with their CPU
    /// worker and pause state); changes through [`Dispatcher::update_settings`] are saved to
    /// `settings_file` when there is one.
    pub fn start(
        supervisor: Supervisor,
        journal: Journal,
        planner: Planner,
        memory: MemoryConfig,
        queues: QueueConfig,
        settings: Settings,
        settings_file: Option<SettingsFile>,
    ) -> Result<(Self, Vec<Recovery>), SubmitError> {
        let config = supervisor.config();
        let gpu_concurrency = config.gpu.as_ref().map(|g| g.max_concurrency as usize).unwrap_or(0);
        let cpu_concurrency = config.cpu.max_concurrency as usize;
        // Every request the GPU lane holds, queued or running, must fit in the CPU queue if the
        // GPU fails.
        let gpu_room = if config.gpu.is_some() { queues.gpu_queue_capacity + gpu_concurrency } else { 0 };
        // A CPU worker shared with other models has one queue: the first model's, with room
        // for every model's GPU lane.
        let cpu = supervisor.shared_cpu().lane(|| Arc::new(LaneQueue::new(Lane::Cpu, queues.cpu_queue_capacity, cpu_concurrency)));
        cpu.failover_room.fetch_add(gpu_room, Ordering::SeqCst);
        let host_total = headroom_memory::observe::host_memory().map(|h| h.total_bytes).unwrap_or(0);
        let inner = Arc::new(Inner {
            supervisor,
            journal,
            planner,
            gpu: LaneQueue::new(Lane::Gpu, queues.gpu_queue_capacity, gpu_concurrency),
            cpu,
            settings: Mutex::new(settings),
            settings_file,
            updating_settings: tokio::sync::Mutex::new(()),
            host_ledger: std::sync::RwLock::new(Ledger::new("host", host_total.saturating_sub(memory.host_reserve_bytes(host_total)))),
            gpu_ledger: Ledger::new("gpu", u64::MAX),
            gpu_grant: Mutex::new(()),
            memory,
            in_flight: Mutex::new(HashMap::new()),
            metrics: Metrics::new(),
            journal_fault: Mutex::new(None),
            defects: Mutex::new(Vec::new()),
            share: Mutex::new(None),
        });
        let dispatcher = Self { inner };
        if dispatcher.inner.supervisor.config().gpu.is_some() {
            tokio::spawn(unload_when_idle(Arc::downgrade(&dispatcher.inner)));
        }
        let recovered = dispatcher.inner.journal.recover()?;
        for r in &recovered {
            if let Recovery::Rerun(record) = r {
                match serde_json::from_value::<StoredBody>(record.request.body.clone()) {
                    Ok(body) => {
                        let sub = Submission {
                            run: body.run,
                            idempotency_key: record.request.idempotency_key.clone(),
                            body_hash: record.request.body_hash.clone(),
                            stream: record.request.stream,
                            allow: body.allow,
                        };
                        // Nobody holds this ticket: without its cancel, dropping it leaves the
                        // request running, and its tokens go nowhere.
                        match dispatcher.launch(sub, record.attempt + 1) {
                            Ok(mut ticket) => ticket.cancel = None,
                            // Already journaled as refused; its client sees that by id or key.
                            Err(e) => tracing::warn!(request_id = %record.request.id, error = %e, "recovered request refused"),
                        }
                    }
                    Err(e) => {
                        dispatcher.inner.journal.record(
                            &record.request.id,
                            &Transition::Failed { kind: EndCause::Internal, detail: format!("cannot re-run after restart: {e}"), resumable: true },
                        )?;
                    }
                }
            }
        }
        Ok((dispatcher, recovered))
    }

    pub fn supervisor(&self) -> &Supervisor {
        &self.inner.supervisor
    }

    pub fn journal(&self) -> &Journal {
        &self.inner.journal
    }

    pub fn queues(&self) -> Vec<QueueStatus> {
        [&self.inner.gpu, &*self.inner.cpu]
            .into_iter()
            .filter(|l| l.lane == Lane::Cpu || self.inner.supervisor.config().gpu.is_some())
            .map(LaneQueue::status)
            .collect()
    }

    /// Test-only: switches a fixed defect back on (see [`Defect`]).
    #[doc(hidden)]
    pub fn reintroduce_defect_for_test(&self, defect: Defect) {
        self.inner.defects.lock().unwrap().push(defect);
    }

    fn has_defect(&self, defect: Defect) -> bool {
        self.inner.defects.lock().unwrap().contains(&defect)
    }

    /// Cancels a queued or running request by id; it frees its place and reservation at once.
    pub fn cancel(&self, id: &str) -> Result<CancelOutcome, JournalError> {
        let running = self.inner.in_flight.lock().unwrap().get(id).map(|f| f.cancel.clone());
        if let Some(cancel) = running {
            cancel.cancel();
            return Ok(CancelOutcome::Cancelled);
        }
        Ok(CancelOutcome::AlreadyEnded(self.inner.journal.get(id)?.state))
    }

    /// Requests launched and not yet ended.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.lock().unwrap().len()
    }

    /// Ids of the requests launched and not yet ended.
    pub fn in_flight_ids(&self) -> Vec<String> {
        self.inner.in_flight.lock().unwrap().keys().cloned().collect()
    }

    /// Waits until nothing is in flight, or `timeout` passes; returns what is still in flight
    /// (the journal keeps it, and the next start re-runs it).
    pub async fn drain(&self, timeout: std::time::Duration) -> usize {
        let deadline = Instant::now() + timeout;
        while self.in_flight() > 0 && Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        self.in_flight()
    }

    /// Sets the model's keep_alive from now on (Ollama's per-request `keep_alive`).
    pub fn set_keep_alive(&self, keep_alive: headroom_memory::KeepAlive) {
        self.inner.supervisor.set_keep_alive(keep_alive);
    }

    /// Unloads the GPU's copy of the model if its keep_alive has passed and no request waits
    /// for or runs on the GPU. Returns whether it began the unload.
    pub fn unload_if_idle(&self) -> bool {
        self.inner.unload_if_idle()
    }

    /// Loads the GPU's copy of the model if its keep_alive unloaded it, and waits for it (or
    /// for its launch to fail). Returns how long that took; `None` when it was loaded.
    pub async fn load_gpu(&self) -> Option<Duration> {
        self.inner.supervisor.load_gpu(&CancelSignal::new()).await
    }

    /// Service-wide expected wait of a new request: the lane it would most likely use (the GPU
    /// while the breaker is closed, else the CPU).
    pub fn estimated_delay_ms(&self) -> Option<u64> {
        let s = &self.inner.supervisor;
        let status = s.status();
        if s.config().gpu.is_some() && !status.degraded && !status.gpu_paused {
            self.inner.gpu.estimated_delay_ms()
        } else {
            self.inner.cpu.estimated_delay_ms()
        }
    }

}

/// Unloads the GPU's model once its keep_alive has passed with no request waiting for or
/// running on the GPU; stops with the dispatcher.
async fn unload_when_idle(inner: std::sync::Weak<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Some(inner) = inner.upgrade() else { return };
        inner.unload_if_idle();
    }
}

impl Inner {
    /// Nothing waits for or runs on the GPU lane.
    fn gpu_lane_idle(&self) -> bool {
        let lane = &self.gpu;
        let work = *lane.work_ahead.lock().unwrap();
        lane.waiting.load(Ordering::SeqCst) == 0 && lane.running.load(Ordering::SeqCst) == 0 && work.prompt_tokens == 0 && work.max_tokens == 0
    }

    fn unload_if_idle(&self) -> bool {
        self.gpu_lane_idle() && self.stand_down(None)
    }
}
