//! Dispatch and failover at full load, against in-process workers (no processes, no model):
//! the router's own logic, fast. The same properties across real worker processes are tested in
//! `headroom-cli/tests/dispatch.rs`.

mod support;

use std::time::Duration;

use headroom_router::{Defect, Dispatcher, Lane, RequestState, Ticket, Transition};
use headroom_worker::Device;
use support::{config, dispatcher, ends, prompt, submission, token_at, until, Ends, Workers};

/// The GPU's 4 slots full and 4 more requests queued behind them (half of them streaming), one
/// CPU slot: then the GPU worker dies.
async fn gpu_dies_at_full_load(defect: Option<Defect>) -> (Dispatcher, Ends) {
    let workers = std::sync::Arc::new(Workers::default());
    let d = dispatcher(config(&workers, 4, Duration::from_millis(4))).await;
    if let Some(defect) = defect {
        d.reintroduce_defect_for_test(defect);
    }
    let tickets: Vec<Ticket> = (0..8).map(|i| d.submit(submission(&format!("full-{i}"), prompt(i), 40, i % 2 == 0)).unwrap()).collect();
    let gpu = |d: &Dispatcher| d.queues().into_iter().find(|q| q.device == Lane::Gpu).unwrap();
    until(10, "4 running and 4 queued on the GPU", || {
        let q = gpu(&d);
        q.running == 4 && q.waiting == 4
    })
    .await;
    // Mid-stream: the running requests have tokens to resume after.
    until(10, "8 tokens of each running request", || workers.tokens_generated(Device::Sim) >= 4 * 8).await;
    workers.kill_latest(Device::Sim);
    let e = ends(tickets).await;
    (d, e)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_worker_that_dies_at_full_load_loses_no_request_and_resumes_each_exactly() {
    let (d, e) = gpu_dies_at_full_load(None).await;
    assert!(e.lost.is_empty(), "lost after acceptance: {:?}", e.lost);
    assert_eq!(e.completed.len(), 8);
    for c in &e.completed {
        let i: usize = c.outcome.request_id.trim_start_matches("full-").parse().unwrap();
        let straight: Vec<u32> = (0..40).map(|k| token_at(&prompt(i), k)).collect();
        assert_eq!(c.outcome.tokens, straight, "{}: resumed after its last token, nothing lost or repeated", c.outcome.request_id);
    }
    let failed_over: Vec<_> = e.completed.iter().filter(|c| !c.outcome.failovers.is_empty()).collect();
    assert!(failed_over.len() >= 4, "the 4 running requests failed over: {}", failed_over.len());
    let resumed = failed_over.iter().filter(|c| c.outcome.failovers[0].resumed_after_tokens > 0).count();
    assert!(resumed >= 4, "the running ones resumed after their delivered tokens: {resumed}");
    for c in &failed_over {
        assert!(c.outcome.degraded, "a failed-over reply is marked degraded");
        let steps = d.journal().transitions(&c.outcome.request_id).unwrap();
        let kinds: Vec<&Transition> = steps.iter().map(|t| &t.transition).collect();
        assert!(kinds.iter().any(|t| matches!(t, Transition::AttemptFailed { .. })), "{kinds:?}");
        assert!(kinds.iter().any(|t| matches!(t, Transition::Queued { device } if *device == Lane::Cpu)), "{kinds:?}");
        assert_eq!(d.journal().get(&c.outcome.request_id).unwrap().state, RequestState::Completed);
    }
    assert!(e.waiting_notices >= 1, "streams waiting for the one CPU slot are told so");
    d.supervisor().shutdown().await;
}

/// Negative control: failover straight to the (busy) CPU worker loses requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_failover_that_bypasses_the_cpu_queue_loses_requests() {
    let (d, e) = gpu_dies_at_full_load(Some(Defect::FailoverBypassesCpuQueue)).await;
    assert!(!e.lost.is_empty(), "the defect must lose requests");
    assert!(e.lost.iter().any(|l| l.contains("at most 1 requests at once")), "{:?}", e.lost);
    d.supervisor().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_request_queued_behind_full_gpu_slots_frees_its_place() {
    let workers = std::sync::Arc::new(Workers::default());
    let d = dispatcher(config(&workers, 1, Duration::from_millis(5))).await;
    let running = d.submit(submission("running", prompt(0), 30, false)).unwrap();
    let queued = d.submit(submission("queued", prompt(1), 30, true)).unwrap();
    until(5, "one running and one queued on the GPU", || {
        let q = d.queues().into_iter().find(|q| q.device == Lane::Gpu).unwrap();
        q.running == 1 && q.waiting == 1
    })
    .await;
    queued.cancel();
    assert!(queued.finish().await.is_err());
    assert_eq!(d.journal().get("queued").unwrap().state, RequestState::Cancelled);
    let done = running.finish().await.unwrap();
    assert_eq!(done.outcome.tokens.len(), 30);
    assert!(!done.outcome.degraded);
    d.supervisor().shutdown().await;
}
