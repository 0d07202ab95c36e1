//! Supervision: start the GPU and CPU workers, check their health, notice deaths and hangs,
//! restart the GPU worker with exponential backoff, and drive the circuit breaker through its
//! probe. Also the first half of dispatch: run a request on the GPU while the breaker is closed
//! and fail it over to the warm CPU worker (replay, or resume from the last token) when the GPU
//! fails. The CPU worker's own requests are never touched by anything the GPU does.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use headroom_model::{Checkpoint, FinishReason, GenerateRequest, SamplerState};
use headroom_worker::{DeviceKind, FailureKind, Fault, FromWorker, GenerateJob, WorkerOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::breaker::{Breaker, BreakerConfig, BreakerState, FailureCause, Transition};
use crate::events::{EventKind, ServiceEvent};
use crate::worker::{Worker, WorkerSpec};
use crate::{Error, Result};

/// Supervision knobs: the `[supervision]` table of a Headroom config file. Units in the names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SupervisionConfig {
    pub health_interval_ms: u64,
    /// A worker that does not answer a health check within this is hung and is replaced.
    pub health_timeout_ms: u64,
    /// A worker that answers its health checks but, with requests running, produces no prefill
    /// or token for this long is hung too. Longer than any kernel compilation (CUDA compiles
    /// a shape not seen before for up to tens of seconds: busy, not hung).
    pub stall_timeout_ms: u64,
    pub load_timeout_ms: u64,
    /// First restart delay of the GPU worker; doubles per failed attempt up to the max.
    pub restart_backoff_initial_ms: u64,
    pub restart_backoff_max_ms: u64,
    /// Canary allocation of the half-open probe.
    pub probe_canary_mib: u64,
    pub breaker: BreakerConfig,
}

impl Default for SupervisionConfig {
    fn default() -> Self {
        Self {
            health_interval_ms: 1000,
            health_timeout_ms: 3000,
            stall_timeout_ms: 120_000,
            load_timeout_ms: 300_000,
            restart_backoff_initial_ms: 250,
            restart_backoff_max_ms: 30_000,
            probe_canary_mib: 64,
            breaker: BreakerConfig::default(),
        }
    }
}

impl SupervisionConfig {
    /// Parses the `[supervision]` table of a Headroom config file (other tables are ignored).
    pub fn from_toml(text: &str) -> Result<Self> {
        crate::config_table(text, "supervision")
    }

    fn health_interval(&self) -> Duration {
        Duration::from_millis(self.health_interval_ms)
    }
    fn health_timeout(&self) -> Duration {
        Duration::from_millis(self.health_timeout_ms)
    }
}

#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// The `headroom` binary whose `worker` subcommand runs a worker.
    pub program: PathBuf,
    pub model_dir: PathBuf,
    /// The GPU worker (`cuda:N` or `sim`); `None` serves from the CPU only.
    pub gpu: Option<WorkerOptions>,
    pub cpu: WorkerOptions,
    /// A smaller model for the CPU worker; responses it serves then say so.
    pub cpu_fallback_model_dir: Option<PathBuf>,
    pub supervision: SupervisionConfig,
    /// Start with the GPU paused (settings): the GPU worker is not started until unpaused.
    pub gpu_paused: bool,
    /// Extra environment variables for every worker process.
    pub worker_env: Vec<(String, String)>,
}

/// What the CPU worker runs: its options and model. Settings change it live
/// ([`Supervisor::replace_cpu_worker`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CpuSetup {
    pub options: WorkerOptions,
    /// A smaller model folder; None: the served model.
    pub fallback_model_dir: Option<PathBuf>,
}

impl SupervisorConfig {
    pub fn new(program: PathBuf, model_dir: PathBuf, gpu: Option<WorkerOptions>) -> Self {
        Self {
            program,
            model_dir,
            gpu,
            cpu: WorkerOptions::new(DeviceKind::Cpu),
            cpu_fallback_model_dir: None,
            supervision: SupervisionConfig::default(),
            gpu_paused: false,
            worker_env: Vec::new(),
        }
    }
}

/// A request as the dispatcher runs it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunRequest {
    pub request_id: String,
    pub request: GenerateRequest,
    /// Whether a stream already under way may continue on another device from its last token.
    /// Without it, a failure after the first token ends the request with a resumable error.
    pub allow_resume: bool,
}

/// One token as the client sees it.
#[derive(Debug, Clone)]
pub struct StreamedToken {
    pub index: u32,
    pub token: u32,
    pub text: String,
    pub device: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailoverRecord {
    pub from: String,
    pub to: String,
    pub reason: String,
    /// Tokens already delivered when the GPU failed (0: replayed from the start).
    pub resumed_after_tokens: u32,
    /// From the failure's report to the first token from the CPU worker.
    pub failure_to_first_token_ms: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunOutcome {
    pub request_id: String,
    /// The device that finished the request.
    pub device: String,
    pub simulated: bool,
    pub degraded: bool,
    pub degraded_reason: Option<String>,
    /// The CPU worker's smaller model, when it served the request.
    pub fallback_model: Option<String>,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prefill (and checkpoint replay) time of the attempt that finished.
    pub prefill_ms: f64,
    /// Decode time the worker measured for the attempt that finished.
    #[serde(default)]
    pub decode_ms: f64,
    pub failovers: Vec<FailoverRecord>,
}

/// A cancellation that can be fired from anywhere (a client disconnect, a cancel endpoint) and
/// awaited by the request it belongs to. Clones share one signal.
#[derive(Debug, Clone)]
pub struct CancelSignal {
    tx: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Default for CancelSignal {
    fn default() -> Self {
        Self::new()
    }
}

impl CancelSignal {
    pub fn new() -> Self {
        Self { tx: Arc::new(tokio::sync::watch::channel(false).0) }
    }

    pub fn cancel(&self) {
        self.tx.send_replace(true);
    }

    pub fn is_cancelled(&self) -> bool {
        *self.tx.borrow()
    }

    /// Resolves once cancelled (at once if it already is).
    pub async fn cancelled(&self) {
        let mut rx = self.tx.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }
}

/// Where an attempt runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The GPU while the breaker is closed, else the CPU.
    Auto,
    /// The GPU; a GPU that is down or paused fails the attempt over.
    Gpu,
    Cpu,
}

struct Inner {
    config: SupervisorConfig,
    gpu: RwLock<Option<Arc<Worker>>>,
    cpu: RwLock<Option<Arc<Worker>>>,
    breaker: Mutex<Breaker>,
    events: broadcast::Sender<ServiceEvent>,
    /// Faults that model the environment (a competing program, a slow card) outlive restarts.
    sim_environment: Mutex<Vec<Fault>>,
    shutting_down: std::sync::atomic::AtomicBool,
    /// The CPU worker's options and model now (the config holds those it started with).
    cpu_setup: RwLock<CpuSetup>,
    /// One CPU worker replacement at a time.
    replacing_cpu: tokio::sync::Mutex<()>,
    /// The GPU paused from settings: nothing new goes to it, and its worker exits once idle.
    gpu_paused: tokio::sync::watch::Sender<bool>,
}

#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

/// The service's device status, for responses, the UI and `/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceStatus {
    pub breaker: BreakerState,
    pub reason: String,
    pub degraded: bool,
    /// Paused from settings (the person's choice, not a failure): requests go to the CPU.
    pub gpu_paused: bool,
    pub gpu: Option<WorkerStatus>,
    pub cpu: Option<WorkerStatus>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub device: String,
    pub pid: u32,
    pub simulated: bool,
    pub model: String,
    pub bundle_hash: String,
    pub load_ms: f64,
}

fn status_of(worker: &Worker) -> WorkerStatus {
    WorkerStatus {
        device: worker.device.label(),
        pid: worker.pid,
        simulated: worker.ready.simulated,
        model: worker.ready.model_name.clone(),
        bundle_hash: worker.ready.bundle_hash.clone(),
        load_ms: worker.ready.load_ms,
    }
}

impl Supervisor {
    /// Starts the CPU worker (warm) and the GPU worker side by side and checks they hold the same
    /// bundle (or that a fallback model was asked for). A GPU that fails to start leaves the
    /// service degraded, not down.
    pub async fn start(config: SupervisorConfig) -> Result<Supervisor> {
        let (events, _) = broadcast::channel(1024);
        let inner = Arc::new(Inner {
            breaker: Mutex::new(Breaker::new(config.supervision.breaker.clone())),
            cpu_setup: RwLock::new(CpuSetup { options: config.cpu.clone(), fallback_model_dir: config.cpu_fallback_model_dir.clone() }),
            replacing_cpu: tokio::sync::Mutex::new(()),
            gpu_paused: tokio::sync::watch::channel(config.gpu_paused).0,
            config,
            gpu: RwLock::new(None),
            cpu: RwLock::new(None),
            events,
            sim_environment: Mutex::new(Vec::new()),
            shutting_down: false.into(),
        });
        let supervisor = Supervisor { inner };
        let cpu_spec = supervisor.cpu_spec();
        // A paused GPU's worker starts when it is unpaused.
        let gpu_spec = supervisor.gpu_spec().filter(|_| !supervisor.gpu_paused());
        let (cpu, gpu) = tokio::join!(Worker::spawn(&cpu_spec), async {
            match &gpu_spec {
                Some(spec) => Some(Worker::spawn(spec).await),
                None => None,
            }
        });
        let cpu = cpu?;
        supervisor.announce(&cpu);
        *supervisor.inner.cpu.write().unwrap() = Some(cpu.clone());
        match gpu {
            Some(Ok(gpu)) => {
                if supervisor.cpu_setup().fallback_model_dir.is_none() && gpu.ready.bundle_hash != cpu.ready.bundle_hash {
                    return Err(Error::Worker(format!(
                        "the GPU and CPU workers loaded different models ({} vs {}); point both at one folder or configure a fallback model",
                        &gpu.ready.bundle_hash[..12.min(gpu.ready.bundle_hash.len())],
                        &cpu.ready.bundle_hash[..12.min(cpu.ready.bundle_hash.len())]
                    )));
                }
                supervisor.announce(&gpu);
                *supervisor.inner.gpu.write().unwrap() = Some(gpu);
            }
            Some(Err(e)) => {
                tracing::error!(error = %e, "GPU worker failed to start; serving from the CPU");
                supervisor.trip(FailureCause::DeviceLost, &format!("GPU worker failed to start: {e}"));
            }
            None => {}
        }
        if supervisor.inner.config.gpu.is_some() {
            tokio::spawn(supervisor.clone().watch_gpu());
        }
        tokio::spawn(supervisor.clone().watch_cpu());
        Ok(supervisor)
    }

    fn cpu_spec(&self) -> WorkerSpec {
        self.cpu_spec_for(&self.cpu_setup())
    }

    fn cpu_spec_for(&self, setup: &CpuSetup) -> WorkerSpec {
        let c = &self.inner.config;
        WorkerSpec {
            program: c.program.clone(),
            options: setup.options.clone(),
            model_dir: setup.fallback_model_dir.clone().unwrap_or_else(|| c.model_dir.clone()),
            load_timeout: Duration::from_millis(c.supervision.load_timeout_ms),
            env: c.worker_env.clone(),
        }
    }

    /// The CPU worker's options and model now.
    pub fn cpu_setup(&self) -> CpuSetup {
        self.inner.cpu_setup.read().unwrap().clone()
    }

    /// Replaces the CPU worker with one started from `setup`, without a gap: the new worker
    /// loads beside the old one, takes new requests once ready, and the old one exits when its
    /// running requests have finished. If the new one fails to start, the old one stays.
    pub async fn replace_cpu_worker(&self, setup: CpuSetup) -> Result<()> {
        let _one_at_a_time = self.inner.replacing_cpu.lock().await;
        if setup == self.cpu_setup() {
            return Ok(());
        }
        let new = Worker::spawn(&self.cpu_spec_for(&setup)).await?;
        if setup.fallback_model_dir.is_none() {
            // Without a fallback model both workers must hold the served model.
            if let Some(gpu) = self.gpu_worker().filter(|g| g.ready.bundle_hash != new.ready.bundle_hash) {
                new.kill();
                return Err(Error::Worker(format!("the new CPU worker loaded another model than the GPU's ({})", gpu.ready.model_name)));
            }
        }
        *self.inner.cpu_setup.write().unwrap() = setup;
        self.announce(&new);
        let old = self.inner.cpu.write().unwrap().replace(new);
        if let Some(old) = old {
            tokio::spawn(retire_when_idle(old));
        }
        Ok(())
    }

    /// Whether the GPU is paused from settings.
    pub fn gpu_paused(&self) -> bool {
        *self.inner.gpu_paused.borrow()
    }

    /// Why the GPU takes no requests now (paused, breaker not closed, no worker), if it does not.
    pub fn gpu_unavailable(&self) -> Option<String> {
        if self.gpu_paused() {
            return Some("the GPU is paused in settings".into());
        }
        let breaker = self.inner.breaker.lock().unwrap();
        (!breaker.allows_requests() || self.gpu_worker().is_none()).then(|| format!("the GPU is unavailable: {}", breaker.reason()))
    }

    /// Pauses the GPU (nothing new goes to it; its worker exits once its running requests end,
    /// freeing its VRAM) or resumes it (the worker starts again).
    pub fn set_gpu_paused(&self, paused: bool) {
        if self.inner.gpu_paused.send_replace(paused) != paused && self.inner.config.gpu.is_some() {
            self.emit(EventKind::GpuPaused {
                paused,
                reason: if paused { "GPU paused in settings; requests go to the CPU worker".into() } else { "GPU resumed in settings; its worker is starting".into() },
            });
        }
    }

    fn gpu_spec(&self) -> Option<WorkerSpec> {
        let c = &self.inner.config;
        c.gpu.as_ref().map(|options| WorkerSpec {
            program: c.program.clone(),
            options: options.clone(),
            model_dir: c.model_dir.clone(),
            load_timeout: Duration::from_millis(c.supervision.load_timeout_ms),
            env: c.worker_env.clone(),
        })
    }

    pub fn subscribe(&self) -> broadcast::Receiver<ServiceEvent> {
        self.inner.events.subscribe()
    }

    pub(crate) fn emit(&self, kind: EventKind) {
        if matches!(kind, EventKind::QueueChanged { .. } | EventKind::MemorySample { .. }) {
            tracing::debug!(event = ?kind, "service event");
        } else {
            tracing::info!(event = ?kind, "service event");
        }
        let _ = self.inner.events.send(ServiceEvent::now(kind));
    }

    fn announce(&self, worker: &Worker) {
        self.emit(EventKind::WorkerStarted {
            device: worker.device.label(),
            pid: worker.pid,
            simulated: worker.ready.simulated,
            load_ms: worker.ready.load_ms,
            bundle_hash: worker.ready.bundle_hash.clone(),
        });
    }

    fn transition(&self, t: Option<Transition>) {
        let Some(t) = t else { return };
        tracing::warn!(from = ?t.from, to = ?t.to, reason = %t.reason, "breaker");
        let was_degraded = t.from != BreakerState::Closed;
        let degraded = t.to != BreakerState::Closed;
        self.emit(EventKind::BreakerChanged { from: t.from, to: t.to, reason: t.reason.clone() });
        if was_degraded != degraded {
            let reason = if degraded {
                format!("GPU unavailable, serving from the CPU: {}", t.reason)
            } else {
                format!("GPU restored: {}", t.reason)
            };
            self.emit(EventKind::Degraded { degraded, reason });
        }
    }

    fn trip(&self, cause: FailureCause, reason: &str) {
        let t = self.inner.breaker.lock().unwrap().record_failure(cause, reason, Instant::now());
        self.transition(t);
    }

    pub fn status(&self) -> DeviceStatus {
        let breaker = self.inner.breaker.lock().unwrap();
        DeviceStatus {
            breaker: breaker.state(),
            reason: breaker.reason().to_string(),
            degraded: self.inner.config.gpu.is_some() && !breaker.allows_requests(),
            gpu_paused: self.inner.config.gpu.is_some() && self.gpu_paused(),
            gpu: self.inner.gpu.read().unwrap().as_deref().map(status_of),
            cpu: self.inner.cpu.read().unwrap().as_deref().map(status_of),
        }
    }

    pub fn config(&self) -> &SupervisorConfig {
        &self.inner.config
    }

    pub fn gpu_worker(&self) -> Option<Arc<Worker>> {
        self.inner.gpu.read().unwrap().clone()
    }

    pub fn cpu_worker(&self) -> Option<Arc<Worker>> {
        self.inner.cpu.read().unwrap().clone()
    }

    /// Injects a fault into the sim GPU worker. Environment faults (competing workload,
    /// slowdown) are re-applied to every restarted worker; `Clear` forgets them.
    pub async fn inject_fault(&self, fault: Fault) -> Result<()> {
        let worker = self.gpu_worker().ok_or_else(|| Error::Invalid("no GPU worker is running".into()))?;
        if worker.device != DeviceKind::Sim {
            return Err(Error::Invalid(format!("fault injection needs --gpu sim; the GPU worker is {}", worker.device)));
        }
        {
            let mut env = self.inner.sim_environment.lock().unwrap();
            match &fault {
                Fault::Compete { .. } => env.retain(|f| !matches!(f, Fault::Compete { .. })),
                Fault::Slowdown { .. } => env.retain(|f| !matches!(f, Fault::Slowdown { .. })),
                Fault::Clear => env.clear(),
                _ => {}
            }
            if matches!(fault, Fault::Compete { .. } | Fault::Slowdown { .. }) {
                env.push(fault.clone());
            }
        }
        worker.fault(fault).await
    }

    /// Stops both workers.
    pub async fn shutdown(&self) {
        self.inner.shutting_down.store(true, std::sync::atomic::Ordering::SeqCst);
        for worker in [self.gpu_worker(), self.cpu_worker()].into_iter().flatten() {
            worker.shutdown().await;
            worker.kill();
        }
    }

    fn shutting_down(&self) -> bool {
        self.inner.shutting_down.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Health checks, death and hang detection, restarts with backoff and the breaker's probe.
    async fn watch_gpu(self) {
        let mut attempt = 0u32;
        // The breaker's opening count when the current worker was started: a worker older than
        // the latest opening is not trusted and is replaced before the probe.
        let mut worker_epoch = self.inner.breaker.lock().unwrap().times_opened();
        let mut paused = self.inner.gpu_paused.subscribe();
        let mut stall = StallWatch::default();
        loop {
            if self.shutting_down() {
                return;
            }
            if self.gpu_paused() {
                if let Some(worker) = self.gpu_worker() {
                    // Requests already on it finish; nothing new is sent while paused.
                    self.clear_gpu(&worker);
                    retire_when_idle(worker.clone()).await;
                    self.emit(EventKind::WorkerExited { device: worker.device.label(), pid: worker.pid, status: "stopped: the GPU is paused".into() });
                }
                tokio::select! {
                    _ = async { let _ = paused.wait_for(|p| !*p).await; } => {}
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
                attempt = 0;
                continue;
            }
            let worker = match self.gpu_worker() {
                Some(w) => w,
                None => {
                    let delay = backoff(&self.inner.config, attempt);
                    attempt += 1;
                    self.emit(EventKind::WorkerRestartScheduled {
                        device: self.inner.config.gpu.as_ref().map(|g| g.device.label()).unwrap_or_default(),
                        attempt,
                        delay_ms: delay.as_millis() as u64,
                        reason: self.inner.breaker.lock().unwrap().reason().to_string(),
                    });
                    tokio::time::sleep(delay).await;
                    let spec = self.gpu_spec().expect("watching a configured GPU");
                    let spawned = Worker::spawn(&spec).await;
                    match spawned {
                        Ok(w) => {
                            worker_epoch = self.inner.breaker.lock().unwrap().times_opened();
                            self.announce(&w);
                            let env = self.inner.sim_environment.lock().unwrap().clone();
                            for fault in env {
                                if let Err(e) = w.fault(fault).await {
                                    tracing::warn!(error = %e, "could not re-apply a sim environment fault");
                                }
                            }
                            *self.inner.gpu.write().unwrap() = Some(w.clone());
                            w
                        }
                        Err(e) => {
                            tracing::error!(error = %e, attempt, "GPU worker restart failed");
                            self.trip(FailureCause::DeviceLost, &e.to_string());
                            continue;
                        }
                    }
                }
            };
            let (state, times_opened) = {
                let b = self.inner.breaker.lock().unwrap();
                (b.state(), b.times_opened())
            };
            if state == BreakerState::Open && times_opened != worker_epoch {
                // Opened (allocation failures, a failed probe) while this process lived: restart
                // it clean rather than trust its allocator.
                self.retire_gpu(&worker).await;
                continue;
            }
            let begin = self.inner.breaker.lock().unwrap().begin_probe(Instant::now());
            if begin.is_some() {
                self.transition(begin);
                let timeout = self.inner.config.supervision.health_timeout().max(Duration::from_secs(10));
                let result = worker.probe(self.inner.config.supervision.probe_canary_mib * headroom_memory::MIB, timeout).await;
                let t = {
                    let mut breaker = self.inner.breaker.lock().unwrap();
                    match &result {
                        Ok(detail) => breaker.probe_succeeded(detail, Instant::now()),
                        Err(e) => breaker.probe_failed(&e.to_string(), Instant::now()),
                    }
                };
                self.transition(t);
                if result.is_ok() {
                    attempt = 0;
                }
                continue;
            }
            // While open, look again soon so the probe follows the cool-down closely.
            let wait = if state == BreakerState::Closed {
                self.inner.config.supervision.health_interval()
            } else {
                self.inner.config.supervision.health_interval().min(Duration::from_millis(50))
            };
            tokio::select! {
                _ = async { let _ = paused.wait_for(|p| *p).await; } => {}
                info = worker.wait_exited() => {
                    self.emit(EventKind::WorkerExited { device: worker.device.label(), pid: worker.pid, status: info.status.clone() });
                    self.trip(FailureCause::DeviceLost, &format!("GPU worker (pid {}) {}", worker.pid, info.status));
                    self.clear_gpu(&worker);
                }
                _ = tokio::time::sleep(wait) => {
                    if state != BreakerState::Closed {
                        continue;
                    }
                    let hung = match worker.health(self.inner.config.supervision.health_timeout()).await {
                        Ok(report) => stall.observe(worker.pid, &report, self.inner.config.supervision.stall_timeout_ms),
                        Err(_) if worker.has_exited() => continue,
                        Err(e) => Some(e.to_string()),
                    };
                    if let Some(reason) = hung {
                        self.emit(EventKind::HealthCheckFailed { device: worker.device.label(), pid: worker.pid, reason: reason.clone() });
                        self.trip(FailureCause::HealthCheck, &reason);
                        self.retire_gpu(&worker).await;
                    }
                }
            }
        }
    }

    fn clear_gpu(&self, worker: &Arc<Worker>) {
        let mut slot = self.inner.gpu.write().unwrap();
        if slot.as_ref().is_some_and(|w| Arc::ptr_eq(w, worker)) {
            *slot = None;
        }
    }

    /// Kills a GPU worker that cannot be trusted and waits for it to be gone.
    async fn retire_gpu(&self, worker: &Arc<Worker>) {
        worker.kill();
        let info = worker.wait_exited().await;
        self.emit(EventKind::WorkerExited { device: worker.device.label(), pid: worker.pid, status: info.status });
        self.clear_gpu(worker);
    }

    /// The CPU worker is the fallback: if it dies it is restarted at once (no breaker).
    async fn watch_cpu(self) {
        let mut attempt = 0u32;
        loop {
            let Some(worker) = self.cpu_worker() else {
                tokio::time::sleep(backoff(&self.inner.config, attempt)).await;
                attempt += 1;
                match Worker::spawn(&self.cpu_spec()).await {
                    Ok(w) => {
                        self.announce(&w);
                        *self.inner.cpu.write().unwrap() = Some(w);
                        attempt = 0;
                    }
                    Err(e) => tracing::error!(error = %e, "CPU worker restart failed"),
                }
                continue;
            };
            let info = worker.wait_exited().await;
            if self.shutting_down() {
                return;
            }
            self.emit(EventKind::WorkerExited { device: worker.device.label(), pid: worker.pid, status: info.status });
            let mut slot = self.inner.cpu.write().unwrap();
            if slot.as_ref().is_some_and(|w| Arc::ptr_eq(w, &worker)) {
                *slot = None;
            }
        }
    }

    /// Runs a request on its own, outside any queue: on the GPU while the breaker is closed,
    /// continuing on the CPU worker when the GPU fails. `on_token` sees every token once, in
    /// order, whichever device produced it. For tests and `headroom failover`; the service's
    /// requests go through the dispatcher, whose failover waits for a CPU slot in the CPU queue.
    pub async fn run(&self, run: RunRequest, target: Target, mut on_token: impl FnMut(&StreamedToken)) -> Result<RunOutcome> {
        let cancel = CancelSignal::new();
        let mut progress = Progress::default();
        let mut target = target;
        loop {
            match self.attempt(&run, target, &mut progress, &cancel, &mut on_token).await {
                Ok(outcome) => return Ok(outcome),
                Err(AttemptError::End(e)) => return Err(e),
                Err(AttemptError::GpuFailed { .. }) => target = Target::Cpu,
            }
        }
    }

    /// One attempt at a request on one worker: the GPU's (`Gpu`, or `Auto` while the breaker
    /// allows it) or the CPU's. It continues from `progress` (the tokens the client already has)
    /// and adds to it. When the GPU fails the request in a way another device can recover from,
    /// the failover is recorded in `progress` and announced, and the caller decides where the
    /// request waits for its next attempt ([`AttemptError::GpuFailed`]). A cancel tells the
    /// worker to stop (which frees its reservation) and returns [`Error::Cancelled`].
    pub async fn attempt(
        &self,
        run: &RunRequest,
        target: Target,
        progress: &mut Progress,
        cancel: &CancelSignal,
        on_token: &mut impl FnMut(&StreamedToken),
    ) -> Result<RunOutcome, AttemptError> {
        if cancel.is_cancelled() {
            return Err(AttemptError::End(Error::Cancelled));
        }
        let usable_gpu = || self.gpu_worker().filter(|_| self.gpu_unavailable().is_none());
        let worker = match target {
            Target::Cpu => None,
            Target::Auto => usable_gpu(),
            Target::Gpu => match usable_gpu() {
                Some(w) => Some(w),
                None => {
                    let why = self.gpu_unavailable().unwrap_or_else(|| "the GPU is unavailable: its worker is restarting".into());
                    return Err(self.failed_over(run, progress, "gpu".into(), why));
                }
            },
        };
        let worker = match worker {
            Some(w) => w,
            None => self.cpu_worker().ok_or_else(|| AttemptError::End(Error::Unavailable("no worker is running; the CPU worker is restarting".into())))?,
        };
        let on_gpu = worker.device.is_gpu();
        let device = worker.device.label();
        let mut request = run.request.clone();
        if !progress.delivered.is_empty() {
            request.resume = Some(Checkpoint {
                prompt_tokens: run.request.prompt_tokens.clone(),
                generated_tokens: progress.delivered.clone(),
                delivered_text: progress.delivered_text.clone(),
                sampler: SamplerState {
                    params: run.request.sampling.clone(),
                    rng_word_pos: progress.rng_word_pos.clone().unwrap_or_else(|| "0".into()),
                },
            });
        }
        tracing::info!(request_id = %run.request_id, %device, resumed_after = progress.delivered.len(), "dispatch");
        let mut rx = match worker.generate(GenerateJob { request_id: run.request_id.clone(), request }).await {
            Ok(rx) => rx,
            // A GPU worker that died before the router noticed: a device failure like any other.
            Err(e) if on_gpu => {
                self.trip(FailureCause::DeviceLost, &e.to_string());
                return Err(self.failed_over(run, progress, device.clone(), format!("{device} failed: {e}")));
            }
            Err(e) => return Err(AttemptError::End(e)),
        };
        let failure = loop {
            let message = tokio::select! {
                message = rx.recv() => message,
                _ = cancel.cancelled() => {
                    if let Err(e) = worker.cancel(&run.request_id).await {
                        tracing::warn!(request_id = %run.request_id, error = %e, "could not forward a cancel");
                    }
                    // The worker checks for cancellation every token; wait for it to let go of
                    // the request so its slot and reservation are free when we return.
                    let _ = tokio::time::timeout(Duration::from_secs(5), async {
                        while let Some(m) = rx.recv().await {
                            if matches!(m, FromWorker::Done { .. } | FromWorker::Failed { .. }) {
                                break;
                            }
                        }
                    })
                    .await;
                    return Err(AttemptError::End(Error::Cancelled));
                }
            };
            let Some(message) = message else {
                break (FailureKind::DeviceLost, format!("the {device} worker stopped answering"), true);
            };
            match message {
                FromWorker::Token { index, token, text, eos, rng_word_pos, .. } => {
                    if let (Some(at), Some(last)) = (progress.failed_at.take(), progress.failovers.last_mut()) {
                        last.failure_to_first_token_ms = Some(at.elapsed().as_secs_f64() * 1000.0);
                    }
                    if !eos {
                        progress.delivered.push(token);
                    }
                    progress.delivered_text.push_str(&text);
                    progress.rng_word_pos = Some(rng_word_pos);
                    on_token(&StreamedToken { index, token, text, device: device.clone() });
                }
                FromWorker::Done { finish_reason, prompt_tokens, completion_tokens, prefill_ms, decode_ms, .. } => {
                    let status = self.status();
                    let degraded = !on_gpu && self.inner.config.gpu.is_some() && (status.degraded || !progress.failovers.is_empty());
                    let degraded_reason = degraded.then(|| {
                        progress.failovers.last().map(|f| f.reason.clone()).unwrap_or_else(|| status.reason.clone())
                    });
                    let fallback_model = (!on_gpu && self.cpu_setup().fallback_model_dir.is_some())
                        .then(|| worker.ready.model_name.clone());
                    return Ok(RunOutcome {
                        request_id: run.request_id.clone(),
                        device,
                        simulated: worker.ready.simulated,
                        degraded,
                        degraded_reason,
                        fallback_model,
                        tokens: std::mem::take(&mut progress.delivered),
                        text: std::mem::take(&mut progress.delivered_text),
                        finish_reason,
                        prompt_tokens,
                        completion_tokens,
                        prefill_ms,
                        decode_ms,
                        failovers: std::mem::take(&mut progress.failovers),
                    });
                }
                FromWorker::Failed { kind, message, replayable, .. } => break (kind, message, replayable),
                other => tracing::warn!(?other, "unexpected frame on a request stream"),
            }
        };
        let (kind, message, replayable) = failure;
        match kind {
            FailureKind::Cancelled => return Err(AttemptError::End(Error::Cancelled)),
            FailureKind::Invalid => return Err(AttemptError::End(Error::Invalid(message))),
            _ => {}
        }
        if !(on_gpu && replayable) {
            return Err(AttemptError::End(Error::Worker(format!("{device}: {message}"))));
        }
        // The GPU failed this request: count it against the device.
        match kind {
            FailureKind::Oom => self.trip(FailureCause::Oom, &message),
            FailureKind::DeviceLost => self.trip(FailureCause::DeviceLost, &message),
            _ => {}
        }
        let reason = format!("{device} failed: {message}");
        if !progress.delivered.is_empty() && !run.allow_resume {
            return Err(AttemptError::End(Error::Interrupted { reason: message, delivered_tokens: progress.delivered.len() as u32 }));
        }
        Err(self.failed_over(run, progress, device, reason))
    }

    /// Records and announces that a request leaves the GPU for the CPU. A CPU worker holding
    /// another model (a fallback) cannot continue another model's tokens: the request is
    /// replayed there from the client's prompt, which that worker tokenizes itself.
    fn failed_over(&self, run: &RunRequest, progress: &mut Progress, from: String, reason: String) -> AttemptError {
        let tokens_bundle = run.request.source.as_ref().map(|s| s.bundle_hash.clone()).or_else(|| self.gpu_worker().map(|w| w.ready.bundle_hash.clone()));
        let cpu_bundle = self.cpu_worker().map(|w| w.ready.bundle_hash.clone());
        if matches!((&tokens_bundle, &cpu_bundle), (Some(t), Some(c)) if t != c) && !progress.delivered.is_empty() {
            tracing::info!(request_id = %run.request_id, delivered = progress.delivered.len(), "the CPU worker holds another model: replaying from the prompt");
            progress.delivered.clear();
            progress.delivered_text.clear();
            progress.rng_word_pos = None;
        }
        let resumed_after_tokens = progress.delivered.len() as u32;
        self.emit(EventKind::Failover {
            request_id: run.request_id.clone(),
            from: from.clone(),
            to: "cpu".into(),
            reason: reason.clone(),
            resumed_after_tokens,
        });
        progress.failed_at = Some(Instant::now());
        progress.failovers.push(FailoverRecord { from: from.clone(), to: "cpu".into(), reason: reason.clone(), resumed_after_tokens, failure_to_first_token_ms: None });
        AttemptError::GpuFailed { from, reason, resumed_after_tokens }
    }
}

/// What a request has from its earlier attempts: the tokens the client already has (a next
/// attempt resumes after them) and the failovers so far.
#[derive(Debug, Default)]
pub struct Progress {
    delivered: Vec<u32>,
    delivered_text: String,
    rng_word_pos: Option<String>,
    failovers: Vec<FailoverRecord>,
    failed_at: Option<Instant>,
}

/// Why an attempt did not finish its request.
#[derive(Debug)]
pub enum AttemptError {
    /// The request ends here (cancelled, invalid, interrupted, or the CPU worker failed it).
    End(Error),
    /// The GPU failed (or was not there); the request can continue on the CPU worker, replayed
    /// or resumed after `resumed_after_tokens`.
    GpuFailed { from: String, reason: String, resumed_after_tokens: u32 },
}

/// Tells a busy worker from a hung one by its progress between health answers.
#[derive(Debug, Default)]
struct StallWatch {
    pid: u32,
    progress: u64,
    since: Option<Instant>,
}

impl StallWatch {
    /// Takes a health answer; returns why the worker is hung, if it is: requests running and
    /// no prefill or token for `stall_timeout_ms`.
    fn observe(&mut self, pid: u32, report: &crate::worker::HealthReport, stall_timeout_ms: u64) -> Option<String> {
        let moved = pid != self.pid || report.progress != self.progress || report.active_requests == 0;
        if moved || self.since.is_none() {
            *self = Self { pid, progress: report.progress, since: Some(Instant::now()) };
            return None;
        }
        let still = self.since.map(|s| s.elapsed()).unwrap_or_default();
        (still >= Duration::from_millis(stall_timeout_ms)).then(|| {
            format!(
                "the worker (pid {pid}) answers health checks but its {} running request(s) produced nothing for {} ms",
                report.active_requests,
                still.as_millis()
            )
        })
    }
}

/// Lets a worker that no longer gets new requests finish the ones it runs, then stops it.
async fn retire_when_idle(worker: Arc<Worker>) {
    // A request that picked this worker just before it was replaced may not have reached it yet.
    tokio::time::sleep(Duration::from_millis(500)).await;
    while worker.active_requests() > 0 && !worker.has_exited() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.shutdown().await;
    if tokio::time::timeout(Duration::from_secs(5), worker.wait_exited()).await.is_err() {
        worker.kill();
    }
}

fn backoff(config: &SupervisorConfig, attempt: u32) -> Duration {
    let s = &config.supervision;
    let factor = 2u64.saturating_pow(attempt.min(16));
    Duration::from_millis(s.restart_backoff_initial_ms.saturating_mul(factor).min(s.restart_backoff_max_ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut c = SupervisorConfig::new("headroom".into(), "m".into(), None);
        c.supervision.restart_backoff_initial_ms = 100;
        c.supervision.restart_backoff_max_ms = 1000;
        let delays: Vec<u64> = (0..6).map(|a| backoff(&c, a).as_millis() as u64).collect();
        assert_eq!(delays, vec![100, 200, 400, 800, 1000, 1000]);
    }

    #[test]
    fn supervision_config_reads_its_toml_table_and_rejects_typos() {
        let c = SupervisionConfig::from_toml("[supervision]\nhealth_timeout_ms = 500\n[supervision.breaker]\ncooldown_ms = 100\n").unwrap();
        assert_eq!(c.health_timeout_ms, 500);
        assert_eq!(c.breaker.cooldown_ms, 100);
        assert_eq!(c.health_interval_ms, SupervisionConfig::default().health_interval_ms);
        let err = SupervisionConfig::from_toml("[supervision]\nhealth_timeout = 5\n").unwrap_err();
        assert!(err.to_string().contains("health_timeout"), "{err}");
    }
}
