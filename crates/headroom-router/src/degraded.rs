//! Whether a reply is degraded, and what that means for the person who asked: one sentence in
//! plain words (`summary`: what happened, who answers instead, how much slower, up to how many
//! tokens) and the engineering detail behind it (`reason`: the failure or admission's figures).

use headroom_worker::FailureKind;
use serde::{Deserialize, Serialize};

use crate::breaker::FailureCause;
use crate::supervisor::{DeviceStatus, FailoverRecord};

/// A degraded reply or service: the plain sentence and the technical reason.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Degradation {
    /// "The GPU is out of memory; kjv-demo on the CPU is answering, about 4× slower, up to 2k tokens."
    pub summary: String,
    /// What the failure or admission said, with its figures.
    pub reason: String,
}

/// Why the CPU answers a request meant for the GPU, as a person would put it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DegradedCause {
    /// An allocation failed, or the GPU has no room for the request now.
    GpuMemory,
    /// The GPU worker died or its device was lost.
    GpuFailed,
    /// The GPU worker stopped answering its health checks.
    GpuUnresponsive,
    /// The person paused the GPU in Settings.
    GpuPaused,
    /// No GPU worker is ready yet (starting or restarting).
    GpuStarting,
}

impl DegradedCause {
    fn words(self) -> &'static str {
        match self {
            Self::GpuMemory => "The GPU is out of memory",
            Self::GpuFailed => "The GPU stopped working",
            Self::GpuUnresponsive => "The GPU stopped responding",
            Self::GpuPaused => "The GPU is paused in Settings",
            Self::GpuStarting => "The GPU is starting",
        }
    }

    /// The cause behind a state the router knows: a failover's failure, the breaker's last
    /// cause, the pause, a missing GPU worker, or else admission's lack of GPU memory.
    fn of(status: &DeviceStatus, failover: Option<&FailoverRecord>) -> Self {
        if let Some(f) = failover {
            return match f.kind {
                Some(FailureKind::Oom | FailureKind::Preempted) => Self::GpuMemory,
                _ => Self::GpuFailed,
            };
        }
        if status.degraded {
            return match status.breaker_cause {
                Some(FailureCause::Oom) => Self::GpuMemory,
                Some(FailureCause::HealthCheck) => Self::GpuUnresponsive,
                _ => Self::GpuFailed,
            };
        }
        if status.gpu_paused {
            return Self::GpuPaused;
        }
        // An unloaded model loads for GPU requests; one the CPU answers had no room to load.
        if status.gpu_unloaded {
            return Self::GpuMemory;
        }
        if status.gpu.is_none() {
            return Self::GpuStarting;
        }
        Self::GpuMemory
    }
}

/// Whether a reply is degraded, and why: the one place that decides, for the headers at submit,
/// the completion, the stream and the status. It is degraded when the CPU serves it while a GPU
/// is configured: because the GPU failed it (`failover`), because the GPU is unavailable, or
/// because admission sent it there (`admission`, its reason). `cpu_slower_by` is how many times
/// slower the CPU decodes than the GPU, where both were measured.
pub fn degradation(status: &DeviceStatus, on_cpu: bool, failover: Option<&FailoverRecord>, admission: Option<&str>, cpu_slower_by: Option<f64>) -> Option<Degradation> {
    if !on_cpu || !status.gpu_configured {
        return None;
    }
    let reason = if let Some(f) = failover {
        f.reason.clone()
    } else if status.degraded {
        format!("GPU unavailable: {}", status.reason)
    } else {
        format!("sent to the CPU: {}", admission?)
    };
    let cause = DegradedCause::of(status, failover);
    let cpu = status.cpu.as_ref();
    let summary = if headroom_model::test_defect("summary-is-reason") {
        reason.clone() // test-only: the engineering text as the only explanation, as before
    } else {
        summary(cause, cpu.map(|w| w.model.as_str()), cpu.and_then(|w| w.context_tokens), cpu_slower_by)
    };
    Some(Degradation { summary, reason })
}

/// "{cause}; {model} on the CPU is answering, about N× slower, up to N tokens." Figures that are
/// not known (no measured rates yet) are left out rather than guessed.
fn summary(cause: DegradedCause, cpu_model: Option<&str>, cpu_context_tokens: Option<u32>, cpu_slower_by: Option<f64>) -> String {
    let mut text = format!("{}; {} is answering", cause.words(), cpu_model.map_or_else(|| "the CPU".to_string(), |m| format!("{m} on the CPU")));
    if let Some(x) = cpu_slower_by.filter(|x| x.is_finite() && *x >= 1.5) {
        text.push_str(&format!(", about {}× slower", x.round()));
    }
    if let Some(tokens) = cpu_context_tokens {
        text.push_str(&format!(", up to {} tokens", token_count(tokens)));
    }
    text.push('.');
    text
}

/// 8192 → "8k", 131072 → "128k", 3000 → "3,000".
fn token_count(n: u32) -> String {
    if n >= 1024 && n % 1024 == 0 {
        return format!("{}k", n / 1024);
    }
    headroom_memory::thousands(n.into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::breaker::BreakerState;
    use crate::supervisor::WorkerStatus;
    use headroom_worker::Device;

    fn status() -> DeviceStatus {
        let worker = |device, model: &str, context_tokens| WorkerStatus { device, pid: 1, simulated: false, model: model.into(), bundle_hash: "h".into(), load_ms: 1.0, split: None, context_tokens };
        DeviceStatus {
            gpu_configured: true,
            breaker: BreakerState::Closed,
            breaker_cause: None,
            reason: "healthy".into(),
            degraded: false,
            gpu_paused: false,
            gpu_unloaded: false,
            gpu: Some(worker(Device::Cuda(0), "SmolLM2", Some(8192))),
            cpu: Some(worker(Device::Cpu, "SmolLM2-small", Some(8192))),
        }
    }

    fn failover(kind: FailureKind) -> FailoverRecord {
        FailoverRecord { from: Device::Cuda(0), to: Device::Cpu, kind: Some(kind), reason: "cuda:0 failed: out of memory".into(), resumed_after_tokens: 3, failure_to_first_token_ms: None }
    }

    #[test]
    fn a_reply_the_gpu_serves_is_not_degraded() {
        assert_eq!(degradation(&status(), false, None, Some("fits"), None), None);
        let no_gpu = DeviceStatus { gpu_configured: false, ..status() };
        assert_eq!(degradation(&no_gpu, true, None, Some("no GPU"), None), None, "a CPU-only service is not degraded");
    }

    #[test]
    fn the_summary_says_what_happened_who_answers_and_the_limits() {
        let d = degradation(&status(), true, Some(&failover(FailureKind::Oom)), None, Some(3.6)).unwrap();
        assert_eq!(d.summary, "The GPU is out of memory; SmolLM2-small on the CPU is answering, about 4× slower, up to 8k tokens.");
        assert_eq!(d.reason, "cuda:0 failed: out of memory");
        let lost = degradation(&status(), true, Some(&failover(FailureKind::DeviceLost)), None, None).unwrap();
        assert_eq!(lost.summary, "The GPU stopped working; SmolLM2-small on the CPU is answering, up to 8k tokens.", "no measured rates: no speed");
    }

    #[test]
    fn the_cause_follows_the_breaker_the_pause_and_admission() {
        let open = |cause| DeviceStatus { degraded: true, breaker: BreakerState::Open, breaker_cause: Some(cause), reason: "3 allocation failures".into(), ..status() };
        let d = degradation(&open(FailureCause::Oom), true, None, None, None).unwrap();
        assert!(d.summary.starts_with("The GPU is out of memory;"), "{}", d.summary);
        assert_eq!(d.reason, "GPU unavailable: 3 allocation failures");
        assert!(degradation(&open(FailureCause::HealthCheck), true, None, None, None).unwrap().summary.starts_with("The GPU stopped responding;"));
        let paused = DeviceStatus { gpu_paused: true, ..status() };
        assert!(degradation(&paused, true, None, Some("the GPU is paused in settings"), None).unwrap().summary.starts_with("The GPU is paused in Settings;"));
        let starting = DeviceStatus { gpu: None, ..status() };
        assert!(degradation(&starting, true, None, Some("no healthy GPU"), None).unwrap().summary.starts_with("The GPU is starting;"));
        // An unloaded model has no worker either, but the CPU answers only when it found no room.
        let unloaded = DeviceStatus { gpu: None, gpu_unloaded: true, ..status() };
        assert!(degradation(&unloaded, true, None, Some("the model needs 5 MiB to load"), None).unwrap().summary.starts_with("The GPU is out of memory;"));
        assert!(degradation(&unloaded, false, None, None, None).is_none(), "a reply from the GPU after a load is not degraded");
        let admitted = degradation(&status(), true, None, Some("the request needs 5.1 MiB; 1.0 MiB free on the GPU"), Some(1.1)).unwrap();
        assert_eq!(admitted.summary, "The GPU is out of memory; SmolLM2-small on the CPU is answering, up to 8k tokens.", "about as fast: no speed claim");
        assert!(admitted.reason.contains("5.1 MiB"), "the figures stay in the reason");
    }

    #[test]
    fn token_counts_read_as_people_write_them() {
        assert_eq!(token_count(8192), "8k");
        assert_eq!(token_count(131072), "128k");
        assert_eq!(token_count(3000), "3,000");
        assert_eq!(token_count(512), "512");
    }
}
