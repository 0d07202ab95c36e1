//! The router's handle on one worker: [`Worker`] (its device, pid and model) over a
//! [`WorkerLink`] (submit a job, cancel, health, memory readings, faults, its end). Whatever the
//! device, the router sees this one `Worker` type; a [`WorkerLauncher`] starts them.
//!
//! In the service every worker is a process ([`ProcessLauncher`], [`ProcessLink`]): spawn it, load
//! the model, send frames, route the frames it sends back to the request or the call waiting for
//! them, and notice when it dies. The router's own tests launch in-process workers through the
//! same traits, so dispatch and supervision are tested without spawning anything.

use std::collections::HashMap;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use headroom_worker::protocol::{decode_body, encode_frame, frame_len};
use headroom_worker::{Device, FailureKind, Fault, FromWorker, GenerateJob, MemoryReading, SplitLayers, ToWorker, WorkerOptions, PROTOCOL_VERSION};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::process::{Child, ChildStdin, ChildStdout};
use tokio::sync::{mpsc, oneshot, watch};

use crate::{Error, Result};

/// How to start a worker: the `headroom` binary, its worker options and the model to load.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    pub program: PathBuf,
    pub options: WorkerOptions,
    pub model_dir: PathBuf,
    pub load_timeout: Duration,
    /// Extra environment variables for the process.
    pub env: Vec<(String, String)>,
}

/// What a worker said when its model was ready.
#[derive(Debug, Clone, PartialEq)]
pub struct ReadyInfo {
    pub bundle_hash: String,
    pub model_name: String,
    pub context_tokens: u32,
    pub max_concurrency: u32,
    pub load_ms: f64,
    pub simulated: bool,
    /// The model runs split: its last layers on this GPU, the rest on the CPU in the worker.
    pub split: Option<SplitLayers>,
}

/// A worker's health answer.
#[derive(Debug, Clone, PartialEq)]
pub struct HealthReport {
    pub memory: MemoryReading,
    /// Requests running there.
    pub active_requests: u32,
    /// Prefills and tokens produced since it started: standing still while busy means hung.
    pub progress: u64,
}

/// How the process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExitInfo {
    pub status: String,
}

type Pending<T> = Arc<Mutex<HashMap<u64, oneshot::Sender<T>>>>;

struct Routes {
    requests: Mutex<HashMap<String, mpsc::UnboundedSender<FromWorker>>>,
    health: Pending<FromWorker>,
    probe: Mutex<Option<oneshot::Sender<FromWorker>>>,
    fault: Mutex<Option<oneshot::Sender<FromWorker>>>,
    ready: Mutex<Option<oneshot::Sender<FromWorker>>>,
    memory: watch::Sender<Option<MemoryReading>>,
}

/// A future a [`WorkerLink`] or [`WorkerLauncher`] returns (the traits are used as objects).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The seam between the router and a worker: everything the router asks of one, whatever runs
/// it. A request's stream ends with `Done` or `Failed`; a worker that ends fails every request it
/// held with `DeviceLost` and then reports its exit.
pub trait WorkerLink: Send + Sync {
    /// Starts a generation; the stream ends with `Done` or `Failed` (a dead worker included).
    fn generate(&self, job: GenerateJob) -> BoxFuture<'_, Result<mpsc::UnboundedReceiver<FromWorker>>>;
    fn cancel<'a>(&'a self, request_id: &'a str) -> BoxFuture<'a, Result<()>>;
    /// A health answer within `timeout`, or an error (an unhealthy worker).
    fn health(&self, timeout: Duration) -> BoxFuture<'_, Result<HealthReport>>;
    /// The half-open probe: canary allocation plus one generated token.
    fn probe(&self, canary_bytes: u64, timeout: Duration) -> BoxFuture<'_, Result<String>>;
    /// Injects a fault (sim only); resolves once acknowledged.
    fn fault(&self, fault: Fault) -> BoxFuture<'_, Result<()>>;
    /// The last memory reading the worker sent.
    fn memory(&self) -> watch::Receiver<Option<MemoryReading>>;
    /// Requests it is generating now.
    fn active_requests(&self) -> usize;
    /// `Some` once the worker has ended.
    fn exited(&self) -> watch::Receiver<Option<ExitInfo>>;
    /// Ends it at once (SIGKILL for a process); its requests hear `DeviceLost`.
    fn kill(&self);
    /// Asks it to end after its current frame.
    fn shutdown(&self) -> BoxFuture<'_, ()>;
    /// Asks it to drop the KV blocks its prefix cache keeps (a worker without one: nothing).
    fn drop_prefix_cache(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }
    /// Tells it the VRAM to keep free when its requests take KV blocks (a worker that takes
    /// none: nothing).
    fn set_vram_reserve(&self, _mib: u64) -> BoxFuture<'_, Result<()>> {
        Box::pin(async { Ok(()) })
    }
}

/// Starts workers: the supervisor's only way to get one.
pub trait WorkerLauncher: Send + Sync + std::fmt::Debug {
    /// Starts a worker, loads the model and resolves once it is ready.
    fn launch<'a>(&'a self, spec: &'a WorkerSpec) -> BoxFuture<'a, Result<Arc<Worker>>>;
}

/// Workers as processes of the `headroom` binary (`<program> worker ...`): the service's launcher.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessLauncher;

impl WorkerLauncher for ProcessLauncher {
    fn launch<'a>(&'a self, spec: &'a WorkerSpec) -> BoxFuture<'a, Result<Arc<Worker>>> {
        Box::pin(Worker::spawn(spec))
    }
}

/// One ready worker, as the router holds it.
pub struct Worker {
    pub device: Device,
    pub pid: u32,
    pub ready: ReadyInfo,
    link: Box<dyn WorkerLink>,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker").field("device", &self.device).field("pid", &self.pid).finish()
    }
}

/// A worker process's stdio, and what is waiting for its answers.
pub struct ProcessLink {
    device: Device,
    pid: u32,
    stdin: tokio::sync::Mutex<ChildStdin>,
    child: Arc<Mutex<Option<Child>>>,
    routes: Arc<Routes>,
    exited: watch::Receiver<Option<ExitInfo>>,
    nonce: AtomicU64,
}

async fn read_message(stdout: &mut ChildStdout) -> Option<FromWorker> {
    let mut prefix = [0u8; 4];
    stdout.read_exact(&mut prefix).await.ok()?;
    let len = frame_len(prefix).map_err(|e| tracing::error!(error = %e, "bad frame from worker")).ok()?;
    let mut body = vec![0u8; len];
    stdout.read_exact(&mut body).await.ok()?;
    decode_body(&body).map_err(|e| tracing::error!(error = %e, "malformed frame from worker")).ok()
}

impl Worker {
    /// A worker over `link` (a launcher's last step).
    pub fn new(device: Device, pid: u32, ready: ReadyInfo, link: Box<dyn WorkerLink>) -> Arc<Worker> {
        Arc::new(Worker { device, pid, ready, link })
    }

    /// Starts the process, checks the protocol version, loads the model and waits until ready.
    pub async fn spawn(spec: &WorkerSpec) -> Result<Arc<Worker>> {
        let device = spec.options.device;
        let mut child = tokio::process::Command::new(&spec.program)
            .args(spec.options.to_args())
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| Error::Worker(format!("cannot start {} for {device}: {e}", spec.program.display())))?;
        let pid = child.id().unwrap_or(0);
        let mut stdin = child.stdin.take().expect("piped stdin");
        let mut stdout = child.stdout.take().expect("piped stdout");
        let hello = tokio::time::timeout(Duration::from_secs(30), read_message(&mut stdout))
            .await
            .map_err(|_| Error::Worker(format!("{device} worker (pid {pid}) did not say hello within 30 s")))?;
        let simulated = match hello {
            Some(FromWorker::Hello { protocol, simulated, .. }) if protocol == PROTOCOL_VERSION => simulated,
            Some(FromWorker::Hello { protocol, .. }) => {
                return Err(Error::Worker(format!(
                    "{device} worker speaks protocol {protocol}, this router {PROTOCOL_VERSION}; use one headroom binary for both"
                )))
            }
            other => return Err(Error::Worker(format!("{device} worker (pid {pid}) opened with {other:?} instead of hello"))),
        };
        let (memory_tx, _) = watch::channel(None);
        let routes = Arc::new(Routes {
            requests: Mutex::new(HashMap::new()),
            health: Arc::new(Mutex::new(HashMap::new())),
            probe: Mutex::new(None),
            fault: Mutex::new(None),
            ready: Mutex::new(None),
            memory: memory_tx,
        });
        let (ready_tx, ready_rx) = oneshot::channel();
        *routes.ready.lock().unwrap() = Some(ready_tx);
        let (exit_tx, exit_rx) = watch::channel(None);
        let child = Arc::new(Mutex::new(Some(child)));
        tokio::spawn(ProcessLink::read_loop(stdout, routes.clone(), child.clone(), exit_tx, device));
        let load = ToWorker::Load { model_dir: spec.model_dir.display().to_string() };
        stdin
            .write_all(&encode_frame(&load).map_err(|e| Error::Worker(e.to_string()))?)
            .await
            .map_err(|e| Error::Worker(format!("{device} worker died before loading: {e}")))?;
        stdin.flush().await.ok();
        let ready = tokio::time::timeout(spec.load_timeout, ready_rx).await;
        let ready = match ready {
            Ok(Ok(FromWorker::Ready { bundle_hash, model_name, context_tokens, max_concurrency, load_ms, split, .. })) => ReadyInfo {
                bundle_hash,
                model_name,
                context_tokens,
                max_concurrency,
                load_ms,
                simulated,
                split,
            },
            Ok(Ok(FromWorker::Failed { kind, message, .. })) => {
                return Err(Error::Worker(format!("{device} worker could not load {}: {message} ({kind:?})", spec.model_dir.display())))
            }
            Ok(_) => return Err(Error::Worker(format!("{device} worker exited while loading the model"))),
            Err(_) => {
                return Err(Error::Worker(format!(
                    "{device} worker did not load the model within {} s",
                    spec.load_timeout.as_secs()
                )))
            }
        };
        let link = ProcessLink { device, pid, stdin: tokio::sync::Mutex::new(stdin), child, routes, exited: exit_rx, nonce: AtomicU64::new(1) };
        Ok(Worker::new(device, pid, ready, Box::new(link)))
    }

    /// Starts a generation; the stream ends with `Done` or `Failed` (a dead worker included).
    pub async fn generate(&self, job: GenerateJob) -> Result<mpsc::UnboundedReceiver<FromWorker>> {
        if self.has_exited() {
            return Err(Error::Worker(format!("the {} worker has exited", self.device)));
        }
        self.link.generate(job).await
    }

    pub async fn cancel(&self, request_id: &str) -> Result<()> {
        self.link.cancel(request_id).await
    }

    /// Asks for a health answer; a worker that does not answer in time is unhealthy.
    pub async fn health(&self, timeout: Duration) -> Result<HealthReport> {
        self.link.health(timeout).await
    }

    /// The half-open probe: canary allocation plus one generated token.
    pub async fn probe(&self, canary_bytes: u64, timeout: Duration) -> Result<String> {
        self.link.probe(canary_bytes, timeout).await
    }

    /// Injects a fault (sim only); waits for the worker's acknowledgement. A reset ends the
    /// worker instead of answering.
    pub async fn fault(&self, fault: Fault) -> Result<()> {
        self.link.fault(fault).await
    }

    /// Asks the worker to drop its prefix cache's blocks (see [`WorkerLink::drop_prefix_cache`]).
    pub async fn drop_prefix_cache(&self) -> Result<()> {
        self.link.drop_prefix_cache().await
    }

    /// Tells the worker the VRAM reserve now (see [`WorkerLink::set_vram_reserve`]).
    pub async fn set_vram_reserve(&self, mib: u64) -> Result<()> {
        self.link.set_vram_reserve(mib).await
    }

    /// The last memory reading the worker sent (health answers and periodic samples).
    pub fn memory(&self) -> watch::Receiver<Option<MemoryReading>> {
        self.link.memory()
    }

    /// Requests this worker is generating now.
    pub fn active_requests(&self) -> usize {
        self.link.active_requests()
    }

    pub fn has_exited(&self) -> bool {
        self.link.exited().borrow().is_some()
    }

    /// Resolves when the worker has ended.
    pub async fn wait_exited(&self) -> ExitInfo {
        let mut rx = self.link.exited();
        loop {
            if let Some(info) = rx.borrow().clone() {
                return info;
            }
            if rx.changed().await.is_err() {
                return ExitInfo { status: "exit status unknown".into() };
            }
        }
    }

    /// Ends the worker at once (SIGKILL for a process); its requests hear `DeviceLost`.
    pub fn kill(&self) {
        self.link.kill()
    }

    /// Asks the worker to end after its current frame.
    pub async fn shutdown(&self) {
        self.link.shutdown().await
    }
}

impl ProcessLink {

    async fn read_loop(
        mut stdout: ChildStdout,
        routes: Arc<Routes>,
        child: Arc<Mutex<Option<Child>>>,
        exit_tx: watch::Sender<Option<ExitInfo>>,
        device: Device,
    ) {
        while let Some(message) = read_message(&mut stdout).await {
            Self::route(&routes, message, device);
        }
        // stdout closed: the process is gone (or going). Every waiter hears it as device loss.
        let status = Self::wait_exit(&child).await;
        tracing::warn!(%device, %status, "worker process ended");
        let lost = |id: Option<String>| FromWorker::Failed {
            request_id: id,
            kind: FailureKind::DeviceLost,
            message: format!("the {device} worker process ended ({status})"),
            replayable: true,
            checkpoint: None,
        };
        for (id, tx) in routes.requests.lock().unwrap().drain() {
            let _ = tx.send(lost(Some(id)));
        }
        routes.health.lock().unwrap().clear();
        for slot in [&routes.probe, &routes.fault, &routes.ready] {
            if let Some(tx) = slot.lock().unwrap().take() {
                let _ = tx.send(lost(None));
            }
        }
        let _ = exit_tx.send(Some(ExitInfo { status }));
    }

    async fn wait_exit(child: &Arc<Mutex<Option<Child>>>) -> String {
        // The Child lives in the Worker once spawned; poll it without holding the lock across await.
        for _ in 0..200 {
            let status = {
                let mut guard = child.lock().unwrap();
                match guard.as_mut() {
                    Some(c) => c.try_wait().ok().flatten(),
                    None => None,
                }
            };
            if let Some(status) = status {
                return describe_status(status);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        "exit status unknown".into()
    }

    fn route(routes: &Routes, message: FromWorker, device: Device) {
        match &message {
            FromWorker::Token { request_id, .. } => {
                if let Some(tx) = routes.requests.lock().unwrap().get(request_id) {
                    let _ = tx.send(message);
                }
            }
            FromWorker::Done { request_id, .. } | FromWorker::Failed { request_id: Some(request_id), .. } => {
                if let Some(tx) = routes.requests.lock().unwrap().remove(request_id) {
                    let _ = tx.send(message);
                }
            }
            FromWorker::Failed { request_id: None, .. } => {
                let waiter = routes.ready.lock().unwrap().take().or_else(|| routes.fault.lock().unwrap().take());
                match waiter {
                    Some(tx) => {
                        let _ = tx.send(message);
                    }
                    None => tracing::warn!(%device, ?message, "worker failure outside a request"),
                }
            }
            FromWorker::Ready { memory, .. } => {
                routes.memory.send_replace(Some(memory.clone()));
                if let Some(tx) = routes.ready.lock().unwrap().take() {
                    let _ = tx.send(message);
                }
            }
            FromWorker::HealthOk { nonce, memory, .. } => {
                routes.memory.send_replace(Some(memory.clone()));
                if let Some(tx) = routes.health.lock().unwrap().remove(nonce) {
                    let _ = tx.send(message);
                }
            }
            FromWorker::ProbeResult { .. } => {
                if let Some(tx) = routes.probe.lock().unwrap().take() {
                    let _ = tx.send(message);
                }
            }
            FromWorker::FaultSet { .. } => {
                if let Some(tx) = routes.fault.lock().unwrap().take() {
                    let _ = tx.send(message);
                }
            }
            FromWorker::MemorySample { memory } => {
                routes.memory.send_replace(Some(memory.clone()));
            }
            FromWorker::Hello { .. } => tracing::warn!(%device, "unexpected second hello"),
        }
    }

    async fn send(&self, message: &ToWorker) -> Result<()> {
        let frame = encode_frame(message).map_err(|e| Error::Worker(e.to_string()))?;
        let mut stdin = self.stdin.lock().await;
        stdin.write_all(&frame).await.map_err(|e| Error::Worker(format!("{} worker is gone: {e}", self.device)))?;
        stdin.flush().await.map_err(|e| Error::Worker(format!("{} worker is gone: {e}", self.device)))
    }

    async fn generate_job(&self, job: GenerateJob) -> Result<mpsc::UnboundedReceiver<FromWorker>> {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = job.request_id.clone();
        self.routes.requests.lock().unwrap().insert(id.clone(), tx);
        if let Err(e) = self.send(&ToWorker::Generate(job)).await {
            self.routes.requests.lock().unwrap().remove(&id);
            return Err(e);
        }
        Ok(rx)
    }

    async fn health_check(&self, timeout: Duration) -> Result<HealthReport> {
        let nonce = self.nonce.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.routes.health.lock().unwrap().insert(nonce, tx);
        self.send(&ToWorker::Health { nonce }).await?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(FromWorker::HealthOk { memory, active_requests, progress, .. })) => Ok(HealthReport { memory, active_requests, progress }),
            Ok(_) => Err(Error::Worker(format!("the {} worker ended during a health check", self.device))),
            Err(_) => {
                self.routes.health.lock().unwrap().remove(&nonce);
                Err(Error::Worker(format!(
                    "the {} worker (pid {}) did not answer a health check within {} ms",
                    self.device,
                    self.pid,
                    timeout.as_millis()
                )))
            }
        }
    }

    async fn probe_device(&self, canary_bytes: u64, timeout: Duration) -> Result<String> {
        let (tx, rx) = oneshot::channel();
        *self.routes.probe.lock().unwrap() = Some(tx);
        self.send(&ToWorker::Probe { canary_bytes }).await?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(FromWorker::ProbeResult { ok: true, message, .. })) => Ok(message),
            Ok(Ok(FromWorker::ProbeResult { message, .. })) => Err(Error::Worker(message)),
            Ok(_) => Err(Error::Worker(format!("the {} worker ended during the probe", self.device))),
            Err(_) => Err(Error::Worker(format!("the probe got no answer within {} ms", timeout.as_millis()))),
        }
    }

    /// A reset ends the process instead of answering.
    async fn set_fault(&self, fault: Fault) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        *self.routes.fault.lock().unwrap() = Some(tx);
        self.send(&ToWorker::Fault { fault: fault.clone() }).await?;
        if matches!(fault, Fault::Reset { after_tokens: None }) {
            return Ok(());
        }
        match tokio::time::timeout(Duration::from_secs(5), rx).await {
            Ok(Ok(FromWorker::FaultSet { .. })) => Ok(()),
            Ok(Ok(FromWorker::Failed { message, .. })) => Err(Error::Invalid(message)),
            // A hang takes effect before the acknowledgement can be read.
            Err(_) if matches!(fault, Fault::Hang) => Ok(()),
            _ => Err(Error::Worker(format!("the {} worker did not acknowledge the fault", self.device))),
        }
    }
}

impl WorkerLink for ProcessLink {
    fn generate(&self, job: GenerateJob) -> BoxFuture<'_, Result<mpsc::UnboundedReceiver<FromWorker>>> {
        Box::pin(self.generate_job(job))
    }

    fn drop_prefix_cache(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.send(&ToWorker::DropPrefixCache))
    }

    fn set_vram_reserve(&self, mib: u64) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move { self.send(&ToWorker::SetVramReserve { mib }).await })
    }

    fn cancel<'a>(&'a self, request_id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.send(&ToWorker::Cancel { request_id: request_id.to_string() }).await })
    }

    fn health(&self, timeout: Duration) -> BoxFuture<'_, Result<HealthReport>> {
        Box::pin(self.health_check(timeout))
    }

    fn probe(&self, canary_bytes: u64, timeout: Duration) -> BoxFuture<'_, Result<String>> {
        Box::pin(self.probe_device(canary_bytes, timeout))
    }

    fn fault(&self, fault: Fault) -> BoxFuture<'_, Result<()>> {
        Box::pin(self.set_fault(fault))
    }

    fn memory(&self) -> watch::Receiver<Option<MemoryReading>> {
        self.routes.memory.subscribe()
    }

    fn active_requests(&self) -> usize {
        self.routes.requests.lock().unwrap().len()
    }

    fn exited(&self) -> watch::Receiver<Option<ExitInfo>> {
        self.exited.clone()
    }

    fn kill(&self) {
        if let Some(child) = self.child.lock().unwrap().as_mut() {
            let _ = child.start_kill();
        }
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let _ = self.send(&ToWorker::Shutdown).await;
        })
    }
}

fn describe_status(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(headroom_worker::RESET_EXIT_CODE), _) => "simulated device reset".into(),
        (Some(headroom_worker::DEVICE_FAULT_EXIT_CODE), _) => "exited after a device fault".into(),
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(9)) => "killed by SIGKILL".into(),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "unknown exit".into(),
    }
}
