//! Every memory-policy knob in one serde struct: defaults, then a TOML file, then `HEADROOM_*`
//! environment variables (flags are applied last by the binary).

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::footprint::MIB;
use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// VRAM kept free for other programs and spikes, in MiB. Unset: the larger of
    /// `vram_reserve_min_mib` and `vram_reserve_percent` of total VRAM.
    pub vram_reserve_mib: Option<u64>,
    pub vram_reserve_percent: f64,
    pub vram_reserve_min_mib: u64,
    /// Added to each request's KV cache + workspace, in percent, for allocator fragmentation.
    pub fragmentation_margin_percent: f64,
    /// Host RAM the CPU path never touches: the larger of these two.
    pub host_reserve_mib: u64,
    pub host_reserve_percent: f64,
    /// Longest a request may wait in the GPU queue before it is sent to CPU or refused, in ms.
    pub max_queue_wait_ms: u64,
    /// Whether a request that does not fit on the GPU may run on the CPU worker.
    pub allow_cpu_redirect: bool,
    /// A shrink below this many tokens is not offered; the request goes elsewhere.
    pub min_shrunk_tokens: u64,
    /// Memory sampling rate for the UI and metrics, in ms.
    pub sample_interval_ms: u64,
    /// Precision of the CPU worker's KV cache, `"f32"` or `"f16"` (half the host RAM per token,
    /// the same text within rounding). Admission counts the chosen one.
    pub cpu_kv_cache: headroom_model::KvPrecision,
    /// Host RAM the CPU worker may keep of finished requests' KV caches, in MiB, so a request
    /// that begins like an earlier one (a system prompt, a chat's earlier turns) skips that
    /// part of its prefill. Counted in the host budget; 0 turns it off.
    pub cpu_prefix_cache_mib: u64,
    /// How many transformer layers the GPU holds when the whole model does not fit: `"auto"`
    /// (as many as fit, see [`crate::split`]) or a count.
    pub gpu_layers: crate::split::GpuLayers,
    /// The context every request on a split's GPU layers is guaranteed, in tokens: the plan
    /// keeps room for its KV cache at the GPU worker's concurrency.
    pub split_min_context_tokens: u64,
    /// KV overcommit on the GPU: a request is admitted holding only 1/this of the KV blocks its
    /// prompt + max_tokens could fill (never fewer than its prompt's and one more), and takes
    /// the rest block by block as it writes them. 1 (the default) reserves every block up front,
    /// so an admitted request never runs out. Above 1, when the device has no block left for a
    /// running request, the request that started last is preempted: it moves to the CPU queue and resumes
    /// there from its checkpoint (journaled, nothing lost). Only the sim GPU counts blocks today.
    pub kv_overcommit: f64,
    /// How long the GPU keeps the model loaded after its last request (Ollama's `keep_alive`:
    /// `"5m"`, `"1h"`, seconds; 0 unloads it as soon as it is idle, -1 never). An unloaded
    /// model frees its VRAM for other programs and loads again for the next request, which
    /// waits for the load on the GPU rather than going to the CPU. The CPU worker stays loaded:
    /// it is the failover. A request's own `keep_alive` (Ollama's API) replaces it from then on.
    pub keep_alive: crate::KeepAlive,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            vram_reserve_mib: None,
            vram_reserve_percent: 10.0,
            vram_reserve_min_mib: 1024,
            fragmentation_margin_percent: 10.0,
            host_reserve_mib: 2048,
            host_reserve_percent: 10.0,
            max_queue_wait_ms: 30_000,
            allow_cpu_redirect: true,
            min_shrunk_tokens: 16,
            sample_interval_ms: 1000,
            cpu_kv_cache: headroom_model::KvPrecision::F32,
            cpu_prefix_cache_mib: 256,
            gpu_layers: crate::split::GpuLayers::Auto,
            split_min_context_tokens: 4096,
            kv_overcommit: 1.0,
            keep_alive: crate::KeepAlive::Forever,
        }
    }
}

fn env_parse<T: std::str::FromStr>(name: &str) -> Result<Option<T>> {
    match std::env::var(name) {
        Ok(v) => v.trim().parse().map(Some).map_err(|_| {
            Error::Config(format!("{name}={v:?} is not a valid value; unset it or fix it"))
        }),
        Err(_) => Ok(None),
    }
}

impl MemoryConfig {
    /// Defaults, overlaid by the `[memory]` table of a TOML file, then by the environment.
    pub fn load(file: Option<&Path>) -> Result<Self> {
        let mut config = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    Error::Config(format!("cannot read config file {}: {e}", path.display()))
                })?;
                Self::from_toml(&text)
                    .map_err(|e| Error::Config(format!("{}: {e}", path.display())))?
            }
            None => Self::default(),
        };
        config.apply_env()?;
        Ok(config)
    }

    /// Parses the `[memory]` table of a Headroom config file (other tables are ignored here).
    pub fn from_toml(text: &str) -> Result<Self> {
        let value: toml::Table =
            toml::from_str(text).map_err(|e| Error::Config(format!("invalid TOML: {e}")))?;
        match value.get("memory") {
            Some(table) => table
                .clone()
                .try_into()
                .map_err(|e| Error::Config(format!("[memory]: {e}"))),
            None => Ok(Self::default()),
        }
    }

    pub fn apply_env(&mut self) -> Result<()> {
        if let Some(v) = env_parse("HEADROOM_VRAM_RESERVE_MIB")? {
            self.vram_reserve_mib = Some(v);
        }
        if let Some(v) = env_parse("HEADROOM_VRAM_RESERVE_PERCENT")? {
            self.vram_reserve_percent = v;
        }
        if let Some(v) = env_parse("HEADROOM_FRAGMENTATION_MARGIN_PERCENT")? {
            self.fragmentation_margin_percent = v;
        }
        if let Some(v) = env_parse("HEADROOM_HOST_RESERVE_MIB")? {
            self.host_reserve_mib = v;
        }
        if let Some(v) = env_parse("HEADROOM_MAX_QUEUE_WAIT_MS")? {
            self.max_queue_wait_ms = v;
        }
        if let Some(v) = env_parse("HEADROOM_ALLOW_CPU_REDIRECT")? {
            self.allow_cpu_redirect = v;
        }
        if let Some(v) = env_parse("HEADROOM_CPU_KV_CACHE")? {
            self.cpu_kv_cache = v;
        }
        if let Some(v) = env_parse("HEADROOM_CPU_PREFIX_CACHE_MIB")? {
            self.cpu_prefix_cache_mib = v;
        }
        if let Some(v) = env_parse("HEADROOM_GPU_LAYERS")? {
            self.gpu_layers = v;
        }
        if let Some(v) = env_parse("HEADROOM_SPLIT_MIN_CONTEXT_TOKENS")? {
            self.split_min_context_tokens = v;
        }
        if let Some(v) = env_parse("HEADROOM_KV_OVERCOMMIT")? {
            self.kv_overcommit = v;
        }
        // Ollama's variable is read too, so a setup written for Ollama keeps its behaviour;
        // Headroom's own wins.
        for name in ["OLLAMA_KEEP_ALIVE", "HEADROOM_KEEP_ALIVE"] {
            if let Ok(v) = std::env::var(name) {
                self.keep_alive = v.parse().map_err(|e| Error::Config(format!("{name}: {e}")))?;
            }
        }
        self.validate()
    }

    pub fn validate(&self) -> Result<()> {
        if !(0.0..=90.0).contains(&self.vram_reserve_percent) {
            return Err(Error::Config(format!(
                "vram_reserve_percent must be between 0 and 90, got {}",
                self.vram_reserve_percent
            )));
        }
        if self.split_min_context_tokens == 0 {
            return Err(Error::Config("split_min_context_tokens must be at least 1 (the context a request is guaranteed on the GPU's layers)".into()));
        }
        if !(1.0..=16.0).contains(&self.kv_overcommit) {
            return Err(Error::Config(format!(
                "kv_overcommit must be between 1 (every KV block reserved up front) and 16, got {}",
                self.kv_overcommit
            )));
        }
        if !(0.0..=100.0).contains(&self.fragmentation_margin_percent) {
            return Err(Error::Config(format!(
                "fragmentation_margin_percent must be between 0 and 100, got {}",
                self.fragmentation_margin_percent
            )));
        }
        Ok(())
    }

    pub fn vram_reserve_bytes(&self, total_bytes: u64) -> u64 {
        match self.vram_reserve_mib {
            Some(mib) => mib * MIB,
            None => (self.vram_reserve_min_mib * MIB)
                .max((total_bytes as f64 * self.vram_reserve_percent / 100.0) as u64),
        }
    }

    pub fn host_reserve_bytes(&self, total_bytes: u64) -> u64 {
        (self.host_reserve_mib * MIB)
            .max((total_bytes as f64 * self.host_reserve_percent / 100.0) as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::footprint::GIB;

    #[test]
    fn default_reserve_is_the_larger_of_1_gib_and_10_percent() {
        let c = MemoryConfig::default();
        assert_eq!(c.vram_reserve_bytes(8 * GIB), GIB);
        assert_eq!(c.vram_reserve_bytes(80 * GIB), 8 * GIB);
    }

    #[test]
    fn toml_overrides_defaults_and_rejects_unknown_keys() {
        let c = MemoryConfig::from_toml("[memory]\nvram_reserve_mib = 512\n").unwrap();
        assert_eq!(c.vram_reserve_bytes(80 * GIB), 512 * MIB);
        let err = MemoryConfig::from_toml("[memory]\nvram_reserv_mib = 512\n").unwrap_err();
        assert!(err.to_string().contains("vram_reserv_mib"), "{err}");
    }
}
