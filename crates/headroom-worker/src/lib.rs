//! `headroom-worker` owns the worker process (one device each: `cuda`, `cpu`, `sim`), the worker
//! protocol, health answers and fault injection for `sim`. It never decides routing: the router
//! tells it what to load and run.

pub mod kernel_cache;
pub mod protocol;
pub mod runtime;
pub mod sim;

use serde::{Deserialize, Serialize};

pub use protocol::{FailureKind, Fault, FromWorker, GenerateJob, MemoryReading, SplitLayers, ToWorker, PROTOCOL_VERSION};
pub use runtime::{DEVICE_FAULT_EXIT_CODE, RESET_EXIT_CODE};

/// The device a worker computes on. On the wire, in the journal and in every API it is its label
/// (`cpu`, `sim`, `cuda:0`). A planned CPU/GPU layer split will add a variant holding both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Device {
    Cpu,
    /// ndarray compute behind a simulated VRAM capacity with fault injection.
    Sim,
    Cuda(u32),
}

impl From<Device> for String {
    fn from(device: Device) -> String {
        device.label()
    }
}

impl TryFrom<String> for Device {
    type Error = String;
    fn try_from(label: String) -> Result<Self, String> {
        label.parse()
    }
}

impl PartialEq<str> for Device {
    fn eq(&self, label: &str) -> bool {
        self.label() == label
    }
}

impl PartialEq<&str> for Device {
    fn eq(&self, label: &&str) -> bool {
        self.label() == *label
    }
}

impl Device {
    pub fn label(&self) -> String {
        match self {
            Self::Cpu => "cpu".into(),
            Self::Sim => "sim".into(),
            Self::Cuda(i) => format!("cuda:{i}"),
        }
    }

    /// Whether this is the GPU side of the service (real or simulated).
    pub fn is_gpu(&self) -> bool {
        !matches!(self, Self::Cpu)
    }
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "sim" => Ok(Self::Sim),
            "cuda" => Ok(Self::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse) {
                Some(Ok(i)) => Ok(Self::Cuda(i)),
                _ => Err(format!("unknown device {s:?}; use cpu, sim, cuda or cuda:N")),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.label())
    }
}

/// How a worker process is started; the router passes these as `headroom worker` flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkerOptions {
    pub device: Device,
    /// Requests generated at once.
    pub max_concurrency: u32,
    /// Context limit below the model's own (prompt + max_tokens), if any.
    pub max_context_tokens: Option<u32>,
    /// Interval of unsolicited memory samples; 0 turns them off.
    pub memory_sample_ms: u64,
    /// Simulated VRAM capacity (sim only).
    pub sim_vram_mib: u64,
    /// Precision of the KV cache on the CPU device (the sim GPU models a GPU's f32).
    pub kv_cache: headroom_model::KvPrecision,
    /// Host RAM the CPU device keeps of finished requests' KV blocks for requests that begin
    /// the same way, in MiB (0: none; see `headroom_model::cpu::prefix`).
    pub prefix_cache_mib: u64,
    /// On a GPU: how many of the model's last layers it holds, the rest running on the CPU in
    /// this process (a planned split, `headroom_memory::split`). `None`: every layer.
    pub gpu_layers: Option<u32>,
    /// On the sim GPU: KV overcommit (`headroom_memory::MemoryConfig::kv_overcommit`; 1: none).
    pub kv_overcommit: f64,
    /// VRAM a request's KV blocks taken past its reservation (overcommit) leave free, in MiB.
    pub vram_reserve_mib: u64,
}

impl WorkerOptions {
    pub fn new(device: Device) -> Self {
        Self {
            device,
            // The CPU worker batches its requests too (`headroom model bench --concurrency`:
            // four sequences decode ~1.8–1.9× one sequence's tokens/s on 2 cores, all of them
            // streaming), so a full GPU lane that fails over keeps streaming instead of queueing.
            max_concurrency: 4,
            // The CPU path is slow at long contexts and must not eat host RAM: cap it below
            // what large models allow on a GPU.
            max_context_tokens: if device.is_gpu() { None } else { Some(8192) },
            memory_sample_ms: 1000,
            sim_vram_mib: 2048,
            kv_cache: headroom_model::KvPrecision::F32,
            prefix_cache_mib: 0,
            gpu_layers: None,
            kv_overcommit: 1.0,
            vram_reserve_mib: 0,
        }
    }

    /// The flags `headroom worker` takes for these options.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            "worker".to_string(),
            "--device".into(),
            self.device.label(),
            "--max-concurrency".into(),
            self.max_concurrency.to_string(),
            "--memory-sample-ms".into(),
            self.memory_sample_ms.to_string(),
            "--sim-vram-mib".into(),
            self.sim_vram_mib.to_string(),
        ];
        if let Some(limit) = self.max_context_tokens {
            args.extend(["--max-context-tokens".into(), limit.to_string()]);
        }
        if self.device == Device::Cpu {
            args.extend(["--kv-cache".into(), self.kv_cache.to_string()]);
            args.extend(["--prefix-cache-mib".into(), self.prefix_cache_mib.to_string()]);
        }
        if self.device.is_gpu() {
            args.extend(["--kv-overcommit".into(), self.kv_overcommit.to_string()]);
            args.extend(["--vram-reserve-mib".into(), self.vram_reserve_mib.to_string()]);
        }
        if let Some(n) = self.gpu_layers.filter(|_| self.device.is_gpu()) {
            args.extend(["--gpu-layers".into(), n.to_string()]);
        }
        args
    }
}

/// Runs the worker on this process's stdin and stdout; returns the exit status.
pub fn run_stdio(options: WorkerOptions) -> i32 {
    runtime::run(options, std::io::stdin().lock(), std::io::stdout())
}
