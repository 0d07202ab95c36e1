//! The request path: journal → admission → a bounded GPU or CPU queue → the supervisor's run
//! (with failover) → journal. No accepted request is lost: each is written to the journal before
//! `submit` returns, every step is appended, and [`Dispatcher::start`] re-runs what a crash left
//! unfinished.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_memory::{Admission, Allowances, Budget, Ledger, MemoryConfig, Planner, RequestShape, Reservation};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, watch, Semaphore};

use crate::events::EventKind;
use crate::metrics::{FailoverLabels, Metrics, OutcomeLabels};
use crate::journal::{Accepted, Journal, JournalError, NewRequest, Recovery, RequestState, Transition};
use crate::settings::{Settings, SettingsFile, RESTART_SETTINGS};
use crate::supervisor::{AttemptError, CancelSignal, Progress, RunOutcome, RunRequest, StreamedToken, Supervisor, Target};
use crate::Error;

/// Queue limits: the `[queues]` table of the config file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Requests that may wait for the GPU; beyond this, a capacity error.
    pub gpu_queue_capacity: usize,
    /// Requests that may wait for the CPU worker.
    pub cpu_queue_capacity: usize,
}

impl QueueConfig {
    /// Parses the `[queues]` table of a Headroom config file.
    pub fn from_toml(text: &str) -> crate::Result<Self> {
        crate::config_table(text, "queues")
    }
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self { gpu_queue_capacity: 64, cpu_queue_capacity: 16 }
    }
}

/// What a client submits.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Submission {
    pub run: RunRequest,
    pub idempotency_key: Option<String>,
    /// A hash of the client's body, for idempotency conflicts.
    pub body_hash: String,
    pub stream: bool,
    pub allow: Allowances,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    /// Refused for capacity (a full queue, or no device can hold it now).
    #[error("{reason}")]
    Capacity { reason: String, retry_after_s: Option<u64>, estimated_delay_ms: Option<u64> },
    #[error("cancelled")]
    Cancelled,
    /// The request ended without a result; `resumable`: the client may retry or resume it.
    #[error("{reason}")]
    Failed { reason: String, resumable: bool },
    #[error("{0}")]
    Journal(#[from] JournalError),
}

/// A finished request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub outcome: RunOutcome,
    /// The admission decision's reason (and the device it chose first).
    pub admission: String,
    pub queued_ms: f64,
    /// Served from the journal for a repeated idempotency key: nothing ran again.
    #[serde(default)]
    pub from_journal: bool,
    /// Whether the request would have continued on the CPU worker had the GPU failed (false:
    /// the client opted out with allow_cpu: false).
    #[serde(default = "yes")]
    pub cpu_failover: bool,
}

fn yes() -> bool {
    true
}

/// How a request ended without a result.
#[derive(Debug, Clone, PartialEq)]
enum Ended {
    Cancelled,
    Failed { reason: String, resumable: bool },
}

type Finished = Option<Result<Completion, Ended>>;

/// What a request's stream carries: its tokens, and notices while it waits for a device.
#[derive(Debug, Clone)]
pub enum StreamEvent {
    Token(StreamedToken),
    /// The request left its device and waits in another queue (a failover waiting for a CPU
    /// slot); the client is told why and for about how long.
    Waiting(WaitNotice),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WaitNotice {
    /// The queue it waits in now.
    pub queue: String,
    pub reason: String,
    /// Requests ahead of it there.
    pub ahead: usize,
    pub estimated_delay_ms: Option<u64>,
}

/// A submitted request: its tokens as they come, and its end. Dropping the ticket of a request
/// that has not finished cancels it (the client went away).
pub struct Ticket {
    pub request_id: String,
    /// gpu or cpu; `attached` (to the same request, running) or `journal` (its stored end).
    pub device_queue: String,
    /// Why admission chose that queue.
    pub admission: String,
    events: mpsc::UnboundedReceiver<StreamEvent>,
    done: watch::Receiver<Finished>,
    cancel: Option<CancelSignal>,
}

impl Ticket {
    /// The next token (notices skipped); None once the request has ended.
    pub async fn next_token(&mut self) -> Option<StreamedToken> {
        loop {
            match self.events.recv().await? {
                StreamEvent::Token(t) => return Some(t),
                StreamEvent::Waiting(_) => {}
            }
        }
    }

    /// The next token or notice; None once the request has ended.
    pub async fn next_event(&mut self) -> Option<StreamEvent> {
        self.events.recv().await
    }

    /// Waits for the end of the request.
    pub async fn finish(mut self) -> Result<Completion, SubmitError> {
        let finished = self.done.wait_for(|f| f.is_some()).await.map(|f| f.clone());
        self.cancel = None;
        match finished {
            Ok(Some(Ok(c))) => Ok(c),
            Ok(Some(Err(Ended::Cancelled))) => Err(SubmitError::Cancelled),
            Ok(Some(Err(Ended::Failed { reason, resumable }))) => Err(SubmitError::Failed { reason, resumable }),
            _ => Err(SubmitError::Failed { reason: "the dispatcher stopped".into(), resumable: true }),
        }
    }

    pub fn cancel(&self) {
        if let Some(c) = &self.cancel {
            c.cancel();
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.done.borrow().is_none() {
            self.cancel();
        }
    }
}

/// Measured rates of one lane (one device and the bundle it holds), EWMA.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rates {
    prefill_ms_per_token: Option<f64>,
    decode_ms_per_token: Option<f64>,
}

fn ewma(current: Option<f64>, sample: f64) -> Option<f64> {
    Some(match current {
        Some(r) => 0.8 * r + 0.2 * sample,
        None => sample,
    })
}

/// One device's queue: a bounded number waiting, the worker's concurrency running. The slots
/// are taken first come, first served (tokio's semaphore is fair), whether a request was
/// admitted here or failed over from the GPU.
struct Lane {
    device: &'static str,
    slots: Semaphore,
    waiting: AtomicUsize,
    running: AtomicUsize,
    /// Requests admitted here may join while fewer than this wait.
    capacity: usize,
    /// Places kept beyond `capacity` for requests failing over from the GPU: as many as the GPU
    /// lane can hold (queued and running), so a GPU failure never finds this queue full.
    failover_room: usize,
    /// Slots of `slots`; settings may change it (see [`Lane::resize`]).
    concurrency: AtomicUsize,
    rates: Mutex<Rates>,
    /// Prompt and max_tokens of every request waiting or running here.
    work_ahead: Mutex<WorkAhead>,
    /// When each waiting request joined, for the oldest age.
    waiting_since: Mutex<HashMap<String, Instant>>,
}

#[derive(Debug, Clone, Copy, Default)]
struct WorkAhead {
    prompt_tokens: u64,
    max_tokens: u64,
}

impl Lane {
    fn new(device: &'static str, capacity: usize, failover_room: usize, concurrency: usize) -> Self {
        Self {
            device,
            slots: Semaphore::new(concurrency.max(1)),
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            capacity,
            failover_room,
            concurrency: AtomicUsize::new(concurrency.max(1)),
            rates: Mutex::new(Rates::default()),
            work_ahead: Mutex::new(WorkAhead::default()),
            waiting_since: Mutex::new(HashMap::new()),
        }
    }

    /// Expected milliseconds to run a request of this shape here, from measured rates; None
    /// before any request has finished here.
    fn expected_run_ms(&self, prompt_tokens: u64, max_tokens: u64) -> Option<f64> {
        let rates = *self.rates.lock().unwrap();
        let decode = rates.decode_ms_per_token?;
        Some(prompt_tokens as f64 * rates.prefill_ms_per_token.unwrap_or(0.0) + max_tokens as f64 * decode)
    }

    /// Expected wait before a new request starts here: the work ahead at measured rates, shared
    /// by the lane's concurrency; None before any request has finished here.
    fn estimated_delay_ms(&self) -> Option<u64> {
        let ahead = *self.work_ahead.lock().unwrap();
        let work = self.expected_run_ms(ahead.prompt_tokens, ahead.max_tokens)?;
        let concurrency = self.concurrency.load(Ordering::Relaxed);
        if self.running.load(Ordering::Relaxed) < concurrency {
            return Some(0);
        }
        Some((work / concurrency as f64).round() as u64)
    }

    fn observe(&self, prompt_tokens: u32, prefill_ms: f64, tokens: u32, decode_ms: f64) {
        let mut rates = self.rates.lock().unwrap();
        if prompt_tokens > 0 {
            rates.prefill_ms_per_token = ewma(rates.prefill_ms_per_token, prefill_ms / prompt_tokens as f64);
        }
        if tokens > 0 {
            rates.decode_ms_per_token = ewma(rates.decode_ms_per_token, decode_ms / tokens as f64);
        }
    }

    fn join(&self, id: &str, prompt_tokens: u64, max_tokens: u64) {
        let mut ahead = self.work_ahead.lock().unwrap();
        ahead.prompt_tokens += prompt_tokens;
        ahead.max_tokens += max_tokens;
        self.waiting_since.lock().unwrap().insert(id.to_string(), Instant::now());
    }

    /// No longer waiting: it took a slot, or ended in the queue.
    fn forget(&self, id: &str) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.waiting_since.lock().unwrap().remove(id);
    }

    fn leave(&self, prompt_tokens: u64, max_tokens: u64) {
        let mut ahead = self.work_ahead.lock().unwrap();
        ahead.prompt_tokens -= prompt_tokens;
        ahead.max_tokens -= max_tokens;
    }

    /// Changes how many requests run here at once. More slots are free at once; fewer are
    /// taken back as running requests finish (none is stopped).
    fn resize(self: &Arc<Self>, concurrency: usize) {
        let concurrency = concurrency.max(1);
        let old = self.concurrency.swap(concurrency, Ordering::SeqCst);
        if concurrency > old {
            self.slots.add_permits(concurrency - old);
        } else if concurrency < old {
            let lane = self.clone();
            tokio::spawn(async move {
                if let Ok(permits) = lane.slots.acquire_many((old - concurrency) as u32).await {
                    permits.forget();
                }
            });
        }
    }

    fn oldest_wait_ms(&self) -> u64 {
        let since = self.waiting_since.lock().unwrap();
        since.values().map(|t| t.elapsed().as_millis() as u64).max().unwrap_or(0)
    }

    fn status(&self) -> QueueStatus {
        let rates = *self.rates.lock().unwrap();
        QueueStatus {
            device: self.device.to_string(),
            waiting: self.waiting.load(Ordering::Relaxed),
            running: self.running.load(Ordering::Relaxed),
            capacity: self.capacity,
            failover_room: self.failover_room,
            concurrency: self.concurrency.load(Ordering::Relaxed),
            oldest_wait_ms: self.oldest_wait_ms(),
            estimated_delay_ms: self.estimated_delay_ms(),
            ms_per_token: rates.decode_ms_per_token,
            prefill_ms_per_token: rates.prefill_ms_per_token,
        }
    }
}

/// Queue depths and delays, for status, metrics and the UI.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueStatus {
    pub device: String,
    pub waiting: usize,
    pub running: usize,
    /// How many admitted requests may wait here.
    pub capacity: usize,
    /// Places beyond `capacity` kept for requests failing over from the GPU.
    pub failover_room: usize,
    pub concurrency: usize,
    /// How long the oldest waiting request has waited.
    pub oldest_wait_ms: u64,
    pub estimated_delay_ms: Option<u64>,
    /// Measured decode milliseconds per token (EWMA).
    pub ms_per_token: Option<f64>,
    pub prefill_ms_per_token: Option<f64>,
}

struct Inner {
    supervisor: Supervisor,
    journal: Journal,
    memory: MemoryConfig,
    planner: Planner,
    gpu: Lane,
    cpu: Arc<Lane>,
    /// What the settings screen changed last (applied), and where it persists.
    settings: Mutex<Settings>,
    settings_file: Option<SettingsFile>,
    /// One settings change at a time.
    updating_settings: tokio::sync::Mutex<()>,
    /// Host RAM held by CPU-path requests, so redirects never exhaust it.
    host_ledger: Ledger,
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
    /// Journal write errors are dropped.
    IgnoreJournalErrors,
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

/// What a settings change did.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SettingsUpdate {
    pub settings: Settings,
    /// The settings that changed.
    pub changed: Vec<String>,
    /// Changed settings that take effect at the next start.
    pub restart_required: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The change is not valid; nothing was applied.
    #[error("{0}")]
    Invalid(String),
    /// A valid change could not be applied (a new CPU worker failed to start); nothing changed.
    #[error("{0}")]
    NotApplied(String),
    /// Applied, but not saved: it is lost at the next start.
    #[error("{0}")]
    NotSaved(String),
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
        let host_total = headroom_memory::observe::host_memory().map(|h| h.total_bytes).unwrap_or(0);
        let inner = Arc::new(Inner {
            supervisor,
            journal,
            planner,
            gpu: Lane::new("gpu", queues.gpu_queue_capacity, 0, gpu_concurrency),
            cpu: Arc::new(Lane::new("cpu", queues.cpu_queue_capacity, gpu_room, cpu_concurrency)),
            settings: Mutex::new(settings),
            settings_file,
            updating_settings: tokio::sync::Mutex::new(()),
            host_ledger: Ledger::new("host", host_total.saturating_sub(memory.host_reserve_bytes(host_total))),
            gpu_ledger: Ledger::new("gpu", u64::MAX),
            gpu_grant: Mutex::new(()),
            memory,
            in_flight: Mutex::new(HashMap::new()),
            metrics: Metrics::new(),
            journal_fault: Mutex::new(None),
            defects: Mutex::new(Vec::new()),
        });
        let dispatcher = Self { inner };
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
                            &Transition::Failed { kind: "internal".into(), detail: format!("cannot re-run after restart: {e}"), resumable: true },
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
            .filter(|l| l.device == "cpu" || self.inner.supervisor.config().gpu.is_some())
            .map(Lane::status)
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

    /// The file settings are saved to, if any.
    pub fn settings_path(&self) -> Option<String> {
        self.inner.settings_file.as_ref().map(|f| f.path.display().to_string())
    }

    /// The settings in force now.
    pub fn settings(&self) -> Settings {
        self.inner.settings.lock().unwrap().clone()
    }

    /// Applies a JSON merge patch of settings, live where possible: the VRAM reserve from the
    /// next admission, the GPU pause at once (running GPU requests finish), CPU concurrency,
    /// context and fallback model by starting a new CPU worker and switching to it when ready.
    /// Then saves them. The GPU device waits for a restart.
    pub async fn update_settings(&self, patch: &serde_json::Value) -> Result<SettingsUpdate, SettingsError> {
        let _one_at_a_time = self.inner.updating_settings.lock().await;
        let current = self.settings();
        let next = current.patched(patch).map_err(SettingsError::Invalid)?;
        let changed = next.changed_from(&current);
        let supervisor = &self.inner.supervisor;
        let mut setup = supervisor.cpu_setup();
        setup.options.max_concurrency = next.cpu_max_concurrency;
        setup.options.max_context_tokens = Some(next.cpu_max_context_tokens);
        setup.fallback_model_dir = next.fallback_model.clone();
        supervisor
            .replace_cpu_worker(setup)
            .await
            .map_err(|e| SettingsError::NotApplied(format!("the CPU worker could not start with these settings, so nothing changed: {e}")))?;
        self.inner.cpu.resize(next.cpu_max_concurrency as usize);
        self.queue_changed(&self.inner.cpu);
        supervisor.set_gpu_paused(next.gpu_paused);
        *self.inner.settings.lock().unwrap() = next.clone();
        let restart_required: Vec<String> = changed.iter().filter(|c| RESTART_SETTINGS.contains(&c.as_str())).cloned().collect();
        supervisor.emit(EventKind::SettingsChanged { settings: next.clone(), changed: changed.clone(), restart_required: restart_required.clone() });
        if let Some(file) = &self.inner.settings_file {
            file.save(&next).map_err(|e| SettingsError::NotSaved(format!("applied, but {e}; it will be lost at the next start")))?;
        }
        Ok(SettingsUpdate { settings: next, changed, restart_required })
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

    /// The Prometheus text exposition of the service's metrics, gauges read now.
    pub fn metrics_text(&self) -> String {
        let inner = &self.inner;
        let m = &inner.metrics;
        let status = inner.supervisor.status();
        m.breaker_state.set(match status.breaker {
            crate::BreakerState::Closed => 0,
            crate::BreakerState::HalfOpen => 1,
            crate::BreakerState::Open => 2,
        });
        m.degraded.set(i64::from(status.degraded));
        m.gpu_paused.set(i64::from(status.gpu_paused));
        for q in self.queues() {
            let label = crate::metrics::device(&q.device);
            m.queue_waiting.get_or_create(&label).set(q.waiting as i64);
            m.queue_running.get_or_create(&label).set(q.running as i64);
            m.queue_capacity.get_or_create(&label).set(q.capacity as i64);
            m.queue_oldest_age_seconds.get_or_create(&label).set(q.oldest_wait_ms as f64 / 1000.0);
            if let Some(d) = q.estimated_delay_ms {
                m.estimated_delay_seconds.get_or_create(&label).set(d as f64 / 1000.0);
            }
            if let Some(r) = q.ms_per_token {
                m.decode_ms_per_token.get_or_create(&label).set(r);
            }
            if let Some(r) = q.prefill_ms_per_token {
                m.prefill_ms_per_token.get_or_create(&label).set(r);
            }
        }
        // Gauges are i64; byte counts never come near its limit, but saturate rather than wrap.
        let bytes = |b: u64| i64::try_from(b).unwrap_or(i64::MAX);
        if let Some(reading) = inner.supervisor.gpu_worker().and_then(|w| w.memory().borrow().clone()) {
            m.vram_capacity_bytes.set(bytes(reading.capacity_bytes.unwrap_or(0)));
            m.vram_used_bytes.set(bytes(reading.used_bytes.unwrap_or(0)));
            m.vram_predicted_bytes.set(bytes(reading.weights_bytes + reading.reserved_bytes + reading.competing_bytes));
        }
        if let Some(host) = headroom_memory::observe::host_memory() {
            m.host_total_bytes.set(bytes(host.total_bytes));
            m.host_available_bytes.set(bytes(host.available_bytes));
        }
        m.host_reserved_bytes.set(bytes(inner.host_ledger.held_bytes()));
        m.encode()
    }

    fn count_end(&self, device: &str, outcome: &str) {
        self.inner.metrics.requests.get_or_create(&OutcomeLabels { device: device.into(), outcome: outcome.into() }).inc();
    }

    fn queue_changed(&self, lane: &Lane) {
        let q = lane.status();
        self.inner.supervisor.emit(EventKind::QueueChanged {
            device: q.device,
            waiting: q.waiting as u32,
            running: q.running as u32,
            capacity: q.capacity as u32,
            oldest_wait_ms: q.oldest_wait_ms,
            estimated_delay_ms: q.estimated_delay_ms,
        });
    }

    /// Accepts a request: journals it, admits it to a queue and starts it. Returns once it is
    /// durably accepted (or refused); the ticket then streams its tokens and its end.
    pub fn submit(&self, sub: Submission) -> Result<Ticket, SubmitError> {
        self.check_lanes(&sub)?;
        let body = serde_json::to_value(StoredBody { run: sub.run.clone(), allow: sub.allow })
            .map_err(|e| SubmitError::Invalid(e.to_string()))?;
        let accepted = self
            .inner
            .journal
            .accept(&NewRequest {
                id: sub.run.request_id.clone(),
                idempotency_key: sub.idempotency_key.clone(),
                body_hash: sub.body_hash.clone(),
                body,
                stream: sub.stream,
                allow_resume: sub.run.allow_resume,
            })
            .map_err(|e| match e {
                JournalError::KeyConflict { .. } => SubmitError::Conflict(e.to_string()),
                e => SubmitError::Journal(e),
            })?;
        match accepted {
            Accepted::New => self.launch(sub, 1),
            Accepted::Existing(record) => {
                let (_tx, events) = mpsc::unbounded_channel();
                let running = self.inner.in_flight.lock().unwrap().get(&record.request.id).map(|f| f.done.clone());
                if let Some(done) = running {
                    // Attach to the running request: its end, not its token stream (that belongs to
                    // the first client); this ticket never cancels it.
                    return Ok(Ticket {
                        request_id: record.request.id,
                        device_queue: "attached".into(),
                        admission: "attached to the running request with this Idempotency-Key".into(),
                        events,
                        done,
                        cancel: None,
                    });
                }
                let finished = match record.state {
                    RequestState::Completed => {
                        let mut c: Completion = record
                            .result
                            .clone()
                            .and_then(|r| serde_json::from_value(r).ok())
                            .ok_or_else(|| SubmitError::Failed { reason: "stored result unreadable".into(), resumable: true })?;
                        c.from_journal = true;
                        Ok(c)
                    }
                    RequestState::Cancelled => Err(Ended::Cancelled),
                    _ => Err(Ended::Failed {
                        reason: record.error.clone().unwrap_or_else(|| format!("request {} ended {:?}", record.request.id, record.state)),
                        resumable: true,
                    }),
                };
                let (_done_tx, done) = watch::channel(Some(finished));
                Ok(Ticket {
                    request_id: record.request.id,
                    device_queue: "journal".into(),
                    admission: "the stored end of the request with this Idempotency-Key".into(),
                    events,
                    done,
                    cancel: None,
                })
            }
        }
    }

    /// Refuses up front a request that could not finish on every lane it may land on: a
    /// request that may run on the CPU worker (sent there, or failing over there when the GPU
    /// fails) must fit that worker's context limit, its own setting or its fallback model's.
    fn check_lanes(&self, sub: &Submission) -> Result<(), SubmitError> {
        let s = &self.inner.supervisor;
        let request = &sub.run.request;
        let needed = request.prompt_tokens.len() + request.max_tokens;
        let gpu = s.config().gpu.is_some();
        // A client that opted out of the CPU runs on the GPU only, without failover.
        if (gpu && !sub.allow.cpu) || self.has_defect(Defect::NoCpuLaneCheck) {
            return Ok(());
        }
        let setup = s.cpu_setup();
        let worker = s.cpu_worker();
        let Some(context) = worker.as_ref().map(|w| w.ready.context_tokens as usize).or(setup.options.max_context_tokens.map(|c| c as usize)) else {
            return Ok(());
        };
        if needed <= context {
            return Ok(());
        }
        let limit = match (&setup.fallback_model_dir, &worker) {
            (Some(_), Some(w)) => format!("the CPU worker's context limit of {context} tokens (its fallback model {}, and the setting cpu_max_context_tokens)", w.ready.model_name),
            _ => format!("the CPU worker's context limit of {context} tokens (the setting cpu_max_context_tokens)"),
        };
        let prompt = request.prompt_tokens.len();
        let max_tokens = request.max_tokens;
        Err(SubmitError::Invalid(if gpu {
            format!(
                "the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) needs {needed} tokens, more than {limit}, where this request would continue if the GPU failed; lower max_tokens or shorten the prompt, or send \"headroom\": {{\"allow_cpu\": false}} to run it on the GPU only, without failover"
            )
        } else {
            format!("the prompt ({prompt} tokens) plus max_tokens ({max_tokens}) needs {needed} tokens, more than {limit}; lower max_tokens or shorten the prompt, or raise cpu_max_context_tokens in Settings")
        }))
    }

    /// The GPU budget admission uses now (None without a healthy GPU): total, the reserve kept
    /// for other programs, weights, what requests hold, observed free memory.
    pub fn gpu_budget(&self) -> Option<Budget> {
        let s = &self.inner.supervisor;
        if s.config().gpu.is_none() || s.status().degraded || s.gpu_paused() {
            return None;
        }
        let worker = s.gpu_worker()?;
        let reading = worker.memory().borrow().clone()?;
        let total = reading.capacity_bytes?;
        // Grants made since the worker's last sample are not in its reading yet.
        let granted = self.inner.gpu_ledger.held_bytes();
        let unseen = granted.saturating_sub(reading.reserved_bytes);
        Some(Budget {
            total_bytes: total,
            reserve_bytes: self.vram_reserve_bytes(total),
            weights_bytes: reading.weights_bytes,
            held_bytes: reading.reserved_bytes.max(granted),
            observed_free_bytes: reading.used_bytes.map(|u| total.saturating_sub(u).saturating_sub(unseen)),
        })
    }

    /// The VRAM kept free for other programs: the settings' reserve, else the config's rule.
    fn vram_reserve_bytes(&self, total: u64) -> u64 {
        match self.inner.settings.lock().unwrap().vram_reserve_mib {
            Some(mib) => mib * headroom_memory::MIB,
            None => self.inner.memory.vram_reserve_bytes(total),
        }
    }

    /// Reserves `bytes` of GPU memory if the budget has them now.
    fn try_grant_gpu(&self, id: &str, bytes: u64) -> Option<Reservation> {
        let _one_at_a_time = self.inner.gpu_grant.lock().unwrap();
        let budget = self.gpu_budget()?;
        (bytes <= budget.available_bytes()).then(|| self.inner.gpu_ledger.try_reserve(id, bytes).ok()).flatten()
    }

    fn host_budget(&self) -> Budget {
        let ledger = &self.inner.host_ledger;
        let host = headroom_memory::observe::host_memory();
        // The ledger's capacity already leaves the reserve out; the budget names the reserve
        // (for reasons) and keeps it out of live free RAM too.
        let reserve = host.map(|h| self.inner.memory.host_reserve_bytes(h.total_bytes)).unwrap_or(0);
        Budget {
            total_bytes: ledger.capacity_bytes() + reserve,
            reserve_bytes: reserve,
            weights_bytes: 0,
            held_bytes: ledger.held_bytes(),
            observed_free_bytes: host.map(|h| h.available_bytes),
        }
    }

    /// Decides where the request goes and starts it there (attempt `attempt`).
    fn launch(&self, mut sub: Submission, attempt: u32) -> Result<Ticket, SubmitError> {
        let id = sub.run.request_id.clone();
        let shape = RequestShape {
            prompt_tokens: sub.run.request.prompt_tokens.len() as u64,
            max_tokens: sub.run.request.max_tokens as u64,
            prefill_chunk: sub.run.request.prefill_chunk as u64,
        };
        // Decide and take the GPU grant in one step, so that concurrent admissions see each other.
        let grant_guard = self.inner.gpu_grant.lock().unwrap();
        let gpu_budget = self.gpu_budget();
        let gpu_eta = self.inner.gpu.estimated_delay_ms();
        let admission = if self.inner.supervisor.gpu_paused() && self.inner.supervisor.config().gpu.is_some() {
            self.inner.planner.decide_without_gpu("the GPU is paused in settings", shape, sub.allow, &self.host_budget())
        } else {
            self.inner.planner.decide(shape, sub.allow, gpu_budget.as_ref(), &self.host_budget(), |_| gpu_eta)
        };
        let gpu_grant = match &admission {
            Admission::Gpu { .. } | Admission::Shrink { .. } => {
                let max_tokens = match &admission {
                    Admission::Shrink { max_tokens, .. } => *max_tokens,
                    _ => shape.max_tokens,
                };
                let bytes = self.inner.planner.footprint(RequestShape { max_tokens, ..shape }).request_bytes();
                self.inner.gpu_ledger.try_reserve(&id, bytes).ok()
            }
            // A queued request is granted its memory when it leaves the queue.
            _ => None,
        };
        drop(grant_guard);
        let refuse = |reason: String, retry_after_s: Option<u64>, estimated_delay_ms: Option<u64>| -> SubmitError {
            self.count_end("none", "refused");
            if let Err(e) = self.journal_step(&id, &Transition::Refused { reason: reason.clone() }) {
                return SubmitError::Journal(e);
            }
            SubmitError::Capacity { reason, retry_after_s, estimated_delay_ms }
        };
        let on_gpu = match &admission {
            Admission::Gpu { .. } | Admission::Queue { .. } => true,
            Admission::Shrink { max_tokens, .. } => {
                sub.run.request.max_tokens = *max_tokens as usize;
                true
            }
            Admission::Cpu { .. } => false,
            Admission::Refuse { reason, retry_after_s } => return Err(refuse(reason.clone(), *retry_after_s, gpu_eta)),
        };
        let lane = if on_gpu { &self.inner.gpu } else { &*self.inner.cpu };
        // A client that said how long it waits gets a capacity error now rather than a reply
        // after it gave up: the expected wait plus generation time, from measured rates.
        let run_ms = lane.expected_run_ms(shape.prompt_tokens, shape.max_tokens);
        if let (Some(limit), Some(run_ms), Some(delay)) = (sub.allow.max_wait_ms, run_ms, lane.estimated_delay_ms()) {
            let expected = delay + run_ms.round() as u64;
            if expected > limit {
                return Err(refuse(
                    format!(
                        "expected to take about {expected} ms on the {} ({delay} ms waiting, then {run_ms:.0} ms for {} prompt and up to {} new tokens at measured rates), more than the client's {limit} ms timeout",
                        lane.device, shape.prompt_tokens, shape.max_tokens
                    ),
                    Some(delay.div_ceil(1000).max(1)),
                    Some(delay),
                ));
            }
        }
        let shape = RequestShape { max_tokens: sub.run.request.max_tokens as u64, ..shape };
        let host_reservation = match self.enter_lane(lane, &id, shape) {
            Ok(r) => r,
            Err(LaneRefusal { reason, retry_after_s, estimated_delay_ms }) => return Err(refuse(reason, Some(retry_after_s), estimated_delay_ms)),
        };
        if let Err(e) = self.journal_step(&id, &Transition::Queued { device: lane.device.into() }) {
            lane.forget(&id);
            lane.leave(shape.prompt_tokens, shape.max_tokens);
            self.queue_changed(lane);
            return Err(SubmitError::Journal(e));
        }

        let (event_tx, events) = mpsc::unbounded_channel();
        let (done_tx, done) = watch::channel(None);
        let cancel = CancelSignal::new();
        self.inner.in_flight.lock().unwrap().insert(id.clone(), InFlight { done: done.clone(), cancel: cancel.clone() });
        let this = self.clone();
        let task_cancel = cancel.clone();
        let ticket_id = id.clone();
        let reason = admission.reason().to_string();
        let ticket_admission = reason.clone();
        let start = Start { attempt, on_gpu, gpu_grant, host_reservation, admission: reason };
        tokio::spawn(async move {
            let result = this.execute(sub, start, task_cancel, event_tx).await;
            this.inner.in_flight.lock().unwrap().remove(&id);
            done_tx.send_replace(Some(result));
        });
        Ok(Ticket { request_id: ticket_id, device_queue: lane.device.into(), admission: ticket_admission, events, done, cancel: Some(cancel) })
    }

    /// Puts a request in `lane`'s bounded queue: a full queue is a refusal now, never unbounded
    /// growth, and the CPU path also reserves host RAM for the request's footprint for as long
    /// as it runs (returned; dropping it gives the RAM back).
    fn enter_lane(&self, lane: &Lane, id: &str, shape: RequestShape) -> Result<Option<Reservation>, LaneRefusal> {
        if lane.waiting.fetch_add(1, Ordering::SeqCst) >= lane.capacity {
            lane.waiting.fetch_sub(1, Ordering::SeqCst);
            let delay = lane.estimated_delay_ms();
            return Err(LaneRefusal {
                reason: format!(
                    "the {} queue is full ({} waiting){}; retry later",
                    lane.device,
                    lane.capacity,
                    delay.map(|d| format!(", estimated delay {d} ms")).unwrap_or_default()
                ),
                retry_after_s: delay.map(|d| d.div_ceil(1000)).unwrap_or(1).max(1),
                estimated_delay_ms: delay,
            });
        }
        let host_reservation = if lane.device == "cpu" {
            match self.inner.host_ledger.try_reserve(id, self.inner.planner.footprint(shape).request_bytes()) {
                Ok(r) => Some(r),
                Err(e) => {
                    lane.waiting.fetch_sub(1, Ordering::SeqCst);
                    return Err(LaneRefusal { reason: format!("not enough host RAM for the CPU path: {e}"), retry_after_s: 5, estimated_delay_ms: None });
                }
            }
        } else {
            None
        };
        lane.join(id, shape.prompt_tokens, shape.max_tokens);
        self.queue_changed(lane);
        Ok(host_reservation)
    }

    /// A request that leaves the GPU (its device failed, or its memory never came) joins the CPU
    /// queue behind the requests already there, in the place kept for it (`failover_room`), so
    /// it is never refused for a full queue and never meets a busy CPU worker. It is told why
    /// it waits and for about how long, and it holds host RAM for its footprint from here on
    /// (waiting for it if the host is short, cancellable).
    async fn join_cpu_after_gpu(&self, id: &str, shape: RequestShape, cancel: &CancelSignal, events: &mpsc::UnboundedSender<StreamEvent>, why: &str) -> Result<Reservation, Ended> {
        let lane = &*self.inner.cpu;
        let ahead = lane.waiting.fetch_add(1, Ordering::SeqCst) + lane.running.load(Ordering::SeqCst);
        if lane.waiting.load(Ordering::SeqCst) > lane.capacity + lane.failover_room {
            tracing::error!(request_id = id, "the CPU queue holds more than its capacity and failover room; the GPU lane outgrew its bound");
        }
        lane.join(id, shape.prompt_tokens, shape.max_tokens);
        self.queue_changed(lane);
        let _ = events.send(StreamEvent::Waiting(WaitNotice { queue: lane.device.into(), reason: why.to_string(), ahead, estimated_delay_ms: lane.estimated_delay_ms() }));
        if let Err(e) = self.journal_step(id, &Transition::Queued { device: lane.device.into() }) {
            lane.forget(id);
            return Err(self.end_in_queue(lane, id, shape.prompt_tokens, shape.max_tokens, journal_failure(&e)));
        }
        let bytes = self.inner.planner.footprint(shape).request_bytes();
        loop {
            match self.inner.host_ledger.try_reserve(id, bytes) {
                Ok(r) => return Ok(r),
                Err(e) => tracing::warn!(request_id = id, error = %e, "failover waits for host RAM"),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                _ = cancel.cancelled() => {
                    lane.forget(id);
                    return Err(self.end_in_queue(lane, id, shape.prompt_tokens, shape.max_tokens, Ended::Cancelled));
                }
            }
        }
    }

    /// Ends a request that never left `lane`'s queue: frees its place, journals why (a queued
    /// request fails only for capacity), counts it.
    fn end_in_queue(&self, lane: &Lane, id: &str, prompt_tokens: u64, max_tokens: u64, ended: Ended) -> Ended {
        lane.leave(prompt_tokens, max_tokens);
        let (transition, outcome) = match &ended {
            Ended::Cancelled => (Transition::Cancelled { reason: "cancelled while queued".into() }, "cancelled"),
            Ended::Failed { reason, resumable } => (Transition::Failed { kind: "capacity".into(), detail: reason.clone(), resumable: *resumable }, "failed"),
        };
        let _ = self.journal_step(id, &transition);
        self.count_end(lane.device, outcome);
        self.queue_changed(lane);
        ended
    }

    /// Appends a step to a request's journal. A write that fails is never dropped: it is
    /// logged, `/readyz` reports it until a later write succeeds, and the caller fails the
    /// request (or, for a request already ending, ends it all the same).
    fn journal_step(&self, id: &str, transition: &Transition) -> Result<(), JournalError> {
        let written = self.inner.journal.record(id, transition).map(|_| ());
        self.journal_written(id, written)
    }

    fn journal_written(&self, id: &str, written: Result<(), JournalError>) -> Result<(), JournalError> {
        if self.has_defect(Defect::IgnoreJournalErrors) {
            return Ok(());
        }
        let mut fault = self.inner.journal_fault.lock().unwrap();
        match &written {
            Ok(()) => *fault = None,
            Err(e) => {
                tracing::error!(request_id = id, error = %e, "journal write failed");
                *fault = Some(format!("the request journal cannot be written ({e}); accepted requests are failed rather than run unrecorded: check the disk holding the data dir"));
            }
        }
        written
    }

    /// Journals a tool call before it is delivered (a failed write is reported like any other).
    pub fn record_tool_call(&self, id: &str, call_id: &str, name: &str, arguments: &str) -> Result<(), JournalError> {
        let written = self.inner.journal.record_tool_call(id, call_id, name, arguments).map(|_| ());
        self.journal_written(id, written)
    }

    /// Why the journal refuses writes now, if it does (for `/readyz`).
    pub fn journal_fault(&self) -> Option<String> {
        self.inner.journal_fault.lock().unwrap().clone()
    }

    /// Waits (in the GPU lane, holding a GPU slot) until the request's GPU memory is granted.
    async fn wait_for_gpu_memory(&self, sub: &Submission, queued_at: Instant, cancel: &CancelSignal) -> GpuWait {
        let inner = &self.inner;
        let request = &sub.run.request;
        let needs = inner
            .planner
            .footprint(RequestShape { prompt_tokens: request.prompt_tokens.len() as u64, max_tokens: request.max_tokens as u64, prefill_chunk: request.prefill_chunk as u64 })
            .request_bytes();
        let max_wait = Duration::from_millis(sub.allow.max_wait_ms.unwrap_or(inner.memory.max_queue_wait_ms));
        loop {
            if self.gpu_budget().is_none() {
                return match inner.supervisor.gpu_unavailable() {
                    Some(why) => GpuWait::Leave { why, cpu_allowed: sub.allow.cpu },
                    // A healthy GPU without a memory reading yet: run without a grant.
                    None => GpuWait::Run(None),
                };
            }
            if let Some(r) = self.try_grant_gpu(&sub.run.request_id, needs) {
                return GpuWait::Run(Some(r));
            }
            if queued_at.elapsed() >= max_wait {
                return GpuWait::Leave {
                    why: format!("waited {} ms for GPU memory that did not free", queued_at.elapsed().as_millis()),
                    cpu_allowed: sub.allow.cpu && inner.memory.allow_cpu_redirect,
                };
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
                _ = cancel.cancelled() => return GpuWait::Cancelled,
            }
        }
    }

    /// Runs a request from its queue to its end: waits for a slot in its lane (and, on the GPU,
    /// for its memory), runs an attempt, and when the GPU fails it, journals the failover at
    /// once and moves it into the CPU queue for its next attempt (replay, or resume after the
    /// tokens already delivered).
    async fn execute(&self, sub: Submission, start: Start, cancel: CancelSignal, events: mpsc::UnboundedSender<StreamEvent>) -> Result<Completion, Ended> {
        let inner = &self.inner;
        let id = sub.run.request_id.clone();
        let shape = RequestShape {
            prompt_tokens: sub.run.request.prompt_tokens.len() as u64,
            max_tokens: sub.run.request.max_tokens as u64,
            prefill_chunk: sub.run.request.prefill_chunk as u64,
        };
        // The host RAM of the CPU path is held until the request ends.
        let Start { mut attempt, mut on_gpu, mut gpu_grant, host_reservation: mut _host, mut admission } = start;
        let mut progress = Progress::default();
        let mut queued_ms = 0.0;
        // Defect::FailoverBypassesCpuQueue: the next attempt takes no slot.
        let mut skip_slot = false;
        loop {
            let lane = if on_gpu { &inner.gpu } else { &*inner.cpu };
            let queued_at = Instant::now();
            let permit = if std::mem::take(&mut skip_slot) {
                lane.forget(&id);
                None
            } else {
                let permit = tokio::select! {
                    p = lane.slots.acquire() => p.ok(),
                    _ = cancel.cancelled() => None,
                };
                lane.forget(&id);
                let Some(permit) = permit else {
                    return Err(self.end_in_queue(lane, &id, shape.prompt_tokens, shape.max_tokens, Ended::Cancelled));
                };
                Some(permit)
            };
            // A request queued for the GPU starts only when its memory is there: a free slot is
            // not free memory. If it does not come within the queue wait, or the GPU goes away,
            // the request moves to the CPU queue.
            if on_gpu && gpu_grant.is_none() {
                match self.wait_for_gpu_memory(&sub, queued_at, &cancel).await {
                    GpuWait::Run(grant) => gpu_grant = grant,
                    GpuWait::Cancelled => return Err(self.end_in_queue(lane, &id, shape.prompt_tokens, shape.max_tokens, Ended::Cancelled)),
                    GpuWait::Leave { why, cpu_allowed: false } => {
                        let reason = format!("{why}, and CPU fallback is not allowed");
                        return Err(self.end_in_queue(lane, &id, shape.prompt_tokens, shape.max_tokens, Ended::Failed { reason, resumable: true }));
                    }
                    GpuWait::Leave { why, cpu_allowed: true } => {
                        drop(permit);
                        lane.leave(shape.prompt_tokens, shape.max_tokens);
                        self.queue_changed(lane);
                        queued_ms += queued_at.elapsed().as_secs_f64() * 1000.0;
                        _host = Some(self.join_cpu_after_gpu(&id, shape, &cancel, &events, &why).await?);
                        admission = why;
                        on_gpu = false;
                        continue;
                    }
                }
            }
            queued_ms += queued_at.elapsed().as_secs_f64() * 1000.0;
            lane.running.fetch_add(1, Ordering::SeqCst);
            self.queue_changed(lane);
            let device = if on_gpu { inner.supervisor.config().gpu.as_ref().map(|g| g.device.label()).unwrap_or_default() } else { "cpu".into() };
            let leave_lane = || {
                lane.running.fetch_sub(1, Ordering::SeqCst);
                lane.leave(shape.prompt_tokens, shape.max_tokens);
                self.queue_changed(lane);
            };
            if let Err(e) = self.journal_step(&id, &Transition::Running { device, attempt }) {
                leave_lane();
                self.count_end(lane.device, "failed");
                return Err(journal_failure(&e));
            }
            let started = Instant::now();
            let mut first = sub.stream;
            let mut journal_broke: Option<JournalError> = None;
            let result = inner
                .supervisor
                .attempt(&sub.run, if on_gpu { Target::Gpu } else { Target::Cpu }, &mut progress, &cancel, &mut |t: &StreamedToken| {
                    if first {
                        first = false;
                        // From here on a replay from the start would show the client text twice.
                        let written = inner.journal.record_delivered(&id, 1);
                        if let Err(e) = self.journal_written(&id, written) {
                            journal_broke = Some(e);
                            cancel.cancel();
                        }
                    }
                    let _ = events.send(StreamEvent::Token(t.clone()));
                })
                .await;
            drop(gpu_grant.take());
            leave_lane();
            drop(permit);
            if let Some(e) = journal_broke {
                self.count_end(lane.device, "failed");
                return Err(journal_failure(&e));
            }
            match result {
                Ok(outcome) => return self.completed(&sub, outcome, on_gpu, admission, queued_ms, started),
                Err(AttemptError::GpuFailed { from, reason, resumed_after_tokens }) => {
                    let metrics = &inner.metrics;
                    metrics.failovers.get_or_create(&FailoverLabels { from: from.clone(), to: "cpu".into() }).inc();
                    if resumed_after_tokens > 0 { metrics.resumes.inc() } else { metrics.replays.inc() };
                    attempt += 1;
                    let next = if resumed_after_tokens > 0 {
                        Transition::Resumed { to: "cpu".into(), attempt, after_tokens: resumed_after_tokens }
                    } else {
                        Transition::Replayed { to: "cpu".into(), attempt }
                    };
                    let journaled = self
                        .journal_step(&id, &Transition::AttemptFailed { device: from, kind: "failover".into(), detail: reason.clone() })
                        .and_then(|()| self.journal_step(&id, &next));
                    if let Err(e) = journaled {
                        self.count_end(lane.device, "failed");
                        return Err(journal_failure(&e));
                    }
                    if !sub.allow.cpu {
                        let detail = format!("{reason}; the request does not allow the CPU (allow_cpu: false), so it ends here; retry it");
                        let _ = self.journal_step(&id, &Transition::Failed { kind: "worker".into(), detail: detail.clone(), resumable: true });
                        self.count_end(lane.device, "failed");
                        return Err(Ended::Failed { reason: detail, resumable: true });
                    }
                    on_gpu = false;
                    if self.has_defect(Defect::FailoverBypassesCpuQueue) {
                        inner.cpu.waiting.fetch_add(1, Ordering::SeqCst);
                        inner.cpu.join(&id, shape.prompt_tokens, shape.max_tokens);
                        skip_slot = true;
                        continue;
                    }
                    _host = Some(self.join_cpu_after_gpu(&id, shape, &cancel, &events, &reason).await?);
                }
                Err(AttemptError::End(Error::Cancelled)) => {
                    let _ = self.journal_step(&id, &Transition::Cancelled { reason: "cancelled while running".into() });
                    self.count_end(lane.device, "cancelled");
                    return Err(Ended::Cancelled);
                }
                Err(AttemptError::End(e)) => {
                    let resumable = matches!(e, Error::Interrupted { .. } | Error::Worker(_) | Error::Unavailable(_));
                    let kind = match &e {
                        Error::Interrupted { .. } => "interrupted",
                        Error::Invalid(_) => "invalid",
                        _ => "worker",
                    };
                    let detail = e.to_string();
                    let _ = self.journal_step(&id, &Transition::Failed { kind: kind.into(), detail: detail.clone(), resumable });
                    self.count_end(lane.device, "failed");
                    return Err(Ended::Failed { reason: detail, resumable });
                }
            }
        }
    }

    /// Journals and counts a finished request.
    fn completed(&self, sub: &Submission, mut outcome: RunOutcome, on_gpu: bool, admission: String, queued_ms: f64, started: Instant) -> Result<Completion, Ended> {
        let inner = &self.inner;
        let id = &sub.run.request_id;
        if !on_gpu && inner.supervisor.config().gpu.is_some() && !outcome.degraded {
            // Admission (or a wait for GPU memory) sent it to the CPU: slower than the client
            // would expect, so say so.
            outcome.degraded = true;
            outcome.degraded_reason = Some(format!("served by the CPU worker: {admission}"));
        }
        let finishing_lane = if outcome.device == "cpu" { &*inner.cpu } else { &inner.gpu };
        if outcome.failovers.is_empty() {
            let total_ms = started.elapsed().as_secs_f64() * 1000.0;
            finishing_lane.observe(outcome.prompt_tokens, outcome.prefill_ms, outcome.completion_tokens, (total_ms - outcome.prefill_ms).max(0.0));
        }
        let metrics = &inner.metrics;
        metrics.requests.get_or_create(&OutcomeLabels { device: outcome.device.clone(), outcome: "completed".into() }).inc();
        metrics.generated_tokens.get_or_create(&crate::metrics::device(&outcome.device)).inc_by(outcome.completion_tokens as u64);
        if sub.stream {
            let written = inner.journal.record_delivered(id, outcome.tokens.len() as u32);
            if let Err(e) = self.journal_written(id, written) {
                return Err(journal_failure(&e));
            }
        }
        let completion = Completion { outcome, admission, queued_ms, from_journal: false, cpu_failover: sub.allow.cpu };
        let stored = serde_json::to_value(&completion).unwrap_or_default();
        self.journal_step(id, &Transition::Completed { device: completion.outcome.device.clone(), result: stored }).map_err(|e| journal_failure(&e))?;
        Ok(completion)
    }
}

/// How a request starts executing (from admission, or after a restart).
struct Start {
    attempt: u32,
    on_gpu: bool,
    gpu_grant: Option<Reservation>,
    host_reservation: Option<Reservation>,
    admission: String,
}

/// What waiting for GPU memory came to.
enum GpuWait {
    /// Run now, with the memory granted (None: a healthy GPU with no memory reading yet).
    Run(Option<Reservation>),
    /// Leave the GPU lane: its memory did not free in time, or the GPU is gone.
    Leave { why: String, cpu_allowed: bool },
    Cancelled,
}

/// A request failed because its journal could not be written: loudly, never run unrecorded.
fn journal_failure(e: &JournalError) -> Ended {
    Ended::Failed { reason: format!("the request journal could not record this request ({e}), so it was stopped; retry once the server's disk is writable"), resumable: true }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_config_reads_its_table_and_rejects_typos() {
        let q = QueueConfig::from_toml("[queues]\ncpu_queue_capacity = 3\n").unwrap();
        assert_eq!((q.gpu_queue_capacity, q.cpu_queue_capacity), (64, 3));
        assert!(QueueConfig::from_toml("[queues]\ncpu_queue = 3\n").unwrap_err().to_string().contains("cpu_queue"));
    }

    #[tokio::test]
    async fn a_lane_resized_by_settings_gives_and_takes_back_slots() {
        let lane = Arc::new(Lane::new("cpu", 4, 0, 1));
        let running = lane.slots.acquire().await.unwrap();
        lane.resize(3);
        assert_eq!(lane.slots.available_permits(), 2, "two more slots at once");
        lane.resize(1);
        // Taken back as they free: the running request keeps its slot until it ends.
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(lane.slots.available_permits(), 0);
        drop(running);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(lane.slots.available_permits(), 1);
        assert_eq!(lane.status().concurrency, 1);
    }

    #[test]
    fn lane_delay_comes_from_measured_rates_and_the_work_ahead() {
        let lane = Lane::new("cpu", 4, 0, 1);
        assert_eq!(lane.estimated_delay_ms(), None, "nothing measured yet");
        lane.observe(100, 100.0, 100, 1000.0); // 1 ms a prompt token, 10 ms a new token
        assert_eq!(lane.estimated_delay_ms(), Some(0), "a free slot: no wait");
        lane.running.store(1, Ordering::SeqCst);
        lane.join("a", 200, 300);
        assert_eq!(lane.estimated_delay_ms(), Some(200 + 3000));
        lane.observe(0, 0.0, 100, 2000.0); // decode EWMA moves a fifth of the way to 20 ms
        assert_eq!(lane.estimated_delay_ms(), Some(200 + 3600));
        lane.leave(200, 300);
        assert_eq!(lane.estimated_delay_ms(), Some(0), "nothing ahead");
    }
}
