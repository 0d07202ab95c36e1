//! Following requests to their ends, for the tests of dispatch here and across real processes
//! (`headroom-cli/tests/dispatch.rs` includes this file).

#![allow(dead_code)]

use std::time::Duration;

use headroom_router::{Completion, StreamEvent, SubmitError, Ticket};

/// How each request of a run ended: its completion, or the error it ended with (lost).
pub struct Ends {
    pub completed: Vec<Completion>,
    pub lost: Vec<String>,
    pub waiting_notices: usize,
}

async fn drain(mut ticket: Ticket) -> (Result<Completion, SubmitError>, usize) {
    let mut notices = 0;
    while let Some(event) = ticket.next_event().await {
        if matches!(event, StreamEvent::Waiting(_)) {
            notices += 1;
        }
    }
    (ticket.finish().await, notices)
}

pub async fn ends(tickets: Vec<Ticket>) -> Ends {
    let tasks: Vec<_> = tickets.into_iter().map(|t| tokio::spawn(drain(t))).collect();
    let mut e = Ends { completed: Vec::new(), lost: Vec::new(), waiting_notices: 0 };
    for task in tasks {
        let (result, notices) = task.await.unwrap();
        e.waiting_notices += notices;
        match result {
            Ok(c) => e.completed.push(c),
            Err(err) => e.lost.push(err.to_string()),
        }
    }
    e
}

/// Polls until `ready` holds, for up to `secs`.
pub async fn until(secs: u64, what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while !ready() {
        assert!(std::time::Instant::now() < deadline, "not within {secs} s: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
