//! An in-process worker for the router's own tests: it speaks the same [`WorkerLink`] as a worker
//! process, generates a deterministic token sequence at a fixed pace (a function of the prompt and
//! the position, so a resumed request continues exactly where it stopped), keeps to its
//! concurrency limit like the real worker, and dies on `kill` like one: every request it held
//! fails with `DeviceLost`. The real-process tests live in `headroom-cli/tests`.

#![allow(dead_code)]

#[path = "flow.rs"]
mod flow;
#[allow(unused_imports)]
pub use flow::{ends, until, Ends};

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use headroom_memory::{Allowances, MemoryConfig};
use headroom_model::{Checkpoint, FinishReason, GenerateRequest, ModelBundle, SamplerState, SamplingParams};
use headroom_router::{
    BoxFuture, Dispatcher, ExitInfo, HealthReport, Journal, QueueConfig, ReadyInfo, RunRequest, Settings, Submission, Supervisor, SupervisorConfig, Worker, WorkerLauncher,
    WorkerLink, WorkerSpec,
};
use headroom_worker::{Device, FailureKind, Fault, FromWorker, GenerateJob, MemoryReading, WorkerOptions};
use tokio::sync::{mpsc, watch};

/// What the test sees of the workers it launched.
#[derive(Debug, Default)]
pub struct Workers {
    launched: Mutex<Vec<(Device, Arc<LinkState>)>>,
    next_pid: AtomicU32,
}

impl Workers {
    /// How many workers of `device` were started (restarts included).
    pub fn launches(&self, device: Device) -> usize {
        self.launched.lock().unwrap().iter().filter(|(d, _)| *d == device).count()
    }

    /// Tokens the newest worker of `device` has generated.
    pub fn tokens_generated(&self, device: Device) -> u64 {
        let launched = self.launched.lock().unwrap();
        launched.iter().rev().find(|(d, _)| *d == device).map_or(0, |(_, s)| s.progress.load(Ordering::SeqCst))
    }

    /// Kills the newest worker of `device`, as SIGKILL would.
    pub fn kill_latest(&self, device: Device) {
        let state = self.launched.lock().unwrap().iter().rev().find(|(d, _)| *d == device).map(|(_, s)| s.clone());
        state.expect("a worker of that device").die("killed by SIGKILL");
    }
}

/// Launches in-process workers that emit one token every `pace`.
#[derive(Debug, Clone)]
pub struct InProcessLauncher {
    pub workers: Arc<Workers>,
    pub pace: Duration,
    /// Workers of this device start once; every later launch fails, as a GPU whose driver is
    /// gone would.
    pub no_restart: Option<Device>,
}

impl WorkerLauncher for InProcessLauncher {
    fn launch<'a>(&'a self, spec: &'a WorkerSpec) -> BoxFuture<'a, headroom_router::Result<Arc<Worker>>> {
        Box::pin(async move {
            let device = spec.options.device;
            if self.no_restart == Some(device) && self.workers.launches(device) > 0 {
                return Err(headroom_router::Error::Worker(format!("cannot start {device}: the device is gone")));
            }
            let pid = 1000 + self.workers.next_pid.fetch_add(1, Ordering::SeqCst);
            let memory = MemoryReading {
                device: device.label(),
                simulated: device == Device::Sim,
                capacity_bytes: Some(spec.options.sim_vram_mib << 20),
                used_bytes: Some(64 << 20),
                weights_bytes: 64 << 20,
                ..MemoryReading::default()
            };
            let state = Arc::new(LinkState {
                device,
                max_concurrency: spec.options.max_concurrency.max(1) as usize,
                pace: self.pace,
                requests: Mutex::new(HashMap::new()),
                memory: watch::channel(Some(memory)).0,
                exited: watch::channel(None).0,
                dead: AtomicBool::new(false),
                progress: AtomicU64::new(0),
            });
            self.workers.launched.lock().unwrap().push((device, state.clone()));
            let ready = ReadyInfo {
                bundle_hash: "in-process".into(),
                model_name: "in-process".into(),
                context_tokens: spec.options.max_context_tokens.unwrap_or(2048),
                max_concurrency: state.max_concurrency as u32,
                load_ms: 0.0,
                simulated: device == Device::Sim,
                split: None,
            };
            Ok(Worker::new(device, pid, ready, Box::new(Link(state))))
        })
    }
}

#[derive(Debug)]
pub struct LinkState {
    device: Device,
    max_concurrency: usize,
    pace: Duration,
    requests: Mutex<HashMap<String, (mpsc::UnboundedSender<FromWorker>, Arc<AtomicBool>)>>,
    memory: watch::Sender<Option<MemoryReading>>,
    exited: watch::Sender<Option<ExitInfo>>,
    dead: AtomicBool,
    progress: AtomicU64,
}

impl LinkState {
    fn die(&self, status: &str) {
        self.dead.store(true, Ordering::SeqCst);
        for (id, (tx, _)) in self.requests.lock().unwrap().drain() {
            let _ = tx.send(FromWorker::Failed {
                request_id: Some(id),
                kind: FailureKind::DeviceLost,
                message: format!("the {} worker process ended ({status})", self.device),
                replayable: true,
                checkpoint: None,
            });
        }
        self.exited.send_replace(Some(ExitInfo { status: status.into() }));
    }
}

/// The token at `index` of a request with `prompt`: the same on every worker.
pub fn token_at(prompt: &[u32], index: usize) -> u32 {
    let seed: u32 = prompt.iter().fold(7u32, |h, t| h.wrapping_mul(31).wrapping_add(*t));
    10 + seed.wrapping_add((index as u32).wrapping_mul(2_654_435_761)) % 1000
}

struct Link(Arc<LinkState>);

impl Link {
    async fn run(state: Arc<LinkState>, job: GenerateJob, tx: mpsc::UnboundedSender<FromWorker>, cancelled: Arc<AtomicBool>) {
        let request = &job.request;
        let start = request.resume.as_ref().map_or(0, |c| c.generated_tokens.len());
        let mut generated: Vec<u32> = request.resume.as_ref().map(|c| c.generated_tokens.clone()).unwrap_or_default();
        for index in start..request.max_tokens {
            tokio::time::sleep(state.pace).await;
            if state.dead.load(Ordering::SeqCst) {
                return; // `die` already failed the request.
            }
            if cancelled.load(Ordering::SeqCst) {
                state.requests.lock().unwrap().remove(&job.request_id);
                let _ = tx.send(FromWorker::Failed { request_id: Some(job.request_id.clone()), kind: FailureKind::Cancelled, message: "cancelled".into(), replayable: false, checkpoint: None });
                return;
            }
            let token = token_at(&request.prompt_tokens, index);
            generated.push(token);
            state.progress.fetch_add(1, Ordering::SeqCst);
            let _ = tx.send(FromWorker::Token { request_id: job.request_id.clone(), index: index as u32, token, text: format!(" t{token}"), eos: false, rng_word_pos: index.to_string() });
        }
        if state.requests.lock().unwrap().remove(&job.request_id).is_none() {
            return;
        }
        let _ = tx.send(FromWorker::Done {
            request_id: job.request_id.clone(),
            finish_reason: FinishReason::Length,
            prompt_tokens: request.prompt_tokens.len() as u32,
            cached_prompt_tokens: 0,
            completion_tokens: generated.len() as u32,
            prefill_ms: 0.0,
            decode_ms: 0.0,
            checkpoint: Checkpoint {
                prompt_tokens: request.prompt_tokens.clone(),
                delivered_text: generated.iter().map(|t| format!(" t{t}")).collect(),
                generated_tokens: generated,
                sampler: SamplerState { params: request.sampling.clone(), rng_word_pos: request.max_tokens.to_string() },
            },
            embedding: None,
        });
    }
}

impl WorkerLink for Link {
    fn generate(&self, job: GenerateJob) -> BoxFuture<'_, headroom_router::Result<mpsc::UnboundedReceiver<FromWorker>>> {
        Box::pin(async move {
            let (tx, rx) = mpsc::unbounded_channel();
            let state = &self.0;
            let mut requests = state.requests.lock().unwrap();
            if state.dead.load(Ordering::SeqCst) {
                return Err(headroom_router::Error::Worker(format!("the {} worker is gone", state.device)));
            }
            if requests.len() >= state.max_concurrency {
                let message = format!("this worker runs at most {} requests at once", state.max_concurrency);
                let _ = tx.send(FromWorker::Failed { request_id: Some(job.request_id), kind: FailureKind::Busy, message, replayable: false, checkpoint: None });
                return Ok(rx);
            }
            let cancelled = Arc::new(AtomicBool::new(false));
            requests.insert(job.request_id.clone(), (tx.clone(), cancelled.clone()));
            tokio::spawn(Link::run(state.clone(), job, tx, cancelled));
            Ok(rx)
        })
    }

    fn cancel<'a>(&'a self, request_id: &'a str) -> BoxFuture<'a, headroom_router::Result<()>> {
        Box::pin(async move {
            if let Some((_, flag)) = self.0.requests.lock().unwrap().get(request_id) {
                flag.store(true, Ordering::SeqCst);
            }
            Ok(())
        })
    }

    fn health(&self, _timeout: Duration) -> BoxFuture<'_, headroom_router::Result<HealthReport>> {
        Box::pin(async move {
            let state = &self.0;
            if state.dead.load(Ordering::SeqCst) {
                return Err(headroom_router::Error::Worker(format!("the {} worker is gone", state.device)));
            }
            Ok(HealthReport {
                memory: state.memory.borrow().clone().unwrap_or_default(),
                active_requests: state.requests.lock().unwrap().len() as u32,
                progress: state.progress.load(Ordering::SeqCst),
            })
        })
    }

    fn probe(&self, _canary_bytes: u64, _timeout: Duration) -> BoxFuture<'_, headroom_router::Result<String>> {
        Box::pin(async move { Ok("canary allocated, one token generated".to_string()) })
    }

    fn fault(&self, fault: Fault) -> BoxFuture<'_, headroom_router::Result<()>> {
        Box::pin(async move { Err(headroom_router::Error::Invalid(format!("the in-process worker takes no fault ({fault:?})"))) })
    }

    fn memory(&self) -> watch::Receiver<Option<MemoryReading>> {
        self.0.memory.subscribe()
    }

    fn active_requests(&self) -> usize {
        self.0.requests.lock().unwrap().len()
    }

    fn exited(&self) -> watch::Receiver<Option<ExitInfo>> {
        self.0.exited.subscribe()
    }

    fn kill(&self) {
        self.0.die("killed by SIGKILL");
    }

    fn shutdown(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move { self.0.die("exit code 0") })
    }
}

pub fn model_dir() -> PathBuf {
    headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL)
}

/// A sim GPU worker with `gpu_slots` slots and a one-slot CPU worker, both in-process.
pub fn config(workers: &Arc<Workers>, gpu_slots: u32, pace: Duration) -> SupervisorConfig {
    let mut gpu = WorkerOptions::new(Device::Sim);
    gpu.max_concurrency = gpu_slots;
    let mut config = SupervisorConfig::new(PathBuf::from("in-process"), model_dir(), Some(gpu));
    config.cpu.max_concurrency = 1;
    config.supervision.health_interval_ms = 50;
    config.launcher = Arc::new(InProcessLauncher { workers: workers.clone(), pace, no_restart: None });
    config
}

pub async fn dispatcher(config: SupervisorConfig) -> Dispatcher {
    let supervisor = Supervisor::start(config).await.unwrap();
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let memory = MemoryConfig::default();
    let (planner, _) = headroom_memory::planner_for(&bundle, "cpu", memory.clone());
    Dispatcher::start(supervisor, Journal::in_memory().unwrap(), planner, memory, QueueConfig::default(), Settings::default(), None).unwrap().0
}

pub fn prompt(i: usize) -> Vec<u32> {
    vec![1, 2, 3, i as u32 + 4]
}

pub fn submission(id: &str, prompt: Vec<u32>, max_tokens: usize, stream: bool) -> Submission {
    let request = GenerateRequest::new(prompt, max_tokens, SamplingParams::default());
    Submission {
        run: RunRequest { request_id: id.into(), request, allow_resume: true },
        idempotency_key: None,
        body_hash: id.into(),
        stream,
        allow: Allowances::default(),
    }
}
