//! `headroom-router` owns the service core: worker supervision and restart, the circuit breaker,
//! dispatch with failover from the GPU worker to the warm CPU worker, the durable request journal
//! with idempotency keys, admission-driven bounded queues, service events and Prometheus metrics.
//! It never parses HTTP or renders UI.

pub mod breaker;
mod cpu_share;
pub mod degraded;
pub mod dispatch;
pub mod events;
pub mod journal;
mod lane;
mod metrics;
pub mod settings;
pub mod supervisor;
pub mod worker;

pub use breaker::{Breaker, BreakerConfig, BreakerState, BreakerTransition, FailureCause};
pub use cpu_share::SharedCpu;
pub use dispatch::{
    CancelOutcome, Completion, Defect, Dispatcher, GpuKv, GpuShare, Placement, QueueConfig, QueueStatus, ServiceStatus, SettingsError, SettingsUpdate, StreamEvent, Submission, SubmitError, Ticket,
    WaitNotice, WorkerSnapshot, WorkerState,
};
pub use events::{EventKind, ServiceEvent};
pub use lane::Lane;
pub use journal::{Accepted, EndCause, Journal, JournalError, NewRequest, Recovery, RequestRecord, RequestState, Transition};
pub use settings::{Settings, SettingsFile, MODEL_SETTINGS};
pub use degraded::{degradation, Degradation};
pub use supervisor::{AttemptError, CancelSignal, Progress, CpuSetup, DeviceStatus, FailoverRecord, GpuResidency, RunOutcome, RunRequest, StreamedToken, LayerPlanner, SupervisionConfig, Supervisor, SupervisorConfig, Target, VramRoom};
pub use worker::{BoxFuture, ExitInfo, HealthReport, ProcessLauncher, ReadyInfo, Worker, WorkerLauncher, WorkerLink, WorkerSpec};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("worker: {0}")]
    Worker(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("cancelled")]
    Cancelled,
    /// The device failed after tokens were delivered and the request did not allow resuming;
    /// the client can resume it explicitly from the tokens it has.
    #[error("interrupted after {delivered_tokens} tokens: {reason}; retry, or allow resume to continue from the last token")]
    Interrupted { reason: String, delivered_tokens: u32 },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One table of a Headroom config file (other tables are ignored; a missing table is the
/// defaults; unknown keys are errors that name them).
pub fn config_table<T: serde::de::DeserializeOwned + Default>(text: &str, name: &str) -> Result<T> {
    let value: toml::Table = toml::from_str(text).map_err(|e| Error::Invalid(format!("invalid TOML: {e}")))?;
    match value.get(name) {
        Some(table) => table.clone().try_into().map_err(|e| Error::Invalid(format!("[{name}]: {e}"))),
        None => Ok(T::default()),
    }
}
