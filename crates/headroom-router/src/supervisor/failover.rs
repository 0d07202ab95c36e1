//! One request run with failover: an attempt on one worker (streaming its tokens, resuming from
//! the delivered ones), and what a GPU failure leaves for the next attempt.

use super::*;

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
    pub device: Device,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailoverRecord {
    pub from: Device,
    pub to: Device,
    /// What failed on the GPU (out of memory, device lost…); absent in journals from before it.
    #[serde(default)]
    pub kind: Option<FailureKind>,
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
    pub device: Device,
    pub simulated: bool,
    /// The model ran split between that GPU and the CPU.
    #[serde(default)]
    pub split: Option<headroom_worker::SplitLayers>,
    pub degraded: bool,
    pub degraded_reason: Option<String>,
    /// The degradation in one plain sentence (see [`crate::degraded`]).
    #[serde(default)]
    pub degraded_summary: Option<String>,
    /// The CPU worker's smaller model, when it served the request.
    pub fallback_model: Option<String>,
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    pub prompt_tokens: u32,
    /// Prompt tokens of the attempt that finished whose keys and values its worker kept from
    /// an earlier request (see `headroom_model::cpu::prefix`).
    #[serde(default)]
    pub cached_prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prefill (and checkpoint replay) time of the attempt that finished.
    pub prefill_ms: f64,
    /// Decode time the worker measured for the attempt that finished.
    #[serde(default)]
    pub decode_ms: f64,
    pub failovers: Vec<FailoverRecord>,
    /// An embedding request's vector (see `GenerateRequest::embed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub embedding: Option<Vec<f32>>,
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

impl Supervisor {
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
        let worker = self.worker_for(run, target, progress)?;
        let device = worker.device;
        let request = progress.resume_request(run);
        tracing::info!(request_id = %run.request_id, %device, resumed_after = progress.delivered.len(), "dispatch");
        let started_order = *progress.started_order.get_or_insert_with(|| FIRST_ATTEMPTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst));
        let mut rx = match worker.generate(GenerateJob { request_id: run.request_id.clone(), request, started_order }).await {
            Ok(rx) => rx,
            // A GPU worker that died before the router noticed: a device failure like any other.
            Err(e) if device.is_gpu() => {
                self.trip(FailureCause::DeviceLost, &e.to_string());
                return Err(self.failed_over(run, progress, device, FailureKind::DeviceLost, format!("{device} failed: {e}")));
            }
            Err(e) => return Err(AttemptError::End(e)),
        };
        match relay(run, &worker, &mut rx, progress, cancel, on_token).await? {
            Relayed::Done(done) => Ok(self.outcome(run, &worker, progress, done)),
            Relayed::Failed { kind, message, replayable } => Err(self.attempt_failed(run, device, progress, kind, message, replayable)),
        }
    }

    /// The worker an attempt runs on; a GPU attempt with no usable GPU fails over at once.
    fn worker_for(&self, run: &RunRequest, target: Target, progress: &mut Progress) -> Result<Arc<Worker>, AttemptError> {
        let usable_gpu = || self.gpu_worker().filter(|_| self.gpu_unavailable().is_none());
        let gpu = match target {
            Target::Cpu => None,
            Target::Auto => usable_gpu(),
            Target::Gpu => match (usable_gpu(), self.inner.config.gpu.as_ref()) {
                (Some(w), _) => Some(w),
                (None, Some(configured)) => {
                    let why = self.gpu_unavailable().unwrap_or_else(|| "the GPU is unavailable: its worker is restarting".into());
                    return Err(self.failed_over(run, progress, configured.device, FailureKind::Unavailable, why));
                }
                (None, None) => return Err(AttemptError::End(Error::Unavailable("no GPU is configured; send the request to the CPU".into()))),
            },
        };
        match gpu {
            Some(w) => Ok(w),
            None => self.cpu_worker().ok_or_else(|| AttemptError::End(Error::Unavailable("no worker is running; the CPU worker is restarting".into()))),
        }
    }

    /// The outcome of an attempt that finished; degraded when the CPU served a request the GPU
    /// would have (see [`degradation`]; the dispatcher adds admission's reason).
    fn outcome(&self, run: &RunRequest, worker: &Worker, progress: &mut Progress, done: Finished) -> RunOutcome {
        let on_gpu = worker.device.is_gpu();
        let degradation = crate::degradation(&self.status(), !on_gpu, progress.failovers.last(), None, None);
        let fallback_model = (!on_gpu && self.cpu_setup().fallback_model_dir.is_some()).then(|| worker.ready.model_name.clone());
        RunOutcome {
            request_id: run.request_id.clone(),
            device: worker.device,
            simulated: worker.ready.simulated,
            split: worker.ready.split,
            degraded: degradation.is_some(),
            degraded_reason: degradation.as_ref().map(|d| d.reason.clone()),
            degraded_summary: degradation.map(|d| d.summary),
            fallback_model,
            tokens: std::mem::take(&mut progress.delivered),
            text: std::mem::take(&mut progress.delivered_text),
            finish_reason: done.finish_reason,
            prompt_tokens: done.prompt_tokens,
            cached_prompt_tokens: done.cached_prompt_tokens,
            completion_tokens: done.completion_tokens,
            prefill_ms: done.prefill_ms,
            decode_ms: done.decode_ms,
            failovers: std::mem::take(&mut progress.failovers),
            embedding: done.embedding,
        }
    }

    /// A worker failed the attempt: the request ends (cancelled, invalid, a CPU failure, or a
    /// stream that may not resume), or it fails over from the GPU.
    fn attempt_failed(&self, run: &RunRequest, device: Device, progress: &mut Progress, kind: FailureKind, message: String, replayable: bool) -> AttemptError {
        match kind {
            FailureKind::Cancelled => return AttemptError::End(Error::Cancelled),
            FailureKind::Invalid => return AttemptError::End(Error::Invalid(message)),
            _ => {}
        }
        if !(device.is_gpu() && replayable) {
            return AttemptError::End(Error::Worker(format!("{device}: {message}")));
        }
        // The GPU failed this request: count it against the device.
        match kind {
            FailureKind::Oom => self.trip(FailureCause::Oom, &message),
            FailureKind::DeviceLost => self.trip(FailureCause::DeviceLost, &message),
            _ => {}
        }
        if !progress.delivered.is_empty() && !run.allow_resume {
            return AttemptError::End(Error::Interrupted { reason: message, delivered_tokens: progress.delivered.len() as u32 });
        }
        self.failed_over(run, progress, device, kind, format!("{device} failed: {message}"))
    }

    /// Records and announces that a request leaves the GPU for the CPU. A CPU worker holding
    /// another model (a fallback) cannot continue another model's tokens: the request is
    /// replayed there from the client's prompt, which that worker tokenizes itself.
    pub(super) fn failed_over(&self, run: &RunRequest, progress: &mut Progress, from: Device, kind: FailureKind, reason: String) -> AttemptError {
        let tokens_bundle = run.request.source.as_ref().map(|s| s.bundle_hash.clone()).or_else(|| self.gpu_worker().map(|w| w.ready.bundle_hash.clone()));
        let cpu_bundle = self.cpu_worker().map(|w| w.ready.bundle_hash.clone());
        if matches!((&tokens_bundle, &cpu_bundle), (Some(t), Some(c)) if t != c) && !progress.delivered.is_empty() {
            tracing::info!(request_id = %run.request_id, delivered = progress.delivered.len(), "the CPU worker holds another model: replaying from the prompt");
            progress.start_over();
        }
        let resumed_after_tokens = progress.delivered.len() as u32;
        self.emit(EventKind::Failover { request_id: run.request_id.clone(), from, to: Device::Cpu, reason: reason.clone(), resumed_after_tokens });
        progress.failed_at = Some(Instant::now());
        progress.failovers.push(FailoverRecord { from, to: Device::Cpu, kind: Some(kind), reason: reason.clone(), resumed_after_tokens, failure_to_first_token_ms: None });
        AttemptError::GpuFailed { from, kind, reason, resumed_after_tokens }
    }
}

/// The end of a finished attempt, as the worker reported it.
struct Finished {
    finish_reason: FinishReason,
    prompt_tokens: u32,
    cached_prompt_tokens: u32,
    completion_tokens: u32,
    prefill_ms: f64,
    decode_ms: f64,
    embedding: Option<Vec<f32>>,
}

/// How a worker's request stream ended.
enum Relayed {
    Done(Finished),
    Failed { kind: FailureKind, message: String, replayable: bool },
}

/// Relays a request's stream from `worker` to `on_token` until it ends, keeping `progress` (the
/// tokens delivered, the worker's checkpoint) current; a cancel stops the worker first.
async fn relay(
    run: &RunRequest,
    worker: &Worker,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<FromWorker>,
    progress: &mut Progress,
    cancel: &CancelSignal,
    on_token: &mut impl FnMut(&StreamedToken),
) -> Result<Relayed, AttemptError> {
    let device = worker.device;
    loop {
        let message = tokio::select! {
            message = rx.recv() => message,
            _ = cancel.cancelled() => {
                stop_cancelled(run, worker, rx).await;
                return Err(AttemptError::End(Error::Cancelled));
            }
        };
        let Some(message) = message else {
            return Ok(Relayed::Failed { kind: FailureKind::DeviceLost, message: format!("the {device} worker stopped answering"), replayable: true });
        };
        match message {
            FromWorker::Token { index, token, text, eos, rng_word_pos, .. } => {
                progress.delivered_token(token, &text, eos, rng_word_pos);
                on_token(&StreamedToken { index, token, text, device });
            }
            FromWorker::Done { finish_reason, prompt_tokens, cached_prompt_tokens, completion_tokens, prefill_ms, decode_ms, embedding, .. } => {
                if run.request.embed && embedding.is_none() {
                    return Ok(Relayed::Failed { kind: FailureKind::Internal, message: format!("the {device} worker answered an embedding without a vector"), replayable: true });
                }
                return Ok(Relayed::Done(Finished { finish_reason, prompt_tokens, cached_prompt_tokens, completion_tokens, prefill_ms, decode_ms, embedding }));
            }
            FromWorker::Failed { kind, message, replayable, checkpoint, .. } => {
                progress.adopt_checkpoint(checkpoint);
                return Ok(Relayed::Failed { kind, message, replayable });
            }
            other => tracing::warn!(?other, "unexpected frame on a request stream"),
        }
    }
}

/// Forwards a cancel and waits (briefly) for the worker to let go of the request, so its slot
/// and reservation are free when the attempt returns.
async fn stop_cancelled(run: &RunRequest, worker: &Worker, rx: &mut tokio::sync::mpsc::UnboundedReceiver<FromWorker>) {
    if let Err(e) = worker.cancel(&run.request_id).await {
        tracing::warn!(request_id = %run.request_id, error = %e, "could not forward a cancel");
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(m) = rx.recv().await {
            if matches!(m, FromWorker::Done { .. } | FromWorker::Failed { .. }) {
                break;
            }
        }
    })
    .await;
}

/// First attempts made in this process, every model's: a request's place among them is its
/// [`GenerateJob::started_order`].
static FIRST_ATTEMPTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What a request has from its earlier attempts: the tokens the client already has (a next
/// attempt resumes after them) and the failovers so far.
#[derive(Debug, Default)]
pub struct Progress {
    /// The request's place among first attempts ([`GenerateJob::started_order`]).
    started_order: Option<u64>,
    delivered: Vec<u32>,
    delivered_text: String,
    /// The sampler's RNG position after the last delivered token, as its worker sent it.
    rng_word_pos: Option<String>,
    /// The checkpoint a failing worker sent with its failure, when it matches what the client
    /// has: the next attempt resumes from it as sent.
    checkpoint: Option<Checkpoint>,
    failovers: Vec<FailoverRecord>,
    failed_at: Option<Instant>,
}

impl Progress {
    fn delivered_token(&mut self, token: u32, text: &str, eos: bool, rng_word_pos: String) {
        if let (Some(at), Some(last)) = (self.failed_at.take(), self.failovers.last_mut()) {
            last.failure_to_first_token_ms = Some(at.elapsed().as_secs_f64() * 1000.0);
        }
        if !eos {
            self.delivered.push(token);
        }
        self.delivered_text.push_str(text);
        self.rng_word_pos = Some(rng_word_pos);
        self.checkpoint = None;
    }

    /// Keeps a failing worker's checkpoint if it holds exactly the tokens the client has (a
    /// worker may have generated a token it never sent).
    fn adopt_checkpoint(&mut self, checkpoint: Option<Checkpoint>) {
        self.checkpoint = checkpoint.filter(|c| c.generated_tokens == self.delivered && !self.delivered.is_empty());
    }

    /// Forgets the delivered tokens: the next attempt replays from the prompt.
    fn start_over(&mut self) {
        self.delivered.clear();
        self.delivered_text.clear();
        self.rng_word_pos = None;
        self.checkpoint = None;
    }

    /// The request for the next attempt: resuming after the delivered tokens, from the
    /// worker's own checkpoint when it sent one, else from the tokens and RNG position it
    /// streamed.
    fn resume_request(&self, run: &RunRequest) -> GenerateRequest {
        let mut request = run.request.clone();
        if self.delivered.is_empty() {
            return request;
        }
        request.resume = Some(match &self.checkpoint {
            Some(sent) => sent.clone(),
            None => Checkpoint {
                prompt_tokens: run.request.prompt_tokens.clone(),
                generated_tokens: self.delivered.clone(),
                delivered_text: self.delivered_text.clone(),
                sampler: SamplerState {
                    params: run.request.sampling.clone(),
                    rng_word_pos: self.rng_word_pos.clone().unwrap_or_else(|| "0".into()),
                },
            },
        });
        request
    }
}

/// Why an attempt did not finish its request.
#[derive(Debug)]
pub enum AttemptError {
    /// The request ends here (cancelled, invalid, interrupted, or the CPU worker failed it).
    End(Error),
    /// The GPU failed (or was not there); the request can continue on the CPU worker, replayed
    /// or resumed after `resumed_after_tokens`.
    GpuFailed { from: Device, kind: FailureKind, reason: String, resumed_after_tokens: u32 },
}
