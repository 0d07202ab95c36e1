//! Several models on one GPU (`GpuShare`): admission for one counts what the others hold, an
//! idle model is evicted (least recently used, never a pinned one) before a request goes to the
//! CPU, and an evicted model loads again at its next request, once the evicted worker is gone.
//! In-process workers: each model's sim GPU worker reports 64 MiB of weights on a 74 MiB GPU
//! with no reserve, so one model and its requests fit and two models do not.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use headroom_memory::MemoryConfig;
use headroom_model::ModelBundle;
use headroom_router::{Defect, Dispatcher, GpuShare, Journal, Lane, QueueConfig, Settings, SharedCpu, Supervisor, Ticket};
use headroom_worker::Device;
use support::{config, ends, model_dir, prompt, submission, until, Workers};

const GPU_MIB: u64 = 74;

async fn model(workers: &Arc<Workers>, share: &GpuShare, name: &str, at_start: bool, pinned: bool, defect: Option<Defect>) -> Dispatcher {
    model_on_cpu_of(workers, share, name, at_start, pinned, defect, None).await
}

/// A model as [`model`] makes it, whose CPU path uses `cpu`, another model's CPU worker.
async fn model_on_cpu_of(workers: &Arc<Workers>, share: &GpuShare, name: &str, at_start: bool, pinned: bool, defect: Option<Defect>, cpu: Option<SharedCpu>) -> Dispatcher {
    let mut c = config(workers, 4, Duration::from_millis(4));
    c.gpu.as_mut().unwrap().sim_vram_mib = GPU_MIB;
    c.gpu_at_start = at_start;
    c.cpu_share = cpu;
    let supervisor = Supervisor::start(c).await.unwrap();
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let memory = MemoryConfig { vram_reserve_mib: Some(0), ..MemoryConfig::default() };
    let (planner, _) = headroom_memory::planner_for(&bundle, "cpu", memory.clone());
    let d = Dispatcher::start(supervisor, Journal::in_memory().unwrap(), planner, memory, QueueConfig::default(), Settings::default(), None).unwrap().0;
    if let Some(defect) = defect {
        d.reintroduce_defect_for_test(defect);
    }
    d.share_gpu(share, name, pinned);
    d
}

fn loaded(d: &Dispatcher) -> bool {
    d.supervisor().gpu_worker().is_some()
}

/// Samples, every millisecond, whether both models held a GPU worker at once.
fn watch_overlap(a: &Dispatcher, b: &Dispatcher) -> (Arc<AtomicBool>, Arc<AtomicBool>) {
    let (overlap, stop) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
    let (a, b, o, s) = (a.clone(), b.clone(), overlap.clone(), stop.clone());
    tokio::spawn(async move {
        while !s.load(Ordering::SeqCst) {
            if loaded(&a) && loaded(&b) {
                o.store(true, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    (overlap, stop)
}

/// Model A loaded and used, model B not loaded; B's request arrives, then A's again.
async fn take_turns(defect: Option<Defect>) -> (bool, Vec<(Device, bool)>) {
    let workers = Arc::new(Workers::default());
    let share = GpuShare::new();
    let a = model(&workers, &share, "a", true, false, defect).await;
    let b = model(&workers, &share, "b", false, false, defect).await;
    assert!(loaded(&a) && !loaded(&b), "B loads at its first request");
    let (overlap, stop) = watch_overlap(&a, &b);
    let mut served = Vec::new();
    for (d, id) in [(&a, "a-1"), (&b, "b-1"), (&a, "a-2")] {
        let e = ends(vec![d.submit(submission(id, prompt(0), 8, false)).unwrap()]).await;
        assert!(e.lost.is_empty(), "{id}: {:?}", e.lost);
        served.push((e.completed[0].outcome.device, e.completed[0].outcome.degraded));
    }
    stop.store(true, Ordering::SeqCst);
    let both = overlap.load(Ordering::SeqCst);
    for d in [a, b] {
        d.supervisor().shutdown().await;
    }
    (both, served)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_model_makes_way_for_another_and_loads_again_after_it() {
    let (both, served) = take_turns(None).await;
    assert_eq!(served, vec![(Device::Sim, false); 3], "each ran on the GPU after evicting the other, none degraded");
    assert!(!both, "the two models never held the GPU at once: each load waited for the evicted worker to go");
}

/// Negative control: admission that counts its own model alone loads B beside A, more than the
/// GPU holds; the check above catches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_admission_blind_to_the_other_model_is_caught() {
    let (both, _) = take_turns(Some(Defect::GpuShareIgnored)).await;
    assert!(both, "both models were loaded at once on a GPU that holds one");
}

/// A pinned model is never evicted: the other model's request goes to its CPU worker, marked
/// degraded for want of GPU memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pinned_model_is_never_evicted() {
    let workers = Arc::new(Workers::default());
    let share = GpuShare::new();
    let a = model(&workers, &share, "a", true, true, None).await;
    let b = model(&workers, &share, "b", false, false, None).await;
    let e = ends(vec![b.submit(submission("b-1", prompt(0), 8, false)).unwrap()]).await;
    let c = &e.completed[0];
    assert_eq!(c.outcome.device, Device::Cpu);
    assert!(c.outcome.degraded_summary.as_deref().is_some_and(|s| s.starts_with("The GPU is out of memory")), "{:?}", c.outcome.degraded_summary);
    assert!(loaded(&a) && !loaded(&b));
    for d in [a, b] {
        d.supervisor().shutdown().await;
    }
}

/// Fault at full load on a shared GPU: model A's 4 slots full with 4 queued behind them, model
/// B's requests arrive (A is busy, so nothing can be evicted: they go to B's CPU worker), then
/// A's GPU worker dies. Nothing of either model is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_gpu_killed_at_full_load_loses_nothing_of_either_model() {
    let workers = Arc::new(Workers::default());
    let share = GpuShare::new();
    let a = model(&workers, &share, "a", true, false, None).await;
    let b = model(&workers, &share, "b", false, false, None).await;
    let mut tickets: Vec<Ticket> = (0..8).map(|i| a.submit(submission(&format!("a-{i}"), prompt(i), 60, i % 2 == 0)).unwrap()).collect();
    let gpu = |d: &Dispatcher| d.queues().into_iter().find(|q| q.device == Lane::Gpu).unwrap();
    until(10, "A's 4 slots full and 4 queued", || gpu(&a).running == 4 && gpu(&a).waiting == 4).await;
    tickets.extend((0..4).map(|i| b.submit(submission(&format!("b-{i}"), prompt(i), 20, i % 2 == 1)).unwrap()));
    until(10, "8 tokens of each running request of A", || workers.tokens_generated(Device::Sim) >= 4 * 8).await;
    assert!(!loaded(&b), "B found no room beside busy A");
    workers.kill_latest(Device::Sim);
    let e = ends(tickets).await;
    assert!(e.lost.is_empty(), "lost after acceptance: {:?}", e.lost);
    assert_eq!(e.completed.len(), 12);
    for c in &e.completed {
        let expected = if c.outcome.request_id.starts_with("a-") { 60 } else { 20 };
        assert_eq!(c.outcome.tokens.len(), expected, "{}", c.outcome.request_id);
    }
    for d in [a, b] {
        d.supervisor().shutdown().await;
    }
}

/// Model A's CPU-path request holds host RAM while B has none running: what B's admission sees
/// held on the host (its status' `host_reserved_bytes`), and A's grant.
async fn host_held_beside(defect: Option<Defect>) -> (u64, u64) {
    let workers = Arc::new(Workers::default());
    let share = GpuShare::new();
    let a = model(&workers, &share, "a", true, false, defect).await;
    let b = model(&workers, &share, "b", false, false, defect).await;
    // The GPU paused: A's request runs on the CPU, holding host RAM for its KV cache.
    a.supervisor().set_gpu_paused(true);
    let ticket = a.submit(submission("a-cpu", prompt(0), 400, false)).unwrap();
    until(10, "A's request runs on the CPU", || a.queues().iter().any(|q| q.device == Lane::Cpu && q.running == 1)).await;
    let seen = (b.status().host_reserved_bytes, a.status().host_reserved_bytes);
    ticket.cancel();
    for d in [a, b] {
        d.supervisor().shutdown().await;
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_models_share_one_host_ram_ledger() {
    let (b_sees, a_holds) = host_held_beside(None).await;
    assert!(a_holds > 0, "A's CPU-path request holds host RAM");
    assert_eq!(b_sees, a_holds, "B's admission counts A's host RAM grant: the host is one machine");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_host_ledger_per_model_is_caught() {
    let (b_sees, a_holds) = host_held_beside(Some(Defect::HostShareIgnored)).await;
    assert!(a_holds > 0);
    assert_eq!(b_sees, 0, "with a ledger per model, B sees nothing of A's grant (the defect the test above catches)");
}

/// A's GPU worker dies with its 4 slots full and 4 requests queued behind them (half of them
/// streaming), and B's request arrives while A restarts: whether both models ever held a GPU
/// worker at once, and where B's request ran. Nothing of A's or B's is lost.
async fn request_beside_a_restart(defect: Option<Defect>) -> (bool, Device) {
    let workers = Arc::new(Workers::default());
    let share = GpuShare::new();
    let a = model(&workers, &share, "a", true, false, defect).await;
    let b = model(&workers, &share, "b", false, false, defect).await;
    let (overlap, stop) = watch_overlap(&a, &b);
    let tickets: Vec<Ticket> = (0..8).map(|i| a.submit(submission(&format!("a-{i}"), prompt(i), 60, i % 2 == 0)).unwrap()).collect();
    let gpu = |d: &Dispatcher| d.queues().into_iter().find(|q| q.device == Lane::Gpu).unwrap();
    until(10, "A's 4 slots full and 4 queued", || gpu(&a).running == 4 && gpu(&a).waiting == 4).await;
    workers.kill_latest(Device::Sim);
    until(10, "A's dead GPU worker noticed", || !loaded(&a)).await;
    let e = ends(vec![b.submit(submission("b-1", prompt(0), 8, false)).unwrap()]).await;
    assert!(e.lost.is_empty(), "{:?}", e.lost);
    let a_ends = ends(tickets).await;
    assert!(a_ends.lost.is_empty(), "A's requests lost after acceptance: {:?}", a_ends.lost);
    assert_eq!(a_ends.completed.len(), 8);
    assert!(a_ends.completed.iter().all(|c| c.outcome.tokens.len() == 60), "every request of A ends with all its tokens");
    until(10, "A's GPU worker back", || loaded(&a)).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.store(true, Ordering::SeqCst);
    let both = overlap.load(Ordering::SeqCst);
    for d in [a, b] {
        d.supervisor().shutdown().await;
    }
    (both, e.completed[0].outcome.device)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarting_model_keeps_its_place_on_the_gpu() {
    let (both, device) = request_beside_a_restart(None).await;
    assert!(!both, "B loaded while A's worker restarted, and A came back beside it: over the budget");
    assert_eq!(device, Device::Cpu, "B's request found no room beside restarting A");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_restart_counted_as_nothing_is_caught() {
    let (both, _) = request_beside_a_restart(Some(Defect::RestartingModelUncounted)).await;
    assert!(both, "with a restarting model counted as nothing, B loads beside it (the defect the test above catches)");
}

/// Two models whose CPU paths run one CPU worker (one slot), with one queue in front of it. A's
/// GPU has its 4 slots full and 4 requests queued behind them (half of them streaming); B
/// cannot load beside busy A, so its 3 requests go to the shared CPU worker (one running, two
/// queued). Then A's GPU worker dies: its 8 requests fail over into the same CPU queue.
/// Returns what was lost after acceptance, how many CPU workers were launched, and the host
/// RAM the models' admission sees their workers hold.
async fn one_cpu_worker_for_two_models(queue_per_model: bool, defect: Option<Defect>) -> (Vec<String>, usize, u64) {
    let workers = Arc::new(Workers::default());
    let share = GpuShare::new();
    let a = model(&workers, &share, "a", true, false, defect).await;
    let cpu = a.supervisor().shared_cpu();
    if queue_per_model {
        cpu.queue_per_model_for_test();
    }
    let b = model_on_cpu_of(&workers, &share, "b", false, false, defect, Some(cpu.clone())).await;
    assert_eq!(cpu.users(), 2);
    let host_weights = b.host_budget().weights_bytes;
    let mut tickets: Vec<Ticket> = (0..8).map(|i| a.submit(submission(&format!("a-{i}"), prompt(i), 60, i % 2 == 0)).unwrap()).collect();
    let lane = |d: &Dispatcher, lane: Lane| d.queues().into_iter().find(|q| q.device == lane).unwrap();
    until(10, "A's 4 GPU slots full and 4 queued", || lane(&a, Lane::Gpu).running == 4 && lane(&a, Lane::Gpu).waiting == 4).await;
    tickets.extend((0..3).map(|i| b.submit(submission(&format!("b-{i}"), prompt(i), 30, i % 2 == 1)).unwrap()));
    until(10, "B's request running on the shared CPU worker", || lane(&b, Lane::Cpu).running == 1).await;
    until(10, "8 tokens of each running request of A", || workers.tokens_generated(Device::Sim) >= 4 * 8).await;
    workers.kill_latest(Device::Sim);
    let e = ends(tickets).await;
    let mut lost: Vec<String> = e.lost.iter().map(|l| format!("{l:?}")).collect();
    for c in &e.completed {
        let expected = if c.outcome.request_id.starts_with("a-") { 60 } else { 30 };
        if c.outcome.tokens.len() != expected {
            lost.push(format!("{} ended with {} of {expected} tokens", c.outcome.request_id, c.outcome.tokens.len()));
        }
    }
    let cpu_launches = workers.launches(Device::Cpu);
    for d in [b, a] {
        d.supervisor().shutdown().await;
    }
    (lost, cpu_launches, host_weights)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_share_one_cpu_worker_and_its_queue_through_a_gpu_kill_at_full_load() {
    let (lost, cpu_launches, host_weights) = one_cpu_worker_for_two_models(false, None).await;
    assert!(lost.is_empty(), "lost after acceptance: {lost:?}");
    assert_eq!(cpu_launches, 1, "one CPU worker for both models");
    assert_eq!(host_weights, 64 << 20, "the shared CPU worker's weights count once (the sim GPU worker holds no host RAM)");
}

/// Negative control: a queue per model in front of the shared worker lets B's request and A's
/// failovers take more slots than the worker has; the worker refuses them and they are lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_queue_per_model_in_front_of_a_shared_cpu_worker_loses_requests() {
    let (lost, cpu_launches, _) = one_cpu_worker_for_two_models(true, None).await;
    assert_eq!(cpu_launches, 1);
    assert!(!lost.is_empty(), "the defect lost nothing");
}

/// Negative control of the host RAM count: the shared worker counted once per model is caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_shared_cpu_worker_counted_per_model_is_caught() {
    let (_, _, host_weights) = one_cpu_worker_for_two_models(false, Some(Defect::SharedCpuCountedTwice)).await;
    assert_eq!(host_weights, 2 * (64 << 20), "counted once per model (the defect the first test catches)");
}

/// A model cannot borrow a CPU worker that runs something else than its CPU path would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cpu_worker_running_another_model_or_options_is_not_shared() {
    let workers = Arc::new(Workers::default());
    let share = GpuShare::new();
    let a = model(&workers, &share, "a", true, false, None).await;
    let mut c = config(&workers, 4, Duration::from_millis(4));
    c.cpu.max_concurrency = 3;
    c.cpu_share = Some(a.supervisor().shared_cpu());
    let err = Supervisor::start(c).await.err().expect("refused");
    assert!(err.to_string().contains("same model with the same CPU settings"), "{err}");
    a.supervisor().shutdown().await;
}
