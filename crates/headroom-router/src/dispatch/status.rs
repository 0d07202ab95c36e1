//! What the service is doing, in one typed snapshot for the HTTP surface and the desktop app:
//! whether it is degraded and why, each worker's state, the queues, the GPU's memory and budget;
//! and where one request is served (its response headers).

use headroom_worker::MemoryReading;

use super::*;
use crate::breaker::BreakerState;

/// A worker as status shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// GPU paused from settings: its worker is stopped on purpose.
    Paused,
    /// Not running (restarting, or failed to start).
    Down,
    /// Running, memory not reported yet: nothing can be admitted to it.
    Starting,
    Ready,
    /// The breaker's half-open probe is running on it.
    Probing,
    /// Running, but the breaker is open: it takes no requests.
    Unhealthy,
    /// Stopped after its model's keep_alive: the next GPU request starts it (not a failure).
    Unloaded,
}

impl std::fmt::Display for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Paused => "paused",
            Self::Down => "down",
            Self::Starting => "starting",
            Self::Ready => "ready",
            Self::Probing => "probing",
            Self::Unhealthy => "unhealthy",
            Self::Unloaded => "unloaded",
        })
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSnapshot {
    pub lane: Lane,
    pub device: Device,
    pub pid: Option<u32>,
    pub state: WorkerState,
    pub simulated: bool,
    pub model: Option<String>,
    pub bundle_hash: Option<String>,
    /// The model runs split between this GPU and the CPU.
    pub split: Option<headroom_worker::SplitLayers>,
    /// The longest prompt + reply the worker accepts.
    pub context_tokens: Option<u32>,
}

/// The whole service at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceStatus {
    /// Why GPU requests are served by the CPU now; None while the GPU serves (or there is none).
    pub degradation: Option<Degradation>,
    pub breaker: BreakerState,
    pub gpu_paused: bool,
    /// The GPU worker (when one is configured), then the CPU worker.
    pub workers: Vec<WorkerSnapshot>,
    pub queues: Vec<QueueStatus>,
    pub estimated_delay_ms: Option<u64>,
    /// The GPU worker's last memory reading.
    pub gpu_memory: Option<MemoryReading>,
    /// What admission works with on the GPU now (None while it takes no requests).
    pub gpu_budget: Option<Budget>,
    /// The CPU worker's prefix cache, from its last memory reading.
    pub cpu_prefix_cache: Option<headroom_model::cpu::PrefixStats>,
    /// Host RAM reserved for requests on the CPU path (KV cache for prompt + max_tokens and
    /// workspace each), and the CPU worker's KV blocks alive (its last reading): what admission
    /// promised against what the requests use.
    pub host_reserved_bytes: u64,
    pub cpu_kv_resident_bytes: Option<u64>,
    /// The GPU's KV cache in blocks, where its worker counts them (the sim GPU).
    pub gpu_kv: Option<GpuKv>,
    /// The GPU's copy of the model: loaded or unloaded, its keep_alive (None without a GPU).
    pub gpu_residency: Option<crate::supervisor::GpuResidency>,
}

/// The GPU worker's KV cache in blocks: what the running requests wrote against what they
/// reserved, and the overcommit that lets them reserve less.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct GpuKv {
    /// Positions per block, and one block's bytes (every layer).
    pub block_tokens: u32,
    pub block_bytes: u64,
    /// Blocks the running requests wrote so far.
    pub resident_blocks: u64,
    pub resident_bytes: u64,
    /// What the running requests hold on the device (KV blocks reserved and taken, workspace).
    pub reserved_bytes: u64,
    /// Blocks the device has room for beside the weights and the VRAM reserve: the pool the
    /// requests' blocks (and workspace) come from.
    pub pool_blocks: u64,
    /// `kv_overcommit`: requests reserve 1/this of their blocks (1: all of them).
    pub overcommit: f64,
    /// Requests preempted for a block since the worker started.
    pub preemptions: u64,
}

impl ServiceStatus {
    pub fn degraded(&self) -> bool {
        self.degradation.is_some()
    }
}

/// Where a request is (or was) served and whether that is degraded, as its response says.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub request_id: String,
    /// The device label (`cuda:0`, `sim`, `cpu`).
    pub device: String,
    /// Served by a GPU worker that runs the model split between it and the CPU.
    pub split: Option<headroom_worker::SplitLayers>,
    pub degradation: Option<Degradation>,
    pub estimated_delay_ms: Option<u64>,
}

impl Placement {
    pub fn degraded(&self) -> bool {
        self.degradation.is_some()
    }
}

impl Completion {
    /// Where it ran, for its response.
    pub fn placement(&self) -> Placement {
        Placement {
            request_id: self.outcome.request_id.clone(),
            device: self.outcome.device.label(),
            split: self.outcome.split,
            degradation: self.outcome.degraded_reason.clone().map(|reason| Degradation { summary: self.outcome.degraded_summary.clone().unwrap_or_else(|| reason.clone()), reason }),
            estimated_delay_ms: Some(0),
        }
    }
}

impl Dispatcher {
    /// Whether the service has a GPU worker at all.
    pub fn gpu_configured(&self) -> bool {
        self.inner.supervisor.config().gpu.is_some()
    }

    /// Every service event from now on (breaker, workers, failovers, queues, memory).
    pub fn subscribe(&self) -> tokio::sync::broadcast::Receiver<crate::ServiceEvent> {
        self.inner.supervisor.subscribe()
    }

    /// How many times slower the CPU lane decodes than the GPU lane, once both were measured.
    pub fn cpu_slower_by(&self) -> Option<f64> {
        let ms = |lane: &LaneQueue| lane.rates.lock().unwrap().decode_ms_per_token;
        Some(ms(&self.inner.cpu)? / ms(&self.inner.gpu)?.max(1e-9))
    }

    /// The service's status now.
    pub fn status(&self) -> ServiceStatus {
        let s = &self.inner.supervisor;
        let device = s.status();
        let gpu_memory = s.gpu_worker().and_then(|w| w.memory().borrow().clone());
        let mut workers = Vec::new();
        if let Some(gpu) = &s.config().gpu {
            let w = device.gpu.as_ref();
            let state = match (w, device.breaker) {
                _ if device.gpu_paused => WorkerState::Paused,
                (None, _) if device.gpu_unloaded => WorkerState::Unloaded,
                (None, _) => WorkerState::Down,
                // A worker that has not reported its memory yet cannot be admitted to.
                (Some(_), BreakerState::Closed) if gpu_memory.is_none() => WorkerState::Starting,
                (Some(_), BreakerState::Closed) => WorkerState::Ready,
                (Some(_), BreakerState::HalfOpen) => WorkerState::Probing,
                (Some(_), BreakerState::Open) => WorkerState::Unhealthy,
            };
            workers.push(snapshot(Lane::Gpu, gpu.device, w, state));
        }
        let c = device.cpu.as_ref();
        workers.push(snapshot(Lane::Cpu, Device::Cpu, c, if c.is_some() { WorkerState::Ready } else { WorkerState::Down }));
        let pool_bytes = self.own_gpu_budget().map_or(0, |b| b.capacity_bytes());
        let gpu_kv = gpu_memory.as_ref().and_then(|r| {
            let planner = self.planner();
            let block_bytes = planner.kv_block_bytes().max(1);
            r.kv_resident_bytes.map(|resident| GpuKv {
                block_tokens: headroom_model::model::KV_BLOCK as u32,
                block_bytes,
                resident_blocks: resident / block_bytes,
                resident_bytes: resident,
                reserved_bytes: r.reserved_bytes,
                pool_blocks: pool_bytes / block_bytes,
                overcommit: planner.config.kv_overcommit,
                preemptions: r.preemptions,
            })
        });
        ServiceStatus {
            degradation: degradation(&device, true, None, None, self.cpu_slower_by()),
            breaker: device.breaker,
            gpu_paused: device.gpu_paused,
            workers,
            queues: self.queues(),
            estimated_delay_ms: self.estimated_delay_ms(),
            gpu_memory,
            gpu_budget: self.gpu_budget(),
            cpu_prefix_cache: s.cpu_worker().and_then(|w| w.memory().borrow().as_ref().and_then(|r| r.prefix_cache)),
            host_reserved_bytes: self.inner.host_ledger().held_bytes(),
            cpu_kv_resident_bytes: s.cpu_worker().and_then(|w| w.memory().borrow().as_ref().and_then(|r| r.kv_resident_bytes)),
            gpu_kv,
            gpu_residency: s.gpu_residency(),
        }
    }

    /// Where a just-submitted request will be served, for its response headers: its lane's
    /// device, and whether that is degraded ([`degradation`]). A ticket attached to a running
    /// request, or answered from the journal, says where the journal last saw it.
    pub fn placement(&self, ticket: &Ticket) -> Placement {
        let s = &self.inner.supervisor;
        let status = s.status();
        let gpu = s.config().gpu.as_ref().map(|g| g.device);
        let mut split = None;
        let slower = self.cpu_slower_by();
        let (device, degradation) = match (ticket.device_queue, gpu) {
            (Some(Lane::Gpu), Some(gpu)) => {
                split = status.gpu.as_ref().and_then(|w| w.split);
                (gpu.label(), None)
            }
            (Some(lane), _) => (Device::Cpu.label(), degradation(&status, lane == Lane::Cpu, None, Some(&ticket.admission), slower)),
            (None, _) => {
                let record = self.inner.journal.get(&ticket.request_id).ok();
                (record.and_then(|r| r.device).unwrap_or_else(|| "unknown".into()), degradation(&status, true, None, None, slower))
            }
        };
        let lane_delay = ticket.device_queue.and_then(|lane| if lane == Lane::Gpu { &self.inner.gpu } else { &*self.inner.cpu }.estimated_delay_ms());
        Placement { request_id: ticket.request_id.clone(), device, split, degradation, estimated_delay_ms: lane_delay.or_else(|| self.estimated_delay_ms()) }
    }
}

fn snapshot(lane: Lane, device: Device, worker: Option<&crate::supervisor::WorkerStatus>, state: WorkerState) -> WorkerSnapshot {
    WorkerSnapshot {
        lane,
        device,
        pid: worker.map(|w| w.pid),
        state,
        simulated: device == Device::Sim,
        model: worker.map(|w| w.model.clone()),
        bundle_hash: worker.map(|w| w.bundle_hash.clone()),
        split: worker.and_then(|w| w.split),
        context_tokens: worker.and_then(|w| w.context_tokens),
    }
}
