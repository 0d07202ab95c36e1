//! `headroom pressure`: the memory-pressure harness. It drives a real `headroom serve` (real
//! HTTP clients, real worker processes) through traffic and injected faults while the GPU's
//! free memory shrinks, and checks the central claim: every accepted request survives, visibly,
//! once. It writes `report.json` and a self-contained `report.html`; the exit code enforces the
//! pass criteria.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::ValueEnum;
use futures_util::StreamExt;
use headroom_memory::footprint::{ModelShape, RequestShape, MIB};
use headroom_memory::MemoryConfig;
use headroom_model::{ChatMessage, GenerateRequest, ModelBundle, SamplingParams};
use serde::Serialize;
use serde_json::{json, Value};
use tokio::io::AsyncBufReadExt;

use crate::pressure_report;
use headroom_server::sse::complete_sse_data;

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Profile {
    /// Small counts: runs in `.ci/run` (under 5 minutes on 2 cores).
    Ci,
    /// More requests, more concurrency, longer generations.
    Full,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PressureGpu {
    /// The simulated GPU: every fault can be injected.
    Sim,
    /// A real CUDA GPU: kill -9 and real memory pressure only (no injected OOMs).
    Cuda,
}

#[derive(clap::Args, Debug)]
pub struct PressureArgs {
    #[arg(long, value_enum, default_value_t = Profile::Ci)]
    pub profile: Profile,
    #[arg(long, value_enum, default_value_t = PressureGpu::Sim)]
    pub gpu: PressureGpu,
    /// Where report.json, report.html and the servers' logs go.
    #[arg(long, default_value = "pressure-report")]
    pub out: PathBuf,
    /// `default` (SmolLM2-135M-Instruct, Q4_1), a .gguf file, a Hugging Face folder, or the name of a
    /// model in the models folder (`kjv-demo`: the 4M-parameter test fixture).
    #[arg(long, default_value = "default")]
    pub model: String,
    /// Run a negative control instead: the agent scenario against a server with a fixed
    /// defect switched back on. The run must report the defect and fail.
    #[arg(long, value_enum)]
    pub control: Option<NegativeControl>,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NegativeControl {
    /// The server ignores Idempotency-Key: an agent's retry after a lost response runs the
    /// request again and delivers a second tool call.
    IdempotencyOff,
    /// Admission on a GPU shared by several models counts each model alone (the several-models
    /// scenario only): two models' weights end up on a GPU that holds one.
    GpuShareIgnored,
}

/// How much traffic a profile sends.
#[derive(Debug, Clone, Copy, Serialize)]
struct Scale {
    per_scenario: usize,
    concurrent: usize,
    /// Requests sent for each fault at full load: the GPU's slots full, the rest queued.
    full_load: usize,
    max_tokens: u32,
    long_prompt_tokens: usize,
    resets: usize,
    squeeze_steps: usize,
    agent_tasks: usize,
    /// Pass thresholds: the share of accepted requests that completed, the share of CPU runs
    /// whose greedy text matches the GPU's (same bundle), and the p95 latency of any scenario.
    min_success_percent: f64,
    min_identical_percent: f64,
    max_p95_ms: f64,
}

impl Profile {
    fn scale(self) -> Scale {
        match self {
            Profile::Ci => Scale {
                per_scenario: 3,
                concurrent: 6,
                full_load: 8,
                max_tokens: 16,
                long_prompt_tokens: 600,
                resets: 1,
                squeeze_steps: 4,
                agent_tasks: 5,
                min_success_percent: 100.0,
                min_identical_percent: 95.0,
                max_p95_ms: 60_000.0,
            },
            Profile::Full => Scale {
                per_scenario: 12,
                concurrent: 24,
                full_load: 16,
                max_tokens: 48,
                long_prompt_tokens: 900,
                resets: 3,
                squeeze_steps: 6,
                agent_tasks: 12,
                min_success_percent: 100.0,
                min_identical_percent: 95.0,
                max_p95_ms: 120_000.0,
            },
        }
    }
}

const VERSES: [&str; 8] = [
    "In the beginning God created the heaven and the earth.",
    "The LORD is my shepherd; I shall not want.",
    "And God said, Let there be light: and there was light.",
    "Blessed are the meek: for they shall inherit the earth.",
    "For God so loved the world, that he gave his only begotten Son,",
    "To every thing there is a season, and a time to every purpose under the heaven:",
    "Ask, and it shall be given you; seek, and ye shall find;",
    "Now faith is the substance of things hoped for, the evidence of things not seen.",
];

/// Milliseconds since the harness started (every time in the report uses this clock).
#[derive(Clone)]
struct Clock(Instant);

impl Clock {
    fn ms(&self) -> f64 {
        self.0.elapsed().as_secs_f64() * 1000.0
    }
}

/// One `headroom serve` child process on a loopback port it picked itself.
struct Server {
    child: tokio::process::Child,
    base: String,
    model_id: String,
    http: reqwest::Client,
}

impl Server {
    async fn start(model_dir: &Path, gpu: PressureGpu, sizing: Option<&Sizing>, dir: &Path, env: &[(&str, &str)]) -> Result<Self> {
        Self::start_with(model_dir, gpu, sizing, dir, env, "").await
    }

    /// The same, with `extra` appended to its config file (`[[models]]`).
    async fn start_with(model_dir: &Path, gpu: PressureGpu, sizing: Option<&Sizing>, dir: &Path, env: &[(&str, &str)], extra: &str) -> Result<Self> {
        std::fs::create_dir_all(dir)?;
        let config = dir.join("headroom.toml");
        // Short queue waits and a small canary keep a CI run fast; everything else is default.
        let mut toml = String::from("[memory]\nmax_queue_wait_ms = 2000\n");
        if let Some(s) = sizing {
            // The GPU is sized to hold the whole model and one short request: the layer plan
            // guarantees that request's context, so it places every layer on the GPU.
            toml.push_str(&format!("vram_reserve_mib = {}\nsplit_min_context_tokens = {}\n", s.reserve_mib, s.short_request_tokens));
        }
        toml.push_str("\n[queues]\ngpu_queue_capacity = 64\ncpu_queue_capacity = 64\n\n[supervision]\nhealth_interval_ms = 500\nprobe_canary_mib = 1\n");
        toml.push_str(extra);
        std::fs::write(&config, toml)?;
        let log = std::fs::File::create(dir.join("serve.log"))?;
        let mut cmd = tokio::process::Command::new(std::env::current_exe()?);
        cmd.arg("serve").arg("--port").arg("0").arg("--model").arg(model_dir).arg("--config").arg(&config).arg("--data-dir").arg(dir.join("data"));
        match gpu {
            PressureGpu::Sim => {
                cmd.args(["--gpu", "sim", "--sim-vram-mib"]).arg(sizing.map(|s| s.sim_vram_mib).unwrap_or(2048).to_string());
            }
            PressureGpu::Cuda => {
                cmd.args(["--gpu", "cuda"]);
            }
        }
        cmd.env_remove("HEADROOM_CONFIG").env_remove("HEADROOM_PORT").env_remove("HEADROOM_API_KEY");
        cmd.envs(env.iter().copied());
        cmd.stdout(Stdio::piped()).stderr(log).kill_on_drop(true);
        let mut child = cmd.spawn().context("cannot start headroom serve")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let base = tokio::time::timeout(Duration::from_secs(300), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(rest) = line.split(" at http://").nth(1) {
                    let addr = rest.split_whitespace().next().unwrap_or_default();
                    return Ok::<_, anyhow::Error>(format!("http://{addr}"));
                }
            }
            bail!("headroom serve exited before it listened; see {}", dir.join("serve.log").display())
        })
        .await
        .context("headroom serve did not start within 300 s")??;
        // Keep draining stdout so the child never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        let http = reqwest::Client::builder().pool_max_idle_per_host(0).build()?;
        let models: Value = http.get(format!("{base}/v1/models")).send().await?.json().await?;
        let model_id = models["data"][0]["id"].as_str().context("GET /v1/models named no model")?.to_string();
        Ok(Self { child, base, model_id, http })
    }

    async fn status(&self) -> Result<Value> {
        Ok(self.http.get(format!("{}/v1/status", self.base)).timeout(Duration::from_secs(10)).send().await?.json().await?)
    }

    async fn fault(&self, fault: Value) -> Result<()> {
        let r = self.http.post(format!("{}/admin/sim/fault", self.base)).json(&fault).send().await?;
        if !r.status().is_success() {
            bail!("fault {fault} was refused: {}", r.text().await.unwrap_or_default());
        }
        Ok(())
    }

    /// The GPU worker as /v1/status shows it: (pid, ready with a closed breaker).
    async fn gpu_worker(&self) -> Result<(Option<u32>, bool)> {
        let s = self.status().await?;
        let gpu = s["workers"].as_array().and_then(|w| w.iter().find(|w| w["kind"] == "gpu")).cloned().unwrap_or(Value::Null);
        Ok((gpu["pid"].as_u64().map(|p| p as u32), gpu["state"] == "ready" && s["breaker"] == "closed"))
    }

    /// Kills the GPU worker with SIGKILL and waits until the router has seen it die (until
    /// then its status still shows it ready); returns its pid.
    async fn kill_gpu_worker(&self) -> Result<u32> {
        let pid = self.gpu_worker().await?.0.context("no GPU worker to kill")?;
        send_signal(pid, "KILL")?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.gpu_worker().await?.0 == Some(pid) {
            if Instant::now() > deadline {
                bail!("the router did not notice the GPU worker {pid} die within 10 s");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Ok(pid)
    }

    /// Admission reads the GPU worker's memory samples: waits until one shows the competitor.
    async fn wait_competing(&self, bytes: u64) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.status().await?["memory"]["gpu"]["competing_bytes"].as_u64() != Some(bytes) {
            if Instant::now() > deadline {
                bail!("the GPU worker's memory samples never showed a {bytes}-byte competitor");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Waits until the GPU worker is up with a closed breaker; returns how long that took.
    async fn wait_gpu_restored(&self, clock: &Clock, timeout: Duration) -> Result<f64> {
        let start = clock.ms();
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok((Some(_), true)) = self.gpu_worker().await {
                return Ok(clock.ms() - start);
            }
            if Instant::now() > deadline {
                bail!("the GPU worker was not restored within {} s", timeout.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = send_signal(pid, "TERM");
        }
        if tokio::time::timeout(Duration::from_secs(20), self.child.wait()).await.is_err() {
            let _ = self.child.kill().await;
        }
    }
}

/// Requests a GPU worker runs at once: the worker's default `max_concurrency`, which the
/// harness leaves as it is (checked against the server's status).
const GPU_SLOTS: u64 = 4;

/// Sim capacity and reserve chosen from the same planner the server uses, so that short
/// requests fit on the GPU and a long prompt never does.
#[derive(Debug, Clone, Serialize)]
struct Sizing {
    sim_vram_mib: u64,
    reserve_mib: u64,
    /// What requests may hold on the GPU: capacity − reserve − weights.
    room_mib: f64,
    weights_mib: f64,
    short_request_mib: f64,
    long_request_mib: f64,
    /// Prompt and max_tokens of the longest short request.
    short_request_tokens: u64,
}

fn plan_sizing(bundle: &ModelBundle, short_tokens: usize, long_tokens: usize, max_tokens: u32) -> Result<Sizing> {
    let (planner, _) = headroom_memory::planner_for(bundle, "cpu", MemoryConfig::default());
    let chunk = GenerateRequest::new(vec![], 1, SamplingParams::default()).prefill_chunk as u64;
    let bytes = |prompt: usize| planner.footprint(RequestShape { prompt_tokens: prompt as u64, max_tokens: max_tokens as u64, prefill_chunk: chunk }).request_bytes();
    let (short, long) = (bytes(short_tokens), bytes(long_tokens));
    let weights = ModelShape::from_config(&bundle.config).weights_bytes();
    // The router gives requests capacity − reserve − weights. That room holds the GPU's slots
    // of short requests and one more waiting for a slot: admission grants a request its memory
    // before it queues for a slot, so without it the next request goes to the CPU and the slots
    // never fill with requests queued behind them. Aim between a short and a long one where
    // that is more.
    let reserve_mib = 64;
    let full = (GPU_SLOTS + 1) * short;
    let sim_vram_mib = (weights + full).div_ceil(MIB).max((weights + (short + long) / 2) / MIB) + reserve_mib;
    let room = (sim_vram_mib - reserve_mib) * MIB - weights;
    if room < full || room >= long {
        bail!(
            "a {long_tokens}-token prompt needs {:.1} MiB and {} short ones {:.1} MiB: too close to size a GPU (in whole MiB) that holds the short ones and not the long one; use a model whose KV cache grows faster",
            long as f64 / MIB as f64,
            GPU_SLOTS + 1,
            full as f64 / MIB as f64
        );
    }
    Ok(Sizing {
        sim_vram_mib,
        reserve_mib,
        room_mib: room as f64 / MIB as f64,
        weights_mib: weights as f64 / MIB as f64,
        short_request_mib: short as f64 / MIB as f64,
        long_request_mib: long as f64 / MIB as f64,
        short_request_tokens: short_tokens as u64 + max_tokens as u64,
    })
}

/// A sim GPU that holds the model only split: the smallest whole-MiB capacity at which the
/// server's layer plan (same reserve and guaranteed context as `sizing`) puts at least half the
/// layers, but not all, on it. Returns it and the layer count the plan chooses.
/// The layer plan the split server makes (its reserve, its guaranteed context of one short
/// request) for `usable` bytes of VRAM after the reserve.
fn split_plan(bundle: &ModelBundle, sizing: &Sizing, usable: u64) -> Result<headroom_memory::SplitPlan> {
    let config = MemoryConfig { vram_reserve_mib: Some(sizing.reserve_mib), split_min_context_tokens: sizing.short_request_tokens, ..MemoryConfig::default() };
    let chunk = GenerateRequest::new(vec![], 1, SamplingParams::default()).prefill_chunk as u64;
    headroom_memory::plan_model_split(bundle, "sim", &config, usable, 1, chunk, Default::default()).map_err(anyhow::Error::msg)
}

fn split_sizing(bundle: &ModelBundle, sizing: &Sizing) -> Result<(Sizing, u32)> {
    let layers = bundle.config.num_hidden_layers as u32;
    for mib in sizing.reserve_mib + 1..=sizing.sim_vram_mib {
        let usable = (mib - sizing.reserve_mib) * MIB;
        let plan = split_plan(bundle, sizing, usable)?;
        if plan.gpu_layers >= (layers / 2).max(1) && plan.gpu_layers < layers {
            let room = usable.saturating_sub(plan.gpu_weights_bytes) as f64 / MIB as f64;
            let weights = plan.gpu_weights_bytes as f64 / MIB as f64;
            return Ok((Sizing { sim_vram_mib: mib, room_mib: room, weights_mib: weights, ..sizing.clone() }, plan.gpu_layers));
        }
    }
    bail!("no whole-MiB sim GPU holds {} split with at least half its {layers} layers (each layer is too small); use a model with larger layers", bundle.name())
}

/// The competitor that makes the split server's next GPU worker launch plan fewer layers but
/// not none: the smallest in whole MiB, with the layer count the plan then gives.
fn shrink_competitor(bundle: &ModelBundle, split: &Sizing, gpu_layers: u32) -> Result<Option<(u64, u32)>> {
    for mib in 1..split.sim_vram_mib.saturating_sub(split.reserve_mib) {
        let plan = split_plan(bundle, split, (split.sim_vram_mib - split.reserve_mib - mib) * MIB)?;
        if plan.gpu_layers < gpu_layers {
            return Ok((plan.gpu_layers > 0).then_some((mib, plan.gpu_layers)));
        }
    }
    Ok(None)
}

/// The ratio the overcommit scenario runs at, and its requests' max_tokens: long enough that
/// they write well past a quarter of their blocks.
const OVERCOMMIT: f64 = 4.0;
const OVERCOMMIT_TOKENS: u32 = 96;

/// A sim GPU for the KV-overcommit scenario: room (after weights and the reserve) for the
/// reservations of `slots` short requests under [`OVERCOMMIT`], one more waiting for a slot
/// (admission grants a request's memory before it queues for a slot: without it the next
/// request goes to the CPU and the slots never fill with requests queued behind them), and
/// about one block more (whole MiB), so the pool runs dry as the running ones write past their
/// reservations. None where the MiB rounding leaves room for all of their blocks (the pool
/// could not run dry).
fn overcommit_sizing(bundle: &ModelBundle, sizing: &Sizing, short_tokens: usize, slots: u64) -> Option<Sizing> {
    let memory = MemoryConfig { vram_reserve_mib: Some(sizing.reserve_mib), kv_overcommit: OVERCOMMIT, ..MemoryConfig::default() };
    let (planner, _) = headroom_memory::planner_for(bundle, "cpu", memory);
    let chunk = GenerateRequest::new(vec![], 1, SamplingParams::default()).prefill_chunk as u64;
    let footprint = planner.footprint(RequestShape { prompt_tokens: short_tokens as u64, max_tokens: OVERCOMMIT_TOKENS as u64, prefill_chunk: chunk });
    let block = planner.kv_block_bytes();
    let weights = ModelShape::from_config(&bundle.config).weights_bytes();
    let reserved = (slots + 1) * footprint.request_bytes();
    let sim_vram_mib = (weights + reserved + block).div_ceil(MIB) + sizing.reserve_mib;
    let spare = (sim_vram_mib - sizing.reserve_mib) * MIB - weights - reserved;
    let growth = slots * (footprint.tokens.div_ceil(16) - footprint.kv_tokens.div_ceil(16)) * block;
    // The request waiting for a slot holds no blocks yet: the running ones may write into its
    // reservation too.
    (spare + footprint.request_bytes() < growth).then(|| Sizing {
        sim_vram_mib,
        room_mib: (reserved + spare) as f64 / MIB as f64,
        short_request_mib: footprint.request_bytes() as f64 / MIB as f64,
        ..sizing.clone()
    })
}

/// Runs `work` while sampling the GPU memory Headroom holds on `server` (in use less a
/// competing program) every 50 ms; gives its output and the peak in MiB.
async fn with_vram_peak<T>(server: &Server, work: impl std::future::Future<Output = T>) -> (T, f64) {
    let held = |s: &Value| {
        let gpu = &s["memory"]["gpu"];
        gpu["used_bytes"].as_f64().map(|used| (used - gpu["competing_bytes"].as_f64().unwrap_or(0.0)) / MIB as f64)
    };
    with_status_peak(server, held, work).await
}

/// Runs `work` while reading `server`'s `/v1/status` every 50 ms; gives its output and the
/// largest `measure` (MiB) of the samples.
async fn with_status_peak<T>(server: &Server, measure: impl Fn(&Value) -> Option<f64>, work: impl std::future::Future<Output = T>) -> (T, f64) {
    tokio::pin!(work);
    let mut peak = 0.0f64;
    loop {
        tokio::select! {
            out = &mut work => return (out, peak),
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                if let Some(mib) = server.status().await.ok().as_ref().and_then(&measure) {
                    peak = peak.max(mib);
                }
            }
        }
    }
}

/// One request the harness sends.
#[derive(Clone)]
struct Shot {
    scenario: &'static str,
    /// `short`, `long` (chats), or `embedding` (`/v1/embeddings` of one verse).
    class: &'static str,
    fault: &'static str,
    stream: bool,
    /// Which prompt (for token equivalence: same prompt, same max_tokens, greedy).
    prompt_key: String,
    body: Value,
    idempotency_key: Option<String>,
    /// Streams: hang up after this many content chunks (client disconnect).
    disconnect_after_chunks: Option<usize>,
    /// Hang up if no full answer by then (a client timeout; non-streaming disconnect).
    client_timeout: Option<Duration>,
}

/// What happened to one request, as its client and then the journal saw it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Record {
    pub scenario: String,
    pub class: String,
    pub fault: String,
    pub stream: bool,
    pub prompt_key: String,
    pub sent_at_ms: f64,
    pub latency_ms: f64,
    /// HTTP status (0: the connection failed or the client hung up).
    pub status: u16,
    /// The service took responsibility for it (not a 4xx, not a capacity refusal).
    pub accepted: bool,
    /// Refused up front with a capacity error (503 + Retry-After): honest, not lost.
    pub refused: bool,
    /// The client hung up or cancelled on purpose.
    pub intended_cancel: bool,
    pub completed: bool,
    pub request_id: Option<String>,
    pub device: Option<String>,
    /// `X-Headroom-Split` (GPU layers / layers) when the GPU worker ran the model split.
    pub split: Option<String>,
    pub degraded: bool,
    /// The client was told: header, body field or stream notice.
    pub degraded_marked: bool,
    pub failovers: usize,
    pub queued_ms: Option<f64>,
    pub first_token_ms: Option<f64>,
    pub text: String,
    pub error: Option<String>,
    pub journal_state: Option<String>,
    /// The queue admission put it in first (gpu or cpu).
    pub queued_on: Option<String>,
    /// From the journal, ms after acceptance: the first failed attempt, what the router did,
    /// and when the CPU attempt started.
    pub first_failure_ms: Option<f64>,
    pub retry_decision: Option<String>,
    pub cpu_start_ms: Option<f64>,
    pub lost: bool,
}

impl Record {
    fn degraded_unmarked(&self) -> bool {
        self.completed && self.degraded && !self.degraded_marked
    }
}

fn chat_body(model: &str, prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 7,
        "ignore_eos": true,
        "stream": stream,
    })
}

fn request_id_in(message: &str) -> Option<String> {
    let rest = message.split("(request ").nth(1)?;
    Some(rest.split(|c: char| c == ';' || c == ')' || c.is_whitespace()).next()?.to_string())
}

/// Sends one request as a real client would and records what it saw.
async fn send(server: &Server, clock: &Clock, shot: Shot, started: Option<tokio::sync::oneshot::Sender<String>>) -> Record {
    let mut record = Record {
        scenario: shot.scenario.into(),
        class: shot.class.into(),
        fault: shot.fault.into(),
        stream: shot.stream,
        prompt_key: shot.prompt_key.clone(),
        sent_at_ms: clock.ms(),
        ..Default::default()
    };
    let t0 = Instant::now();
    let path = if shot.class == "embedding" { "/v1/embeddings" } else { "/v1/chat/completions" };
    let mut req = server.http.post(format!("{}{path}", server.base)).json(&shot.body);
    if let Some(k) = &shot.idempotency_key {
        req = req.header("Idempotency-Key", k);
    }
    let exchange = async {
        let response = req.send().await?;
        record.status = response.status().as_u16();
        let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_string);
        record.request_id = header("x-request-id");
        record.device = header("x-headroom-device");
        record.split = header("x-headroom-split");
        let header_degraded = header("x-headroom-degraded").as_deref() == Some("true");
        if !response.status().is_success() {
            let body: Value = response.json().await.unwrap_or(Value::Null);
            let message = body["error"]["message"].as_str().unwrap_or_default().to_string();
            record.refused = record.status == 503 && body["error"]["type"] == "capacity_error";
            record.accepted = !record.refused && record.status >= 500 || record.status == 409;
            record.request_id = request_id_in(&message).or(record.request_id.take());
            record.error = Some(format!("{}: {message}", record.status));
            return Ok::<_, anyhow::Error>(());
        }
        record.accepted = true;
        if !shot.stream {
            let body: Value = response.json().await?;
            // An embedding's `headroom` object rides on its item.
            let embedding = &body["data"][0];
            let h = if shot.class == "embedding" { &embedding["headroom"] } else { &body["headroom"] };
            record.request_id = h["request_id"].as_str().map(str::to_string).or(record.request_id.take());
            record.device = h["device"].as_str().map(str::to_string);
            record.degraded = h["degraded"] == true;
            // Marked: the header says so, and the body says in plain words what it means.
            record.degraded_marked = header_degraded && record.degraded && h["degraded_summary"].as_str().is_some_and(|s| !s.is_empty());
            record.failovers = h["failovers"].as_array().map(Vec::len).unwrap_or(0);
            record.queued_ms = h["queued_ms"].as_f64();
            if shot.class == "embedding" {
                record.completed = embedding["embedding"].as_array().is_some_and(|v| !v.is_empty() && v.iter().all(Value::is_f64));
                return Ok(());
            }
            record.text = body["choices"][0]["message"]["content"].as_str().unwrap_or_default().to_string();
            record.completed = body["choices"][0]["finish_reason"].is_string();
            return Ok(());
        }
        let mut started = started;
        let mut stream = response.bytes_stream();
        let mut buffer = Vec::<u8>::new();
        let mut chunks = 0usize;
        let mut marked = false;
        let mut summarized = false;
        while let Some(piece) = stream.next().await {
            buffer.extend_from_slice(&piece?);
            for data in complete_sse_data(&mut buffer) {
                if data == "[DONE]" {
                    continue;
                }
                let chunk: Value = serde_json::from_str(&data)?;
                if let Some(e) = chunk.get("error") {
                    record.error = Some(e["message"].as_str().unwrap_or("stream error").to_string());
                    continue;
                }
                let h = &chunk["headroom"];
                if let Some(id) = h["request_id"].as_str() {
                    record.request_id = Some(id.to_string());
                    if let Some(tx) = started.take() {
                        let _ = tx.send(id.to_string());
                    }
                }
                if h["degraded"] == true || h["notice"].is_string() {
                    marked = true;
                }
                if let Some(d) = h["device"].as_str() {
                    record.device = Some(d.to_string());
                }
                if h["failovers"].is_array() {
                    // The last chunk carries the whole `headroom` object.
                    record.degraded = h["degraded"] == true;
                    summarized = h["degraded_summary"].as_str().is_some_and(|s| !s.is_empty());
                    record.failovers = h["failovers"].as_array().map(Vec::len).unwrap_or(0);
                    record.queued_ms = h["queued_ms"].as_f64();
                }
                let choice = &chunk["choices"][0];
                if let Some(t) = choice["delta"]["content"].as_str().filter(|t| !t.is_empty()) {
                    record.first_token_ms.get_or_insert(t0.elapsed().as_secs_f64() * 1000.0);
                    record.text.push_str(t);
                    chunks += 1;
                    if shot.disconnect_after_chunks.is_some_and(|n| chunks >= n) {
                        record.intended_cancel = true;
                        return Ok(()); // dropping the stream hangs up
                    }
                }
                if choice["finish_reason"].is_string() {
                    record.completed = record.error.is_none();
                }
            }
        }
        record.degraded_marked = marked && summarized && record.degraded;
        Ok(())
    };
    let result = match shot.client_timeout {
        Some(limit) => match tokio::time::timeout(limit, exchange).await {
            Ok(r) => r,
            Err(_) => {
                record.intended_cancel = true;
                Ok(())
            }
        },
        None => exchange.await,
    };
    if let Err(e) = result {
        record.error = Some(format!("transport: {e}"));
        // Whether it was accepted is for the journal to say (below); assume the worst.
        record.accepted = true;
    }
    record.latency_ms = t0.elapsed().as_secs_f64() * 1000.0;
    record
}

/// A plain client that hung up never learnt its request's id: asking again with the same
/// Idempotency-Key shows how the request ended (a 409 `request_cancelled`, or the stored answer)
/// without running it twice.
async fn end_by_key(server: &Server, record: &mut Record, key: &str, body: &Value) {
    // The server notices the hang-up and cancels a moment later.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let again = server.http.post(format!("{}/v1/chat/completions", server.base)).header("Idempotency-Key", key).json(body).send().await;
    let Ok(again) = again else { return };
    let answer: Value = again.json().await.unwrap_or(Value::Null);
    let cancelled = answer["error"]["code"] == "request_cancelled";
    let completed = answer["choices"].is_array();
    record.journal_state = Some(if cancelled { "cancelled".into() } else if completed { "completed".into() } else { answer["error"]["code"].as_str().unwrap_or("unknown").to_string() });
    record.request_id = None; // checked here, not by id
    record.lost = !cancelled && !completed;
}

/// Fills in what the journal knows about each accepted request, and whether it was lost.
async fn reconcile(server: &Server, records: &mut [Record]) {
    for r in records.iter_mut() {
        let Some(id) = r.request_id.clone() else {
            r.lost |= r.accepted && !r.intended_cancel && !r.completed;
            continue;
        };
        // A cancelled or dropped request ends a moment after its client leaves.
        let mut journal = Value::Null;
        for _ in 0..100 {
            journal = match server.http.get(format!("{}/v1/requests/{id}", server.base)).send().await {
                Ok(resp) if resp.status().is_success() => resp.json().await.unwrap_or(Value::Null),
                _ => Value::Null,
            };
            let state = journal["state"].as_str().unwrap_or_default();
            if ["completed", "failed", "cancelled", "refused"].contains(&state) || journal.is_null() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        r.journal_state = journal["state"].as_str().map(str::to_string);
        let accepted_at = journal["accepted_unix_ms"].as_f64().unwrap_or(0.0);
        for record in journal["transitions"].as_array().into_iter().flatten() {
            let at = record["at_unix_ms"].as_f64().unwrap_or(0.0) - accepted_at;
            let t = &record["transition"];
            let kind = t["transition"].as_str().unwrap_or_default();
            match kind {
                "queued" if r.queued_on.is_none() => r.queued_on = t["device"].as_str().map(str::to_string),
                "attempt_failed" if r.first_failure_ms.is_none() => r.first_failure_ms = Some(at),
                "replayed" | "resumed" if r.retry_decision.is_none() => {
                    r.retry_decision = Some(format!("{kind} on {}", t["to"].as_str().unwrap_or("?")));
                    if t["to"] == "cpu" {
                        r.cpu_start_ms.get_or_insert(at);
                    }
                }
                "running" if t["device"] == "cpu" => {
                    r.cpu_start_ms.get_or_insert(at);
                }
                _ => {}
            }
        }
        let ended_well = match r.journal_state.as_deref() {
            Some("completed") => r.completed || r.intended_cancel,
            Some("cancelled") => r.intended_cancel,
            Some("refused") => r.refused,
            _ => false,
        };
        r.lost = r.accepted && !ended_well;
    }
}

/// A fault or environment change, for the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct Marker {
    pub at_ms: f64,
    pub label: String,
}

/// A memory sample: GPU from the worker's readings (service events), host from the OS.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Sample {
    pub at_ms: f64,
    pub vram_capacity_mib: Option<f64>,
    pub vram_used_mib: Option<f64>,
    pub vram_reserved_mib: Option<f64>,
    pub vram_competing_mib: Option<f64>,
    pub host_used_mib: Option<f64>,
    /// Resident memory of the server and its workers together.
    pub headroom_rss_mib: Option<f64>,
    pub queue_waiting: Option<u64>,
}

#[derive(Default)]
struct Timeline {
    samples: Vec<Sample>,
    markers: Vec<Marker>,
    /// (at, from, to) from the event stream.
    breaker: Vec<(f64, String, String)>,
}

type SharedTimeline = Arc<Mutex<Timeline>>;

fn mark(timeline: &SharedTimeline, clock: &Clock, label: impl Into<String>) {
    timeline.lock().unwrap().markers.push(Marker { at_ms: clock.ms(), label: label.into() });
}

fn rss_mib(pid: u32) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: f64 = status.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// Samples memory and queues every 200 ms and follows `/v1/events` until `stop` fires.
fn watch(server: &Server, server_pid: u32, clock: Clock, timeline: SharedTimeline, stop: tokio::sync::watch::Receiver<bool>) -> Vec<tokio::task::JoinHandle<()>> {
    let (http, base) = (server.http.clone(), server.base.clone());
    let (t1, c1, mut s1) = (timeline.clone(), clock.clone(), stop.clone());
    let poll = tokio::spawn(async move {
        let mib = |v: &Value| v.as_f64().map(|b| b / MIB as f64);
        loop {
            if let Ok(status) = async { http.get(format!("{base}/v1/status")).timeout(Duration::from_secs(5)).send().await?.json::<Value>().await }.await {
                let gpu = &status["memory"]["gpu"];
                let host = &status["memory"]["host"];
                let pids = std::iter::once(server_pid).chain(status["workers"].as_array().into_iter().flatten().filter_map(|w| w["pid"].as_u64().map(|p| p as u32)));
                let rss: f64 = pids.filter_map(rss_mib).sum();
                let waiting = status["queues"].as_array().map(|q| q.iter().filter_map(|q| q["waiting"].as_u64()).sum());
                t1.lock().unwrap().samples.push(Sample {
                    at_ms: c1.ms(),
                    vram_capacity_mib: mib(&gpu["capacity_bytes"]),
                    vram_used_mib: mib(&gpu["used_bytes"]),
                    vram_reserved_mib: mib(&gpu["reserved_bytes"]),
                    vram_competing_mib: mib(&gpu["competing_bytes"]),
                    host_used_mib: host["total_bytes"].as_f64().zip(host["available_bytes"].as_f64()).map(|(t, a)| (t - a) / MIB as f64),
                    headroom_rss_mib: Some(rss),
                    queue_waiting: waiting,
                });
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                _ = s1.changed() => return,
            }
        }
    });
    let (http, base) = (server.http.clone(), server.base.clone());
    let (t2, c2, mut s2) = (timeline, clock, stop);
    let events = tokio::spawn(async move {
        let Ok(response) = http.get(format!("{base}/v1/events")).send().await else { return };
        let mut stream = response.bytes_stream();
        let mut buffer = Vec::<u8>::new();
        loop {
            let piece = tokio::select! {
                p = stream.next() => p,
                _ = s2.changed() => return,
            };
            let Some(Ok(piece)) = piece else { return };
            buffer.extend_from_slice(&piece);
            for data in complete_sse_data(&mut buffer) {
                let Ok(v) = serde_json::from_str::<Value>(&data) else { continue };
                if v["event"] == "breaker_changed" {
                    let s = |k: &str| v[k].as_str().unwrap_or_default().to_string();
                    t2.lock().unwrap().breaker.push((c2.ms(), s("from"), s("to")));
                }
            }
        }
    });
    vec![poll, events]
}

/// Runs shots `parallel` at a time.
async fn run_all(server: &Server, clock: &Clock, shots: Vec<Shot>, parallel: usize) -> Vec<Record> {
    let results = futures_util::stream::iter(shots.into_iter().map(|s| send(server, clock, s, None)))
        .buffered(parallel.max(1))
        .collect::<Vec<_>>()
        .await;
    results
}

/// Sends `shots` all at once and fires a fault while the GPU's slots are full and requests
/// wait behind them: at least one request running on the GPU and at least one waiting for a
/// GPU slot. Returns every request's record and when the fault fired.
async fn at_full_load<F, Fut>(server: &Server, clock: &Clock, timeline: &SharedTimeline, label: String, shots: Vec<Shot>, fire: F) -> Result<(Vec<Record>, f64)>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let n = shots.len();
    let sending = run_all(server, clock, shots, n);
    let firing = async {
        let deadline = Instant::now() + Duration::from_secs(30);
        let gpu = loop {
            let s = server.status().await?;
            let gpu = s["queues"].as_array().into_iter().flatten().find(|q| q["device"] == "gpu").cloned().unwrap_or(Value::Null);
            if gpu["running"].as_u64().unwrap_or(0) >= 1 && gpu["waiting"].as_u64().unwrap_or(0) >= 1 {
                break gpu;
            }
            if Instant::now() > deadline {
                bail!("the GPU's slots never filled with requests queued behind them within 30 s ({gpu})");
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        mark(timeline, clock, format!("{label}: {} running and {} waiting on the GPU", gpu["running"], gpu["waiting"]));
        let at = clock.ms();
        fire().await?;
        Ok::<_, anyhow::Error>(at)
    };
    let (records, fired_at) = tokio::join!(sending, firing);
    Ok((records, fired_at?))
}

/// Waits until a queue shows at least `running` requests running on `device` (gpu or cpu).
async fn wait_running(server: &Server, device: &str, running: u64, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        let s = server.status().await?;
        let n = s["queues"].as_array().into_iter().flatten().find(|q| q["device"] == device).and_then(|q| q["running"].as_u64()).unwrap_or(0);
        if n >= running {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("no request started on the {device} worker within {} s", timeout.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Per-scenario figures.
#[derive(Debug, Clone, Serialize)]
pub struct ScenarioSummary {
    pub scenario: String,
    pub stream: bool,
    pub sent: usize,
    pub accepted: usize,
    pub completed: usize,
    pub refused: usize,
    pub cancelled_by_client: usize,
    pub lost: usize,
    pub success_rate: f64,
    pub degraded: usize,
    pub degraded_unmarked: usize,
    pub on_gpu: usize,
    pub on_cpu: usize,
    pub failovers: usize,
    pub p50_latency_ms: f64,
    pub p95_latency_ms: f64,
    pub max_queued_ms: f64,
}

pub fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * (v.len() as f64 - 1.0)).round() as usize;
    v[rank.min(v.len() - 1)]
}

fn summarize(records: &[Record]) -> Vec<ScenarioSummary> {
    let mut groups: BTreeMap<(String, bool), Vec<&Record>> = BTreeMap::new();
    for r in records {
        groups.entry((r.scenario.clone(), r.stream)).or_default().push(r);
    }
    let mut out: Vec<ScenarioSummary> = groups
        .into_iter()
        .map(|((scenario, stream), rs)| {
            let count = |f: &dyn Fn(&Record) -> bool| rs.iter().filter(|r| f(r)).count();
            let accepted = count(&|r| r.accepted);
            let intended = count(&|r| r.intended_cancel);
            let completed = count(&|r| r.completed);
            let latencies: Vec<f64> = rs.iter().filter(|r| r.completed).map(|r| r.latency_ms).collect();
            let wanted = accepted.saturating_sub(count(&|r| r.accepted && r.intended_cancel));
            ScenarioSummary {
                sent: rs.len(),
                accepted,
                completed,
                refused: count(&|r| r.refused),
                cancelled_by_client: intended,
                lost: count(&|r| r.lost),
                success_rate: if wanted == 0 { 1.0 } else { count(&|r| r.accepted && !r.intended_cancel && r.completed) as f64 / wanted as f64 },
                degraded: count(&|r| r.completed && r.degraded),
                degraded_unmarked: count(&|r| r.degraded_unmarked()),
                on_gpu: count(&|r| r.completed && r.device.as_deref().is_some_and(|d| d != "cpu")),
                on_cpu: count(&|r| r.completed && r.device.as_deref() == Some("cpu")),
                failovers: rs.iter().map(|r| r.failovers).sum(),
                p50_latency_ms: percentile(&latencies, 50.0),
                p95_latency_ms: percentile(&latencies, 95.0),
                max_queued_ms: rs.iter().filter_map(|r| r.queued_ms).fold(0.0, f64::max),
                scenario,
                stream,
            }
        })
        .collect();
    // In the order they ran: streaming off first.
    out.sort_by_key(|s| s.stream);
    out
}

/// Greedy runs of the same request on the GPU and on the CPU.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Equivalence {
    pub compared: usize,
    pub identical: usize,
    pub identical_percent: f64,
    /// (prompt, character offset of the first difference) for each that differed.
    pub divergences: Vec<(String, usize)>,
}

fn equivalence(records: &[Record]) -> Equivalence {
    let mut reference: BTreeMap<&str, &str> = BTreeMap::new();
    // Texts only: an embedding's vector agrees across engines to rounding, not bit for bit.
    let records: Vec<&Record> = records.iter().filter(|r| r.class != "embedding").collect();
    for r in records.iter().filter(|r| r.completed && !r.intended_cancel && r.failovers == 0 && r.device.as_deref().is_some_and(|d| d != "cpu")) {
        reference.entry(&r.prompt_key).or_insert(&r.text);
    }
    let mut e = Equivalence::default();
    for r in records.iter().filter(|r| r.completed && !r.intended_cancel && (r.device.as_deref() == Some("cpu") || r.failovers > 0)) {
        let Some(gpu) = reference.get(r.prompt_key.as_str()) else { continue };
        e.compared += 1;
        if *gpu == r.text {
            e.identical += 1;
        } else {
            let at = gpu.chars().zip(r.text.chars()).take_while(|(a, b)| a == b).count();
            e.divergences.push((r.prompt_key.clone(), at));
        }
    }
    e.identical_percent = if e.compared == 0 { f64::NAN } else { 100.0 * e.identical as f64 / e.compared as f64 };
    e
}

/// One GPU fault and how long the GPU worker took to come back.
#[derive(Debug, Clone, Serialize)]
pub struct Recovery {
    pub fault: String,
    pub stream: bool,
    pub restored: bool,
    pub recovery_ms: Option<f64>,
}

/// A client-side agent's side effects.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AgentSummary {
    pub tasks: usize,
    /// Tasks whose tool ran exactly once.
    pub exactly_once: usize,
    /// Tool executions beyond the first for the same task.
    pub duplicate_side_effects: usize,
    /// Tasks whose tool never ran (the call was lost).
    pub lost_calls: usize,
    pub retries: usize,
    pub tool_calls_journaled: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Criterion {
    pub name: String,
    pub passed: bool,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub profile: Profile,
    pub gpu: PressureGpu,
    pub model: String,
    pub scale: serde_json::Value,
    pub sizing: Option<serde_json::Value>,
    pub wall_s: f64,
    pub passed: bool,
    pub criteria: Vec<Criterion>,
    pub scenarios: Vec<ScenarioSummary>,
    /// p50/p95 latency by request class and the device that finished it.
    pub latency_by_class: Vec<Value>,
    pub equivalence: Equivalence,
    pub recoveries: Vec<Recovery>,
    pub agent: AgentSummary,
    pub host_ram: Value,
    pub queue_age_ms: Value,
    pub profiles: Value,
    pub failed_requests: Vec<Value>,
    pub breaker: Vec<(f64, String, String)>,
    /// How long the breaker stayed open each time (open → closed, from the event stream).
    pub breaker_open_ms: Vec<f64>,
    pub markers: Vec<Marker>,
    pub samples: Vec<Sample>,
    pub records: Vec<Record>,
}

pub fn pressure(args: PressureArgs) -> Result<()> {
    let model_dir = headroom_model::bundle::resolve_model(&args.model);
    let bundle = ModelBundle::open(&model_dir).with_context(|| format!("cannot open the model folder {}", model_dir.display()))?;
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}; pass --out", args.out.display()))?;
    let out = args.out.canonicalize()?;
    let runtime = tokio::runtime::Runtime::new()?;
    if let Some(control) = args.control {
        return negative_control(&runtime, &args, control, &out);
    }
    let report = runtime.block_on(run(&args, &model_dir, &bundle, &out))?;
    std::fs::write(out.join("report.json"), serde_json::to_string_pretty(&report)?)?;
    std::fs::write(out.join("report.html"), pressure_report::html(&report))?;
    println!("{}", pressure_report::text_summary(&report));
    println!("report: {} and {}", out.join("report.json").display(), out.join("report.html").display());
    if !report.passed {
        let failed: Vec<&str> = report.criteria.iter().filter(|c| !c.passed).map(|c| c.name.as_str()).collect();
        bail!("pressure run failed: {}", failed.join(", "));
    }
    Ok(())
}

/// The agent scenario against a server with a fixed defect switched back on: it must report
/// the defect and fail (the exit code says so), or the criterion it guards could not fail.
fn negative_control(runtime: &tokio::runtime::Runtime, args: &PressureArgs, control: NegativeControl, out: &Path) -> Result<()> {
    let clock = Clock(Instant::now());
    let timeline: SharedTimeline = Arc::default();
    let env = match control {
        NegativeControl::IdempotencyOff => [("HEADROOM_TEST_IGNORE_IDEMPOTENCY_KEY", "1")],
        NegativeControl::GpuShareIgnored => return shared_gpu_control(runtime, args, out),
    };
    let agent = runtime.block_on(run_agent(args.gpu, &out.join("agent"), &clock, &timeline, args.profile.scale().agent_tasks, &env))?;
    std::fs::write(out.join("control.json"), serde_json::to_string_pretty(&json!({"control": control, "agent": agent}))?)?;
    println!(
        "negative control {control:?}: {} duplicate side effects, {} lost calls, {} exactly once over {} agent tasks ({} retries)",
        agent.duplicate_side_effects, agent.lost_calls, agent.exactly_once, agent.tasks, agent.retries
    );
    if agent.duplicate_side_effects > 0 {
        bail!("pressure run failed: zero duplicate side effects ({} duplicates with {control:?}, as a negative control must)", agent.duplicate_side_effects);
    }
    println!("the negative control found no duplicates: the duplicate criterion cannot fail");
    Ok(())
}

async fn run(args: &PressureArgs, model_dir: &Path, bundle: &ModelBundle, out: &Path) -> Result<Report> {
    let clock = Clock(Instant::now());
    let scale = args.profile.scale();
    let sim = args.gpu == PressureGpu::Sim;

    let Prompts { long_prompts, short_tokens, long_tokens } = prompts(bundle, scale)?;
    let sizing = if sim { Some(plan_sizing(bundle, short_tokens, long_tokens, scale.max_tokens)?) } else { None };

    let server = Server::start(model_dir, args.gpu, sizing.as_ref(), &out.join("server"), &[]).await?;
    let server_pid = server.child.id().context("the server exited")?;
    let slots = server.status().await?["queues"].as_array().into_iter().flatten().find(|q| q["device"] == "gpu").and_then(|q| q["concurrency"].as_u64());
    if slots.is_some_and(|n| n != GPU_SLOTS) {
        bail!("the server's GPU worker runs {} requests at once; the harness sizes its sim GPUs for {GPU_SLOTS}", slots.unwrap_or(0));
    }
    let timeline: SharedTimeline = Arc::default();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let watchers = watch(&server, server_pid, clock.clone(), timeline.clone(), stop_rx.clone());
    let host_budget_mib = {
        let host = headroom_memory::observe::host_memory().context("cannot read host memory")?;
        let reserve = MemoryConfig::default().host_reserve_bytes(host.total_bytes);
        host.total_bytes.saturating_sub(reserve) as f64 / MIB as f64
    };

    let model = server.model_id.clone();
    let max_tokens = scale.max_tokens;
    let short = |scenario: &'static str, fault: &'static str, i: usize, stream: bool| Shot {
        scenario,
        class: "short",
        fault,
        stream,
        prompt_key: format!("short-{}", i % VERSES.len()),
        body: chat_body(&model, VERSES[i % VERSES.len()], max_tokens, stream),
        idempotency_key: None,
        disconnect_after_chunks: None,
        client_timeout: None,
    };
    // An embedding of one verse; its vector is not compared across devices here (the engines
    // agree to rounding, not bit for bit: `tests/dispatch.rs` checks them), its fate is.
    let embedding = |scenario: &'static str, fault: &'static str, i: usize| Shot {
        class: "embedding",
        prompt_key: format!("embedding-{}", i % VERSES.len()),
        body: json!({"model": model, "input": VERSES[i % VERSES.len()], "encoding_format": "float"}),
        ..short(scenario, fault, i, false)
    };
    let long = |scenario: &'static str, fault: &'static str, i: usize, stream: bool| Shot {
        class: "long",
        prompt_key: format!("long-{}", i % long_prompts.len()),
        body: chat_body(&model, &long_prompts[i % long_prompts.len()], max_tokens, stream),
        ..short(scenario, fault, i, stream)
    };

    let mut records: Vec<Record> = Vec::new();
    let mut recoveries: Vec<Recovery> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let n = scale.per_scenario;
    for stream in [false, true] {
        let mode = if stream { "streaming" } else { "plain" };
        eprintln!("pressure: {mode} requests");

        // GPU-resident: everything fits; also the reference for token equivalence.
        mark(&timeline, &clock, format!("baseline ({mode})"));
        records.extend(run_all(&server, &clock, (0..VERSES.len().min(2 * n)).map(|i| short("gpu_resident", "none", i, stream)).collect(), 1).await);

        // Concurrent traffic: more at once than the GPU holds.
        mark(&timeline, &clock, format!("concurrent burst ({mode})"));
        records.extend(run_all(&server, &clock, (0..scale.concurrent).map(|i| short("concurrent", "none", i, stream)).collect(), scale.concurrent).await);

        // Long prompts: over the GPU profile, within host RAM: redirected before admission.
        mark(&timeline, &clock, format!("long prompts → CPU ({mode})"));
        records.extend(run_all(&server, &clock, (0..n).map(|i| long("long_prompts", "redirect_before_admission", i, stream)).collect(), 2).await);

        // Faults at full load: each kind fires with the GPU's slots full and requests queued
        // behind them (a request waiting for a GPU slot means every slot is taken).
        let faults: &[(&str, &str)] = if sim {
            &[("oom_before_generation", "oom_before_generation"), ("oom_mid_generation", "oom_mid_generation"), ("driver_reset", "kill_9_gpu_worker")]
        } else {
            &[("driver_reset", "kill_9_gpu_worker")]
        };
        for &(scenario, fault) in faults {
            for _ in 0..scale.resets {
                server.wait_gpu_restored(&clock, Duration::from_secs(60)).await?;
                if sim {
                    // Slow the simulated GPU (~60 ms a token) so the burst is still running when
                    // the fault lands.
                    server.fault(json!({"fault": "slowdown", "factor": 40.0})).await?;
                }
                let mut burst: Vec<Shot> = (0..scale.full_load).map(|i| short(scenario, fault, i, stream)).collect();
                if !stream {
                    // Embeddings queued among the chats meet the fault too.
                    burst.extend((0..scale.full_load.div_ceil(4)).map(|i| embedding(scenario, fault, i)));
                }
                let target = &server;
                let fire = move || async move {
                    match fault {
                        "oom_before_generation" => target.fault(json!({"fault": "oom_next_allocation"})).await,
                        "oom_mid_generation" => target.fault(json!({"fault": "oom_after_tokens", "tokens": max_tokens / 2})).await,
                        _ => target.kill_gpu_worker().await.map(|_| ()),
                    }
                };
                let (burst, fired_at) = at_full_load(&server, &clock, &timeline, format!("{fault} at full load ({mode})"), burst, fire).await?;
                records.extend(burst);
                recoveries.push(restore_after(&server, &clock, fault, stream, fired_at).await);
                if sim {
                    // A restarted sim worker gets the environment faults again: clear them.
                    server.fault(json!({"fault": "clear"})).await?;
                }
            }
        }

        // Cancellation while waiting in the CPU queue: the CPU worker runs one request at a time.
        mark(&timeline, &clock, format!("cancel in CPU queue ({mode})"));
        {
            let first = send(&server, &clock, long("cancel_in_cpu_queue", "none", 0, stream), None);
            let key = format!("cancel-{}-{}", std::process::id(), clock.ms() as u64);
            let mut queued = long("cancel_in_cpu_queue", "cancel_while_queued", 1, stream);
            queued.idempotency_key = Some(key.clone());
            let queued_body = queued.body.clone();
            let (tx, rx) = tokio::sync::oneshot::channel();
            let second = async {
                wait_running(&server, "cpu", 1, Duration::from_secs(30)).await.ok();
                if stream {
                    // The opening chunk names the request; cancel it by id.
                    let handle = send(&server, &clock, queued, Some(tx));
                    let cancel = async {
                        if let Ok(id) = rx.await {
                            let _ = server.http.post(format!("{}/v1/requests/{id}/cancel", server.base)).send().await;
                        }
                    };
                    let (mut r, _) = tokio::join!(handle, cancel);
                    r.intended_cancel = true;
                    r
                } else {
                    // A plain client cancels by hanging up; its Idempotency-Key then shows the end.
                    drop(tx);
                    queued.client_timeout = Some(Duration::from_millis(300));
                    let mut r = send(&server, &clock, queued, None).await;
                    end_by_key(&server, &mut r, &key, &queued_body).await;
                    r
                }
            };
            let (a, b) = tokio::join!(first, second);
            records.push(a);
            records.push(b);
        }

        // Client disconnect mid-stream (plain clients: a client timeout mid-generation).
        mark(&timeline, &clock, format!("client disconnect ({mode})"));
        {
            if sim {
                server.fault(json!({"fault": "slowdown", "factor": 4.0})).await?;
            }
            let mut shot = short("client_disconnect", "client_disconnect", 1, stream);
            if stream {
                shot.disconnect_after_chunks = Some(3);
                records.push(send(&server, &clock, shot, None).await);
            } else {
                let key = format!("disconnect-{}-{}", std::process::id(), clock.ms() as u64);
                shot.idempotency_key = Some(key.clone());
                shot.client_timeout = Some(Duration::from_millis(400));
                let body = shot.body.clone();
                let mut r = send(&server, &clock, shot, None).await;
                end_by_key(&server, &mut r, &key, &body).await;
                records.push(r);
            }
            if sim {
                server.fault(json!({"fault": "clear"})).await?;
            }
            // The worker is free again: the next request is served.
            records.push(send(&server, &clock, short("client_disconnect", "after_disconnect", 2, stream), None).await);
        }

        // A competing GPU workload grows step by step while traffic runs.
        if let (true, Some(s)) = (sim, &sizing) {
            for step in 0..=scale.squeeze_steps {
                let competitor = (s.room_mib.ceil() as u64) * step as u64 / scale.squeeze_steps as u64;
                mark(&timeline, &clock, format!("competitor {competitor} MiB"));
                server.fault(json!({"fault": "compete", "mib": competitor})).await?;
                server.wait_competing(competitor * MIB).await?;
                let burst = (0..scale.concurrent / 2).map(|i| short("vram_squeeze", "competing_workload", i + step, stream)).collect();
                records.extend(run_all(&server, &clock, burst, scale.concurrent / 2).await);
            }
            server.fault(json!({"fault": "clear"})).await?;
            server.wait_competing(0).await?;
            mark(&timeline, &clock, "competitor released");
            let released_at = clock.ms();
            recoveries.push(restore_after(&server, &clock, "competing_workload", stream, released_at).await);
        } else {
            notes.push("vram_squeeze needs the sim GPU's competing workload; on cuda run a real second program".into());
        }
    }
    let checks_at = records.len();
    reconcile(&server, &mut records[..checks_at]).await;

    // A second server whose sim GPU holds the model only split: traffic runs split, and faults
    // fire at full load there too (an OOM mid-stream, kill -9 of the GPU worker).
    let mut split_run: Option<(u32, u32, u64)> = None;
    // The layers the GPU worker holds after a restart beside the re-planning competitor.
    let mut split_replan: Option<u32> = None;
    // Restarts whose /v1/status placement was not the one re-planned.
    let mut misplaced: Vec<String> = Vec::new();
    if let (true, Some(s)) = (sim, &sizing) {
        let (split_sizing, gpu_layers) = split_sizing(bundle, s)?;
        let layers = bundle.config.num_hidden_layers as u32;
        split_run = Some((gpu_layers, layers, split_sizing.sim_vram_mib));
        let replan = shrink_competitor(bundle, &split_sizing, gpu_layers)?;
        split_replan = replan.map(|(_, shrunk)| shrunk);
        if replan.is_none() {
            notes.push(format!("the re-planning check needs a competitor that leaves room for fewer than {gpu_layers} layers but not none; no whole MiB does on this model"));
        }
        let split_server = Server::start(model_dir, args.gpu, Some(&split_sizing), &out.join("split-server"), &[]).await?;
        let placed = split_server.status().await?["placement"].clone();
        if placed["gpu_layers"].as_u64() != Some(gpu_layers as u64) {
            bail!("the server did not plan the split of {gpu_layers} layers on a {} MiB sim GPU: {placed}", split_sizing.sim_vram_mib);
        }
        let first = records.len();
        for stream in [false, true] {
            let mode = if stream { "streaming" } else { "plain" };
            eprintln!("pressure: split ({gpu_layers} of {layers} layers on the sim GPU), {mode} requests");
            mark(&timeline, &clock, format!("split baseline ({mode})"));
            records.extend(run_all(&split_server, &clock, (0..VERSES.len().min(2 * n)).map(|i| short("split_resident", "none", i, stream)).collect(), 1).await);
            for &(scenario, fault) in &[("split_oom_mid_generation", "oom_mid_generation"), ("split_driver_reset", "kill_9_gpu_worker")] {
                split_server.wait_gpu_restored(&clock, Duration::from_secs(60)).await?;
                split_server.fault(json!({"fault": "slowdown", "factor": 40.0})).await?;
                let mut burst: Vec<Shot> = (0..scale.full_load).map(|i| short(scenario, fault, i, stream)).collect();
                if !stream {
                    // Embeddings queued among the chats meet the fault too.
                    burst.extend((0..scale.full_load.div_ceil(4)).map(|i| embedding(scenario, fault, i)));
                }
                let target = &split_server;
                let fire = move || async move {
                    match fault {
                        "oom_mid_generation" => target.fault(json!({"fault": "oom_after_tokens", "tokens": max_tokens / 2})).await,
                        _ => target.kill_gpu_worker().await.map(|_| ()),
                    }
                };
                let (burst, fired_at) = at_full_load(&split_server, &clock, &timeline, format!("split: {fault} at full load ({mode})"), burst, fire).await?;
                records.extend(burst);
                recoveries.push(restore_after(&split_server, &clock, fault, stream, fired_at).await);
                split_server.fault(json!({"fault": "clear"})).await?;
            }
            // A competing program takes the room the split's requests had: they go to the CPU
            // (the plan stays as made at start), and none is lost.
            let competitor = split_sizing.room_mib.ceil() as u64;
            mark(&timeline, &clock, format!("split: competitor {competitor} MiB ({mode})"));
            split_server.fault(json!({"fault": "compete", "mib": competitor})).await?;
            split_server.wait_competing(competitor * MIB).await?;
            let burst = (0..scale.concurrent / 2).map(|i| short("split_vram_squeeze", "competing_workload", i, stream)).collect();
            records.extend(run_all(&split_server, &clock, burst, scale.concurrent / 2).await);
            split_server.fault(json!({"fault": "clear"})).await?;
            split_server.wait_competing(0).await?;

            // The plan is made again at each launch of the GPU worker: a program that starts
            // while the worker is down (killed at full load) makes the next launch hold fewer
            // layers; once it left, the launch after holds them all again.
            let Some((competitor, shrunk)) = replan else { continue };
            let shrunk_placement = format!("split: {shrunk} of {layers} layers on the GPU");
            let full_placement = format!("split: {gpu_layers} of {layers} layers on the GPU");
            for (scenario, environment, placement, after) in [
                ("split_replan_reset", json!({"fault": "compete", "mib": competitor}), &shrunk_placement, "split_replanned"),
                ("split_regrow_reset", json!({"fault": "clear"}), &full_placement, "split_regrown"),
            ] {
                split_server.fault(json!({"fault": "slowdown", "factor": 40.0})).await?;
                let burst: Vec<Shot> = (0..scale.full_load).map(|i| short(scenario, "kill_9_gpu_worker", i, stream)).collect();
                let (target, tl, ck) = (&split_server, &timeline, &clock);
                let environment = &environment;
                let fire = move || async move {
                    target.kill_gpu_worker().await?;
                    mark(tl, ck, format!("{scenario}: GPU worker killed; environment now {environment}"));
                    target.fault(environment.clone()).await
                };
                let (burst, fired_at) = at_full_load(&split_server, &clock, &timeline, format!("split: kill_9 at full load, then {environment} ({mode})"), burst, fire).await?;
                records.extend(burst);
                recoveries.push(restore_after(&split_server, &clock, scenario, stream, fired_at).await);
                split_server.fault(json!({"fault": "slowdown", "factor": 1.0})).await?;
                let now = split_server.status().await?["placement"]["placement"].as_str().unwrap_or_default().to_string();
                mark(&timeline, &clock, format!("split: placement after the restart: {now}"));
                if &now != placement {
                    misplaced.push(format!("{scenario} ({mode}): /v1/status placed the restarted worker \"{now}\", not \"{placement}\""));
                }
                records.extend(run_all(&split_server, &clock, (0..scale.concurrent / 2).map(|i| short(after, "none", i, stream)).collect(), 1).await);
            }
        }
        reconcile(&split_server, &mut records[first..]).await;
        split_server.stop().await;
    } else {
        notes.push("the layer split runs on the sim GPU sized by the harness; on cuda use `headroom plan` and a model that does not fit".into());
    }

    // KV overcommit: requests reserve a quarter of their KV blocks on a sim GPU that holds the
    // full load's reservations and about a block more; the pool runs dry as they write, the
    // last started are preempted to the CPU queue, and once one was, the GPU worker is killed at full
    // load too.
    let mut overcommit_run: Option<(u64, u64, f64)> = None;
    let overcommit = if let (true, Some(s)) = (sim, &sizing) { overcommit_sizing(bundle, s, short_tokens, GPU_SLOTS) } else { None };
    match &overcommit {
        Some(oc) => {
            let ratio = OVERCOMMIT.to_string();
            let oc_server = Server::start(model_dir, args.gpu, Some(oc), &out.join("overcommit-server"), &[("HEADROOM_KV_OVERCOMMIT", ratio.as_str())]).await?;
            let placed = oc_server.status().await?["placement"]["gpu_layers"].clone();
            if placed.as_u64().is_some_and(|n| n != bundle.config.num_hidden_layers as u64) {
                bail!("the overcommit server split the model ({placed} layers on a {} MiB sim GPU); it must hold it whole", oc.sim_vram_mib);
            }
            let (mut preempted, mut peak) = (0u64, 0.0f64);
            let first = records.len();
            for stream in [false, true] {
                let mode = if stream { "streaming" } else { "plain" };
                eprintln!("pressure: KV overcommit {OVERCOMMIT}× on a {} MiB sim GPU, {mode} requests", oc.sim_vram_mib);
                oc_server.wait_gpu_restored(&clock, Duration::from_secs(60)).await?;
                oc_server.fault(json!({"fault": "slowdown", "factor": 40.0})).await?;
                // Their own prompt keys: token equivalence compares them among themselves.
                let burst: Vec<Shot> = (0..scale.full_load)
                    .map(|i| Shot {
                        prompt_key: format!("overcommit-{}", i % VERSES.len()),
                        body: chat_body(&model, VERSES[i % VERSES.len()], OVERCOMMIT_TOKENS, stream),
                        ..short("overcommit_dry_kill", "kv_pool_dry_then_kill_9", i, stream)
                    })
                    .collect();
                let (target, tl, ck) = (&oc_server, &timeline, &clock);
                let fire = move || async move {
                    // Up to 30 s for the pool to run dry (a preemption), then kill -9.
                    let deadline = Instant::now() + Duration::from_secs(30);
                    let seen = loop {
                        let n = target.status().await?["memory"]["gpu_kv"]["preemptions"].as_u64().unwrap_or(0);
                        if n > 0 || Instant::now() > deadline {
                            break n;
                        }
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    };
                    mark(tl, ck, format!("overcommit: {seen} requests preempted; GPU worker killed"));
                    target.kill_gpu_worker().await?;
                    Ok(seen)
                };
                let seen = std::cell::Cell::new(0);
                let fire = || async { fire().await.map(|n| seen.set(n)) };
                let (result, held) = with_vram_peak(&oc_server, at_full_load(&oc_server, &clock, &timeline, format!("overcommit: pool dry, then kill_9 ({mode})"), burst, fire)).await;
                let (burst, fired_at) = result?;
                (preempted, peak) = (preempted + seen.get(), peak.max(held));
                records.extend(burst);
                recoveries.push(restore_after(&oc_server, &clock, "kv_pool_dry_then_kill_9", stream, fired_at).await);
                oc_server.fault(json!({"fault": "clear"})).await?;
            }
            reconcile(&oc_server, &mut records[first..]).await;
            oc_server.stop().await;
            overcommit_run = Some((oc.sim_vram_mib, preempted, peak));
        }
        None if sim => notes.push("the KV-overcommit scenario needs a sim GPU (in whole MiB) whose spare room cannot hold the full load's blocks; none does for this model".into()),
        None => notes.push("the KV-overcommit scenario runs on the sim GPU only (a CUDA worker does not count its blocks yet)".into()),
    }

    // Several models on one GPU: two chat models and an embedding model (copies of the model
    // under other names) on the sim GPU sized for one model; each takes the GPU in turn by
    // evicting the idle others, fills it, and loses its GPU worker to kill -9 at full load.
    let shared_run = if let (true, Some(s)) = (sim, &sizing) {
        Some(shared_gpu_waves(model_dir, args.gpu, s, &out.join("models-server"), &clock, &timeline, scale, max_tokens, &mut records, &mut recoveries, &[]).await?)
    } else {
        notes.push("the several-models scenario runs on the sim GPU sized by the harness".into());
        None
    };

    // An agent with a side-effecting mock tool, on a second server whose model always calls it.
    let agent = run_agent(args.gpu, &out.join("agent"), &clock, &timeline, scale.agent_tasks, &[]).await?;

    let _ = stop_tx.send(true);
    for w in watchers {
        let _ = w.await;
    }
    server.stop().await;
    let timeline = Arc::try_unwrap(timeline).map_err(|_| anyhow!("timeline still shared"))?.into_inner().unwrap();

    // Figures.
    let scenarios = summarize(&records);
    let mut latency_by_class = Vec::new();
    let mut classes: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.completed) {
        classes.entry((r.class.clone(), r.device.clone().unwrap_or_default())).or_default().push(r.latency_ms);
    }
    for ((class, device), l) in &classes {
        latency_by_class.push(json!({"class": class, "device": device, "count": l.len(), "p50_ms": percentile(l, 50.0), "p95_ms": percentile(l, 95.0)}));
    }
    let equivalence = equivalence(&records);
    let host_peak = timeline.samples.iter().filter_map(|s| s.host_used_mib).fold(0.0, f64::max);
    let rss_peak = timeline.samples.iter().filter_map(|s| s.headroom_rss_mib).fold(0.0, f64::max);
    let queued: Vec<f64> = records.iter().filter_map(|r| r.queued_ms).collect();
    // What Headroom itself held on the GPU (in use less the competing program), against what
    // it may hold: capacity less the reserve kept for other programs.
    let vram_own_peak = timeline.samples.iter().filter_map(|s| Some(s.vram_used_mib? - s.vram_competing_mib.unwrap_or(0.0))).fold(0.0, f64::max);
    let vram_allowed = sizing.as_ref().map(|z| z.sim_vram_mib as f64 - z.reserve_mib as f64);
    let failed_requests: Vec<Value> = records
        .iter()
        .filter(|r| r.first_failure_ms.is_some())
        .map(|r| json!({"request_id": r.request_id, "scenario": r.scenario, "stream": r.stream, "first_failure_ms": r.first_failure_ms, "retry_decision": r.retry_decision, "cpu_start_ms": r.cpu_start_ms, "device": r.device, "completed": r.completed}))
        .collect();

    let lost: usize = records.iter().filter(|r| r.lost).count();
    let unmarked: usize = records.iter().filter(|r| r.degraded_unmarked()).count();
    let unrestored: Vec<String> = recoveries.iter().filter(|r| !r.restored).map(|r| format!("{} (stream {})", r.fault, r.stream)).collect();
    // Accepted and not cancelled on purpose: each must complete.
    let owed: Vec<&Record> = records.iter().filter(|r| r.accepted && !r.intended_cancel).collect();
    let success_percent = if owed.is_empty() { 100.0 } else { 100.0 * owed.iter().filter(|r| r.completed).count() as f64 / owed.len() as f64 };
    let worst_p95 = scenarios.iter().map(|s| s.p95_latency_ms).filter(|v| v.is_finite()).fold(0.0, f64::max);
    let at_full_load = records
        .iter()
        .filter(|r| matches!(r.scenario.as_str(), "oom_before_generation" | "oom_mid_generation" | "driver_reset" | "split_oom_mid_generation" | "split_driver_reset" | "split_replan_reset" | "split_regrow_reset" | "overcommit_dry_kill"))
        .count();
    // Split traffic the GPU served must say it ran split, with the planned layer count.
    let split_records: Vec<&Record> = records.iter().filter(|r| r.scenario.starts_with("split_")).collect();
    let split_on_gpu: Vec<&&Record> = split_records.iter().filter(|r| r.completed && r.device.as_deref() == Some("sim")).collect();
    // Each says the layers of the worker that served it: the planned split, or after the
    // restart beside the competitor (and up to the next restart) the shrunk one.
    let expected_split = |r: &Record| {
        let (g, l, _) = split_run?;
        let shrunk = matches!(r.scenario.as_str(), "split_replanned" | "split_regrow_reset");
        Some(format!("{}/{l}", if shrunk { split_replan.unwrap_or(g) } else { g }))
    };
    let split_marked = split_on_gpu.iter().filter(|r| r.split == expected_split(r)).count();
    let replanned = split_on_gpu.iter().filter(|r| r.scenario == "split_replanned").count();
    let criteria = vec![
        Criterion { name: "zero accepted requests lost".into(), passed: lost == 0 && agent.lost_calls == 0, detail: format!("{lost} lost of {} accepted; agent calls lost {}", records.iter().filter(|r| r.accepted).count(), agent.lost_calls) },
        Criterion { name: "zero duplicate side effects".into(), passed: agent.duplicate_side_effects == 0, detail: format!("{} duplicates over {} agent tasks ({} retries)", agent.duplicate_side_effects, agent.tasks, agent.retries) },
        Criterion { name: "host RAM within its budget".into(), passed: host_peak <= host_budget_mib, detail: format!("peak host RAM in use {host_peak:.0} MiB, budget {host_budget_mib:.0} MiB (total − host reserve); Headroom's processes peaked at {rss_peak:.0} MiB") },
        Criterion {
            name: "VRAM reserve kept".into(),
            passed: vram_allowed.is_none_or(|a| vram_own_peak <= a + 1e-6),
            detail: match vram_allowed {
                Some(a) => format!("Headroom held at most {vram_own_peak:.1} MiB of GPU memory (weights + requests); capacity less the reserve is {a:.1} MiB (sampled each second by the worker)"),
                None => "not checked: the reserve is only known for the sim GPU sized by the harness".into(),
            },
        },
        Criterion { name: "every degraded response marked".into(), passed: unmarked == 0, detail: format!("{unmarked} unmarked (a header or stream notice, and a plain summary) of {} degraded", records.iter().filter(|r| r.completed && r.degraded).count()) },
        Criterion {
            name: "success rate".into(),
            passed: success_percent >= scale.min_success_percent,
            detail: format!("{success_percent:.1}% of {} accepted requests completed (threshold {}%); {at_full_load} of them sent into faults fired at full load", owed.len(), scale.min_success_percent),
        },
        Criterion {
            name: "token equivalence".into(),
            passed: equivalence.compared > 0 && equivalence.identical_percent >= scale.min_identical_percent,
            detail: format!("{} of {} CPU runs identical to the GPU's greedy text (threshold {}%)", equivalence.identical, equivalence.compared, scale.min_identical_percent),
        },
        Criterion {
            name: "split traffic ran split".into(),
            passed: split_run.is_none() || (!split_on_gpu.is_empty() && split_marked == split_on_gpu.len() && (split_replan.is_none() || replanned > 0) && misplaced.is_empty()),
            detail: match split_run {
                Some((g, l, mib)) => format!(
                    "{split_marked} of {} split requests the {mib} MiB sim GPU served said the split of the worker that served them (X-Headroom-Split: {g}/{l}{}); {} split requests in all",
                    split_on_gpu.len(),
                    match split_replan {
                        Some(n) => format!(", and {n}/{l} for the {replanned} served after a restart beside a competing program"),
                        None => String::new(),
                    },
                    split_records.len()
                ) + &misplaced.iter().map(|m| format!("; {m}")).collect::<String>(),
                None => "not run: the split needs the sim GPU sized by the harness".into(),
            },
        },
        Criterion {
            name: "KV overcommit: the pool ran dry, preempted requests resumed, the reserve held".into(),
            passed: overcommit_run.is_none_or(|(mib, preempted, peak)| preempted > 0 && overcommit.as_ref().is_some_and(|oc| peak <= (mib - oc.reserve_mib) as f64 + 1e-6)),
            detail: match (overcommit_run, &overcommit) {
                (Some((mib, preempted, peak)), Some(oc)) => format!(
                    "{preempted} preemptions on a {mib} MiB sim GPU at overcommit {OVERCOMMIT}× before the kill -9s (plain and streaming runs); Headroom held at most {peak:.1} MiB there (capacity less the reserve: {} MiB); {} requests, none lost (see the first criterion)",
                    mib - oc.reserve_mib,
                    records.iter().filter(|r| r.scenario == "overcommit_dry_kill").count()
                ),
                _ => "not run (see the notes)".into(),
            },
        },
        Criterion {
            name: "several models: each took the GPU in turn by evicting the idle others, the last beside a competing program; the models and that program there never passed capacity less the reserve".into(),
            passed: shared_run.as_ref().is_none_or(|r| r.evictions > 0 && r.on_gpu.iter().all(|(_, n)| *n > 0) && r.peak_gpu_mib <= r.limit_mib + 1e-6),
            detail: match &shared_run {
                Some(r) => format!(
                    "{} evictions; loads per model: {}; requests that ran on the GPU per model: {}; p95 latency per model: {}; a competing program of {} MiB in the last wave; the models (weights and grants) and the competitor on the GPU peaked at {:.1} MiB (capacity less the reserve: {:.0} MiB); {} requests, none lost (see the first criterion)",
                    r.evictions,
                    r.loads.iter().map(|(m, n)| format!("{m} {n}")).collect::<Vec<_>>().join(", "),
                    r.on_gpu.iter().map(|(m, n)| format!("{m} {n}")).collect::<Vec<_>>().join(", "),
                    r.latency_ms.iter().map(|(m, _, p95)| format!("{m} {p95:.0} ms")).collect::<Vec<_>>().join(", "),
                    r.competitor_mib,
                    r.peak_gpu_mib,
                    r.limit_mib,
                    records.iter().filter(|x| x.scenario == "models_share_gpu").count()
                ),
                None => "not run (see the notes)".into(),
            },
        },
        Criterion { name: "p95 latency".into(), passed: worst_p95 <= scale.max_p95_ms, detail: format!("worst scenario p95 {worst_p95:.0} ms (threshold {:.0} ms)", scale.max_p95_ms) },
        Criterion { name: "GPU worker restored after each fault".into(), passed: unrestored.is_empty() && !recoveries.is_empty(), detail: if unrestored.is_empty() { format!("{} faults, all restored", recoveries.len()) } else { format!("not restored after {}", unrestored.join(", ")) } },
    ];
    let passed = criteria.iter().all(|c| c.passed);
    let sim_note = "simulated GPU: ndarray compute behind an enforced VRAM limit";
    let gpu_resident: Vec<&ScenarioSummary> = scenarios.iter().filter(|s| s.scenario == "gpu_resident").collect();
    let fallback: Vec<&ScenarioSummary> = scenarios.iter().filter(|s| s.scenario != "gpu_resident").collect();
    let profiles = json!({
        "gpu_resident": {"available": true, "requests": gpu_resident.iter().map(|s| s.completed).sum::<usize>(), "p95_latency_ms": gpu_resident.iter().map(|s| s.p95_latency_ms).fold(0.0, f64::max)},
        "cpu_fallback": {"available": true, "requests": fallback.iter().map(|s| s.completed).sum::<usize>(), "on_cpu": fallback.iter().map(|s| s.on_cpu).sum::<usize>(), "p95_latency_ms": fallback.iter().map(|s| s.p95_latency_ms).filter(|v| v.is_finite()).fold(0.0, f64::max)},
        "layer_split": match split_run {
            Some((gpu_layers, layers, mib)) => {
                let split: Vec<&ScenarioSummary> = scenarios.iter().filter(|s| s.scenario.starts_with("split_")).collect();
                json!({"available": true, "gpu_layers": gpu_layers, "layers": layers, "sim_vram_mib": mib, "requests": split.iter().map(|s| s.completed).sum::<usize>(), "on_cpu": split.iter().map(|s| s.on_cpu).sum::<usize>(), "p95_latency_ms": split.iter().map(|s| s.p95_latency_ms).filter(|v| v.is_finite()).fold(0.0, f64::max)})
            }
            None => json!({"available": false, "reason": "the split runs on the sim GPU sized by the harness"}),
        },
        "kv_overcommit": match (overcommit_run, &overcommit) {
            (Some((mib, preempted, peak)), Some(oc)) => {
                let over: Vec<&ScenarioSummary> = scenarios.iter().filter(|s| s.scenario == "overcommit_dry_kill").collect();
                json!({"available": true, "overcommit": OVERCOMMIT, "sim_vram_mib": mib, "reserve_mib": oc.reserve_mib, "preempted": preempted, "vram_peak_mib": peak, "requests": over.iter().map(|s| s.completed).sum::<usize>(), "on_cpu": over.iter().map(|s| s.on_cpu).sum::<usize>()})
            }
            _ => json!({"available": false}),
        },
        "several_models": shared_run.as_ref().map(|r| json!({"models": r.models, "evictions": r.evictions, "loads": r.loads, "on_gpu": r.on_gpu, "latency_ms_p50_p95": r.latency_ms, "competitor_mib": r.competitor_mib, "peak_gpu_mib": r.peak_gpu_mib, "limit_mib": r.limit_mib})),
        "note": if sim { sim_note } else { "CUDA GPU" },
        "skipped": notes,
    });
    Ok(Report {
        profile: args.profile,
        gpu: args.gpu,
        model: bundle.name(),
        scale: serde_json::to_value(scale)?,
        sizing: sizing.map(|s| serde_json::to_value(s)).transpose()?,
        wall_s: clock.ms() / 1000.0,
        passed,
        criteria,
        scenarios,
        latency_by_class,
        equivalence,
        recoveries,
        agent,
        host_ram: json!({"peak_used_mib": host_peak, "budget_mib": host_budget_mib, "headroom_processes_peak_mib": rss_peak}),
        queue_age_ms: json!({"p50": percentile(&queued, 50.0), "p95": percentile(&queued, 95.0), "max": queued.iter().cloned().fold(0.0, f64::max)}),
        profiles,
        failed_requests,
        breaker_open_ms: breaker_open_spans(&timeline.breaker),
        breaker: timeline.breaker,
        markers: timeline.markers,
        samples: timeline.samples,
        records,
    })
}

/// After a fault: the GPU worker must be back (ready, breaker closed) within a minute. The
/// recovery time runs from the fault (`since_ms`) to the moment it is ready.
async fn restore_after(server: &Server, clock: &Clock, fault: &str, stream: bool, since_ms: f64) -> Recovery {
    let waited = server.wait_gpu_restored(clock, Duration::from_secs(60)).await;
    Recovery { fault: fault.into(), stream, restored: waited.is_ok(), recovery_ms: waited.ok().map(|_| clock.ms() - since_ms) }
}

/// The agent: for each task it asks the model what to do (with an Idempotency-Key) and runs
/// each tool call the moment it is delivered, once per call id (as agent frameworks do); on
/// any error, or a response lost after a call was delivered, it retries with the same key.
/// Faults hit the GPU worker meanwhile, including a kill -9 right after a call was delivered.
/// Each task has one logical call: a second call id executed for it is a duplicate side effect.
async fn run_agent(gpu: PressureGpu, dir: &Path, clock: &Clock, timeline: &SharedTimeline, tasks: usize, server_env: &[(&str, &str)]) -> Result<AgentSummary> {
    let model_dir = dir.join("tool-model");
    headroom_model::fixture::write_scripted_folder(&model_dir, &["<tool_call>", r#"{"name":"append_ledger","arguments":{"entry":"payment"}}"#, "</tool_call>"])?;
    let server = Server::start(&model_dir, gpu, None, dir, server_env).await?;
    let tools = json!([{"type": "function", "function": {"name": "append_ledger", "description": "Append an entry to the ledger (a side effect)", "parameters": {"type": "object", "properties": {"entry": {"type": "string"}}, "required": ["entry"]}}}]);
    let mut executed: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    let mut summary = AgentSummary { tasks: tasks * 2, ..Default::default() };
    let faults = ["none", "lost_after_call", "kill_9_gpu_worker", "oom_before_generation", "response_lost"];
    for stream in [false, true] {
        for t in 0..tasks {
            let task = format!("task-{}-{t}", if stream { "s" } else { "p" });
            let key = format!("agent-{}-{task}", std::process::id());
            let fault = faults[t % faults.len()];
            let body = json!({"model": server.model_id, "messages": [{"role": "user", "content": format!("Record the payment for {task}")}], "tools": tools, "max_tokens": 8, "temperature": 0, "stream": stream});
            if gpu == PressureGpu::Sim {
                match fault {
                    "oom_before_generation" => server.fault(json!({"fault": "oom_next_allocation"})).await?,
                    // Slow enough that the kill lands while the call is being generated.
                    "kill_9_gpu_worker" => server.fault(json!({"fault": "slowdown", "factor": 400.0})).await?,
                    _ => {}
                }
            }
            mark(timeline, clock, format!("agent {task}: {fault}"));
            let mut request_id = None;
            for attempt in 1..=6 {
                let request = server.http.post(format!("{}/v1/chat/completions", server.base)).header("Idempotency-Key", &key).json(&body).send();
                let killer = async {
                    if fault == "kill_9_gpu_worker" && attempt == 1 && wait_running(&server, "gpu", 1, Duration::from_secs(20)).await.is_ok() {
                        kill_gpu_worker(&server, timeline, clock, "agent: kill -9 GPU worker mid-generation").await;
                    }
                };
                let (response, ()) = tokio::join!(request, killer);
                let response = match response {
                    Ok(r) if r.status().is_success() => r,
                    Ok(r) => {
                        let wait = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok()).unwrap_or(1);
                        summary.retries += 1;
                        tokio::time::sleep(Duration::from_millis(200 * wait.min(5))).await;
                        continue;
                    }
                    Err(_) => {
                        summary.retries += 1;
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                };
                request_id = response.headers().get("x-request-id").and_then(|v| v.to_str().ok()).map(str::to_string);
                if fault == "response_lost" && attempt == 1 {
                    // The server sent the whole answer, but it never reached the agent (a proxy
                    // dropped it): the agent retries.
                    let _ = response.bytes().await;
                    summary.retries += 1;
                    continue;
                }
                let lose_after_call = fault == "lost_after_call" && attempt == 1;
                let ran = executed.entry(task.clone()).or_default();
                let complete = deliver_tool_calls(response, stream, lose_after_call, |call_id| {
                    ran.insert(call_id);
                })
                .await;
                if lose_after_call {
                    // The connection dropped after the call ran, and the GPU worker dies: the
                    // agent retries with its key and must not be handed a new call.
                    kill_gpu_worker(&server, timeline, clock, "agent: kill -9 GPU worker after a tool call was delivered").await;
                    summary.retries += 1;
                    continue;
                }
                if complete {
                    break;
                }
                summary.retries += 1;
            }
            if gpu == PressureGpu::Sim && fault != "none" {
                let _ = server.wait_gpu_restored(clock, Duration::from_secs(60)).await;
                server.fault(json!({"fault": "clear"})).await?;
            }
            // The journal's record of tool calls delivered for the request behind this key.
            if let Some(id) = &request_id {
                if let Ok(j) = server.http.get(format!("{}/v1/requests/{id}", server.base)).send().await {
                    let j: Value = j.json().await.unwrap_or(Value::Null);
                    summary.tool_calls_journaled += j["tool_calls_delivered"].as_u64().unwrap_or(0) as usize;
                }
            }
        }
    }
    for t in 0..tasks {
        for mode in ["p", "s"] {
            match executed.get(&format!("task-{mode}-{t}")).map_or(0, |calls| calls.len()) {
                0 => summary.lost_calls += 1,
                1 => summary.exactly_once += 1,
                n => summary.duplicate_side_effects += n - 1,
            }
        }
    }
    server.stop().await;
    Ok(summary)
}

/// Kills the GPU worker as a driver reset would (a no-op if none is running).
async fn kill_gpu_worker(server: &Server, timeline: &SharedTimeline, clock: &Clock, label: &str) {
    match server.kill_gpu_worker().await {
        Ok(pid) => mark(timeline, clock, format!("{label} ({pid})")),
        Err(e) => mark(timeline, clock, format!("{label}: not done: {e}")),
    }
}

/// Reads a chat answer and hands each tool call id to `run` the moment it arrives (streams:
/// chunk by chunk). With `hang_up_after_call`, stops reading right after the first call (the
/// connection drops). Returns whether the answer arrived whole.
async fn deliver_tool_calls(response: reqwest::Response, stream: bool, hang_up_after_call: bool, mut run: impl FnMut(String)) -> bool {
    if !stream {
        let Ok(v) = response.json::<Value>().await else { return false };
        for id in v["choices"][0]["message"]["tool_calls"].as_array().into_iter().flatten().filter_map(|c| c["id"].as_str()) {
            run(id.to_string());
        }
        return v["choices"][0]["finish_reason"].is_string();
    }
    let mut body = response.bytes_stream();
    let mut buffer = Vec::new();
    while let Some(Ok(piece)) = body.next().await {
        buffer.extend_from_slice(&piece);
        for data in complete_sse_data(&mut buffer) {
            if data == "[DONE]" {
                return true;
            }
            let chunk: Value = serde_json::from_str(&data).unwrap_or(Value::Null);
            if chunk.get("error").is_some() {
                return false;
            }
            let calls = stream_tool_calls(&format!("data: {data}\n\n"));
            let delivered = !calls.is_empty();
            for id in calls {
                run(id);
            }
            if delivered && hang_up_after_call {
                return false;
            }
        }
    }
    false
}

/// Open → closed spans of the breaker, in ms.
fn breaker_open_spans(changes: &[(f64, String, String)]) -> Vec<f64> {
    let mut opened = None;
    let mut spans = Vec::new();
    for (at, _, to) in changes {
        match to.as_str() {
            "open" => {
                opened.get_or_insert(*at);
            }
            "closed" => spans.extend(opened.take().map(|o| at - o)),
            _ => {}
        }
    }
    spans
}

/// Tool call ids in an SSE chat stream.
fn stream_tool_calls(text: &str) -> Vec<String> {
    complete_sse_data(&mut text.as_bytes().to_vec())
        .iter()
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["id"].as_str().map(str::to_string))
        .collect()
}


/// Sends `signal` (TERM, KILL) to a process, as a person would with `kill`: the harness acts on
/// the server and its workers from outside, like the faults it stands for.
fn send_signal(pid: u32, signal: &str) -> Result<()> {
    let status = std::process::Command::new("kill").args([format!("-{signal}"), pid.to_string()]).status()?;
    anyhow::ensure!(status.success(), "kill -{signal} {pid} failed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breaker_spans_run_from_open_to_closed() {
        let c = |at: f64, from: &str, to: &str| (at, from.to_string(), to.to_string());
        let changes = [c(10.0, "closed", "open"), c(20.0, "open", "half_open"), c(25.0, "half_open", "open"), c(40.0, "half_open", "closed"), c(50.0, "closed", "open")];
        assert_eq!(breaker_open_spans(&changes), vec![30.0], "a span ends only at closed; the last is still open");
    }

    #[test]
    fn sse_events_are_taken_whole_and_a_partial_one_waits() {
        let mut buffer = b"event: a\ndata: {\"x\":1}\n\ndata: [DONE]\n\ndata: {\"par".to_vec();
        assert_eq!(complete_sse_data(&mut buffer), vec!["{\"x\":1}".to_string(), "[DONE]".to_string()]);
        assert_eq!(buffer, b"data: {\"par");
    }

    #[test]
    fn percentiles_pick_ranks() {
        let v = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 100.0), 5.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert!(percentile(&[], 50.0).is_nan());
    }

    #[test]
    fn request_ids_come_out_of_error_messages() {
        assert_eq!(request_id_in("worker failed (request req-12; GET /v1/requests/req-12 shows its history)").as_deref(), Some("req-12"));
        assert_eq!(request_id_in("no id here"), None);
    }

    #[test]
    fn tool_call_ids_are_read_from_a_stream() {
        let sse = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"id\":\"call_1\"}]}}]}\n\ndata: [DONE]\n\n";
        assert_eq!(stream_tool_calls(sse), vec!["call_1".to_string()]);
    }

    fn rec(prompt: &str, device: &str, failovers: usize, text: &str) -> Record {
        Record { prompt_key: prompt.into(), device: Some(device.into()), failovers, text: text.into(), completed: true, ..Default::default() }
    }

    #[test]
    fn equivalence_compares_cpu_runs_with_the_gpu_reference() {
        let records = [rec("a", "sim", 0, "abc"), rec("a", "cpu", 1, "abc"), rec("a", "cpu", 0, "abx"), rec("b", "cpu", 0, "zzz")];
        let e = equivalence(&records);
        assert_eq!(e.compared, 2, "b has no GPU reference");
        assert_eq!(e.identical, 1);
        assert_eq!(e.divergences, vec![("a".to_string(), 2)]);
    }

    #[test]
    fn a_degraded_answer_without_a_mark_is_flagged() {
        let mut r = rec("a", "cpu", 1, "x");
        r.degraded = true;
        assert!(r.degraded_unmarked());
        r.degraded_marked = true;
        assert!(!r.degraded_unmarked());
    }
}

/// The harness's prompts: long ones well past what the GPU budget holds, and the token counts
/// of the longest short verse and of the long prompts (the sim GPU is sized from them).
struct Prompts {
    long_prompts: Vec<String>,
    short_tokens: usize,
    long_tokens: usize,
}

fn prompts(bundle: &ModelBundle, scale: Scale) -> Result<Prompts> {
    let chat_len = |text: &str| -> Result<usize> { Ok(bundle.chat_prompt(&[ChatMessage::new("user", text)], None)?.len()) };
    let context = bundle.config.max_position_embeddings;
    let long_target = scale.long_prompt_tokens.min(context.saturating_sub(scale.max_tokens as usize + 8));
    let mut long_prompts = Vec::new();
    for i in 0..3 {
        let mut text = String::new();
        let mut k = i;
        while chat_len(&text)? < long_target {
            text.push_str(VERSES[k % VERSES.len()]);
            text.push(' ');
            k += 1;
        }
        while chat_len(&text)? > long_target {
            text.pop();
        }
        long_prompts.push(text);
    }
    let short_tokens = VERSES.iter().map(|v| chat_len(v)).collect::<Result<Vec<_>>>()?.into_iter().max().unwrap_or(16);
    let long_tokens = chat_len(&long_prompts[0])?;
    Ok(Prompts { long_prompts, short_tokens, long_tokens })
}

/// The several-models scenario on a server whose admission counts each model alone: the
/// models' weights on the GPU must pass capacity less the reserve, so the criterion fails.
fn shared_gpu_control(runtime: &tokio::runtime::Runtime, args: &PressureArgs, out: &Path) -> Result<()> {
    if args.gpu != PressureGpu::Sim {
        bail!("--control gpu-share-ignored needs --gpu sim (the harness sizes the sim GPU for one model)");
    }
    let model_dir = headroom_model::bundle::resolve_model(&args.model);
    let bundle = ModelBundle::open(&model_dir)?;
    let scale = args.profile.scale();
    let p = prompts(&bundle, scale)?;
    let sizing = plan_sizing(&bundle, p.short_tokens, p.long_tokens, scale.max_tokens)?;
    let (clock, timeline): (Clock, SharedTimeline) = (Clock(Instant::now()), Arc::default());
    let (mut records, mut recoveries) = (Vec::new(), Vec::new());
    let run = runtime.block_on(shared_gpu_waves(&model_dir, args.gpu, &sizing, &out.join("models-server"), &clock, &timeline, scale, scale.max_tokens, &mut records, &mut recoveries, &[("HEADROOM_TEST_DEFECT", "gpu-share-ignored")]))?;
    println!("negative control GpuShareIgnored: the models and the competing program on the GPU peaked at {:.1} MiB; capacity less the reserve is {:.0} MiB", run.peak_gpu_mib, run.limit_mib);
    if run.peak_gpu_mib > run.limit_mib {
        bail!("pressure run failed: several models: the models and the competing program on the GPU passed capacity less the reserve ({:.1} > {:.0} MiB with GpuShareIgnored, as a negative control must)", run.peak_gpu_mib, run.limit_mib);
    }
    println!("the negative control stayed within the budget: the several-models criterion cannot fail");
    Ok(())
}

/// What the several-models scenario found.
struct SharedRun {
    models: Vec<String>,
    /// Models unloaded to make room for another (`headroom_model_gpu_unloads_total`, summed).
    evictions: u64,
    /// Requests of each model that ran on the GPU (finished there or failed over from it).
    on_gpu: Vec<(String, usize)>,
    /// Loads of each model on the GPU for its requests (`headroom_model_gpu_loads_total`).
    loads: Vec<(String, u64)>,
    /// Each model's completed requests' p50 and p95 latency, ms.
    latency_ms: Vec<(String, f64, f64)>,
    /// The most seen on the GPU, every 50 ms: what admission charged the models there (weights
    /// and grants) with the competing program's memory.
    peak_gpu_mib: f64,
    limit_mib: f64,
    /// The competing program of the last wave (0: none fitted).
    competitor_mib: u64,
}

/// Copies a model (a .gguf file or a folder) to `dir/NAME-SUFFIX`, so one server can serve it
/// again under another name.
fn copy_model(model_dir: &Path, dir: &Path, suffix: &str) -> Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let name = model_dir.file_stem().context("the model has no name")?.to_string_lossy().into_owned();
    if model_dir.is_file() {
        let to = dir.join(format!("{name}-{suffix}.gguf"));
        std::fs::copy(model_dir, &to)?;
        return Ok(to);
    }
    let to = dir.join(format!("{name}-{suffix}"));
    std::fs::create_dir_all(&to)?;
    for entry in std::fs::read_dir(model_dir)? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name()))?;
        }
    }
    Ok(to)
}

/// The several-models scenario: waves of requests, one model at a time (chat A, embeddings C,
/// chat B, chat A again, chat B beside a competing program), each started while another model
/// holds the GPU; once the wave's model has its GPU slots full with requests queued behind
/// them, its GPU worker gets kill -9.
#[allow(clippy::too_many_arguments)]
async fn shared_gpu_waves(model_dir: &Path, gpu: PressureGpu, sizing: &Sizing, dir: &Path, clock: &Clock, timeline: &SharedTimeline, scale: Scale, max_tokens: u32, records: &mut Vec<Record>, recoveries: &mut Vec<Recovery>, env: &[(&str, &str)]) -> Result<SharedRun> {
    // The second chat model is the first's folder under another name: the two share one CPU
    // worker (one process, one queue), so each wave's kill fails over into the queue the other
    // model's requests use too.
    let second = format!("{}-b", model_dir.file_stem().context("the model has no name")?.to_string_lossy());
    let embedder = copy_model(model_dir, &dir.join("models"), "embed")?;
    let extra = format!("\n[[models]]\nsource = {:?}\nname = {second:?}\n\n[[models]]\nsource = {:?}\nrole = \"embedding\"\n", model_dir.display().to_string(), embedder.display().to_string());
    let server = Server::start_with(model_dir, gpu, Some(sizing), dir, env, &extra).await?;
    let listed = server.status().await?["models"].as_array().context("no models[] in /v1/status")?.clone();
    let models: Vec<String> = listed.iter().filter_map(|m| m["id"].as_str().map(str::to_string)).collect();
    if models.len() != 3 {
        bail!("the several-models server serves {models:?}, not three models");
    }
    let cpu_pids: Vec<Option<u64>> = listed.iter().map(|m| m["cpu_pid"].as_u64()).collect();
    if cpu_pids[0].is_none() || cpu_pids[0] != cpu_pids[1] || cpu_pids[2] == cpu_pids[0] {
        bail!("the two chat models should share one CPU worker and the embedding model have its own; their CPU workers' pids are {cpu_pids:?}");
    }
    mark(timeline, clock, format!("several models: {} and {} share one CPU worker (pid {})", models[0], models[1], cpu_pids[0].unwrap_or(0)));
    let limit_mib = (sizing.sim_vram_mib - sizing.reserve_mib) as f64;
    let first = records.len();
    // The last wave runs beside a competing program that leaves one model's requests room for
    // one short request (in whole MiB): admission for each model counts it with the other
    // models' holdings, and the wave's model still evicts the idle one to run.
    let competitor_mib = (sizing.room_mib - sizing.short_request_mib).floor().max(0.0) as u64;
    let waves = [0usize, 2, 1, 0, 1];
    // What admission charges each model on the GPU (weights and grants), and the competing
    // program.
    let charged = |s: &Value| {
        let models: f64 = s["models"].as_array().into_iter().flatten().map(|m| m["gpu_weights_bytes"].as_f64().unwrap_or(0.0) + m["gpu_held_bytes"].as_f64().unwrap_or(0.0)).sum();
        Some((models + s["memory"]["gpu_other_bytes"].as_f64().unwrap_or(0.0)) / MIB as f64)
    };
    let waves_run = async {
        for (wave, &m) in waves.iter().enumerate() {
            let model = models[m].clone();
            let embedding = m == 2;
            let stream = wave % 2 == 1;
            let competing = wave == waves.len() - 1 && competitor_mib > 0;
            let fault = if competing { "competitor_evict_then_kill_9" } else { "evict_then_kill_9" };
            if competing {
                // A device-wide fault: every model's sim GPU worker, and the ones launched later, see it.
                mark(timeline, clock, format!("several models: a competing program takes {competitor_mib} MiB of the shared GPU"));
                server.fault(json!({"fault": "compete", "mib": competitor_mib})).await?;
            }
            let shots: Vec<Shot> = (0..scale.full_load)
                .map(|i| {
                    let verse = VERSES[i % VERSES.len()];
                    let body = if embedding { json!({"model": model, "input": verse, "encoding_format": "float"}) } else { chat_body(&model, verse, max_tokens, stream && i % 2 == 0) };
                    Shot {
                        scenario: "models_share_gpu",
                        class: if embedding { "embedding" } else { "short" },
                        fault,
                        stream: !embedding && stream && i % 2 == 0,
                        prompt_key: format!("models-{model}:{}", i % VERSES.len()),
                        body,
                        idempotency_key: None,
                        disconnect_after_chunks: None,
                        client_timeout: None,
                    }
                })
                .collect();
            eprintln!("pressure: several models, wave {} on {model}", wave + 1);
            // Slow enough that the wave's model has requests queued behind its full slots.
            server.fault(json!({"fault": "slowdown", "factor": 20.0, "model": model})).await?;
            let n = shots.len();
            let sending = run_all(&server, clock, shots, n);
            let firing = async {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let s = server.status().await?;
                    let entry = s["models"].as_array().into_iter().flatten().find(|e| e["id"] == model.as_str()).cloned().unwrap_or(Value::Null);
                    let q = entry["queues"].as_array().into_iter().flatten().find(|q| q["device"] == "gpu").cloned().unwrap_or(Value::Null);
                    if let (Some(pid), true) = (entry["gpu_pid"].as_u64(), q["running"].as_u64().unwrap_or(0) >= 1 && q["waiting"].as_u64().unwrap_or(0) >= 1) {
                        mark(timeline, clock, format!("several models: {model} holds the GPU, {} running and {} waiting; its GPU worker killed", q["running"], q["waiting"]));
                        send_signal(pid as u32, "KILL")?;
                        return Ok::<_, anyhow::Error>((clock.ms(), pid));
                    }
                    if Instant::now() > deadline {
                        bail!("{model} never filled its GPU slots with requests queued behind them within 30 s");
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            };
            let (burst, fired) = tokio::join!(sending, firing);
            let (fired_at, killed) = fired?;
            records.extend(burst);
            // Restored: the model has a new GPU worker its breaker trusts again, or it is unloaded
            // (evicted meanwhile, it loads again at its next request).
            let deadline = Instant::now() + Duration::from_secs(60);
            let restored = loop {
                let s = server.status().await?;
                let entry = s["models"].as_array().into_iter().flatten().find(|e| e["id"] == model.as_str()).cloned().unwrap_or(Value::Null);
                let pid = entry["gpu_pid"].as_u64();
                if (pid.is_some() && pid != Some(killed) && entry["breaker"] == "closed") || entry["gpu_residency"]["state"] == "unloaded" {
                    break true;
                }
                if Instant::now() > deadline {
                    break false;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            recoveries.push(Recovery { fault: fault.into(), stream, restored, recovery_ms: restored.then(|| clock.ms() - fired_at) });
            server.fault(json!({"fault": "clear", "model": model})).await?;
            if competing {
                server.fault(json!({"fault": "compete", "mib": 0})).await?;
                mark(timeline, clock, "several models: the competing program released");
            }
        }
        Ok::<_, anyhow::Error>(())
    };
    let (waves_done, peak_gpu_mib) = with_status_peak(&server, charged, waves_run).await;
    waves_done?;
    reconcile(&server, &mut records[first..]).await;
    let metrics = server.http.get(format!("{}/metrics", server.base)).send().await?.text().await?;
    let evictions = metrics.lines().filter(|l| l.starts_with("headroom_model_gpu_unloads_total{")).filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok()).sum();
    let loads = models
        .iter()
        .map(|m| {
            let line = format!("headroom_model_gpu_loads_total{{model=\"{m}\"}} ");
            (m.clone(), metrics.lines().find_map(|l| l.strip_prefix(line.as_str())?.parse().ok()).unwrap_or(0))
        })
        .collect();
    let latency_ms = models
        .iter()
        .map(|m| {
            let l: Vec<f64> = records[first..].iter().filter(|r| r.completed && r.prompt_key.starts_with(&format!("models-{m}:"))).map(|r| r.latency_ms).collect();
            (m.clone(), percentile(&l, 50.0), percentile(&l, 95.0))
        })
        .collect();
    // Ran on the GPU: admitted to its GPU queue, and finished there or failed over from it.
    let on_gpu = models
        .iter()
        .map(|m| {
            let ran = records[first..].iter().filter(|r| r.prompt_key.starts_with(&format!("models-{m}:")) && r.queued_on.as_deref() == Some("gpu") && (r.device.as_deref() == Some("sim") || r.failovers > 0));
            (m.clone(), ran.count())
        })
        .collect();
    server.stop().await;
    Ok(SharedRun { models, evictions, on_gpu, loads, latency_ms, peak_gpu_mib, limit_mib, competitor_mib })
}
