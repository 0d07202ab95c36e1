//! The service as a library: [`run`] layers the configuration (file, saved settings, flags),
//! starts the workers under the supervisor, opens the journal, starts the dispatcher and serves
//! the HTTP API until told to stop, then shuts down gracefully (stop accepting, let running
//! requests finish, leave the rest to the journal). The `headroom` CLI and the desktop app both
//! parse [`ServeOptions`] and call it; both binaries also run [`run_worker`] when the supervisor
//! spawns them as `<exe> worker ...`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::ValueEnum;
use headroom_memory::MemoryConfig;
use headroom_model::bundle::resolve_model;
use headroom_model::device::{probe_cuda, CudaProbe};
use headroom_model::ModelBundle;
use headroom_router::{Dispatcher, Journal, QueueConfig, Recovery, Settings, SettingsFile, SupervisionConfig, Supervisor, SupervisorConfig};
use headroom_server::{AppState, Limits, ServerConfig};
use headroom_worker::{Device, WorkerOptions};

/// Logs to stderr, filtered by `HEADROOM_LOG` (default `warn`). Idempotent.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("HEADROOM_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .try_init();
}

/// `<exe> worker ...`: one worker process, as the supervisor spawns it (speaks the worker
/// protocol on stdio).
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// cpu, sim (simulated VRAM with fault injection) or cuda:N.
    #[arg(long)]
    pub device: String,
    /// Requests generated at once (default: 4 on a GPU, 1 on the CPU).
    #[arg(long)]
    pub max_concurrency: Option<u32>,
    /// Context limit (prompt + max_tokens) below the model's own.
    #[arg(long)]
    pub max_context_tokens: Option<u32>,
    #[arg(long, default_value_t = 1000)]
    pub memory_sample_ms: u64,
    /// Simulated VRAM capacity of the sim device.
    #[arg(long, default_value_t = 2048)]
    pub sim_vram_mib: u64,
    /// Precision of the CPU engine's KV cache: f32 or f16.
    #[arg(long, default_value = "f32")]
    pub kv_cache: headroom_model::KvPrecision,
    /// On the CPU: host RAM kept of finished requests' KV blocks for requests that begin the
    /// same way, in MiB (0: none).
    #[arg(long, default_value_t = 0)]
    pub prefix_cache_mib: u64,
    /// On a GPU: hold only the model's last N layers there and run the rest on the CPU (a split).
    #[arg(long)]
    pub gpu_layers: Option<u32>,
    /// On the sim GPU: admit requests holding 1/N of their KV blocks, taking the rest as they
    /// are written and preempting the request that started last when none is left (1: no overcommit).
    #[arg(long, default_value_t = 1.0)]
    pub kv_overcommit: f64,
    /// VRAM the KV blocks taken past a reservation leave free, in MiB.
    #[arg(long, default_value_t = 0)]
    pub vram_reserve_mib: u64,
}

/// Runs one worker until its stdin closes; returns the process exit code. Never touches CUDA
/// without a driver.
pub fn run_worker(args: WorkerArgs) -> Result<i32> {
    let device: Device = args.device.parse().map_err(anyhow::Error::msg)?;
    if let Device::Cuda(_) = device {
        if let CudaProbe::Unavailable { reason } = probe_cuda() {
            bail!("worker --device {device}: {reason}; use --device cpu or sim");
        }
    }
    Ok(headroom_worker::run_stdio(worker_options(device, args)))
}

fn worker_options(device: Device, args: WorkerArgs) -> WorkerOptions {
    let mut options = WorkerOptions::new(device);
    if let Some(n) = args.max_concurrency {
        options.max_concurrency = n.max(1);
    }
    options.max_context_tokens = args.max_context_tokens;
    options.memory_sample_ms = args.memory_sample_ms;
    options.sim_vram_mib = args.sim_vram_mib;
    options.kv_cache = args.kv_cache;
    options.prefix_cache_mib = args.prefix_cache_mib;
    options.gpu_layers = args.gpu_layers;
    options.kv_overcommit = args.kv_overcommit;
    options.vram_reserve_mib = args.vram_reserve_mib;
    options
}

/// One served model, as `[[models]]` in the config file gives it (or `--model`).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// `default`, a .gguf file, a Hugging Face folder, or a name in the models folder.
    pub source: String,
    /// The name requests give the model (default: its file or folder name without `.gguf`).
    #[serde(default)]
    pub name: Option<String>,
    /// Layers on the GPU: `"auto"` (as many as fit; the default, or `[memory] gpu_layers`) or a
    /// count (the rest run on the CPU, split).
    #[serde(default)]
    pub gpu_layers: Option<headroom_memory::GpuLayers>,
    /// `chat` or `embedding`; left out, an encoder (BERT) is an embedding model and any other
    /// model a chat model.
    #[serde(default)]
    pub role: Option<headroom_server::Role>,
    /// This model's keep_alive (default: `[memory] keep_alive`).
    #[serde(default)]
    pub keep_alive: Option<headroom_memory::KeepAlive>,
    /// Loaded at start and never evicted to make room for another model.
    #[serde(default)]
    pub pin: bool,
    /// A smaller model for this model's CPU worker (as `[server] cpu_fallback_model` is for
    /// the first): a models-folder name, a path, or the `name` of another [[models]] entry;
    /// replies it gives say so. Models whose CPU path runs the same model share one CPU worker.
    #[serde(default)]
    pub fallback: Option<String>,
}

impl ModelEntry {
    fn named(source: &str) -> Self {
        Self { source: source.to_string(), name: None, gpu_layers: None, role: None, keep_alive: None, pin: false, fallback: None }
    }

    /// What the model serves: its `role`, else what the model is. An encoder cannot chat.
    fn role(&self, bundle: &ModelBundle) -> Result<headroom_server::Role> {
        use headroom_server::Role;
        let encoder = bundle.config.is_encoder();
        match self.role {
            Some(Role::Chat) if encoder => bail!("{} is an embedding model (a BERT encoder): it cannot chat; set role = \"embedding\" in its [[models]] entry, or leave role out", self.source),
            Some(role) => Ok(role),
            None if encoder => Ok(Role::Embedding),
            None => Ok(Role::Chat),
        }
    }

    /// The id requests name the model by: its `name`, else the bundle's. A name is compared,
    /// never looked up as a path, and names the model's journal file: letters, digits and
    /// `.`, `_`, `-` only.
    fn id(&self, bundle: &ModelBundle) -> Result<String> {
        let Some(name) = &self.name else { return Ok(bundle.name()) };
        let fits = !name.is_empty() && name.len() <= 64 && !name.starts_with('.') && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !fits {
            bail!("[[models]] name {name:?} (for {}) is not a usable model name: use 1 to 64 letters, digits, '.', '_' or '-', not starting with '.' (requests name the model by it)", self.source);
        }
        Ok(name.clone())
    }
}

/// The model a `fallback` names: another entry by its `name`, else a models-folder name or path.
fn resolve_fallback(fallback: &str, entries: &[ModelEntry]) -> PathBuf {
    match entries.iter().find(|e| e.name.as_deref() == Some(fallback)) {
        Some(entry) => resolve_model(&entry.source),
        None => resolve_model(fallback),
    }
}

/// The CPU workers started so far, by the model they run: a model whose CPU path runs one of
/// them shares it (one process, one queue, its weights in RAM once).
#[derive(Default)]
struct CpuWorkers(Vec<(PathBuf, headroom_router::SharedCpu, String)>);

impl CpuWorkers {
    fn key(dir: &Path) -> PathBuf {
        dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf())
    }

    /// The CPU worker already running `dir`, and the model that started it.
    fn running(&self, dir: &Path) -> Option<(headroom_router::SharedCpu, String)> {
        let key = Self::key(dir);
        self.0.iter().find(|(k, _, _)| *k == key).map(|(_, cpu, owner)| (cpu.clone(), owner.clone()))
    }

    fn add(&mut self, dir: &Path, cpu: headroom_router::SharedCpu, owner: &str) {
        self.0.push((Self::key(dir), cpu, owner.to_string()));
    }
}

/// The models to serve: the `--model` flags, then `[[models]]`; only `[[models]]` when the flag
/// was left at its default and the file lists some.
fn model_entries(flags: &[String], text: &str) -> Result<Vec<ModelEntry>> {
    let listed: Vec<ModelEntry> = headroom_router::config_table(text, "models").map_err(|e| anyhow::anyhow!("{e}: each [[models]] takes source, name, role (chat or embedding), keep_alive, pin, fallback, gpu_layers"))?;
    let flagged: Vec<ModelEntry> = flags.iter().filter(|m| !m.trim().is_empty()).map(|m| ModelEntry::named(m.trim())).collect();
    let defaulted = flagged.len() == 1 && flagged[0].source == "default";
    let mut entries = if defaulted && !listed.is_empty() { Vec::new() } else { flagged };
    entries.extend(listed);
    if entries.is_empty() {
        entries.push(ModelEntry::named("default"));
    }
    Ok(entries)
}

/// Ollama's default port: where `OLLAMA_HOST` without a port points.
pub const OLLAMA_PORT: u16 = 11434;

/// `OLLAMA_HOST` as Ollama reads it: `[http://]host[:port]`, `:port`, or a bare host; the host
/// (`None`: keep the configured one) and the port (11434 when none is given).
fn ollama_host(value: &str) -> std::result::Result<(Option<String>, u16), String> {
    let rest = value.trim().trim_start_matches("http://").trim_start_matches("https://").trim_end_matches('/');
    let (host, port) = match rest.rsplit_once(':') {
        // An IPv6 address without a port ("::1") has colons but no brackets.
        Some((host, port)) if !host.contains(':') || host.ends_with(']') => {
            (host, port.parse::<u16>().map_err(|_| format!("{port:?} is not a port"))?)
        }
        _ => (rest, OLLAMA_PORT),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Ok(((!host.is_empty()).then(|| host.to_string()), port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_fallback_names_another_entry_or_a_model_and_models_on_one_cpu_model_share_its_worker() {
        let text = "[[models]]\nsource = \"kjv-demo\"\nname = \"small\"\n\n[[models]]\nsource = \"default\"\nfallback = \"small\"\n";
        let entries = model_entries(&["default".into()], text).unwrap();
        let by_name = resolve_fallback(entries[1].fallback.as_deref().unwrap(), &entries);
        assert_eq!(by_name, resolve_model("kjv-demo"), "`small` is the first entry's source");
        assert_eq!(resolve_fallback("kjv-demo", &entries), resolve_model("kjv-demo"), "a models-folder name as before");
        let cpu = headroom_router::SharedCpu::for_test(&by_name);
        let mut workers = CpuWorkers::default();
        workers.add(&resolve_model("kjv-demo"), cpu, "small");
        // The same folder by another spelling is the same CPU model.
        let spelled = resolve_model("kjv-demo").join("..").join("kjv-demo");
        assert_eq!(workers.running(&spelled).map(|(_, owner)| owner).as_deref(), Some("small"));
        assert!(workers.running(&resolve_model("default")).is_none());
    }

    #[test]
    fn models_take_a_name_and_their_layer_count() {
        use headroom_memory::GpuLayers;
        let text = "[[models]]\nsource = \"kjv-demo\"\nname = \"notes-embed\"\nrole = \"embedding\"\ngpu_layers = 2\n\n[[models]]\nsource = \"kjv-demo\"\ngpu_layers = \"auto\"\n";
        let entries = model_entries(&["default".into()], text).unwrap();
        assert_eq!((entries[0].name.as_deref(), entries[0].gpu_layers), (Some("notes-embed"), Some(GpuLayers::Count(2))));
        assert_eq!((entries[1].name.as_deref(), entries[1].gpu_layers), (None, Some(GpuLayers::Auto)));
        let bundle = ModelBundle::open(resolve_model("kjv-demo")).unwrap();
        assert_eq!(entries[0].id(&bundle).unwrap(), "notes-embed");
        assert_eq!(entries[1].id(&bundle).unwrap(), "kjv-demo", "without a name, the file's");
        for bad in ["../x", "a/b", "", ".hidden", "x y", "ä", "a:b"] {
            let entry = ModelEntry { name: Some(bad.into()), ..ModelEntry::named("kjv-demo") };
            let err = entry.id(&bundle).unwrap_err().to_string();
            assert!(err.contains("is not a usable model name"), "{bad:?}: {err}");
        }
        let err = model_entries(&["default".into()], "[[models]]\nsource = \"x\"\ngpu_layers = \"most\"\n").unwrap_err().to_string();
        assert!(err.contains("gpu_layers must be") && err.contains("each [[models]] takes"), "{err}");
    }

    #[test]
    fn ollama_host_reads_as_ollama_reads_it() {
        let cases = [
            ("127.0.0.1:11434", Some("127.0.0.1"), 11434),
            ("0.0.0.0", Some("0.0.0.0"), OLLAMA_PORT),
            (":8081", None, 8081),
            ("http://localhost:9000/", Some("localhost"), 9000),
            ("[::1]:7000", Some("::1"), 7000),
        ];
        for (value, host, port) in cases {
            assert_eq!(ollama_host(value), Ok((host.map(str::to_string), port)), "{value}");
        }
        assert!(ollama_host("localhost:http").unwrap_err().contains("not a port"));
    }

    #[derive(Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[derive(clap::Subcommand)]
    enum Command {
        Worker(WorkerArgs),
    }

    /// The flags the supervisor starts a worker with are the ones the worker reads back:
    /// concurrency, context limit and the CPU KV cache precision arrive unchanged.
    #[test]
    fn worker_options_survive_the_command_line() {
        let mut sent = WorkerOptions::new(Device::Cpu);
        sent.max_concurrency = 3;
        sent.max_context_tokens = Some(4096);
        sent.kv_cache = headroom_model::KvPrecision::F16;
        sent.prefix_cache_mib = 96;
        let args = std::iter::once("headroom".to_string()).chain(sent.to_args());
        let Command::Worker(parsed) = Cli::try_parse_from(args).unwrap().command;
        let device = parsed.device.parse().unwrap();
        let received = worker_options(device, parsed);
        assert_eq!(
            (received.device, received.max_concurrency, received.max_context_tokens, received.kv_cache, received.prefix_cache_mib),
            (sent.device, sent.max_concurrency, sent.max_context_tokens, sent.kv_cache, sent.prefix_cache_mib)
        );
        let bad = Cli::try_parse_from(["headroom", "worker", "--device", "cpu", "--kv-cache", "q8"]);
        assert!(bad.is_err_and(|e| e.to_string().contains("\"f32\" or \"f16\"")), "a clear error for an unknown precision");
    }
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
pub enum GpuChoice {
    /// CUDA when a driver answers, otherwise CPU only.
    Auto,
    Cuda,
    /// A simulated GPU (ndarray compute behind a VRAM limit, with fault injection).
    Sim,
    None,
}

#[derive(clap::Args, Debug)]
pub struct ServeOptions {
    /// Address to bind (default 127.0.0.1). Anything else requires HEADROOM_API_KEY.
    #[arg(long, env = "HEADROOM_HOST")]
    pub host: Option<String>,
    /// Port (default 8080; 0 picks a free one and prints it).
    #[arg(long, env = "HEADROOM_PORT")]
    pub port: Option<u16>,
    /// `default` (SmolLM2-135M-Instruct, Q4_1), a .gguf file, a Hugging Face folder, or the name of a
    /// model in the models folder (`kjv-demo`: the 4M-parameter test fixture). Repeat it (or
    /// separate with commas) to serve several models on one GPU; the first is loaded at start,
    /// the others at their first request. `[[models]]` in the config file adds models with a
    /// role, keep_alive and pin.
    #[arg(long = "model", env = "HEADROOM_MODEL", value_delimiter = ',', default_value = "default")]
    pub model: Vec<String>,
    #[arg(long, value_enum, env = "HEADROOM_GPU", default_value_t = GpuChoice::Auto)]
    pub gpu: GpuChoice,
    /// Simulated VRAM of `--gpu sim`.
    #[arg(long, default_value_t = 2048)]
    pub sim_vram_mib: u64,
    /// VRAM kept free for other programs (overrides [memory] vram_reserve_mib).
    #[arg(long)]
    pub vram_reserve_mib: Option<u64>,
    /// A Headroom config file (TOML: [server], [memory], [queues], [supervision]).
    #[arg(long, env = "HEADROOM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Where the request journal lives (default $XDG_DATA_HOME/headroom).
    #[arg(long, env = "HEADROOM_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
}

fn default_data_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("XDG_DATA_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("headroom");
    }
    match std::env::var_os("HOME") {
        Some(h) => PathBuf::from(h).join(".local/share/headroom"),
        None => PathBuf::from(".headroom"),
    }
}

/// The built web UI of this checkout, if any.
fn default_ui_dir() -> Option<PathBuf> {
    std::env::var_os("HEADROOM_UI_DIR")
        .map(PathBuf::from)
        .or_else(|| Some(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../ui/dist"))))
}

fn gpu_worker(choice: GpuChoice, sim_vram_mib: u64, cuda_device: u32) -> Result<Option<WorkerOptions>> {
    let cuda = |required: bool| -> Result<Option<WorkerOptions>> {
        match probe_cuda() {
            CudaProbe::Available { .. } if cfg!(feature = "cuda") => Ok(Some(WorkerOptions::new(Device::Cuda(cuda_device)))),
            CudaProbe::Available { .. } if required => bail!("--gpu cuda: this headroom was built without the `cuda` feature; rebuild with default features"),
            CudaProbe::Unavailable { reason } if required => bail!("--gpu cuda: {reason}; use --gpu auto, sim or none"),
            CudaProbe::Available { .. } => {
                eprintln!("headroom: serving from the CPU only: this build has no CUDA support");
                Ok(None)
            }
            CudaProbe::Unavailable { reason } => {
                eprintln!("headroom: serving from the CPU only: {reason}");
                Ok(None)
            }
        }
    };
    match choice {
        GpuChoice::Auto => cuda(false),
        GpuChoice::Cuda => cuda(true),
        GpuChoice::Sim => {
            let mut sim = WorkerOptions::new(Device::Sim);
            sim.sim_vram_mib = sim_vram_mib;
            Ok(Some(sim))
        }
        GpuChoice::None => Ok(None),
    }
}

/// Where the model's layers live on the GPU worker's device (`[memory] gpu_layers`), planned
/// from the VRAM free at each launch of the GPU worker: all of them when they fit with one
/// request of `split_min_context_tokens`, otherwise the last ones that do (a split), none when
/// not one layer fits (the GPU worker then does not start). The start plans with it, and the
/// supervisor again before every later launch ([`headroom_router::LayerPlanner`]).
struct LayerPlacement {
    bundle: ModelBundle,
    device: Device,
    memory: MemoryConfig,
    /// The count came from Settings: one that no longer fits falls back to "auto" (a saved
    /// choice must not keep the GPU down), where one from the config file is an error.
    from_settings: bool,
    /// Measured once, at the first split (the host's read bandwidth takes ~2 s to measure).
    bandwidths: std::sync::OnceLock<headroom_memory::Bandwidths>,
}

impl LayerPlacement {
    /// A model's placement: its layer count from its settings (saved from the settings
    /// screen), else its [[models]] entry, else `[memory] gpu_layers`.
    fn new(bundle: ModelBundle, device: Device, memory: &MemoryConfig, settings: &Settings, entry: &ModelEntry) -> Self {
        Self {
            bundle,
            device,
            memory: MemoryConfig { vram_reserve_mib: settings.vram_reserve_mib, gpu_layers: settings.gpu_layers.or(entry.gpu_layers).unwrap_or(memory.gpu_layers), ..memory.clone() },
            from_settings: settings.gpu_layers.is_some(),
            bandwidths: Default::default(),
        }
    }

    fn plan(&self, room: headroom_router::VramRoom) -> Result<headroom_memory::SplitPlan, String> {
        let label = self.device.label();
        let usable = room.free_bytes.min(room.total_bytes).saturating_sub(self.memory.vram_reserve_bytes(room.total_bytes));
        let chunk = headroom_model::generate::default_prefill_chunk() as u64;
        let plan = |memory: &MemoryConfig, bandwidths| headroom_memory::plan_model_split(&self.bundle, &label, memory, usable, 1, chunk, bandwidths);
        let fix = |e: String| format!("{e}. Set `gpu_layers` (in [memory] or HEADROOM_GPU_LAYERS; for a model of [[models]], in its entry) to a count that fits, or to \"auto\".");
        let mut memory = self.memory.clone();
        let placement = match plan(&memory, Default::default()) {
            Err(e) if self.from_settings => {
                eprintln!("headroom: the gpu_layers setting does not fit now ({}); placing as many layers as fit", fix(e));
                memory.gpu_layers = headroom_memory::GpuLayers::Auto;
                plan(&memory, Default::default()).map_err(fix)?
            }
            placed => placed.map_err(fix)?,
        };
        if placement.gpu_layers == 0 || placement.head_on_gpu {
            return Ok(placement);
        }
        // A split's speed estimate: the host's bandwidth measured, the GPU's from its driver.
        let bandwidths = *self.bandwidths.get_or_init(|| headroom_memory::Bandwidths {
            host: Some(headroom_model::cpu::measure_read_bandwidth()),
            gpu: match self.device {
                Device::Cuda(index) => headroom_model::device::cuda_memory_bandwidth(index as i32),
                _ => None,
            },
        });
        plan(&memory, bandwidths).map_err(fix)
    }
}

/// What an embedding app (the desktop shell) gets once the server listens.
#[derive(Clone)]
pub struct Running {
    /// Where the HTTP API and the web UI listen.
    pub addr: std::net::SocketAddr,
    /// The same routes, for in-process calls (`tower::ServiceExt::oneshot`), no socket involved.
    pub app: axum::Router,
    /// Whether the GPU worker is the simulated one (fault injection at /admin/sim/fault).
    pub simulated_gpu: bool,
}

/// `headroom serve`: runs until Ctrl-C or SIGTERM.
pub fn serve(args: ServeOptions) -> Result<()> {
    serve_until(args, |_| {}, shutdown_signal())
}

/// Runs the server on its own tokio runtime until `stop` completes.
pub fn serve_until(
    args: ServeOptions,
    on_ready: impl FnOnce(Running) + Send,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    tokio::runtime::Runtime::new()?.block_on(run(args, on_ready, stop))
}

/// Runs the server on the caller's runtime until `stop` completes, then shuts down gracefully
/// (stop accepting, let running requests finish, leave the rest to the journal). `on_ready` is
/// called once the workers are up and the port is bound.
pub async fn run(
    args: ServeOptions,
    on_ready: impl FnOnce(Running) + Send,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    let text = match &args.config {
        Some(path) => std::fs::read_to_string(path).with_context(|| format!("cannot read config file {}", path.display()))?,
        None => String::new(),
    };
    // Every table comes from the one reading of the file.
    let file = args.config.as_deref().map(|p| p.display().to_string()).unwrap_or_else(|| "config".into());
    let in_file = |e: &dyn std::fmt::Display| anyhow::anyhow!("{file}: {e}");
    let mut server = ServerConfig::from_toml(&text).map_err(|e| in_file(&e))?;
    let supervision = SupervisionConfig::from_toml(&text).map_err(|e| in_file(&e))?;
    let queues = QueueConfig::from_toml(&text).map_err(|e| in_file(&e))?;
    let mut memory = MemoryConfig::from_toml(&text).map_err(|e| in_file(&e))?;
    memory.apply_env()?;
    // Ollama's `OLLAMA_HOST`, for setups written for Ollama: below HEADROOM_HOST/PORT and the
    // flags, above the config file. Its port defaults to Ollama's 11434.
    if args.host.is_none() && args.port.is_none() {
        if let Some(value) = std::env::var("OLLAMA_HOST").ok().filter(|v| !v.trim().is_empty()) {
            let (host, port) = ollama_host(&value).map_err(|e| anyhow::anyhow!("OLLAMA_HOST={value:?}: {e}; give host[:port] such as 127.0.0.1:11434, or unset it"))?;
            if let Some(host) = host {
                server.host = host;
            }
            server.port = port;
        }
    }
    if let Some(host) = args.host {
        server.host = host;
    }
    if let Some(port) = args.port {
        server.port = port;
    }
    if let Some(mib) = args.vram_reserve_mib {
        memory.vram_reserve_mib = Some(mib);
    }
    memory.validate()?;
    if server.ui_dir.is_none() {
        server.ui_dir = default_ui_dir();
    }
    let api_key = std::env::var("HEADROOM_API_KEY").ok().filter(|k| !k.is_empty());
    if !server.is_loopback() && api_key.is_none() {
        bail!(
            "--host {} exposes the API beyond this machine: set HEADROOM_API_KEY to a secret (clients then send `Authorization: Bearer <it>`), or bind 127.0.0.1",
            server.host
        );
    }
    let data_dir = args.data_dir.or(server.data_dir.clone()).unwrap_or_else(default_data_dir);
    std::fs::create_dir_all(&data_dir).with_context(|| format!("cannot create the data directory {}; pass --data-dir", data_dir.display()))?;

    // Settings saved from the settings screen override the config file; flags override both
    // for this run.
    let settings_file = SettingsFile::in_dir(&data_dir);
    let mut settings = match settings_file.load().map_err(anyhow::Error::msg)? {
        Some(saved) => saved,
        None => Settings { vram_reserve_mib: memory.vram_reserve_mib, fallback_model: server.cpu_fallback_model.clone(), ..Settings::default() },
    };
    if let Some(mib) = args.vram_reserve_mib {
        settings.vram_reserve_mib = Some(mib);
    }

    let entries = model_entries(&args.model, &text).map_err(|e| in_file(&e))?;
    let primary = entries[0].clone();
    // The settings say which fallback model runs, so that a later change of another setting
    // restarts the CPU worker with it (the first model's `fallback` of [[models]] included).
    if settings.fallback_model.is_none() {
        settings.fallback_model = primary.fallback.as_deref().map(|f| resolve_fallback(f, &entries));
    }
    if let Some(dir) = &settings.fallback_model {
        headroom_router::settings::refuse_encoder_fallback(dir).map_err(anyhow::Error::msg)?;
    }
    let model_dir = resolve_model(&primary.source);
    let bundle = ModelBundle::open(&model_dir).with_context(|| format!("cannot open the model folder {}", model_dir.display()))?;
    let model_id = primary.id(&bundle)?;
    let primary_role = primary.role(&bundle)?;
    let mut gpu = gpu_worker(args.gpu, args.sim_vram_mib, settings.gpu_device)?;
    match gpu.as_mut() {
        // The sim GPU counts each request's KV blocks as they are written, so it can take the
        // blocks overcommit left out of a reservation and preempt when none is left.
        Some(sim) if sim.device == Device::Sim => {
            sim.kv_overcommit = memory.kv_overcommit;
            let total = sim.sim_vram_mib * headroom_memory::MIB;
            let reserve = settings.vram_reserve_mib.map_or_else(|| memory.vram_reserve_bytes(total), |mib| mib * headroom_memory::MIB);
            sim.vram_reserve_mib = reserve / headroom_memory::MIB;
        }
        _ if memory.kv_overcommit > 1.0 => {
            eprintln!("headroom: kv_overcommit = {} applies to the sim GPU only (a CUDA worker does not count its KV blocks against the device yet); every block is reserved up front", memory.kv_overcommit);
            memory.kv_overcommit = 1.0;
        }
        _ => {}
    }
    let layer_placement = gpu.as_ref().map(|gpu| Arc::new(LayerPlacement::new(bundle.clone(), gpu.device, &memory, &settings, &primary)));
    // The GPU worker launches with the layers of this plan (the supervisor's `placement`); no
    // Headroom worker holds VRAM yet. Without a reading (no NVML) every layer loads.
    let placement = match (&layer_placement, gpu.as_ref().and_then(|gpu| headroom_router::VramRoom::of(gpu, 0))) {
        (Some(placer), Some(room)) => {
            let plan = placer.plan(room).map_err(anyhow::Error::msg)?;
            eprintln!("headroom: {}", plan.reason);
            Some(plan)
        }
        _ => None,
    };
    let gpu = gpu.filter(|_| placement.as_ref().is_none_or(|p| p.gpu_layers > 0));
    let mut cpu = WorkerOptions::new(Device::Cpu);
    cpu.max_concurrency = settings.cpu_max_concurrency;
    cpu.max_context_tokens = Some(settings.cpu_max_context_tokens);
    cpu.kv_cache = memory.cpu_kv_cache;
    cpu.prefix_cache_mib = memory.cpu_prefix_cache_mib;

    {
        let backend = headroom_memory::calibration::backend_key(&gpu.as_ref().map(|g| g.device.label()).unwrap_or_else(|| "cpu".into()));
        let other_gpu = gpu.clone();
        let other_cpu = cpu.clone();
        let other_supervision = supervision.clone();
        let mut config = SupervisorConfig::new(std::env::current_exe()?, model_dir.clone(), gpu);
        config.cpu = cpu;
        config.cpu_fallback_model_dir = settings.fallback_model.clone();
        config.supervision = supervision;
        config.gpu_paused = settings.gpu_paused;
        config.keep_alive = primary.keep_alive.unwrap_or(memory.keep_alive);
        config.placement = placement;
        config.replan = layer_placement.filter(|_| config.gpu.is_some()).map(|placer| headroom_router::LayerPlanner(Arc::new(move |room| placer.plan(room))));
        eprintln!("headroom: starting workers for {} ({})", bundle.name(), bundle.short_hash());
        let supervisor = Supervisor::start(config).await.context("cannot start the workers")?;
        // A split GPU worker's share of each request follows from its `Ready` (the dispatcher's
        // planner is the whole model's).
        let (planner, calibration) = headroom_memory::planner_for(&bundle, backend, memory.clone());
        if !calibration.measured {
            eprintln!("headroom: memory estimates use defaults: {}", calibration.source);
        }
        let journal_path = data_dir.join("journal.sqlite");
        let journal = Journal::open(&journal_path)?;
        let (dispatcher, recovered) = Dispatcher::start(supervisor.clone(), journal, planner, memory.clone(), queues.clone(), settings.clone(), Some(settings_file))?;
        let rerun = recovered.iter().filter(|r| matches!(r, Recovery::Rerun(_))).count();
        if !recovered.is_empty() {
            eprintln!(
                "headroom: the journal held {} unfinished requests from the last run: {rerun} re-run, {} marked failed (resumable)",
                recovered.len(),
                recovered.len() - rerun
            );
        }
        let limits = Limits { context_tokens: bundle.config.max_position_embeddings, default_max_tokens: server.default_max_tokens };
        let bundle = Arc::new(bundle);
        let mut served = vec![headroom_server::ServedModel { dispatcher: dispatcher.clone(), bundle: bundle.clone(), model_id: model_id.clone(), limits: limits.clone(), role: primary_role }];
        // The other models: their own workers on the same GPU (loaded at their first request
        // unless pinned) and their own journals; one GPU budget for all.
        let share = headroom_router::GpuShare::new();
        if entries.len() > 1 {
            dispatcher.share_gpu(&share, &model_id, primary.pin);
        }
        let mut cpu_workers = CpuWorkers::default();
        cpu_workers.add(settings.fallback_model.as_deref().unwrap_or(&model_dir), supervisor.shared_cpu(), &model_id);
        for entry in &entries[1..] {
            let dir = resolve_model(&entry.source);
            let other = ModelBundle::open(&dir).with_context(|| format!("cannot open the model {} ({}) of [[models]]", entry.source, dir.display()))?;
            let id = entry.id(&other)?;
            let role = entry.role(&other)?;
            if served.iter().any(|m| m.model_id == id) {
                bail!("the model name {id} is served twice (--model and [[models]], or two [[models]]); list each model once, or give one a `name`");
            }
            // Its own fallback model and layer count: saved from the settings screen (for this
            // model), else its [[models]] entry; the service-wide settings are the first model's.
            let own_file = SettingsFile { path: data_dir.join(format!("settings-{id}.json")) };
            let saved = own_file.load().map_err(anyhow::Error::msg)?;
            let own_settings = Settings {
                fallback_model: saved.as_ref().and_then(|s| s.fallback_model.clone()).or_else(|| entry.fallback.as_deref().map(|f| resolve_fallback(f, &entries))),
                gpu_layers: saved.as_ref().and_then(|s| s.gpu_layers),
                ..settings.clone()
            };
            if let Some(dir) = &own_settings.fallback_model {
                headroom_router::settings::refuse_encoder_fallback(dir).map_err(|e| anyhow::anyhow!("{id}: {e}"))?;
            }
            let mut config = SupervisorConfig::new(std::env::current_exe()?, dir.clone(), other_gpu.clone());
            // Its layers planned from the VRAM free at each launch, as the first model's.
            config.replan = other_gpu.as_ref().map(|gpu| {
                let placer = LayerPlacement::new(other.clone(), gpu.device, &memory, &own_settings, entry);
                headroom_router::LayerPlanner(Arc::new(move |room| placer.plan(room)))
            });
            config.cpu = other_cpu.clone();
            config.supervision = other_supervision.clone();
            config.gpu_paused = settings.gpu_paused;
            config.keep_alive = entry.keep_alive.unwrap_or(memory.keep_alive);
            config.gpu_at_start = entry.pin;
            config.cpu_fallback_model_dir = own_settings.fallback_model.clone();
            let cpu_dir = own_settings.fallback_model.clone().unwrap_or_else(|| dir.clone());
            let shared = cpu_workers.running(&cpu_dir);
            let cpu_line = match &shared {
                Some((_, owner)) => format!("; its CPU path runs on {owner}'s CPU worker ({})", cpu_dir.display()),
                None => String::new(),
            };
            let borrowed = shared.is_some();
            config.cpu_share = shared.map(|(cpu, _)| cpu);
            eprintln!("headroom: starting workers for {} ({}, {}{}{cpu_line})", id, other.short_hash(), role.as_str(), if entry.pin { ", pinned" } else { "" });
            let other_supervisor = Supervisor::start(config).await.with_context(|| format!("cannot start the workers of {id}"))?;
            if !borrowed {
                cpu_workers.add(&cpu_dir, other_supervisor.shared_cpu(), &id);
            }
            let (planner, _) = headroom_memory::planner_for(&other, backend, memory.clone());
            let journal = Journal::open(&data_dir.join(format!("journal-{id}.sqlite")))?;
            // Service-wide settings changed in the UI reach every model through the server;
            // this model's fallback and layer count are changed with `?model=` and saved in
            // its own file.
            let (other_dispatcher, recovered) = Dispatcher::start(other_supervisor, journal, planner, memory.clone(), queues.clone(), own_settings, Some(own_file))?;
            if !recovered.is_empty() {
                eprintln!("headroom: {id}: the journal held {} unfinished requests from the last run", recovered.len());
            }
            other_dispatcher.share_gpu(&share, &id, entry.pin);
            served.push(headroom_server::ServedModel {
                dispatcher: other_dispatcher,
                limits: Limits { context_tokens: other.config.max_position_embeddings, default_max_tokens: server.default_max_tokens },
                bundle: Arc::new(other),
                model_id: id,
                role,
            });
        }
        let state = Arc::new(AppState {
            dispatcher: dispatcher.clone(),
            limits,
            bundle,
            model_id: model_id.clone(),
            role: primary_role,
            models: Arc::new(served.clone()),
            api_key,
            sim_faults: args.gpu == GpuChoice::Sim,
            created_unix: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        });
        let app = headroom_server::app(state, &server);
        let in_process = app.clone();
        let listener = tokio::net::TcpListener::bind((server.host.as_str(), server.port))
            .await
            .with_context(|| format!("cannot listen on {}:{}; is another server using the port? pass --port", server.host, server.port))?;
        let addr = listener.local_addr()?;
        let status = supervisor.status();
        let gpu_line = match &status.gpu {
            Some(g) => format!("GPU worker {} (pid {}{})", g.device, g.pid, if g.simulated { ", simulated" } else { "" }),
            None if supervisor.config().gpu.is_some() => format!("GPU worker not running ({}); serving from the CPU", status.reason),
            None => "no GPU worker".into(),
        };
        println!("headroom: serving {model_id} at http://{addr} ({gpu_line}; CPU worker warm; journal {})", journal_path.display());
        use std::io::Write;
        let _ = std::io::stdout().flush();
        on_ready(Running { addr, app: in_process, simulated_gpu: args.gpu == GpuChoice::Sim });
        let grace = Duration::from_millis(server.shutdown_grace_ms);
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        let serving = axum::serve(listener, app).with_graceful_shutdown(async move {
            let _ = stop_rx.wait_for(|stop| *stop).await;
        });
        let mut serving = std::pin::pin!(std::future::IntoFuture::into_future(serving));
        tokio::select! {
            r = &mut serving => r?,
            _ = stop => {
                eprintln!("headroom: shutting down: no new requests; waiting for {} running", dispatcher.in_flight());
                let _ = stop_tx.send(true);
                // Connections close as their requests finish; long-lived ones (event streams)
                // are cut after the grace period.
                if let Ok(r) = tokio::time::timeout(grace, &mut serving).await {
                    r?;
                }
            }
        }
        let mut left = 0;
        for m in &served {
            left += m.dispatcher.drain(grace).await;
        }
        if left > 0 {
            eprintln!("headroom: {left} requests still running are left in the journal; the next start re-runs them");
        }
        for m in &served {
            m.dispatcher.supervisor().shutdown().await;
        }
        Ok(())
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
