//! Supervision: start the GPU and CPU workers, check their health, notice deaths and hangs,
//! restart the GPU worker with exponential backoff, and drive the circuit breaker through its
//! probe. Also the first half of dispatch: run a request on the GPU while the breaker is closed
//! and fail it over to the warm CPU worker (replay, or resume from the last token) when the GPU
//! fails. The CPU worker's own requests are never touched by anything the GPU does.
//!
//! The files: `lifecycle` (the workers' processes: watch, restart, probe, retire), `failover`
//! (running one request with failover); this one holds the configuration, the status, and the
//! supervisor's state.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use headroom_model::{Checkpoint, FinishReason, GenerateRequest, SamplerState};
use headroom_worker::{Device, FailureKind, Fault, FromWorker, GenerateJob, WorkerOptions};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::breaker::{Breaker, BreakerConfig, BreakerState, BreakerTransition, FailureCause};
use crate::cpu_share::{CpuRun, SharedCpu};
use crate::events::{EventKind, ServiceEvent};
use crate::worker::{ProcessLauncher, Worker, WorkerLauncher, WorkerSpec};
use crate::{Error, Result};

mod failover;
mod lifecycle;

pub use failover::{AttemptError, CancelSignal, FailoverRecord, Progress, RunOutcome, RunRequest, StreamedToken, Target};
use lifecycle::retire_when_idle;

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
    /// How workers start: processes of `program` in the service; in-process in the router's tests.
    pub launcher: Arc<dyn WorkerLauncher>,
    /// Where the model's layers were placed for the GPU worker's first launch (`gpu` carries its
    /// `gpu_layers`); `None` when nothing was planned (no GPU, or no memory reading).
    pub placement: Option<headroom_memory::SplitPlan>,
    /// Places the layers again before each later launch of the GPU worker (a restart, a resume
    /// from pause), from the VRAM free then: a competing program that took memory shrinks the
    /// split, one that left lets it grow. `None`: every launch loads what the first one did.
    pub replan: Option<LayerPlanner>,
    /// How long the GPU keeps the model loaded once idle (see [`Supervisor::unload`]).
    pub keep_alive: headroom_memory::KeepAlive,
    /// Load the model on the GPU at start (true) or at its first GPU request (false: a model
    /// that shares the GPU with others and is not pinned).
    pub gpu_at_start: bool,
    /// Another model's CPU worker to use instead of starting one: it must run the folder this
    /// model's CPU path runs (`cpu_fallback_model_dir`, else `model_dir`) with the same options.
    /// That model's supervisor keeps it warm (see [`SharedCpu`]).
    pub cpu_share: Option<SharedCpu>,
}

/// The VRAM a GPU worker about to launch can have: the device's capacity, and what is free of
/// it (other programs subtracted; no Headroom worker holds any then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VramRoom {
    pub total_bytes: u64,
    pub free_bytes: u64,
}

impl VramRoom {
    /// The room of the GPU worker `options` describes: the driver's reading on CUDA (`None`
    /// without NVML); on the sim GPU its size less `sim_competing_bytes`.
    pub fn of(options: &WorkerOptions, sim_competing_bytes: u64) -> Option<VramRoom> {
        match options.device {
            Device::Cuda(index) => headroom_memory::observe::gpu_memory(index).map(|r| VramRoom { total_bytes: r.total_bytes, free_bytes: r.free_bytes }),
            Device::Sim => {
                let total = options.sim_vram_mib * headroom_memory::MIB;
                Some(VramRoom { total_bytes: total, free_bytes: total.saturating_sub(sim_competing_bytes) })
            }
            Device::Cpu => None,
        }
    }
}

/// Plans the GPU worker's layers for the VRAM free now: `Err` says why no plan could be made
/// (a fixed `gpu_layers` that does not fit).
#[derive(Clone)]
pub struct LayerPlanner(pub Arc<dyn Fn(VramRoom) -> std::result::Result<headroom_memory::SplitPlan, String> + Send + Sync>);

impl std::fmt::Debug for LayerPlanner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LayerPlanner")
    }
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
            cpu: WorkerOptions::new(Device::Cpu),
            cpu_fallback_model_dir: None,
            supervision: SupervisionConfig::default(),
            gpu_paused: false,
            worker_env: Vec::new(),
            launcher: Arc::new(ProcessLauncher),
            placement: None,
            replan: None,
            keep_alive: headroom_memory::KeepAlive::Forever,
            gpu_at_start: true,
            cpu_share: None,
        }
    }

    /// What this model's CPU worker runs with `setup`: its options and the fallback model's
    /// folder, else the served model's.
    fn cpu_run(&self, setup: &CpuSetup) -> CpuRun {
        CpuRun { options: setup.options.clone(), model_dir: setup.fallback_model_dir.clone().unwrap_or_else(|| self.model_dir.clone()) }
    }
}

struct Inner {
    config: SupervisorConfig,
    gpu: RwLock<Option<Arc<Worker>>>,
    /// The CPU worker: this model's own, or one it shares with others (see [`SharedCpu`]).
    cpu: SharedCpu,
    /// Whether this supervisor started the CPU worker (and restarts and stops it).
    owns_cpu: bool,
    breaker: Mutex<Breaker>,
    events: broadcast::Sender<ServiceEvent>,
    /// Faults that model the environment (a competing program, a slow card) outlive restarts.
    sim_environment: Mutex<Vec<Fault>>,
    shutting_down: std::sync::atomic::AtomicBool,
    /// The CPU worker's options and model now, as this model asks for them (the config holds
    /// those it started with).
    cpu_setup: RwLock<CpuSetup>,
    /// The GPU paused from settings: nothing new goes to it, and its worker exits once idle.
    gpu_paused: tokio::sync::watch::Sender<bool>,
    /// The layer placement the GPU worker was last launched with (or waits for).
    placement: RwLock<Option<headroom_memory::SplitPlan>>,
    /// The fallback model's bundle, opened once per folder (see [`Supervisor::fallback_bundle`]).
    fallback_bundle: Mutex<Option<(PathBuf, Arc<headroom_model::ModelBundle>)>>,
    /// The GPU's copy of the model was unloaded for idleness: its worker exits, and the next
    /// request for the GPU loads it again ([`Supervisor::load_gpu`]). Not a failure.
    gpu_unloaded: tokio::sync::watch::Sender<bool>,
    residency: Mutex<Residency>,
    /// The VRAM reserve the GPU worker keeps free as settings set it since start (MiB); its
    /// launches take it instead of the config's.
    vram_reserve_mib: Mutex<Option<u64>>,
    /// Loads of the model on the GPU for a request, after a keep_alive unload, an eviction, or
    /// a start without it.
    gpu_loads: std::sync::atomic::AtomicU64,
}

/// What keeps the GPU's copy of the model loaded: its keep_alive and its last use.
struct Residency {
    keep_alive: headroom_memory::KeepAlive,
    last_used: Instant,
    /// A request asked for the unloaded model and its worker is not ready yet.
    loading: bool,
    /// Whether any request has used the model yet (`last_used` starts at the service's start).
    ever_used: bool,
    /// The last GPU worker's load time and memory, for a load that waits to happen: admission
    /// charges its weights and adds its load time to the expected delay.
    last_load_ms: f64,
    last_reading: Option<headroom_worker::MemoryReading>,
}

/// The GPU's copy of the model, for `/v1/status` and Ollama's `/api/ps`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuResidency {
    /// `loaded`, `unloaded` (idle past its keep_alive; loads on the next request) or `loading`.
    pub state: String,
    /// The keep_alive in force, in Ollama's form (`"5m"`, `"-1"`).
    pub keep_alive: String,
    /// Milliseconds until an idle model unloads; `None` while it never does.
    pub unloads_in_ms: Option<u64>,
    /// Milliseconds since a request last used the model.
    pub idle_ms: u64,
}

#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

/// The service's device status, for responses, the UI and `/status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// Whether the service has a GPU worker at all (without one nothing is degraded).
    #[serde(default)]
    pub gpu_configured: bool,
    pub breaker: BreakerState,
    /// What opened the breaker, while it is not closed.
    #[serde(default)]
    pub breaker_cause: Option<FailureCause>,
    pub reason: String,
    pub degraded: bool,
    /// Paused from settings (the person's choice, not a failure): requests go to the CPU.
    pub gpu_paused: bool,
    /// The GPU's model is unloaded for idleness, or loading again for a request (not degraded).
    #[serde(default)]
    pub gpu_unloaded: bool,
    pub gpu: Option<WorkerStatus>,
    pub cpu: Option<WorkerStatus>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerStatus {
    pub device: Device,
    pub pid: u32,
    pub simulated: bool,
    pub model: String,
    pub bundle_hash: String,
    pub load_ms: f64,
    /// Where a split model's layers run (see [`headroom_worker::SplitLayers`]).
    #[serde(default)]
    pub split: Option<headroom_worker::SplitLayers>,
    /// The longest prompt + reply the worker accepts.
    #[serde(default)]
    pub context_tokens: Option<u32>,
}

fn status_of(worker: &Worker) -> WorkerStatus {
    WorkerStatus {
        device: worker.device,
        pid: worker.pid,
        simulated: worker.ready.simulated,
        model: worker.ready.model_name.clone(),
        bundle_hash: worker.ready.bundle_hash.clone(),
        load_ms: worker.ready.load_ms,
        split: worker.ready.split,
        context_tokens: Some(worker.ready.context_tokens as u32),
    }
}

impl Supervisor {
    /// Starts the CPU worker (warm) and the GPU worker side by side and checks they hold the same
    /// bundle (or that a fallback model was asked for). A GPU that fails to start leaves the
    /// service degraded, not down.
    pub async fn start(config: SupervisorConfig) -> Result<Supervisor> {
        let (events, _) = broadcast::channel(1024);
        let setup = CpuSetup { options: config.cpu.clone(), fallback_model_dir: config.cpu_fallback_model_dir.clone() };
        let run = config.cpu_run(&setup);
        let (cpu, owns_cpu) = match &config.cpu_share {
            Some(shared) if shared.running() != run => {
                return Err(Error::Invalid(format!(
                    "the CPU worker to share runs {}, and this model's CPU path runs {} (or other CPU options); models share a CPU worker only when they run the same model with the same CPU settings",
                    shared.model_dir().display(),
                    run.model_dir.display()
                )))
            }
            Some(shared) => {
                shared.join();
                (shared.clone(), false)
            }
            None => (SharedCpu::new(run), true),
        };
        let inner = Arc::new(Inner {
            breaker: Mutex::new(Breaker::new(config.supervision.breaker.clone())),
            cpu_setup: RwLock::new(setup),
            cpu,
            owns_cpu,
            gpu_paused: tokio::sync::watch::channel(config.gpu_paused).0,
            placement: RwLock::new(config.placement.clone()),
            fallback_bundle: Mutex::new(None),
            gpu_unloaded: tokio::sync::watch::channel(config.gpu.is_some() && !config.gpu_at_start).0,
            vram_reserve_mib: Mutex::new(None),
            gpu_loads: 0.into(),
            residency: Mutex::new(Residency { keep_alive: config.keep_alive, last_used: Instant::now(), loading: false, ever_used: false, last_load_ms: 0.0, last_reading: None }),
            config,
            gpu: RwLock::new(None),
            events,
            sim_environment: Mutex::new(Vec::new()),
            shutting_down: false.into(),
        });
        let supervisor = Supervisor { inner };
        // A paused GPU's worker starts when it is unpaused.
        let gpu_spec = supervisor.gpu_spec().filter(|_| !supervisor.gpu_paused() && !supervisor.gpu_unloaded());
        let owns_cpu = supervisor.inner.owns_cpu;
        let (cpu, gpu) = tokio::join!(
            async {
                if owns_cpu {
                    supervisor.inner.config.launcher.launch(&supervisor.cpu_spec()).await.map(Some)
                } else {
                    // Borrowed: its owner started it (and restarts it while it is down).
                    Ok(supervisor.cpu_worker())
                }
            },
            async {
                match &gpu_spec {
                    Some(spec) => Some(supervisor.inner.config.launcher.launch(spec).await),
                    None => None,
                }
            }
        );
        let cpu = cpu?;
        if let Some(cpu) = cpu.as_ref().filter(|_| owns_cpu) {
            supervisor.announce(cpu);
            *supervisor.inner.cpu.inner.worker.write().unwrap() = Some(cpu.clone());
        }
        match gpu {
            Some(Ok(gpu)) => {
                if let Some(cpu) = cpu.as_ref().filter(|c| supervisor.cpu_setup().fallback_model_dir.is_none() && gpu.ready.bundle_hash != c.ready.bundle_hash) {
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
        if owns_cpu {
            tokio::spawn(supervisor.clone().watch_cpu());
        }
        Ok(supervisor)
    }

    /// The CPU worker's launch: what it runs now (a settings change of any model sharing it
    /// may have replaced it).
    fn cpu_spec(&self) -> WorkerSpec {
        self.cpu_spec_for(self.inner.cpu.running())
    }

    fn cpu_spec_for(&self, run: CpuRun) -> WorkerSpec {
        let c = &self.inner.config;
        WorkerSpec { program: c.program.clone(), options: run.options, model_dir: run.model_dir, load_timeout: Duration::from_millis(c.supervision.load_timeout_ms), env: c.worker_env.clone() }
    }

    /// The CPU worker this model uses, shared or its own: another model's supervisor borrows it
    /// with [`SupervisorConfig::cpu_share`].
    pub fn shared_cpu(&self) -> SharedCpu {
        self.inner.cpu.clone()
    }

    /// The CPU worker's options and model now.
    pub fn cpu_setup(&self) -> CpuSetup {
        self.inner.cpu_setup.read().unwrap().clone()
    }

    /// Replaces the CPU worker with one started from `setup`, without a gap: the new worker
    /// loads beside the old one, takes new requests once ready, and the old one exits when its
    /// running requests have finished. If the new one fails to start, the old one stays.
    ///
    /// A CPU worker shared with other models is replaced for all of them (a service-wide
    /// setting: each model asks for the same, and the first to ask starts it); a change of the
    /// model it runs, which only this model asked for, is refused (`Error::Invalid`).
    pub async fn replace_cpu_worker(&self, setup: CpuSetup) -> Result<()> {
        let shared = &self.inner.cpu;
        let _one_at_a_time = shared.inner.replacing.lock().await;
        if setup == self.cpu_setup() {
            return Ok(());
        }
        let run = self.inner.config.cpu_run(&setup);
        let running = shared.running();
        if run == running {
            // Another model sharing the worker asked for the same first.
            *self.inner.cpu_setup.write().unwrap() = setup;
            return Ok(());
        }
        if run.model_dir != running.model_dir && shared.users() > 1 {
            return Err(Error::Invalid(format!(
                "this model's CPU worker runs {} for {} models, which share it; to give this model another CPU model, set `fallback` in its [[models]] entry of the config file and restart",
                running.model_dir.display(),
                shared.users()
            )));
        }
        let new = self.inner.config.launcher.launch(&self.cpu_spec_for(run.clone())).await?;
        if setup.fallback_model_dir.is_none() {
            // Without a fallback model both workers must hold the served model.
            if let Some(gpu) = self.gpu_worker().filter(|g| g.ready.bundle_hash != new.ready.bundle_hash) {
                new.kill();
                return Err(Error::Worker(format!("the new CPU worker loaded another model than the GPU's ({})", gpu.ready.model_name)));
            }
        }
        *self.inner.cpu_setup.write().unwrap() = setup;
        *shared.inner.running.write().unwrap() = run;
        self.announce(&new);
        let old = shared.inner.worker.write().unwrap().replace(new);
        if let Some(old) = old {
            tokio::spawn(retire_when_idle(old));
        }
        Ok(())
    }

    /// The CPU worker's fallback model, when it holds one: its tokenizer and chat template, to
    /// count a request's prompt as that worker will. Opened once per folder; `None` also when it
    /// cannot be opened (the worker that loaded it said why).
    pub fn fallback_bundle(&self) -> Option<Arc<headroom_model::ModelBundle>> {
        let dir = self.cpu_setup().fallback_model_dir?;
        let mut cached = self.inner.fallback_bundle.lock().unwrap();
        if let Some((_, bundle)) = cached.as_ref().filter(|(opened, _)| *opened == dir) {
            return Some(bundle.clone());
        }
        let bundle = Arc::new(headroom_model::ModelBundle::open(&dir).ok()?);
        *cached = Some((dir, bundle.clone()));
        Some(bundle)
    }

    /// Whether the GPU's copy of the model is unloaded for idleness (it loads on demand).
    pub fn gpu_unloaded(&self) -> bool {
        *self.inner.gpu_unloaded.borrow()
    }

    /// Sets the keep_alive in force from now on (a request's own, as Ollama does).
    pub fn set_keep_alive(&self, keep_alive: headroom_memory::KeepAlive) {
        self.inner.residency.lock().unwrap().keep_alive = keep_alive;
    }

    /// A request used the model now: its keep_alive counts from here.
    pub fn touch_gpu(&self) {
        let mut r = self.inner.residency.lock().unwrap();
        r.last_used = Instant::now();
        r.ever_used = true;
    }

    /// When a request last used the model (on any device); `None` before the first.
    pub fn last_used(&self) -> Option<std::time::SystemTime> {
        let r = self.inner.residency.lock().unwrap();
        r.ever_used.then(|| std::time::SystemTime::now() - r.last_used.elapsed())
    }

    /// The GPU's copy of the model: loaded or not, its keep_alive, when it unloads.
    pub fn gpu_residency(&self) -> Option<GpuResidency> {
        self.inner.config.gpu.as_ref()?;
        let r = self.inner.residency.lock().unwrap();
        let idle = r.last_used.elapsed();
        let state = match (self.gpu_unloaded(), r.loading) {
            (true, _) => "unloaded",
            (false, true) => "loading",
            (false, false) => "loaded",
        };
        Some(GpuResidency {
            state: state.into(),
            keep_alive: r.keep_alive.to_string(),
            unloads_in_ms: r.keep_alive.remaining(idle).filter(|_| state == "loaded").map(|d| d.as_millis() as u64),
            idle_ms: idle.as_millis() as u64,
        })
    }

    /// Unloads the GPU's copy of the model: once its keep_alive has run out (`evicted_for`
    /// None), or now, whatever its keep_alive, to make room for the model `evicted_for` on a
    /// shared GPU. The caller knows that no request waits for or runs on the GPU. Returns the
    /// worker leaving, whose exit frees the memory; `None` when nothing was unloaded.
    pub fn unload(&self, evicted_for: Option<&str>) -> Option<Arc<Worker>> {
        if self.gpu_paused() || self.gpu_unloaded() || self.shutting_down() {
            return None;
        }
        let worker = self.gpu_worker()?;
        if worker.active_requests() > 0 || !self.inner.breaker.lock().unwrap().allows_requests() {
            return None;
        }
        let (keep_alive, idle) = {
            let mut r = self.inner.residency.lock().unwrap();
            if evicted_for.is_none() && !r.keep_alive.expired(r.last_used.elapsed()) {
                return None;
            }
            // Admission charges a load against this reading (a worker that just loaded has not
            // sampled yet: the previous one's); without any, the model stays.
            let reading = worker.memory().borrow().clone().or_else(|| r.last_reading.clone())?;
            r.last_load_ms = worker.ready.load_ms;
            r.last_reading = Some(reading);
            (r.keep_alive, r.last_used.elapsed())
        };
        self.inner.gpu_unloaded.send_replace(true);
        let reason = match evicted_for {
            None => format!("idle for {} ms, past its keep_alive of {keep_alive}; its VRAM is free until the next request loads it again", idle.as_millis()),
            Some(other) => format!("evicted to make room for {other} (idle for {} ms, least recently used); the next request loads it again", idle.as_millis()),
        };
        self.emit(EventKind::GpuModelUnloaded { device: worker.device, reason });
        Some(worker)
    }

    /// Loads the GPU's copy of the model again if it was unloaded, and waits until its worker is
    /// ready, the load fails (the breaker opens) or `cancel` fires. Returns how long it waited,
    /// `None` when the model was loaded.
    pub async fn load_gpu(&self, cancel: &CancelSignal) -> Option<Duration> {
        let started = Instant::now();
        let device = self.inner.config.gpu.as_ref()?.device;
        let began = {
            let mut r = self.inner.residency.lock().unwrap();
            if !self.gpu_unloaded() && !r.loading {
                return None;
            }
            r.loading = true;
            self.inner.gpu_unloaded.send_replace(false)
        };
        if began {
            self.inner.gpu_loads.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            self.emit(EventKind::GpuModelLoading { device, reason: "a request for the GPU arrived while the model was unloaded".into() });
        }
        let limit = Duration::from_millis(self.inner.config.supervision.load_timeout_ms) + Duration::from_secs(1);
        while self.gpu_worker().is_none() && self.inner.breaker.lock().unwrap().allows_requests() && started.elapsed() < limit && !self.gpu_paused() {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(10)) => {}
                _ = cancel.cancelled() => break,
            }
        }
        Some(started.elapsed())
    }

    /// Loads of the model on the GPU for a request since start (see [`Supervisor::load_gpu`]).
    pub fn gpu_loads(&self) -> u64 {
        self.inner.gpu_loads.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether the GPU's model is unloaded or loading again for a request (not a failure).
    pub fn gpu_loads_on_demand(&self) -> bool {
        self.on_demand(&self.inner.residency.lock().unwrap())
    }

    fn on_demand(&self, r: &Residency) -> bool {
        self.gpu_unloaded() || r.loading
    }

    /// The expected time before an unloaded model can serve: its last load time.
    pub fn gpu_load_estimate_ms(&self) -> Option<f64> {
        let r = self.inner.residency.lock().unwrap();
        self.on_demand(&r).then_some(r.last_load_ms)
    }

    /// The last GPU worker's memory reading, kept while the model is unloaded or loading.
    pub fn unloaded_gpu_reading(&self) -> Option<headroom_worker::MemoryReading> {
        let r = self.inner.residency.lock().unwrap();
        self.on_demand(&r).then(|| r.last_reading.clone()).flatten()
    }

    /// The latest memory reading of a GPU worker no longer running (exited, unloaded): what
    /// the next launch will take, about.
    pub fn last_gpu_reading(&self) -> Option<headroom_worker::MemoryReading> {
        self.inner.residency.lock().unwrap().last_reading.clone()
    }

    /// The worker that loaded the model again is ready, or its launch failed.
    pub(super) fn loaded(&self) {
        self.inner.residency.lock().unwrap().loading = false;
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

    /// Tells the GPU worker, and every later launch of it, the VRAM reserve to keep free when
    /// its requests take KV blocks (the settings' reserve changed).
    pub async fn set_vram_reserve_mib(&self, mib: u64) {
        // Test-only: the worker keeps its launch's reserve, as before (the negative control).
        if headroom_model::test_defect("reserve-fixed-at-launch") {
            return;
        }
        *self.inner.vram_reserve_mib.lock().unwrap() = Some(mib);
        if let Some(worker) = self.gpu_worker() {
            if let Err(e) = worker.set_vram_reserve(mib).await {
                // It is going away; its successor launches with the new reserve.
                tracing::warn!(error = %e, "could not tell the GPU worker its new VRAM reserve");
            }
        }
    }

    /// The GPU worker's launch: its options with the layers of the placement in force.
    fn gpu_spec(&self) -> Option<WorkerSpec> {
        let c = &self.inner.config;
        let placement = self.placement();
        let reserve = *self.inner.vram_reserve_mib.lock().unwrap();
        c.gpu.as_ref().map(|options| WorkerSpec {
            program: c.program.clone(),
            options: WorkerOptions {
                vram_reserve_mib: reserve.unwrap_or(options.vram_reserve_mib),
                gpu_layers: match &placement {
                    Some(plan) if !plan.head_on_gpu => Some(plan.gpu_layers),
                    Some(_) => None,
                    None => options.gpu_layers,
                },
                ..options.clone()
            },
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
            device: worker.device,
            pid: worker.pid,
            simulated: worker.ready.simulated,
            load_ms: worker.ready.load_ms,
            bundle_hash: worker.ready.bundle_hash.clone(),
        });
    }

    fn transition(&self, t: Option<BreakerTransition>) {
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
            let summary = crate::degradation(&self.status(), true, None, None, None).map(|d| d.summary);
            self.emit(EventKind::Degraded { degraded, reason, summary });
        }
    }

    fn trip(&self, cause: FailureCause, reason: &str) {
        let t = self.inner.breaker.lock().unwrap().record_failure(cause, reason, Instant::now());
        self.transition(t);
    }

    pub fn status(&self) -> DeviceStatus {
        let breaker = self.inner.breaker.lock().unwrap();
        DeviceStatus {
            gpu_configured: self.inner.config.gpu.is_some(),
            breaker: breaker.state(),
            breaker_cause: breaker.cause(),
            reason: breaker.reason().to_string(),
            degraded: self.inner.config.gpu.is_some() && !breaker.allows_requests(),
            gpu_paused: self.inner.config.gpu.is_some() && self.gpu_paused(),
            gpu_unloaded: self.inner.config.gpu.is_some() && self.gpu_loads_on_demand(),
            gpu: self.inner.gpu.read().unwrap().as_deref().map(status_of),
            cpu: self.cpu_worker().as_deref().map(status_of),
        }
    }

    /// Where the model's layers live on the GPU worker's device now: the plan of its latest
    /// launch (or of the launch that waits for room), `None` when nothing was planned.
    pub fn placement(&self) -> Option<headroom_memory::SplitPlan> {
        self.inner.placement.read().unwrap().clone()
    }

    /// The VRAM the GPU worker about to launch can have: the driver's reading on CUDA; on the
    /// sim GPU its size less the competing workload the launch re-applies.
    pub(crate) fn vram_room(&self) -> Option<VramRoom> {
        let competing: u64 = self.inner.sim_environment.lock().unwrap().iter().map(|f| match f {
            Fault::Compete { mib } => mib * headroom_memory::MIB,
            _ => 0,
        }).sum();
        VramRoom::of(self.inner.config.gpu.as_ref()?, competing)
    }

    /// Places the layers again for the GPU worker's next launch (see [`SupervisorConfig::replan`]).
    /// `Err` says why it must not launch now: not one layer fits, or a fixed count does not.
    fn replan_gpu(&self) -> std::result::Result<(), String> {
        let (Some(planner), Some(room)) = (self.inner.config.replan.as_ref(), self.vram_room()) else { return Ok(()) };
        // Test-only: launch with the start's placement whatever the VRAM now (the negative
        // control of the re-planning pressure check).
        if headroom_model::test_defect("no-replan") {
            return Ok(());
        }
        let plan = (planner.0)(room)?;
        let before = self.inner.placement.write().unwrap().replace(plan.clone());
        if before.as_ref().map(|p| (p.gpu_layers, p.head_on_gpu)) != Some((plan.gpu_layers, plan.head_on_gpu)) {
            self.emit(EventKind::PlacementChanged {
                placement: plan.placement(),
                gpu_layers: plan.gpu_layers,
                layers: plan.layers,
                predicted_decode_tok_s: plan.predicted_decode_tok_s,
                reason: plan.reason.clone(),
            });
        }
        if plan.gpu_layers == 0 {
            return Err(format!("not one layer fits on the GPU now: {}", plan.reason));
        }
        Ok(())
    }

    pub fn config(&self) -> &SupervisorConfig {
        &self.inner.config
    }

    pub fn gpu_worker(&self) -> Option<Arc<Worker>> {
        self.inner.gpu.read().unwrap().clone()
    }

    pub fn cpu_worker(&self) -> Option<Arc<Worker>> {
        self.inner.cpu.worker()
    }

    /// Injects a fault into the sim GPU worker. Environment faults (competing workload,
    /// slowdown) are re-applied to every restarted worker; `Clear` forgets them. While no GPU
    /// worker runs (between a death and its restart), an environment fault is kept for the
    /// next launch, which plans its layers with it.
    pub async fn inject_fault(&self, fault: Fault) -> Result<()> {
        match self.inner.config.gpu.as_ref().map(|g| g.device) {
            Some(Device::Sim) => {}
            Some(device) => return Err(Error::Invalid(format!("fault injection needs --gpu sim; the GPU worker is {device}"))),
            None => return Err(Error::Invalid("fault injection needs --gpu sim; no GPU worker is configured".into())),
        }
        let environment = fault.is_environment();
        if environment {
            let mut env = self.inner.sim_environment.lock().unwrap();
            match &fault {
                Fault::Compete { .. } => env.retain(|f| !matches!(f, Fault::Compete { .. })),
                Fault::Slowdown { .. } => env.retain(|f| !matches!(f, Fault::Slowdown { .. })),
                _ => env.clear(),
            }
            if !matches!(fault, Fault::Clear) {
                env.push(fault.clone());
            }
        }
        match self.gpu_worker() {
            Some(worker) => match worker.fault(fault).await {
                // It died meanwhile: its successor gets the environment at launch.
                Err(_) if environment && worker.has_exited() => Ok(()),
                applied => applied,
            },
            None if environment => Ok(()),
            None => Err(Error::Invalid("no GPU worker is running".into())),
        }
    }

    /// Stops both workers (a CPU worker borrowed from another model is that model's to stop).
    pub async fn shutdown(&self) {
        self.inner.shutting_down.store(true, std::sync::atomic::Ordering::SeqCst);
        let cpu = self.cpu_worker().filter(|_| self.inner.owns_cpu);
        for worker in [self.gpu_worker(), cpu].into_iter().flatten() {
            worker.shutdown().await;
            worker.kill();
        }
    }

    fn shutting_down(&self) -> bool {
        self.inner.shutting_down.load(std::sync::atomic::Ordering::SeqCst)
    }

}

#[cfg(test)]
mod tests {
    use super::*;
    use super::lifecycle::backoff;

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
