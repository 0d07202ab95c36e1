//! Service events: every breaker transition, worker start, exit and restart, failover and memory
//! sample, with its reason. They feed the UI, the tray, the SSE stream and metrics.

use std::time::{SystemTime, UNIX_EPOCH};

use headroom_worker::{Device, MemoryReading};
use serde::{Deserialize, Serialize};

use crate::breaker::BreakerState;
use crate::Lane;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceEvent {
    pub at_unix_ms: u64,
    #[serde(flatten)]
    pub kind: EventKind,
}

impl ServiceEvent {
    pub fn now(kind: EventKind) -> Self {
        let at_unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        Self { at_unix_ms, kind }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    BreakerChanged { from: BreakerState, to: BreakerState, reason: String },
    /// The service entered (`degraded: true`) or left degraded mode: GPU requests go to the CPU.
    Degraded {
        degraded: bool,
        reason: String,
        /// While degraded: the plain sentence (see [`crate::degraded`]), for banners and the tray.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        summary: Option<String>,
    },
    /// The GPU was paused or resumed in settings (the person's choice, not a failure).
    GpuPaused { paused: bool, reason: String },
    /// The GPU's copy of the model was unloaded: idle past its keep_alive (not degraded).
    GpuModelUnloaded { device: Device, reason: String },
    /// A request asked for the unloaded model: its GPU worker is starting for it.
    GpuModelLoading { device: Device, reason: String },
    /// Settings changed: all of them now, which changed, and which of those wait for a restart.
    SettingsChanged { settings: crate::settings::Settings, changed: Vec<String>, restart_required: Vec<String> },
    WorkerStarted { device: Device, pid: u32, simulated: bool, load_ms: f64, bundle_hash: String },
    WorkerExited { device: Device, pid: u32, status: String },
    WorkerRestartScheduled { device: Device, attempt: u32, delay_ms: u64, reason: String },
    /// The GPU worker's layers were placed again before a launch, differently: `placement` as
    /// `/v1/status` says it ("split: 2 of 4 layers on the GPU"), the split's predicted decode
    /// tokens/s, and the plan's reason.
    PlacementChanged { placement: String, gpu_layers: u32, layers: u32, predicted_decode_tok_s: Option<f64>, reason: String },
    HealthCheckFailed { device: Device, pid: u32, reason: String },
    Failover { request_id: String, from: Device, to: Device, reason: String, resumed_after_tokens: u32 },
    MemorySample { reading: MemoryReading },
    /// A queue's depth changed (a request joined, started or left).
    QueueChanged { device: Lane, waiting: u32, running: u32, capacity: u32, oldest_wait_ms: u64, estimated_delay_ms: Option<u64> },
}
