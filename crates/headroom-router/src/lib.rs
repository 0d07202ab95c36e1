//! `headroom-router` owns the service core: worker supervision and restart, the circuit breaker,
//! dispatch with failover from the GPU worker to the warm CPU worker, and service events. (The
//! journal, admission-driven queues and idempotency arrive with the router-core issue.) It never
//! parses HTTP or renders UI.

pub mod breaker;
pub mod events;
pub mod supervisor;
pub mod worker;

pub use breaker::{Breaker, BreakerConfig, BreakerState, FailureCause};
pub use events::{EventKind, ServiceEvent};
pub use supervisor::{DeviceStatus, FailoverRecord, RunOutcome, RunRequest, StreamedToken, SupervisionConfig, Supervisor, SupervisorConfig, Target};
pub use worker::{Worker, WorkerSpec};

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
