//! The worker protocol: length-prefixed JSON frames over the worker's stdin and stdout (stderr
//! carries logs). Every frame is a 4-byte big-endian length, then one JSON message. The worker
//! opens with [`FromWorker::Hello`] naming [`PROTOCOL_VERSION`]; a router that speaks another
//! version refuses it instead of guessing.

use std::io::{Read, Write};

use headroom_memory::{GpuMemory, HostMemory};
use headroom_model::{Checkpoint, FinishReason, GenerateRequest};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

pub const PROTOCOL_VERSION: u32 = 1;

/// A frame longer than this is a protocol error (a prompt of a million tokens is ~8 MB of JSON).
pub const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// Router → worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToWorker {
    /// Load a model folder; answered by `Ready` or `Failed { request_id: None }`.
    Load { model_dir: String },
    Generate(GenerateJob),
    Cancel { request_id: String },
    Health { nonce: u64 },
    /// Half-open check of the breaker: hold `canary_bytes` on the device, run a one-token
    /// generation, release both; answered by `ProbeResult`.
    Probe { canary_bytes: u64 },
    /// Fault injection; only the `sim` device accepts it.
    Fault { fault: Fault },
    /// Drop the blocks the CPU engine's prefix cache keeps (admission needs their host RAM for
    /// a request); its next memory reading shows it. No answer.
    DropPrefixCache,
    /// The VRAM the sim GPU keeps free when requests take KV blocks under overcommit: the
    /// reserve changed in settings. No answer; the next memory reading shows it.
    SetVramReserve { mib: u64 },
    Shutdown,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenerateJob {
    pub request_id: String,
    /// Prompt tokens, sampling, stop strings, max tokens reserved up front, and an optional
    /// checkpoint to resume from.
    pub request: GenerateRequest,
    /// When the request first started, among all requests (the router's count of first
    /// attempts; a resume keeps its request's): a worker that must preempt one takes the one
    /// that started last, so a request resumed after a preemption is not the first to go again
    /// while later ones run.
    #[serde(default)]
    pub started_order: u64,
}

/// Faults the `sim` device can inject.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "fault", rename_all = "snake_case")]
pub enum Fault {
    /// The next allocation (a load or a request's KV cache) fails with out-of-memory.
    OomNextAllocation,
    /// The next request fails with out-of-memory after producing this many tokens.
    OomAfterTokens { tokens: u32 },
    /// The process exits, as a driver reset would kill it: at once, or after this many more
    /// tokens of whatever is running.
    Reset { after_tokens: Option<u32> },
    /// Stop answering anything (health checks included) until killed.
    Hang,
    /// Every token takes this many times as long.
    Slowdown { factor: f64 },
    /// The next request holds the device for this long before its first token, as CUDA's
    /// kernel compilation does for a shape not compiled yet: anything else that needs the
    /// device (a memory query, another request) waits for it meanwhile.
    Compile { ms: u64 },
    /// Hold this much simulated VRAM for a competing program.
    Compete { mib: u64 },
    /// Remove every fault and release the competing workload.
    Clear,
}

impl Fault {
    /// Whether the fault is of the device's surroundings (a competing program, a slowdown, or
    /// clearing them) rather than of one worker: it outlives the worker, and on a GPU that
    /// several models share it bites them all.
    pub fn is_environment(&self) -> bool {
        matches!(self, Fault::Compete { .. } | Fault::Slowdown { .. } | Fault::Clear)
    }
}

/// Where a split model's layers run (see `headroom_model::split`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitLayers {
    pub gpu_layers: u32,
    pub layers: u32,
}

/// Worker → router.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum FromWorker {
    Hello {
        protocol: u32,
        device: String,
        simulated: bool,
        pid: u32,
    },
    Ready {
        bundle_hash: String,
        model_name: String,
        context_tokens: u32,
        max_concurrency: u32,
        load_ms: f64,
        memory: MemoryReading,
        /// A split model: the last this many of its `layers` run on this GPU, the rest on the
        /// host's CPU in this process. `None`: the whole model runs on this device.
        #[serde(default)]
        split: Option<SplitLayers>,
    },
    Token {
        request_id: String,
        index: u32,
        token: u32,
        /// Text this token made final (may be empty while a character or stop string is open).
        text: String,
        /// The end-of-sequence token: it ends the stream and is not part of a checkpoint.
        eos: bool,
        /// The sampler's RNG position after this token, so the router holds a checkpoint at
        /// every token even if the worker dies without a word.
        rng_word_pos: String,
    },
    Done {
        request_id: String,
        finish_reason: FinishReason,
        prompt_tokens: u32,
        /// Prompt tokens whose keys and values came from the prefix cache (not computed).
        #[serde(default)]
        cached_prompt_tokens: u32,
        completion_tokens: u32,
        prefill_ms: f64,
        decode_ms: f64,
        checkpoint: Checkpoint,
        /// An embedding request's vector: the mean of its prompt's final hidden states, length 1.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        embedding: Option<Vec<f32>>,
    },
    Failed {
        /// `None` for a failure outside any request (a load).
        request_id: Option<String>,
        kind: FailureKind,
        message: String,
        /// Whether running it again elsewhere is safe and could succeed.
        replayable: bool,
        checkpoint: Option<Checkpoint>,
    },
    /// Answered by a thread that generation and compilation never block, from the latest
    /// memory reading.
    HealthOk {
        nonce: u64,
        active_requests: u32,
        memory: MemoryReading,
        /// Grows with every prefill and every token: a busy worker whose progress stands still
        /// is hung.
        #[serde(default)]
        progress: u64,
    },
    ProbeResult {
        ok: bool,
        message: String,
        probe_ms: f64,
    },
    FaultSet {
        fault: Fault,
    },
    MemorySample {
        memory: MemoryReading,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureKind {
    Oom,
    DeviceLost,
    Cancelled,
    /// The worker is at its concurrency limit.
    Busy,
    /// Under KV overcommit the device had no block left for a running request: the newest
    /// request leaves with its checkpoint to resume elsewhere. Not the device's fault.
    Preempted,
    /// The request itself is wrong (context too long, bad token); replaying cannot help.
    Invalid,
    Internal,
    /// The device takes no requests now (breaker open, paused from settings, worker
    /// restarting): set by the router, never sent by a worker.
    Unavailable,
}

impl FailureKind {
    /// Failures the circuit breaker counts against the device.
    pub fn is_device_failure(self) -> bool {
        matches!(self, Self::Oom | Self::DeviceLost)
    }
}

/// What a worker knows about its memory. Fields a device cannot read are `None`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryReading {
    pub device: String,
    pub simulated: bool,
    /// Device memory: VRAM (sim: the simulated capacity), or host RAM for the CPU worker.
    pub capacity_bytes: Option<u64>,
    pub used_bytes: Option<u64>,
    /// Held by the model's weights.
    pub weights_bytes: u64,
    /// Weights a GPU worker holds in host RAM: a split model's CPU part (embedding, first
    /// layers, head). 0 otherwise.
    #[serde(default)]
    pub host_weights_bytes: u64,
    /// Held by admitted requests' reservations.
    pub reserved_bytes: u64,
    /// Held by a (simulated) competing program.
    pub competing_bytes: u64,
    /// burn/cubecl allocator's reading on CUDA.
    pub allocator_bytes: Option<u64>,
    pub gpu: Option<GpuMemory>,
    pub host: Option<HostMemory>,
    /// The CPU engine's prefix cache: blocks and bytes it keeps beyond the running requests'
    /// reservations, and its hits.
    #[serde(default)]
    pub prefix_cache: Option<headroom_model::cpu::PrefixStats>,
    /// KV blocks alive now, in bytes: on the CPU the engine's (running requests' and the prefix
    /// cache's, a shared block once), on the sim GPU the running requests' blocks written so
    /// far. What the requests' reservations hold in fact.
    #[serde(default)]
    pub kv_resident_bytes: Option<u64>,
    /// Requests preempted since the worker started: under KV overcommit the device had no
    /// block left for an older request (each resumed elsewhere).
    #[serde(default)]
    pub preemptions: u64,
    /// The VRAM the worker itself keeps free when its requests take KV blocks (the sim GPU
    /// under overcommit: the reserve it was launched with or last told).
    #[serde(default)]
    pub kept_free_bytes: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("the other side closed the stream")]
    Closed,
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")]
    TooLarge(usize),
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("malformed frame: {0}")]
    Json(#[from] serde_json::Error),
}

/// Encodes one message as a frame.
pub fn encode_frame<T: Serialize>(message: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(message)?;
    if body.len() > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    Ok(frame)
}

/// Decodes a frame body (without its length prefix).
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    Ok(serde_json::from_slice(body)?)
}

/// Checks a frame length prefix.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge(len));
    }
    Ok(len)
}

pub fn write_frame<T: Serialize>(out: &mut impl Write, message: &T) -> Result<(), FrameError> {
    out.write_all(&encode_frame(message)?)?;
    out.flush()?;
    Ok(())
}

pub fn read_frame<T: DeserializeOwned>(input: &mut impl Read) -> Result<T, FrameError> {
    let mut prefix = [0u8; 4];
    match input.read_exact(&mut prefix) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Err(FrameError::Closed),
        Err(e) => return Err(e.into()),
    }
    let mut body = vec![0u8; frame_len(prefix)?];
    input.read_exact(&mut body)?;
    decode_body(&body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_reject_oversize() {
        let messages = vec![
            ToWorker::Health { nonce: 7 },
            ToWorker::Fault { fault: Fault::Reset { after_tokens: Some(3) } },
            ToWorker::Load { model_dir: "/m".into() },
        ];
        let mut buf = Vec::new();
        for m in &messages {
            write_frame(&mut buf, m).unwrap();
        }
        let mut reader = &buf[..];
        for m in &messages {
            let got: ToWorker = read_frame(&mut reader).unwrap();
            assert_eq!(&got, m);
        }
        assert!(matches!(read_frame::<ToWorker>(&mut reader), Err(FrameError::Closed)));
        let huge = ((MAX_FRAME_BYTES + 1) as u32).to_be_bytes();
        assert!(matches!(read_frame::<ToWorker>(&mut &huge[..]), Err(FrameError::TooLarge(_))));
    }
}
