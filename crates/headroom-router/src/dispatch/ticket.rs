//! What a client holds: the submission, its ticket (tokens, notices, the completion), and how a
//! request can end.

use super::*;

/// What a client submits.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Submission {
    pub run: RunRequest,
    pub idempotency_key: Option<String>,
    /// A hash of the client's body, for idempotency conflicts.
    pub body_hash: String,
    pub stream: bool,
    pub allow: Allowances,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Conflict(String),
    /// Refused for capacity (a full queue, or no device can hold it now).
    #[error("{reason}")]
    Capacity { reason: String, retry_after_s: Option<u64>, estimated_delay_ms: Option<u64> },
    #[error("cancelled")]
    Cancelled,
    /// The request ended without a result; `resumable`: the client may retry or resume it.
    #[error("{reason}")]
    Failed { reason: String, resumable: bool },
    #[error("{0}")]
    Journal(#[from] JournalError),
}

/// A finished request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    pub outcome: RunOutcome,
    /// The admission decision's reason (and the device it chose first).
    pub admission: String,
    pub queued_ms: f64,
    /// Served from the journal for a repeated idempotency key: nothing ran again.
    #[serde(default)]
    pub from_journal: bool,
    /// Whether the request would have continued on the CPU worker had the GPU failed (false:
    /// the client opted out with allow_cpu: false).
    #[serde(default = "yes")]
    pub cpu_failover: bool,
    /// How long this request waited for its model to load on the GPU (it had been unloaded
    /// after its keep_alive), in ms; 0 when it was loaded. Not journaled: a stored completion
    /// served again loads nothing.
    #[serde(skip)]
    pub load_ms: f64,
}

pub(super) fn yes() -> bool {
    true
}

/// How a request ended without a result.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Ended {
    Cancelled,
    Failed { reason: String, resumable: bool },
}

pub(super) type Finished = Option<Result<Completion, Ended>>;

/// What a request's stream carries: its tokens, and notices while it waits for a device.
#[derive(Debug, Clone)]
pub enum StreamEvent {
    Token(StreamedToken),
    /// The request left its device and waits in another queue (a failover waiting for a CPU
    /// slot); the client is told why and for about how long.
    Waiting(WaitNotice),
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WaitNotice {
    /// The queue it waits in now.
    pub queue: Lane,
    pub reason: String,
    /// Requests ahead of it there.
    pub ahead: usize,
    pub estimated_delay_ms: Option<u64>,
}

/// A submitted request: its tokens as they come, and its end. Dropping the ticket of a request
/// that has not finished cancels it (the client went away).
pub struct Ticket {
    pub request_id: String,
    /// The lane it waits in; None when it joined the same request already running (a retry
    /// with its idempotency key) or was answered from the journal (it had ended).
    pub device_queue: Option<Lane>,
    /// Why admission chose that queue.
    pub admission: String,
    pub(super) events: mpsc::UnboundedReceiver<StreamEvent>,
    pub(super) done: watch::Receiver<Finished>,
    pub(super) cancel: Option<CancelSignal>,
}

impl Ticket {
    /// The next token (notices skipped); None once the request has ended.
    pub async fn next_token(&mut self) -> Option<StreamedToken> {
        loop {
            match self.events.recv().await? {
                StreamEvent::Token(t) => return Some(t),
                StreamEvent::Waiting(_) => {}
            }
        }
    }

    /// The next token or notice; None once the request has ended.
    pub async fn next_event(&mut self) -> Option<StreamEvent> {
        self.events.recv().await
    }

    /// Waits for the end of the request.
    pub async fn finish(mut self) -> Result<Completion, SubmitError> {
        let finished = self.done.wait_for(|f| f.is_some()).await.map(|f| f.clone());
        self.cancel = None;
        match finished {
            Ok(Some(Ok(c))) => Ok(c),
            Ok(Some(Err(Ended::Cancelled))) => Err(SubmitError::Cancelled),
            Ok(Some(Err(Ended::Failed { reason, resumable }))) => Err(SubmitError::Failed { reason, resumable }),
            _ => Err(SubmitError::Failed { reason: "the dispatcher stopped".into(), resumable: true }),
        }
    }

    pub fn cancel(&self) {
        if let Some(c) = &self.cancel {
            c.cancel();
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if self.done.borrow().is_none() {
            self.cancel();
        }
    }
}
