//! The worker process's main loop: read router frames from stdin, hand each generation to the
//! model's batch thread, write events to stdout. One worker holds one model on one device; its
//! running requests advance together, one batched step at a time ([`headroom_model::batch`]).

use std::collections::HashMap;
use std::io::{Read, Write};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use headroom_memory::{Ledger, MemoryConfig, Planner, RequestShape, Reservation};
use headroom_model::{Batch, CancelToken, CpuBackend, CpuModel, Decoder, GenerateRequest, ModelBundle, Session, SplitModel};
#[cfg(feature = "cuda")]
use headroom_model::Llama;

use crate::protocol::{
    read_frame, write_frame, FailureKind, Fault, FrameError, FromWorker, GenerateJob,
    MemoryReading, SplitLayers, ToWorker, PROTOCOL_VERSION,
};
use crate::sim::{FaultState, TokenVerdict};
use crate::{Device, WorkerOptions};

/// Exit status of a simulated device reset, so the router's logs can tell it from a crash.
pub const RESET_EXIT_CODE: i32 = 86;
/// Exit status after a real CUDA fault: the device cannot be trusted, start a clean process.
pub const DEVICE_FAULT_EXIT_CODE: i32 = 87;

/// Frames out, one writer at a time. A router that has gone away ends the worker.
#[derive(Clone)]
struct Outbox(Arc<Mutex<Box<dyn Write + Send>>>);

impl Outbox {
    fn send(&self, message: &FromWorker) {
        let mut out = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = write_frame(&mut *out, message) {
            tracing::info!(error = %e, "router is gone; worker exits");
            std::process::exit(0);
        }
    }
}

enum Engine {
    /// The CPU engine (packed weights); the sim GPU runs it too.
    Cpu(CpuModel),
    /// A split on the sim GPU: its layers in burn's ndarray backend, as CUDA runs them.
    SimSplit(SplitModel<CpuBackend>),
    /// An embedding model's encoder on the CPU engine (the CPU worker, the sim GPU).
    Encoder(headroom_model::cpu::CpuBert),
    #[cfg(feature = "cuda")]
    Cuda(Llama<burn_cuda::Cuda<f32>>, burn_cuda::CudaDevice),
    #[cfg(feature = "cuda")]
    CudaEncoder(headroom_model::Bert<burn_cuda::Cuda<f32>>, burn_cuda::CudaDevice),
    #[cfg(feature = "cuda")]
    CudaSplit(SplitModel<burn_cuda::Cuda<f32>>, burn_cuda::CudaDevice),
}

struct Loaded {
    bundle: ModelBundle,
    engine: Engine,
    /// Set when the model runs split: its KV cache on this device is its GPU layers' alone.
    split: Option<SplitLayers>,
    planner: Planner,
    /// The sim device's weights, held in its ledger for as long as the model is loaded.
    _weights: Option<Reservation>,
}

struct State {
    options: WorkerOptions,
    out: Outbox,
    loaded: Mutex<Option<Arc<Loaded>>>,
    /// The loaded model's batch thread takes the jobs sent here.
    jobs: Mutex<Option<Sender<(GenerateJob, CancelToken)>>>,
    active: Mutex<HashMap<String, CancelToken>>,
    faults: FaultState,
    /// Simulated VRAM (sim only).
    ledger: Option<Ledger>,
    /// The latest memory reading. Health answers use it: reading the device live can wait
    /// behind a kernel compilation (cubecl holds its device client), and a busy worker must
    /// still answer. Each reading carries the number it was taken under ([`Self::keep_reading`]).
    latest_memory: Mutex<(u64, MemoryReading)>,
    readings_taken: AtomicU64,
    /// Prefills and tokens produced so far (health reports it; see [`FromWorker::HealthOk`]).
    progress: AtomicU64,
    /// The running requests' KV blocks written so far, in bytes (sim: what the device holds of
    /// their reservations in fact), and the requests preempted since start (KV overcommit).
    kv_resident: AtomicU64,
    preemptions: AtomicU64,
    /// The VRAM kept free when requests take KV blocks (sim), in bytes: the reserve at launch,
    /// then as settings change it (`SetVramReserve`).
    vram_reserve: AtomicU64,
    /// Test-only: health reads the device live, as before the health path was separated (the
    /// negative control of the busy-is-not-hung test).
    health_reads_device: bool,
}

/// Runs a worker over the given streams until the router closes them or sends `Shutdown`.
pub fn run(options: WorkerOptions, input: impl Read, output: impl Write + Send + 'static) -> i32 {
    let ledger = match options.device {
        Device::Sim => Some(Ledger::new("sim", options.sim_vram_mib * headroom_memory::MIB)),
        _ => None,
    };
    let reserve = options.vram_reserve_mib * headroom_memory::MIB;
    let state = Arc::new(State {
        out: Outbox(Arc::new(Mutex::new(Box::new(output)))),
        loaded: Mutex::new(None),
        jobs: Mutex::new(None),
        active: Mutex::new(HashMap::new()),
        faults: FaultState::new(ledger.clone()),
        ledger,
        options,
        latest_memory: Mutex::new((0, MemoryReading::default())),
        readings_taken: AtomicU64::new(0),
        progress: AtomicU64::new(0),
        kv_resident: AtomicU64::new(0),
        preemptions: AtomicU64::new(0),
        vram_reserve: AtomicU64::new(reserve),
        health_reads_device: std::env::var_os("HEADROOM_TEST_HEALTH_READS_DEVICE").is_some(),
    });
    state.out.send(&FromWorker::Hello {
        protocol: PROTOCOL_VERSION,
        device: state.options.device.label(),
        simulated: state.options.device == Device::Sim,
        pid: std::process::id(),
    });
    if state.options.memory_sample_ms > 0 {
        let sampler = state.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(sampler.options.memory_sample_ms));
            sampler.faults.block_if_hung();
            sampler.out.send(&FromWorker::MemorySample { memory: sampler.read_memory() });
        });
    }
    let mut input = input;
    loop {
        let message: ToWorker = match read_frame(&mut input) {
            Ok(m) => m,
            Err(FrameError::Closed) => return 0,
            Err(e) => {
                tracing::error!(error = %e, "unreadable frame from the router");
                return 2;
            }
        };
        // A hung device answers nothing, not even health checks.
        state.faults.block_if_hung();
        match message {
            ToWorker::Load { model_dir } => state.clone().load(Path::new(&model_dir)),
            ToWorker::Generate(job) => state.start_job(job),
            ToWorker::Cancel { request_id } => {
                if let Some(token) = state.active.lock().unwrap().get(&request_id) {
                    token.cancel();
                }
            }
            ToWorker::Health { nonce } => state.out.send(&FromWorker::HealthOk {
                nonce,
                active_requests: state.active.lock().unwrap().len() as u32,
                memory: if state.health_reads_device { state.read_memory() } else { state.latest_memory.lock().unwrap().1.clone() },
                progress: state.progress.load(Ordering::SeqCst),
            }),
            ToWorker::Probe { canary_bytes } => {
                let state = state.clone();
                std::thread::spawn(move || state.probe(canary_bytes));
            }
            ToWorker::Fault { fault } => {
                state.set_fault(fault);
                // A competing workload changes the reading.
                state.refresh_latest_memory();
            }
            ToWorker::DropPrefixCache => {
                if let Some(Loaded { engine: Engine::Cpu(model), .. }) = state.loaded.lock().unwrap().as_deref() {
                    model.prefix_cache.clear();
                }
                state.refresh_latest_memory();
            }
            ToWorker::SetVramReserve { mib } => {
                state.vram_reserve.store(mib * headroom_memory::MIB, Ordering::SeqCst);
                state.refresh_latest_memory();
            }
            ToWorker::Shutdown => return 0,
        }
    }
}

impl State {
    fn failed(&self, request_id: Option<&str>, kind: FailureKind, message: String) {
        self.out.send(&failure(request_id, kind, message));
    }

    fn load(self: Arc<Self>, dir: &Path) {
        let started = Instant::now();
        let bundle = match ModelBundle::open(dir) {
            Ok(b) => b,
            Err(e) => return self.failed(None, FailureKind::Invalid, e.to_string()),
        };
        let split = match self.split_layers(&bundle) {
            Ok(split) => split,
            Err(message) => return self.failed(None, FailureKind::Invalid, message),
        };
        let weights = match &self.ledger {
            Some(ledger) => {
                if self.faults.take_oom_next_allocation() {
                    return self.failed(None, FailureKind::Oom, "simulated out-of-memory loading the weights".into());
                }
                match ledger.try_reserve("weights", device_weight_bytes(&bundle, self.options.device, split)) {
                    Ok(r) => Some(r),
                    Err(e) => {
                        return self.failed(None, FailureKind::Oom, format!("the weights do not fit: {e}"))
                    }
                }
            }
            None => None,
        };
        let engine = match self.load_engine(&bundle, split) {
            Ok(e) => e,
            Err((kind, message)) => return self.failed(None, kind, message),
        };
        let (planner, calibration) = headroom_memory::planner_for(
            &bundle,
            headroom_memory::calibration::backend_key(&self.options.device.label()),
            MemoryConfig { cpu_kv_cache: self.options.kv_cache, kv_overcommit: self.options.kv_overcommit, ..MemoryConfig::default() },
        );
        tracing::info!(source = %calibration.source, "workspace calibration");
        // A split holds its GPU layers' share of each request's KV cache on the device.
        let planner = match split {
            Some(split) => planner.split(split.gpu_layers as u64),
            None => planner,
        };
        let context = self.context_limit(&bundle);
        let loaded = Arc::new(Loaded { bundle, engine, split, planner, _weights: weights });
        *self.loaded.lock().unwrap() = Some(loaded.clone());
        // A model loaded again replaces the batch thread: the old one finishes what it runs and
        // ends when its channel closes.
        let (jobs, receiver) = channel();
        *self.jobs.lock().unwrap() = Some(jobs);
        let state = self.clone();
        let model = loaded.clone();
        std::thread::Builder::new()
            .name("batch".into())
            .spawn(move || state.serve_batch(&model, receiver))
            .expect("cannot start the batch thread");
        self.out.send(&FromWorker::Ready {
            bundle_hash: loaded.bundle.hash.clone(),
            model_name: loaded.bundle.name(),
            context_tokens: context as u32,
            max_concurrency: self.options.max_concurrency,
            load_ms: started.elapsed().as_secs_f64() * 1000.0,
            memory: self.read_memory(),
            split,
        });
        tracing::info!(device = %self.options.device.label(), hash = %loaded.bundle.short_hash(), "model loaded");
    }

    /// The split this worker runs `bundle` as, from `gpu_layers` (GPU devices only).
    fn split_layers(&self, bundle: &ModelBundle) -> Result<Option<SplitLayers>, String> {
        let layers = bundle.config.num_hidden_layers as u32;
        match self.options.gpu_layers.filter(|_| self.options.device.is_gpu()) {
            None => Ok(None),
            Some(0) => Err("gpu_layers = 0 leaves nothing on the GPU: serve the model from the CPU worker (--gpu none) or give the GPU at least one layer".into()),
            Some(n) if n > layers => Err(format!("gpu_layers = {n}, but {} has {layers} layers; use at most {layers}, or \"auto\"", bundle.name())),
            Some(n) if n == layers => Ok(None),
            Some(n) if bundle.config.is_encoder() => Err(format!("gpu_layers = {n} would split {}, an encoder, which runs whole on one device; leave gpu_layers out or set it to {layers}", bundle.name())),
            Some(gpu_layers) => Ok(Some(SplitLayers { gpu_layers, layers })),
        }
    }

    fn load_engine(&self, bundle: &ModelBundle, split: Option<SplitLayers>) -> Result<Engine, (FailureKind, String)> {
        let loaded = catch_unwind(AssertUnwindSafe(|| -> Result<Engine, headroom_model::Error> {
            if bundle.config.is_encoder() {
                return self.load_encoder(bundle);
            }
            match (self.options.device, split) {
                (Device::Cpu, _) => {
                    let mut model = bundle.load_cpu(|_, _| {})?;
                    model.kv_precision = self.options.kv_cache;
                    let block_bytes = headroom_model::cpu::CpuCache::bytes(&bundle.config, headroom_model::cpu::KEY_BLOCK, model.kv_precision) as u64;
                    // Off where a reused prefix could change a reply (see `prefill_is_chunk_invariant`).
                    let blocks = if model.prefill_is_chunk_invariant() { self.options.prefix_cache_mib * headroom_memory::MIB / block_bytes.max(1) } else { 0 };
                    model.prefix_cache = headroom_model::cpu::PrefixCache::new(blocks as usize);
                    Ok(Engine::Cpu(model))
                }
                (Device::Sim, None) => Ok(Engine::Cpu(bundle.load_cpu(|_, _| {})?)),
                (Device::Sim, Some(split)) => {
                    Ok(Engine::SimSplit(SplitModel::load(bundle, split.gpu_layers as usize, &Default::default(), burn::tensor::DType::F32)?))
                }
                #[cfg(feature = "cuda")]
                (Device::Cuda(index), split) => {
                    crate::kernel_cache::configure();
                    let device = burn_cuda::CudaDevice::new(index as usize);
                    // Compile (or fetch from the kernel cache) the prefill and decode kernels now,
                    // under the load timeout, so the first request and the breaker's restore
                    // probe do not wait for the compiler.
                    let started = Instant::now();
                    let engine = match split {
                        None => {
                            let model = bundle.load_as(&device, bundle.gpu_matrix_dtype(), |_, _| {})?;
                            warm_up(&model, bundle, self.options.max_concurrency)?;
                            Engine::Cuda(model, device)
                        }
                        Some(split) => {
                            let model = SplitModel::load(bundle, split.gpu_layers as usize, &device, bundle.gpu_matrix_dtype())?;
                            warm_up(&model, bundle, self.options.max_concurrency)?;
                            Engine::CudaSplit(model, device)
                        }
                    };
                    tracing::info!(ms = started.elapsed().as_millis() as u64, batch_sizes = self.options.max_concurrency, "CUDA kernels warmed up");
                    Ok(engine)
                }
                #[cfg(not(feature = "cuda"))]
                (Device::Cuda(_), _) => Err(headroom_model::Error::InvalidRequest(
                    "this build has no CUDA support; rebuild with the `cuda` feature".into(),
                )),
            }
        }));
        match loaded {
            Ok(Ok(engine)) => Ok(engine),
            Ok(Err(e)) => Err((FailureKind::Invalid, e.to_string())),
            Err(panic) => {
                let (kind, message) = classify_panic(&panic);
                self.failed(None, kind, message);
                self.exit_after_device_fault();
            }
        }
    }

    /// An embedding model's encoder, whole on the worker's device (it never splits).
    fn load_encoder(&self, bundle: &ModelBundle) -> Result<Engine, headroom_model::Error> {
        match self.options.device {
            Device::Cpu | Device::Sim => Ok(Engine::Encoder(bundle.load_cpu_encoder()?)),
            #[cfg(feature = "cuda")]
            Device::Cuda(index) => {
                crate::kernel_cache::configure();
                let device = burn_cuda::CudaDevice::new(index as usize);
                let started = Instant::now();
                let model = bundle.load_encoder(&device, |_, _| {})?;
                // Every padded prompt length, compiled before the first request.
                let lengths = model.warm_up_lengths(self.context_limit(bundle));
                for &length in &lengths {
                    headroom_model::Session::start(&model, bundle, &GenerateRequest::embedding(vec![0; length]), &CancelToken::new())?;
                }
                tracing::info!(ms = started.elapsed().as_millis() as u64, lengths = lengths.len(), "CUDA encoder kernels warmed up");
                Ok(Engine::CudaEncoder(model, device))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(headroom_model::Error::InvalidRequest("this build has no CUDA support; rebuild with the `cuda` feature".into())),
        }
    }

    fn context_limit(&self, bundle: &ModelBundle) -> usize {
        let model = bundle.config.max_position_embeddings;
        match self.options.max_context_tokens {
            Some(limit) => model.min(limit as usize),
            None => model,
        }
    }

    fn set_fault(&self, fault: Fault) {
        if self.options.device != Device::Sim {
            return self.failed(
                None,
                FailureKind::Invalid,
                format!("fault injection exists only on the sim device, not {}", self.options.device.label()),
            );
        }
        if let Fault::Reset { after_tokens: None } = fault {
            tracing::warn!("simulated device reset: exiting");
            std::process::exit(RESET_EXIT_CODE);
        }
        if let Err(message) = self.faults.set(&fault) {
            return self.failed(None, FailureKind::Invalid, message);
        }
        self.out.send(&FromWorker::FaultSet { fault });
    }

    /// Reads the device's memory now (it may wait for the device) and keeps it for health.
    fn read_memory(&self) -> MemoryReading {
        let taken = self.readings_taken.fetch_add(1, Ordering::SeqCst) + 1;
        let reading = match self.options.device {
            Device::Sim => self.faults.with_device(|| self.memory()),
            _ => self.memory(),
        };
        self.keep_reading(taken, reading.clone());
        reading
    }

    /// Keeps `reading` for health answers unless one begun after it is kept already: the batch
    /// thread's reading, begun before the prefix cache was dropped and finished after, must not
    /// bring the dropped blocks back.
    fn keep_reading(&self, taken: u64, reading: MemoryReading) {
        let mut latest = self.latest_memory.lock().unwrap();
        if taken > latest.0 {
            *latest = (taken, reading);
        }
    }

    /// Keeps a reading for health answers after a message changed what it says (a fault, the
    /// prefix cache dropped, the reserve changed): taken without waiting for the device (faults
    /// and the reserve exist on the sim device only, whose ledger reads at once).
    fn refresh_latest_memory(&self) {
        let taken = self.readings_taken.fetch_add(1, Ordering::SeqCst) + 1;
        self.keep_reading(taken, self.memory());
    }

    fn memory(&self) -> MemoryReading {
        let loaded = self.loaded.lock().unwrap().clone();
        let weights_bytes = loaded
            .as_ref()
            .map(|l| match (&l.engine, self.options.device) {
                (Engine::Cpu(model), Device::Cpu) => model.weight_bytes() as u64,
                (_, device) => device_weight_bytes(&l.bundle, device, l.split),
            })
            .unwrap_or(0);
        let host_weights_bytes = match loaded.as_ref().map(|l| &l.engine) {
            Some(Engine::SimSplit(model)) => model.cpu_weight_bytes() as u64,
            #[cfg(feature = "cuda")]
            Some(Engine::CudaSplit(model, _)) => model.cpu_weight_bytes() as u64,
            _ => 0,
        };
        let (prefix_cache, kv_resident_bytes) = match (loaded.as_ref().map(|l| &l.engine), self.options.device) {
            (Some(Engine::Cpu(model)), Device::Cpu) => (Some(model.prefix_cache.stats()), Some(model.kv_resident_bytes() as u64)),
            (Some(_), Device::Sim) => (None, Some(self.kv_resident.load(Ordering::SeqCst))),
            _ => (None, None),
        };
        let mut reading = MemoryReading {
            prefix_cache,
            kv_resident_bytes,
            preemptions: self.preemptions.load(Ordering::SeqCst),
            kept_free_bytes: (self.options.device == Device::Sim).then(|| self.vram_reserve.load(Ordering::SeqCst)),
            device: self.options.device.label(),
            simulated: self.options.device == Device::Sim,
            weights_bytes,
            host_weights_bytes,
            host: headroom_memory::observe::host_memory(),
            ..Default::default()
        };
        match self.options.device {
            Device::Sim => {
                let ledger = self.ledger.as_ref().expect("sim has a ledger");
                let competing = self.faults.competing_bytes();
                reading.capacity_bytes = Some(ledger.capacity_bytes());
                reading.used_bytes = Some(ledger.held_bytes());
                reading.competing_bytes = competing;
                reading.reserved_bytes = ledger
                    .held_bytes()
                    .saturating_sub(competing)
                    .saturating_sub(if loaded.is_some() { weights_bytes } else { 0 });
            }
            Device::Cpu => {
                if let Some(host) = reading.host {
                    reading.capacity_bytes = Some(host.total_bytes);
                    reading.used_bytes = Some(host.total_bytes - host.available_bytes);
                }
            }
            Device::Cuda(index) => {
                reading.gpu = headroom_memory::observe::gpu_memory(index);
                if let Some(gpu) = &reading.gpu {
                    reading.capacity_bytes = Some(gpu.total_bytes);
                    reading.used_bytes = Some(gpu.used_bytes);
                }
                #[cfg(feature = "cuda")]
                if let Some(Engine::Cuda(_, device) | Engine::CudaSplit(_, device) | Engine::CudaEncoder(_, device)) = loaded.as_ref().map(|l| &l.engine) {
                    use cubecl::prelude::Runtime;
                    reading.allocator_bytes = cubecl::cuda::CudaRuntime::client(device)
                        .memory_usage()
                        .ok()
                        .map(|u| u.bytes_in_use);
                }
            }
        }
        reading
    }

    fn start_job(self: &Arc<Self>, job: GenerateJob) {
        let jobs = self.jobs.lock().unwrap().clone();
        let Some(jobs) = jobs else {
            return self.failed(Some(&job.request_id), FailureKind::Internal, "no model is loaded yet".into());
        };
        let cancel = CancelToken::new();
        {
            let mut active = self.active.lock().unwrap();
            if active.contains_key(&job.request_id) {
                return self.failed(
                    Some(&job.request_id),
                    FailureKind::Invalid,
                    format!("request {} is already running here", job.request_id),
                );
            }
            // Test-only: the slots are not enforced (`worker-over-slots`).
            if active.len() >= self.options.max_concurrency as usize && !headroom_model::test_defect("worker-over-slots") {
                return self.failed(
                    Some(&job.request_id),
                    FailureKind::Busy,
                    format!("this worker runs at most {} requests at once", self.options.max_concurrency),
                );
            }
            active.insert(job.request_id.clone(), cancel.clone());
        }
        let id = job.request_id.clone();
        if jobs.send((job, cancel)).is_err() {
            self.finish(&id, failure(Some(&id), FailureKind::Internal, "the batch thread has ended".into()));
        }
    }

    /// Ends a request: frees its slot, then tells the router (so the next request it sends here
    /// is never refused as busy).
    fn finish(&self, id: &str, last: FromWorker) {
        self.active.lock().unwrap().remove(id);
        self.out.send(&last);
    }

    /// The batch thread of a loaded model: runs its requests together until the model is
    /// replaced (its job channel closes) and nothing runs.
    fn serve_batch(&self, loaded: &Loaded, jobs: Receiver<(GenerateJob, CancelToken)>) {
        match &loaded.engine {
            Engine::Cpu(model) => self.drive(model, loaded, &jobs),
            Engine::SimSplit(model) => self.drive(model, loaded, &jobs),
            Engine::Encoder(model) => self.drive(model, loaded, &jobs),
            #[cfg(feature = "cuda")]
            Engine::Cuda(model, _) => self.drive(model, loaded, &jobs),
            #[cfg(feature = "cuda")]
            Engine::CudaSplit(model, _) => self.drive(model, loaded, &jobs),
            #[cfg(feature = "cuda")]
            Engine::CudaEncoder(model, _) => self.drive(model, loaded, &jobs),
        }
    }

    fn drive<M: Decoder>(&self, model: &M, loaded: &Loaded, jobs: &Receiver<(GenerateJob, CancelToken)>) {
        let mut batch: Batch<M, String> = Batch::new(model);
        let mut running: HashMap<String, Running> = HashMap::new();
        loop {
            // Requests join between steps; an idle worker waits for one.
            let mut incoming = Vec::new();
            if batch.is_empty() {
                match jobs.recv() {
                    Ok(job) => incoming.push(job),
                    Err(_) => return,
                }
            }
            incoming.extend(jobs.try_iter());
            for (job, cancel) in incoming {
                let id = job.request_id.clone();
                match self.admit(model, loaded, &job) {
                    Ok((session, run)) => {
                        running.insert(id.clone(), run);
                        batch.join(id, session, cancel);
                    }
                    Err((last, device_fault)) => {
                        self.finish(&id, last);
                        if device_fault {
                            self.exit_after_device_fault();
                        }
                    }
                }
            }
            if self.ledger.is_some() {
                self.take_next_blocks(loaded, &mut batch, &mut running);
            }
            if batch.is_empty() {
                continue;
            }
            let step_started = Instant::now();
            let mut faulted = Vec::new();
            let stepped = catch_unwind(AssertUnwindSafe(|| {
                batch.step(|id, session, token, text| {
                    let run = running.get_mut(id).expect("every batched request is running");
                    let eos = session.finished().is_some() && session.generated().last() != Some(&token);
                    if let Some(n) = run.oom_after.as_mut() {
                        if *n == 0 {
                            faulted.push(id.clone());
                            return false;
                        }
                        *n -= 1;
                    }
                    self.out.send(&FromWorker::Token {
                        request_id: id.clone(),
                        index: run.index,
                        token,
                        text,
                        eos,
                        rng_word_pos: session.sampler_state().rng_word_pos,
                    });
                    run.decode_started.get_or_insert_with(Instant::now);
                    run.index += 1;
                    run.produced += 1;
                    match self.faults.after_token() {
                        TokenVerdict::Continue => true,
                        TokenVerdict::Reset => {
                            tracing::warn!(request_id = %id, "simulated device reset mid-request: exiting");
                            std::process::exit(RESET_EXIT_CODE);
                        }
                    }
                })
            }));
            self.progress.fetch_add(1, Ordering::SeqCst);
            let left = match stepped {
                Ok(left) => left,
                Err(panic) => {
                    // A step that panicked leaves every cache of the batch in doubt: all of its
                    // requests fail (replayable where the device is to blame).
                    let (kind, message) = classify_panic(&panic);
                    tracing::error!(?kind, %message, requests = running.len(), "a batched step panicked");
                    batch = Batch::new(model);
                    for (id, run) in running.drain() {
                        drop(run);
                        self.finish(&id, failure(Some(&id), kind, message.clone()));
                    }
                    if matches!(self.options.device, Device::Cuda(_)) {
                        self.exit_after_device_fault();
                    }
                    continue;
                }
            };
            self.faults.slow_down(step_started.elapsed());
            if self.ledger.is_some() {
                // Only the sim device reports its requests' blocks (see `memory`).
                let block_bytes = loaded.planner.kv_block_bytes();
                let resident: u64 = batch.sessions().map(|(_, s)| s.positions().div_ceil(headroom_model::model::KV_BLOCK) as u64 * block_bytes).sum();
                self.kv_resident.store(resident, Ordering::SeqCst);
            }
            if left.is_empty() {
                continue;
            }
            for gone in left {
                let run = running.remove(&gone.key).expect("every batched request is running");
                let last = run.last_frame(&gone.key, &gone.session, gone.error, faulted.contains(&gone.key));
                // The reservation is free, and the session's blocks are in the prefix cache,
                // before the router hears the request ended: a drop of the prefix cache or a
                // request sent after that frame sees them.
                drop(run);
                drop(gone.session);
                self.finish(&gone.key, last);
            }
            self.read_memory();
        }
    }

    /// Under KV overcommit a request reserved only part of its blocks: before a step, each
    /// running request (in the order they joined) takes from the device the blocks this step may
    /// write past its reservation, keeping the VRAM reserve free. Where the device has none left,
    /// the request that started last ([`GenerateJob::started_order`]) is preempted: it leaves the
    /// batch with its checkpoint, its blocks go back, and the router resumes it elsewhere.
    /// Without overcommit every block was reserved at admission and nothing is taken here.
    fn take_next_blocks<'m, M: Decoder>(&self, loaded: &Loaded, batch: &mut Batch<'m, M, String>, running: &mut HashMap<String, Running>) {
        let block_bytes = loaded.planner.kv_block_bytes();
        let keep_free = self.vram_reserve.load(Ordering::SeqCst);
        let mut i = 0;
        loop {
            let Some((id, needed)) = batch.sessions().nth(i).map(|(id, s)| (id.clone(), s.positions_after_step().div_ceil(headroom_model::model::KV_BLOCK) as u64)) else { return };
            let run = running.get_mut(&id).expect("every batched request is running");
            let short = needed.saturating_sub(run.kv_blocks);
            let grown = match run.reservation.as_mut() {
                Some(reservation) if short > 0 => reservation.try_grow(short * block_bytes, keep_free),
                _ => Ok(()),
            };
            match grown {
                Ok(()) => {
                    run.kv_blocks = run.kv_blocks.max(needed);
                    i += 1;
                }
                Err(e) => {
                    // The request that started last; test-only: the one that joined the batch
                    // last, which is a resumed one.
                    let joined_last = headroom_model::test_defect("preempt-joined-last");
                    let (at, last) = batch.sessions().map(|(id, _)| id).enumerate().max_by_key(|(_, id)| if joined_last { 0 } else { running[*id].started_order }).map(|(at, id)| (at, id.clone())).expect("the batch holds the request that needs a block");
                    let session = batch.remove(&last).expect("it is in the batch");
                    // The request that needs the block moved up one place if the preempted one
                    // was before it; it tries again either way.
                    if at < i {
                        i -= 1;
                    }
                    let run = running.remove(&last).expect("every batched request is running");
                    self.preemptions.fetch_add(1, Ordering::SeqCst);
                    tracing::warn!(request_id = %last, for_request = %id, error = %e, "no KV block left on the device: the request that started last is preempted");
                    let frame = run.preempted_frame(&last, &session, &e.to_string());
                    // Its blocks are free before the router hears of it.
                    drop(session);
                    drop(run);
                    self.finish(&last, frame);
                }
            }
        }
    }

    /// Checks a job and readies its session (nothing computed yet): the context limit, the
    /// fallback's own tokens, the KV cache and workspace reserved on the (simulated) device. A
    /// refusal is the request's final frame, and whether the device faulted.
    #[allow(clippy::result_large_err)] // a refusal is rare and goes straight to the router
    fn admit<'m, M: Decoder>(
        &self,
        model: &'m M,
        loaded: &'m Loaded,
        job: &GenerateJob,
    ) -> Result<(Session<'m, M>, Running), (FromWorker, bool)> {
        let id = job.request_id.as_str();
        let refuse = |kind, message: String| (failure(Some(id), kind, message), false);
        // A fallback model tokenizes the client's prompt itself (unless a test switched that
        // off, as the negative control of the fallback-tokenizer test).
        let own = match loaded.bundle.own_request(&job.request) {
            Ok(_) if std::env::var_os("HEADROOM_TEST_IGNORE_PROMPT_SOURCE").is_some() => None,
            Ok(own) => own,
            Err(e) => return Err(refuse(FailureKind::Invalid, e.to_string())),
        };
        if job.request.embed && own.is_some() {
            // Another model's vectors live in another space: never mix them into the asker's.
            return Err(refuse(FailureKind::Invalid, format!("this worker holds {}, not the model the embedding was asked of", loaded.bundle.name())));
        }
        let request = own.as_ref().unwrap_or(&job.request);
        let context = self.context_limit(&loaded.bundle);
        let checked = if request.embed {
            headroom_model::check_embedding(request, context)
        } else {
            headroom_model::generate::check_context(request.prompt_tokens.len(), request.max_tokens, context)
        };
        if let Err(e) = checked {
            let message = if context < loaded.bundle.config.max_position_embeddings {
                format!("{e} (this worker's context limit is {context} tokens)")
            } else {
                e.to_string()
            };
            return Err(refuse(FailureKind::Invalid, message));
        }
        // The KV cache and workspace are reserved up front, so an admitted stream never runs out
        // of (simulated) device memory half way; under overcommit only part of the KV blocks
        // are (see `take_next_blocks`).
        let mut kv_blocks = 0;
        let reservation = match &self.ledger {
            Some(ledger) => {
                if self.faults.take_oom_next_allocation() {
                    return Err(refuse(FailureKind::Oom, "simulated out-of-memory allocating the KV cache".into()));
                }
                let footprint = loaded.planner.footprint(RequestShape::of(request));
                kv_blocks = footprint.kv_tokens.div_ceil(headroom_model::model::KV_BLOCK as u64);
                if self.options.kv_overcommit > 1.0 {
                    // Running requests take blocks past their reservations, which the router
                    // sees only at the next reading: a new request must leave the reserve free
                    // too, and where it cannot, it goes elsewhere like a preempted one.
                    match ledger.try_reserve_keeping(id, footprint.request_bytes(), self.vram_reserve.load(Ordering::SeqCst)) {
                        Ok(r) => Some(r),
                        Err(e) => return Err(refuse(FailureKind::Preempted, format!("no KV blocks left on the device for a new request under overcommit: {e}"))),
                    }
                } else {
                    match ledger.try_reserve(id, footprint.request_bytes()) {
                        Ok(r) => Some(r),
                        Err(e) => return Err(refuse(FailureKind::Oom, format!("out of memory for the KV cache: {e}"))),
                    }
                }
            }
            None => None,
        };
        if self.options.device == Device::Sim {
            // A compilation pending (fault) holds the device now; otherwise wait for the device
            // if another request's compilation holds it.
            self.faults.compile_if_pending();
            self.faults.with_device(|| ());
            self.read_memory();
        }
        let session = match catch_unwind(AssertUnwindSafe(|| Session::new(model, &loaded.bundle, request))) {
            Ok(Ok(session)) => session,
            Ok(Err(e)) => return Err(refuse(FailureKind::Invalid, e.to_string())),
            Err(panic) => {
                let (kind, message) = classify_panic(&panic);
                tracing::error!(request_id = id, ?kind, %message, "allocating the KV cache panicked");
                return Err((failure(Some(id), kind, message), matches!(self.options.device, Device::Cuda(_))));
            }
        };
        let run = Running {
            started_order: job.started_order,
            reservation,
            kv_blocks,
            // An embedding makes no tokens: the fault waits for a generation.
            oom_after: if request.embed { None } else { self.faults.take_oom_after_tokens() },
            index: session.generated().len() as u32,
            produced: 0,
            prompt_tokens: request.prompt_tokens.len() as u32,
            decode_started: None,
        };
        Ok((session, run))
    }

    /// Half-open check: hold a canary allocation on the device and run one token.
    fn probe(&self, canary_bytes: u64) {
        let started = Instant::now();
        let result = self.try_probe(canary_bytes);
        let probe_ms = started.elapsed().as_secs_f64() * 1000.0;
        let (ok, message) = match result {
            Ok(()) => (true, format!("canary of {} held and a two-token generation ran", headroom_memory::footprint::human_bytes(canary_bytes))),
            Err(m) => (false, m),
        };
        self.out.send(&FromWorker::ProbeResult { ok, message, probe_ms });
    }

    fn try_probe(&self, canary_bytes: u64) -> Result<(), String> {
        let loaded = self.loaded.lock().unwrap().clone().ok_or("no model is loaded")?;
        let _canary = match &self.ledger {
            Some(ledger) => {
                if self.faults.take_oom_next_allocation() {
                    return Err("simulated out-of-memory on the canary allocation".into());
                }
                Some(ledger.try_reserve("canary", canary_bytes).map_err(|e| format!("canary allocation failed: {e}"))?)
            }
            None => None,
        };
        // The warm-up's shapes: compiled at load, so the probe never waits for the compiler
        // (on a cold kernel cache a new shape took longer than the probe's timeout).
        let request = warm_up_request(&loaded.bundle).map_err(|e| e.to_string())?;
        let cancel = CancelToken::new();
        #[cfg(feature = "cuda")]
        let on_cuda = |device: &burn_cuda::CudaDevice| {
            let floats = (canary_bytes / 4).max(1) as usize;
            let canary = burn::tensor::Tensor::<burn_cuda::Cuda<f32>, 1>::zeros([floats], device);
            let _ = canary.into_data();
        };
        let outcome = catch_unwind(AssertUnwindSafe(|| match &loaded.engine {
            Engine::Cpu(model) => {
                let _canary = vec![0u8; canary_bytes.min(64 << 20) as usize];
                headroom_model::generate(model, &loaded.bundle, &request, &cancel, |_| {}).map(|_| ())
            }
            Engine::SimSplit(model) => headroom_model::generate(model, &loaded.bundle, &request, &cancel, |_| {}).map(|_| ()),
            Engine::Encoder(model) => headroom_model::generate(model, &loaded.bundle, &request, &cancel, |_| {}).map(|_| ()),
            #[cfg(feature = "cuda")]
            Engine::Cuda(model, device) => {
                on_cuda(device);
                headroom_model::generate(model, &loaded.bundle, &request, &cancel, |_| {}).map(|_| ())
            }
            #[cfg(feature = "cuda")]
            Engine::CudaSplit(model, device) => {
                on_cuda(device);
                headroom_model::generate(model, &loaded.bundle, &request, &cancel, |_| {}).map(|_| ())
            }
            #[cfg(feature = "cuda")]
            Engine::CudaEncoder(model, device) => {
                on_cuda(device);
                headroom_model::generate(model, &loaded.bundle, &request, &cancel, |_| {}).map(|_| ())
            }
        }));
        match outcome {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(panic) => {
                let (_, message) = classify_panic(&panic);
                if matches!(self.options.device, Device::Cuda(_)) {
                    self.out.send(&FromWorker::ProbeResult { ok: false, message: message.clone(), probe_ms: 0.0 });
                    self.exit_after_device_fault();
                }
                Err(message)
            }
        }
    }

    fn exit_after_device_fault(&self) -> ! {
        tracing::error!(device = %self.options.device.label(), "device fault: exiting so the router restarts a clean worker");
        std::process::exit(DEVICE_FAULT_EXIT_CODE);
    }
}

/// A request in the batch: what the worker tracks beside its session.
struct Running {
    /// The job's [`GenerateJob::started_order`].
    started_order: u64,
    /// Its KV cache and workspace on the sim device, held until it leaves the batch.
    reservation: Option<Reservation>,
    /// KV blocks its reservation covers (fewer than it may write under overcommit).
    kv_blocks: u64,
    /// Tokens left before an injected out-of-memory fails it.
    oom_after: Option<u32>,
    /// The index of its next token (a resume continues the checkpoint's count).
    index: u32,
    produced: u32,
    prompt_tokens: u32,
    decode_started: Option<Instant>,
}

impl Running {
    /// The frame of a request preempted for a KV block: its checkpoint, to resume elsewhere.
    fn preempted_frame<M: Decoder>(&self, id: &str, session: &Session<'_, M>, why: &str) -> FromWorker {
        // Test-only: a preempted request fails like a plain error (the defect the control runs).
        let replayable = !headroom_model::test_defect("preempt-unreplayable");
        FromWorker::Failed {
            request_id: Some(id.to_string()),
            kind: if replayable { FailureKind::Preempted } else { FailureKind::Internal },
            message: format!("preempted after {} tokens: no KV block left on the device for an older request ({why})", self.produced),
            replayable,
            checkpoint: Some(session.checkpoint()),
        }
    }

    /// The frame that ends a request which left the batch: done, cancelled, failed by an
    /// injected out-of-memory (with its checkpoint, to resume elsewhere) or by an error.
    fn last_frame<M: Decoder>(&self, id: &str, session: &Session<'_, M>, error: Option<headroom_model::Error>, out_of_memory: bool) -> FromWorker {
        if out_of_memory {
            return FromWorker::Failed {
                request_id: Some(id.to_string()),
                kind: FailureKind::Oom,
                message: format!("simulated out-of-memory after {} tokens", self.produced),
                replayable: true,
                checkpoint: Some(session.checkpoint()),
            };
        }
        if let Some(e) = error {
            return failure(Some(id), FailureKind::Internal, e.to_string());
        }
        let finish_reason = session.finished().unwrap_or(headroom_model::FinishReason::Length);
        if finish_reason == headroom_model::FinishReason::Cancelled {
            return FromWorker::Failed {
                request_id: Some(id.to_string()),
                kind: FailureKind::Cancelled,
                message: "cancelled by the router".into(),
                replayable: false,
                checkpoint: Some(session.checkpoint()),
            };
        }
        FromWorker::Done {
            request_id: id.to_string(),
            finish_reason,
            prompt_tokens: self.prompt_tokens,
            cached_prompt_tokens: session.prompt_reused() as u32,
            completion_tokens: session.generated().len() as u32,
            prefill_ms: session.prefill_ms,
            decode_ms: self.decode_started.map_or(0.0, |t| t.elapsed().as_secs_f64() * 1000.0),
            checkpoint: session.checkpoint(),
            embedding: session.embedding(),
        }
    }
}

/// The generation a CUDA worker compiles its kernels with at load, and the breaker's probe runs.
/// Runs a lone generation and every batch size up to `max_concurrency` once, so their shapes
/// are compiled and autotuned before the first request (a batched step has its own shapes,
/// `[n, 1, hidden]` for n sequences).
#[cfg(feature = "cuda")]
fn warm_up<M: Decoder>(model: &M, bundle: &ModelBundle, max_concurrency: u32) -> headroom_model::Result<()> {
    let request = warm_up_request(bundle)?;
    headroom_model::generate(model, bundle, &request, &CancelToken::new(), |_| {})?;
    let requests = vec![request; max_concurrency as usize];
    for n in 2..=requests.len() {
        headroom_model::batch::generate_together(model, bundle, &requests[..n])?;
    }
    // An embedding's pooled sum is a reduction of its own.
    let embedding = GenerateRequest::embedding(requests[0].prompt_tokens.clone());
    headroom_model::Session::start(model, bundle, &embedding, &CancelToken::new())?;
    Ok(())
}

/// Bytes of weights the GPU device holds for `bundle`: CUDA's 16-bit matrices, the sim GPU's
/// f32 model of them; of a split, its GPU layers' alone.
fn device_weight_bytes(bundle: &ModelBundle, device: Device, split: Option<SplitLayers>) -> u64 {
    let shape = headroom_memory::gpu_shape(bundle, &device.label());
    match split {
        None => shape.weights_bytes(),
        Some(split) => headroom_memory::split::LayerBytes::of(&shape, &shape).gpu_layer * split.gpu_layers as u64,
    }
}

/// A short generation (an embedding, for an encoder): the breaker's probe, and CUDA's warm-up.
fn warm_up_request(bundle: &ModelBundle) -> headroom_model::Result<GenerateRequest> {
    let mut prompt = bundle.encode("And it came to pass", true)?;
    prompt.resize(prompt.len().max(8), 0);
    if bundle.config.is_encoder() {
        return Ok(GenerateRequest::embedding(prompt));
    }
    Ok(GenerateRequest::new(prompt, 2, Default::default()))
}

fn failure(request_id: Option<&str>, kind: FailureKind, message: String) -> FromWorker {
    FromWorker::Failed {
        request_id: request_id.map(str::to_string),
        kind,
        replayable: matches!(kind, FailureKind::Oom | FailureKind::DeviceLost | FailureKind::Busy | FailureKind::Preempted),
        message,
        checkpoint: None,
    }
}

/// burn-cuda reports an out-of-memory or a lost device by panicking; the message tells which.
fn classify_panic(panic: &Box<dyn std::any::Any + Send>) -> (FailureKind, String) {
    let message = panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the device panicked without a message".into());
    let lower = message.to_lowercase();
    if lower.contains("out of memory") || lower.contains("outofmemory") || lower.contains("out_of_memory") {
        return (FailureKind::Oom, message);
    }
    // cubecl reports a failed allocation or launch on its device thread and hands the caller only
    // `CallError`: say what that means instead of passing the bare unwrap message to the user.
    let message = if lower.contains("callerror") {
        "the CUDA runtime failed a call (cubecl CallError: an allocation or launch failed, typically \
         GPU memory taken by another program); the GPU worker restarts clean"
            .to_string()
    } else {
        message
    };
    (FailureKind::DeviceLost, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panics_are_classified_by_message() {
        let oom: Box<dyn std::any::Any + Send> = Box::new(String::from("CUDA_ERROR_OUT_OF_MEMORY: out of memory"));
        assert_eq!(classify_panic(&oom).0, FailureKind::Oom);
        let lost: Box<dyn std::any::Any + Send> = Box::new("CUDA_ERROR_LAUNCH_FAILED");
        assert_eq!(classify_panic(&lost).0, FailureKind::DeviceLost);
        // Seen on an H200 when another program took the VRAM between admission and allocation.
        let call: Box<dyn std::any::Any + Send> =
            Box::new(String::from("called `Result::unwrap()` on an `Err` value: CallError"));
        let (kind, message) = classify_panic(&call);
        assert_eq!(kind, FailureKind::DeviceLost);
        assert!(message.contains("CUDA runtime failed") && message.contains("restarts"), "{message}");
    }
}
