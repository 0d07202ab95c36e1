//! keep_alive: the GPU's copy of the model unloads once idle past its keep_alive, and the next
//! GPU requests load it again and run there, not on the CPU. In-process workers, fast; the HTTP
//! side (Ollama's load and unload calls, `/api/ps`) is tested in `headroom-cli/tests/api.rs`.

mod support;

use std::time::Duration;

use headroom_memory::KeepAlive;
use headroom_router::{Defect, Dispatcher, EventKind, Lane, Ticket, WorkerState};
use headroom_worker::{Device, FailureKind, Fault};
use support::{config, dispatcher, ends, prompt, submission, token_at, until, Ends, Workers};

type Shared = std::sync::Arc<Workers>;

fn residency(d: &Dispatcher) -> String {
    d.status().gpu_residency.expect("a GPU is configured").state
}

fn gpu_state(d: &Dispatcher) -> WorkerState {
    d.status().workers.iter().find(|w| w.lane == Lane::Gpu).unwrap().state
}

/// A sim GPU (4 slots) whose model unloads 100 ms after its last request; one request runs and
/// the model unloads.
async fn unloaded_after_one_request(defect: Option<Defect>) -> (Dispatcher, Shared) {
    let workers = Shared::default();
    let mut c = config(&workers, 4, Duration::from_millis(4));
    c.keep_alive = KeepAlive::For(Duration::from_millis(100));
    let d = dispatcher(c).await;
    if let Some(defect) = defect {
        d.reintroduce_defect_for_test(defect);
    }
    let first = ends(vec![d.submit(submission("first", prompt(0), 8, false)).unwrap()]).await;
    assert_eq!(first.completed[0].outcome.device, Device::Sim);
    until(5, "the model unloads after its keep_alive", || residency(&d) == "unloaded" && d.supervisor().gpu_worker().is_none()).await;
    (d, workers)
}

/// Against the unloaded model: 8 requests (half streaming) fill the GPU's 4 slots and queue 4
/// behind them; once they do, the reloaded GPU worker is killed. Returns whether the slots
/// filled on a reloaded GPU (and so the kill fired), and how each request ended.
async fn full_load_on_an_unloaded_model(d: &Dispatcher, workers: &Shared) -> (bool, Ends) {
    let tickets: Vec<Ticket> = (0..8).map(|i| d.submit(submission(&format!("load-{i}"), prompt(i), 40, i % 2 == 0)).unwrap()).collect();
    let gpu = |d: &Dispatcher| d.queues().into_iter().find(|q| q.device == Lane::Gpu).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    let mut full = false;
    while std::time::Instant::now() < deadline && !full {
        let q = gpu(d);
        full = q.running == 4 && q.waiting == 4 && workers.launches(Device::Sim) == 2 && workers.tokens_generated(Device::Sim) >= 4 * 8;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if full {
        workers.kill_latest(Device::Sim);
    }
    (full, ends(tickets).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unloaded_model_loads_again_for_a_full_gpu_whose_kill_loses_nothing() {
    let (d, workers) = unloaded_after_one_request(None).await;
    let mut events = d.subscribe();
    // Unloaded is not degraded: the GPU still takes its requests.
    let status = d.status();
    assert!(!status.degraded(), "{:?}", status.degradation);
    assert_eq!(gpu_state(&d), WorkerState::Unloaded);
    assert!(status.gpu_budget.is_some(), "admission charges the reload against the VRAM free now");

    let (full, e) = full_load_on_an_unloaded_model(&d, &workers).await;
    assert!(full, "the 4 slots filled on a GPU worker loaded again, with 4 queued behind them");
    assert!(e.lost.is_empty(), "lost after acceptance: {:?}", e.lost);
    assert_eq!(e.completed.len(), 8);
    for c in &e.completed {
        let i: usize = c.outcome.request_id.trim_start_matches("load-").parse().unwrap();
        let straight: Vec<u32> = (0..40).map(|k| token_at(&prompt(i), k)).collect();
        assert_eq!(c.outcome.tokens, straight, "{}: nothing lost or repeated", c.outcome.request_id);
        // Each was for the GPU until the kill: none was sent to the CPU because the model was
        // unloaded. A running request hears of the kill itself; a queued one that takes a slot
        // before the supervisor has noticed the death finds the killed worker gone.
        for f in &c.outcome.failovers {
            let from_the_kill = f.reason.contains("killed") || f.reason.contains("the sim worker is gone");
            assert!(from_the_kill, "{}: left the GPU before the kill: {:?} {}", c.outcome.request_id, f.kind, f.reason);
        }
        assert!(c.outcome.device == Device::Sim || !c.outcome.failovers.is_empty(), "{}: admitted to the CPU", c.outcome.request_id);
    }
    assert!(e.completed.iter().any(|c| c.load_ms > 0.0), "the first requests waited for the load and say so");
    let mut loading = 0;
    while let Ok(event) = events.try_recv() {
        loading += matches!(event.kind, EventKind::GpuModelLoading { .. }) as usize;
    }
    assert_eq!(loading, 1, "one load for all 8 requests");
    d.supervisor().shutdown().await;
}

/// Negative control: a GPU request that finds the model unloaded goes to the CPU (degraded)
/// instead of loading it again; the run above must catch it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_an_unloaded_model_that_redirects_to_the_cpu_is_caught() {
    let (d, workers) = unloaded_after_one_request(Some(Defect::UnloadedModelRedirects)).await;
    let (full, e) = full_load_on_an_unloaded_model(&d, &workers).await;
    assert!(!full, "no GPU worker loads for them");
    let redirected = e.completed.iter().filter(|c| c.outcome.failovers.iter().any(|f| f.kind == Some(FailureKind::Unavailable))).count();
    assert!(redirected > 0, "requests went to the CPU instead of loading the model");
    assert!(e.completed.iter().all(|c| c.outcome.degraded), "and were degraded for it");
    d.supervisor().shutdown().await;
}

/// A load that would breach the VRAM reserve does not start: with another program holding the
/// memory the model needs, the request goes to the CPU with admission's reason, and the model
/// stays unloaded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_would_breach_the_reserve_does_not_start() {
    let (d, workers) = unloaded_after_one_request(None).await;
    // The sim GPU has 2048 MiB; the default reserve keeps 1024 free and the model's weights need
    // 64: a program holding 1000 leaves less than that.
    d.supervisor().inject_fault(Fault::Compete { mib: 1000 }).await.unwrap();
    let e = ends(vec![d.submit(submission("no-room", prompt(1), 8, false)).unwrap()]).await;
    assert!(e.lost.is_empty(), "{:?}", e.lost);
    let c = &e.completed[0];
    assert_eq!(c.outcome.device, Device::Cpu);
    assert!(c.outcome.degraded && c.outcome.degraded_summary.as_deref().is_some_and(|s| s.starts_with("The GPU is out of memory")), "{:?}", c.outcome.degraded_summary);
    assert_eq!(workers.launches(Device::Sim), 1, "the model was not loaded");
    assert_eq!(residency(&d), "unloaded");
    // The program leaves: the next request loads the model and runs on the GPU.
    d.supervisor().inject_fault(Fault::Clear).await.unwrap();
    let e = ends(vec![d.submit(submission("room-again", prompt(2), 8, false)).unwrap()]).await;
    assert_eq!(e.completed[0].outcome.device, Device::Sim);
    assert!(!e.completed[0].outcome.degraded);
    assert_eq!(workers.launches(Device::Sim), 2);
    d.supervisor().shutdown().await;
}

/// keep_alive -1 (the default) never unloads; a request's own keep_alive replaces it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forever_keeps_the_model_until_a_request_sets_a_keep_alive() {
    let workers = Shared::default();
    let d = dispatcher(config(&workers, 4, Duration::from_millis(1))).await;
    ends(vec![d.submit(submission("a", prompt(0), 4, false)).unwrap()]).await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(residency(&d), "loaded");
    assert_eq!(d.status().gpu_residency.unwrap().unloads_in_ms, None);
    d.set_keep_alive(KeepAlive::For(Duration::ZERO));
    until(5, "keep_alive 0 unloads the idle model", || residency(&d) == "unloaded").await;
    assert_eq!(workers.launches(Device::Sim), 1);
    d.supervisor().shutdown().await;
}
