//! Journal writes on the request path: every step appended, a failed write failing its request
//! loudly (and reported by readiness) rather than completing unrecorded.

use super::*;

impl Dispatcher {
    /// Appends a step to a request's journal. A write that fails is never dropped: it is
    /// logged, `/readyz` reports it until a later write succeeds, and the caller fails the
    /// request (or, for a request already ending, ends it all the same).
    pub(super) fn journal_step(&self, id: &str, transition: &Transition) -> Result<(), JournalError> {
        let written = self.inner.journal.record(id, transition).map(|_| ());
        self.journal_written(id, written)
    }

    pub(super) fn journal_written(&self, id: &str, written: Result<(), JournalError>) -> Result<(), JournalError> {
        if self.has_defect(Defect::IgnoreJournalErrors) {
            return Ok(());
        }
        let mut fault = self.inner.journal_fault.lock().unwrap();
        match &written {
            Ok(()) => *fault = None,
            Err(e) => {
                tracing::error!(request_id = id, error = %e, "journal write failed");
                *fault = Some(format!("the request journal cannot be written ({e}); accepted requests are failed rather than run unrecorded: check the disk holding the data dir"));
            }
        }
        written
    }

    /// Journals a tool call before it is delivered (a failed write is reported like any other).
    pub fn record_tool_call(&self, id: &str, call_id: &str, name: &str, arguments: &str) -> Result<(), JournalError> {
        let written = self.inner.journal.record_tool_call(id, call_id, name, arguments).map(|_| ());
        self.journal_written(id, written)
    }

    /// Why the journal refuses writes now, if it does (for `/readyz`).
    pub fn journal_fault(&self) -> Option<String> {
        self.inner.journal_fault.lock().unwrap().clone()
    }
}

/// A request failed because its journal could not be written: loudly, never run unrecorded.
pub(super) fn journal_failure(e: &JournalError) -> Ended {
    Ended::Failed { reason: format!("the request journal could not record this request ({e}), so it was stopped; retry once the server's disk is writable"), resumable: true }
}
