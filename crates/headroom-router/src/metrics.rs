//! Prometheus metrics of the service core. Counters move as requests end; gauges (queues,
//! memory, breaker, delays) are read from live state when `/metrics` is scraped, so they are
//! never stale.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct OutcomeLabels {
    pub device: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct FailoverLabels {
    pub from: String,
    pub to: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct DeviceLabel {
    pub device: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

pub(crate) struct Metrics {
    registry: Registry,
    pub requests: Family<OutcomeLabels, Counter>,
    pub failovers: Family<FailoverLabels, Counter>,
    pub replays: Counter,
    pub resumes: Counter,
    pub generated_tokens: Family<DeviceLabel, Counter>,
    /// 0 closed, 1 half-open, 2 open.
    pub breaker_state: Gauge,
    pub degraded: Gauge,
    pub gpu_paused: Gauge,
    pub gpu_model_loaded: Gauge,
    pub gpu_model_unloads: Counter,
    pub queue_waiting: Family<DeviceLabel, Gauge>,
    pub queue_running: Family<DeviceLabel, Gauge>,
    pub queue_capacity: Family<DeviceLabel, Gauge>,
    pub queue_oldest_age_seconds: Family<DeviceLabel, FloatGauge>,
    pub estimated_delay_seconds: Family<DeviceLabel, FloatGauge>,
    pub decode_ms_per_token: Family<DeviceLabel, FloatGauge>,
    pub prefill_ms_per_token: Family<DeviceLabel, FloatGauge>,
    pub vram_capacity_bytes: Gauge,
    pub vram_used_bytes: Gauge,
    /// What the memory model accounts for on the GPU: weights + reservations (+ a simulated
    /// competing program), to set against the observed `vram_used_bytes`.
    pub vram_predicted_bytes: Gauge,
    pub host_total_bytes: Gauge,
    pub host_available_bytes: Gauge,
    pub host_reserved_bytes: Gauge,
    pub prefix_cache_bytes: Gauge,
    pub cpu_kv_resident_bytes: Gauge,
    pub gpu_kv_resident_bytes: Gauge,
    pub preemptions: Counter,
    pub prefix_cache_looked_up_tokens: Gauge,
    pub prefix_cache_reused_tokens: Gauge,
}

impl Metrics {
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("headroom"),
            requests: Family::default(),
            failovers: Family::default(),
            replays: Counter::default(),
            resumes: Counter::default(),
            generated_tokens: Family::default(),
            breaker_state: Gauge::default(),
            degraded: Gauge::default(),
            gpu_paused: Gauge::default(),
            gpu_model_loaded: Gauge::default(),
            gpu_model_unloads: Counter::default(),
            queue_waiting: Family::default(),
            queue_running: Family::default(),
            queue_capacity: Family::default(),
            queue_oldest_age_seconds: Family::default(),
            estimated_delay_seconds: Family::default(),
            decode_ms_per_token: Family::default(),
            prefill_ms_per_token: Family::default(),
            vram_capacity_bytes: Gauge::default(),
            vram_used_bytes: Gauge::default(),
            vram_predicted_bytes: Gauge::default(),
            host_total_bytes: Gauge::default(),
            host_available_bytes: Gauge::default(),
            host_reserved_bytes: Gauge::default(),
            prefix_cache_bytes: Gauge::default(),
            cpu_kv_resident_bytes: Gauge::default(),
            gpu_kv_resident_bytes: Gauge::default(),
            preemptions: Counter::default(),
            prefix_cache_looked_up_tokens: Gauge::default(),
            prefix_cache_reused_tokens: Gauge::default(),
        };
        m.registry.register("requests", "Requests ended, by the device that served them and how they ended", m.requests.clone());
        m.registry.register("failovers", "Requests moved from one device to another mid-flight", m.failovers.clone());
        m.registry.register("replays", "Requests re-run from the start on another device", m.replays.clone());
        m.registry.register("resumes", "Streams resumed from their checkpoint on another device", m.resumes.clone());
        m.registry.register("generated_tokens", "Tokens generated, by device", m.generated_tokens.clone());
        m.registry.register("breaker_state", "GPU circuit breaker: 0 closed, 1 half-open, 2 open", m.breaker_state.clone());
        m.registry.register("degraded", "1 while GPU requests are served by the CPU worker", m.degraded.clone());
        m.registry.register("gpu_paused", "1 while the GPU is paused in settings (requests go to the CPU worker by choice)", m.gpu_paused.clone());
        m.registry.register("gpu_model_loaded", "1 while the GPU holds the model; 0 once its keep_alive unloaded it (the next GPU request loads it)", m.gpu_model_loaded.clone());
        m.registry.register("gpu_model_unloads", "Times the GPU's copy of the model was unloaded after its keep_alive", m.gpu_model_unloads.clone());
        m.registry.register("queue_waiting", "Requests waiting for a slot", m.queue_waiting.clone());
        m.registry.register("queue_running", "Requests running", m.queue_running.clone());
        m.registry.register("queue_capacity", "Requests that may wait before a capacity error", m.queue_capacity.clone());
        m.registry.register("queue_oldest_age_seconds", "Age of the oldest waiting request", m.queue_oldest_age_seconds.clone());
        m.registry.register("estimated_delay_seconds", "Expected wait of a new request, from measured rates", m.estimated_delay_seconds.clone());
        m.registry.register("decode_ms_per_token", "EWMA of measured decode time per token", m.decode_ms_per_token.clone());
        m.registry.register("prefill_ms_per_token", "EWMA of measured prefill time per prompt token", m.prefill_ms_per_token.clone());
        m.registry.register("vram_capacity_bytes", "GPU memory (the simulated capacity on sim)", m.vram_capacity_bytes.clone());
        m.registry.register("vram_used_bytes", "GPU memory observed in use", m.vram_used_bytes.clone());
        m.registry.register("vram_predicted_bytes", "GPU memory the memory model accounts for: weights + reservations + competing", m.vram_predicted_bytes.clone());
        m.registry.register("host_total_bytes", "Host RAM", m.host_total_bytes.clone());
        m.registry.register("host_available_bytes", "Host RAM available", m.host_available_bytes.clone());
        m.registry.register("host_reserved_bytes", "Host RAM reserved by CPU-path requests", m.host_reserved_bytes.clone());
        m.registry.register("cpu_kv_resident_bytes", "The CPU worker's KV blocks alive (running requests' and its prefix cache's), against host_reserved_bytes", m.cpu_kv_resident_bytes.clone());
        m.registry.register("gpu_kv_resident_bytes", "The GPU worker's running requests' KV blocks written so far, against vram_predicted_bytes (sim GPU)", m.gpu_kv_resident_bytes.clone());
        m.registry.register("preemptions", "GPU requests preempted for a KV block under kv_overcommit (each resumed on the CPU)", m.preemptions.clone());
        m.registry.register("prefix_cache_bytes", "Host RAM the CPU worker keeps of finished requests' KV blocks", m.prefix_cache_bytes.clone());
        m.registry.register("prefix_cache_looked_up_tokens", "Prompt tokens the CPU worker looked up in its prefix cache, in whole blocks", m.prefix_cache_looked_up_tokens.clone());
        m.registry.register("prefix_cache_reused_tokens", "Prompt tokens whose KV the CPU worker's prefix cache held (not computed again)", m.prefix_cache_reused_tokens.clone());
        m
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("writing to a String cannot fail");
        out
    }
}

pub(crate) fn device(device: &str) -> DeviceLabel {
    DeviceLabel { device: device.to_string() }
}
