//! Supervision against in-process workers: a GPU worker that dies is noticed, the breaker opens
//! (the service is degraded, requests go to the CPU), a new worker is launched, and after its
//! probe the GPU serves again. The real-process version is `headroom-cli/tests/failover.rs`.

mod support;

use std::sync::Arc;
use std::time::Duration;

use headroom_router::{BreakerState, EventKind, Supervisor};
use headroom_worker::Device;
use support::{config, dispatcher, prompt, submission, until, InProcessLauncher, Workers};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_gpu_worker_is_replaced_and_the_gpu_serves_again() {
    let workers = Arc::new(Workers::default());
    let mut cfg = config(&workers, 2, Duration::from_millis(1));
    cfg.supervision.restart_backoff_initial_ms = 10;
    let supervisor = Supervisor::start(cfg).await.unwrap();
    let mut events = supervisor.subscribe();
    assert_eq!((workers.launches(Device::Sim), workers.launches(Device::Cpu)), (1, 1));
    let first = supervisor.gpu_worker().unwrap().pid;
    workers.kill_latest(Device::Sim);
    until(5, "the death is noticed: degraded", || supervisor.status().degraded).await;
    until(10, "a new GPU worker", || supervisor.gpu_worker().is_some_and(|w| w.pid != first)).await;
    until(10, "the breaker closes again after the probe", || supervisor.status().breaker == BreakerState::Closed).await;
    assert_eq!(workers.launches(Device::Sim), 2);
    assert_eq!(workers.launches(Device::Cpu), 1, "the CPU worker was left alone");
    let mut saw = (false, false);
    while let Ok(event) = events.try_recv() {
        match event.kind {
            EventKind::Degraded { degraded: true, .. } => saw.0 = true,
            EventKind::Degraded { degraded: false, .. } => saw.1 = true,
            _ => {}
        }
    }
    assert_eq!(saw, (true, true), "entering and leaving degraded mode are announced");
    supervisor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_gpu_is_down_requests_are_served_by_the_cpu_and_marked_degraded() {
    let workers = Arc::new(Workers::default());
    let mut cfg = config(&workers, 2, Duration::from_millis(1));
    // Long enough that the GPU is still down when the request runs.
    cfg.supervision.restart_backoff_initial_ms = 60_000;
    cfg.supervision.restart_backoff_max_ms = 60_000;
    let d = dispatcher(cfg).await;
    workers.kill_latest(Device::Sim);
    until(5, "degraded", || d.supervisor().status().degraded).await;
    let done = d.submit(submission("during", prompt(3), 8, false)).unwrap().finish().await.unwrap();
    assert_eq!(done.outcome.device, "cpu");
    assert!(done.outcome.degraded);
    assert!(done.outcome.degraded_reason.as_deref().is_some_and(|r| !r.is_empty()));
    d.supervisor().shutdown().await;
}

/// The control of the test above: a GPU worker that cannot be started again never comes back;
/// the service stays degraded and keeps serving from the CPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_worker_that_cannot_restart_leaves_the_service_degraded_and_serving_from_the_cpu() {
    let workers = Arc::new(Workers::default());
    let mut cfg = config(&workers, 2, Duration::from_millis(1));
    cfg.supervision.restart_backoff_initial_ms = 10;
    cfg.supervision.restart_backoff_max_ms = 20;
    cfg.launcher = Arc::new(InProcessLauncher { workers: workers.clone(), pace: Duration::from_millis(1), no_restart: Some(Device::Sim) });
    let d = dispatcher(cfg).await;
    let first = d.supervisor().gpu_worker().unwrap().pid;
    workers.kill_latest(Device::Sim);
    until(5, "degraded", || d.supervisor().status().degraded).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(d.supervisor().gpu_worker().is_none_or(|w| w.pid == first && w.has_exited()), "no new GPU worker");
    assert!(d.supervisor().status().degraded);
    let done = d.submit(submission("after", prompt(5), 8, true)).unwrap().finish().await.unwrap();
    assert_eq!(done.outcome.device, "cpu");
    assert!(done.outcome.degraded);
    d.supervisor().shutdown().await;
}
