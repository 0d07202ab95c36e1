//! Failover across real processes: a router (the supervisor, in this test process) with a `sim`
//! GPU worker and a warm CPU worker, both `headroom worker` processes on the embedded model.
//! Faults are injected into the sim worker; the CPU worker must never notice.

use std::path::PathBuf;
use std::time::Duration;

use headroom_memory::{MemoryConfig, ModelShape, RequestShape, MIB};
use headroom_model::{GenerateRequest, ModelBundle, SamplingParams};
use headroom_router::{BreakerState, EventKind, LayerPlanner, RunOutcome, RunRequest, ServiceEvent, Supervisor, SupervisorConfig, Target, VramRoom};
use headroom_worker::{Device, Fault, SplitLayers, WorkerOptions};
use tokio::sync::broadcast;

fn model_dir() -> PathBuf {
    headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL)
}

fn config() -> SupervisorConfig {
    let mut sim = WorkerOptions::new(Device::Sim);
    sim.memory_sample_ms = 0;
    let mut config = SupervisorConfig::new(PathBuf::from(env!("CARGO_BIN_EXE_headroom")), model_dir(), Some(sim));
    config.cpu.max_concurrency = 2;
    config.supervision.health_interval_ms = 150;
    config.supervision.health_timeout_ms = 1500;
    config.supervision.restart_backoff_initial_ms = 50;
    config.supervision.breaker.cooldown_ms = 300;
    config
}

fn prompt() -> Vec<u32> {
    let bundle = ModelBundle::open(model_dir()).unwrap();
    bundle.encode("And God said unto Moses,", true).unwrap()
}

fn request(id: &str, max_tokens: usize) -> RunRequest {
    // Sampled, not greedy: resuming must restore the RNG position too.
    let sampling = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, repetition_penalty: 1.1, seed: 7 };
    RunRequest {
        request_id: id.to_string(),
        request: GenerateRequest::new(prompt(), max_tokens, sampling),
        allow_resume: true,
    }
}

async fn straight(supervisor: &Supervisor, id: &str, max_tokens: usize) -> RunOutcome {
    supervisor.run(request(id, max_tokens), Target::Cpu, |_| {}).await.unwrap()
}

/// Waits for an event matching `pred`, failing after `secs`.
async fn wait_for(events: &mut broadcast::Receiver<ServiceEvent>, secs: u64, what: &str, pred: impl Fn(&EventKind) -> bool) -> ServiceEvent {
    tokio::time::timeout(Duration::from_secs(secs), async {
        loop {
            match events.recv().await {
                Ok(e) if pred(&e.kind) => return e,
                Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("event stream ended: {e}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no {what} event within {secs} s"))
}

/// Waits until every named predicate has matched some event, in any order: events raised by
/// different tasks (the request path and the supervisor) have no fixed order between them.
async fn wait_for_all(events: &mut broadcast::Receiver<ServiceEvent>, secs: u64, wanted: &[(&str, &dyn Fn(&EventKind) -> bool)]) {
    let mut seen = vec![false; wanted.len()];
    tokio::time::timeout(Duration::from_secs(secs), async {
        while seen.contains(&false) {
            match events.recv().await {
                Ok(e) => {
                    for (i, (_, pred)) in wanted.iter().enumerate() {
                        seen[i] |= pred(&e.kind);
                    }
                }
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => panic!("event stream ended: {e}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        let missing: Vec<&str> = wanted.iter().zip(&seen).filter(|(_, s)| !**s).map(|((name, _), _)| *name).collect();
        panic!("within {secs} s, no event for: {missing:?}")
    })
}

async fn wait_closed(events: &mut broadcast::Receiver<ServiceEvent>) {
    wait_for(events, 60, "breaker closed", |k| matches!(k, EventKind::BreakerChanged { to: BreakerState::Closed, .. })).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_before_generation_replays_on_cpu_with_identical_tokens() {
    let supervisor = Supervisor::start(config()).await.unwrap();
    let reference = straight(&supervisor, "ref", 24).await;
    assert_eq!(reference.device, "cpu");
    assert!(!reference.degraded);

    let on_gpu = supervisor.run(request("gpu", 24), Target::Auto, |_| {}).await.unwrap();
    assert_eq!(on_gpu.device, "sim");
    assert!(on_gpu.simulated);
    assert_eq!(on_gpu.tokens, reference.tokens, "sim and cpu compute alike");

    supervisor.inject_fault(Fault::OomNextAllocation).await.unwrap();
    let mut streamed = Vec::new();
    let out = supervisor.run(request("oom", 24), Target::Auto, |t| streamed.push((t.token, t.device.clone()))).await.unwrap();
    assert_eq!(out.device, "cpu");
    assert!(out.degraded, "a failed-over response says it was degraded");
    assert!(out.degraded_reason.as_deref().unwrap().contains("out-of-memory"), "{:?}", out.degraded_reason);
    assert_eq!(out.failovers.len(), 1);
    assert_eq!(out.failovers[0].resumed_after_tokens, 0);
    assert_eq!(out.tokens, reference.tokens);
    assert!(streamed.iter().all(|(_, d)| d == "cpu"));
    // One OOM is below the threshold: the GPU still takes the next request.
    assert_eq!(supervisor.status().breaker, BreakerState::Closed);
    let next = supervisor.run(request("after", 24), Target::Auto, |_| {}).await.unwrap();
    assert_eq!(next.device, "sim");
    supervisor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_mid_generation_resumes_on_cpu_without_duplicates() {
    let supervisor = Supervisor::start(config()).await.unwrap();
    let reference = straight(&supervisor, "ref", 30).await;
    supervisor.inject_fault(Fault::OomAfterTokens { tokens: 7 }).await.unwrap();
    let mut streamed = Vec::new();
    let out = supervisor.run(request("mid", 30), Target::Auto, |t| streamed.push(t.clone())).await.unwrap();
    assert_eq!(out.failovers.len(), 1);
    assert_eq!(out.failovers[0].resumed_after_tokens, 7);
    assert_eq!(out.tokens, reference.tokens, "resumed stream equals a straight run");
    assert_eq!(out.text, reference.text);
    // Every index exactly once, the first 7 from the sim GPU, the rest from the CPU.
    let indices: Vec<u32> = streamed.iter().map(|t| t.index).collect();
    assert_eq!(indices, (0..streamed.len() as u32).collect::<Vec<_>>());
    assert!(streamed[..7].iter().all(|t| t.device == "sim"));
    assert!(streamed[7..].iter().all(|t| t.device == "cpu"));
    supervisor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_the_gpu_worker_leaves_the_cpu_worker_and_its_request_alone() {
    let supervisor = Supervisor::start(config()).await.unwrap();
    let mut events = supervisor.subscribe();
    let reference = straight(&supervisor, "ref", 40).await;
    let cpu_pid = supervisor.cpu_worker().unwrap().pid;
    let gpu_pid = supervisor.gpu_worker().unwrap().pid;
    // Slow the sim GPU so the kill lands mid-stream.
    supervisor.inject_fault(Fault::Slowdown { factor: 20.0 }).await.unwrap();

    let cpu_job = {
        let s = supervisor.clone();
        tokio::spawn(async move { s.run(request("cpu-side", 40), Target::Cpu, |_| {}).await })
    };
    let (first_tx, first_rx) = tokio::sync::oneshot::channel();
    let gpu_job = {
        let s = supervisor.clone();
        tokio::spawn(async move {
            let mut first = Some(first_tx);
            s.run(request("gpu-side", 40), Target::Auto, move |t| {
                if t.index >= 3 {
                    if let Some(tx) = first.take() {
                        let _ = tx.send(());
                    }
                }
            })
            .await
        })
    };
    tokio::time::timeout(Duration::from_secs(60), first_rx).await.unwrap().unwrap();
    let status = std::process::Command::new("kill").args(["-9", &gpu_pid.to_string()]).status().unwrap();
    assert!(status.success());

    let gpu_out = gpu_job.await.unwrap().unwrap();
    assert_eq!(gpu_out.device, "cpu");
    assert!(gpu_out.failovers[0].reason.contains("SIGKILL") || gpu_out.failovers[0].reason.contains("ended"), "{:?}", gpu_out.failovers);
    assert!(gpu_out.failovers[0].resumed_after_tokens >= 3);
    assert_eq!(gpu_out.tokens, reference.tokens);
    let cpu_out = cpu_job.await.unwrap().unwrap();
    assert_eq!(cpu_out.tokens, reference.tokens, "the CPU worker's own request is undisturbed");
    assert!(cpu_out.failovers.is_empty());
    assert_eq!(supervisor.cpu_worker().unwrap().pid, cpu_pid, "the CPU worker was never restarted");

    wait_for_all(
        &mut events,
        10,
        &[
            ("worker exited", &|k| matches!(k, EventKind::WorkerExited { device, .. } if device == "sim")),
            ("degraded", &|k| matches!(k, EventKind::Degraded { degraded: true, .. })),
        ],
    )
    .await;
    wait_closed(&mut events).await;
    let restored = supervisor.gpu_worker().unwrap();
    assert_ne!(restored.pid, gpu_pid, "a new GPU worker process");
    assert!(!supervisor.status().degraded);
    // The slowdown models the environment and survives the restart; clear it and use the GPU.
    supervisor.inject_fault(Fault::Clear).await.unwrap();
    let again = supervisor.run(request("again", 40), Target::Auto, |_| {}).await.unwrap();
    assert_eq!(again.device, "sim");
    assert_eq!(again.tokens, reference.tokens);
    supervisor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_gpu_worker_fails_its_health_check_and_is_replaced() {
    let mut config = config();
    config.supervision.health_timeout_ms = 400;
    let supervisor = Supervisor::start(config).await.unwrap();
    let mut events = supervisor.subscribe();
    let hung_pid = supervisor.gpu_worker().unwrap().pid;
    supervisor.inject_fault(Fault::Hang).await.unwrap();
    let failed = wait_for(&mut events, 10, "health check failed", |k| matches!(k, EventKind::HealthCheckFailed { .. })).await;
    let EventKind::HealthCheckFailed { pid, reason, .. } = failed.kind else { unreachable!() };
    assert_eq!(pid, hung_pid);
    assert!(reason.contains("did not answer a health check"), "{reason}");
    // While the GPU is out, requests run on the CPU and say so.
    let out = supervisor.run(request("during", 12), Target::Auto, |_| {}).await.unwrap();
    if supervisor.status().degraded {
        assert_eq!(out.device, "cpu");
    }
    wait_closed(&mut events).await;
    assert_ne!(supervisor.gpu_worker().unwrap().pid, hung_pid);
    let after = supervisor.run(request("after", 12), Target::Auto, |_| {}).await.unwrap();
    assert_eq!(after.device, "sim");
    supervisor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_ooms_run_the_breaker_through_a_full_cycle() {
    let mut config = config();
    // Long enough that the open state is still there when the test looks at it, even on a
    // loaded 2-core CI machine.
    config.supervision.breaker.cooldown_ms = 5000;
    let supervisor = Supervisor::start(config).await.unwrap();
    let mut events = supervisor.subscribe();
    let first_pid = supervisor.gpu_worker().unwrap().pid;
    for i in 0..3 {
        supervisor.inject_fault(Fault::OomNextAllocation).await.unwrap();
        let out = supervisor.run(request(&format!("oom-{i}"), 8), Target::Auto, |_| {}).await.unwrap();
        assert_eq!(out.device, "cpu", "request {i} failed over");
    }
    let opened = wait_for(&mut events, 5, "breaker open", |k| matches!(k, EventKind::BreakerChanged { to: BreakerState::Open, .. })).await;
    let EventKind::BreakerChanged { reason, .. } = opened.kind else { unreachable!() };
    assert!(reason.contains("3 allocation failures"), "{reason}");
    wait_for(&mut events, 5, "degraded", |k| matches!(k, EventKind::Degraded { degraded: true, .. })).await;
    let status = supervisor.status();
    assert!(status.degraded, "{status:?}");
    // Open: requests go straight to the CPU, no failover needed, and say why.
    let during = supervisor.run(request("during", 8), Target::Auto, |_| {}).await.unwrap();
    assert_eq!(during.device, "cpu");
    assert!(during.failovers.is_empty());
    assert!(during.degraded);
    assert!(during.degraded_reason.as_deref().unwrap_or("").contains("allocation failures"), "{:?}", during.degraded_reason);
    wait_for(&mut events, 15, "half-open", |k| matches!(k, EventKind::BreakerChanged { to: BreakerState::HalfOpen, .. })).await;
    wait_closed(&mut events).await;
    wait_for(&mut events, 5, "restored", |k| matches!(k, EventKind::Degraded { degraded: false, .. })).await;
    assert_ne!(supervisor.gpu_worker().unwrap().pid, first_pid, "opened on OOMs: the worker was restarted clean");
    let after = supervisor.run(request("after", 8), Target::Auto, |_| {}).await.unwrap();
    assert_eq!(after.device, "sim");
    assert!(!after.degraded);
    supervisor.shutdown().await;
}

/// Bytes the sim worker reserves for `request`, from the same planner it uses.
fn request_bytes(request: &RunRequest) -> u64 {
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let (planner, calibration) = headroom_memory::planner_for(&bundle, "cpu", MemoryConfig::default());
    assert!(calibration.measured, "the embedded model ships its CPU calibration: {}", calibration.source);
    let footprint = planner.footprint(RequestShape::of(&request.request));
    footprint.request_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn competing_workload_makes_the_sim_gpu_refuse_and_the_request_fail_over() {
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let weights = ModelShape::from_config(&bundle.config).weights_bytes();
    let long = request("long", 256);
    let needed = request_bytes(&long);
    assert!(needed > MIB, "the competitor is set in whole MiB: the request must need more");
    // Room for the weights and two such requests; the competitor leaves less than one.
    let capacity_mib = (weights + 2 * needed).div_ceil(MIB);
    let competitor_mib = (capacity_mib * MIB - weights - needed) / MIB + 1;
    let mut config = config();
    config.gpu.as_mut().unwrap().sim_vram_mib = capacity_mib;
    let supervisor = Supervisor::start(config).await.unwrap();
    supervisor.inject_fault(Fault::Compete { mib: competitor_mib }).await.unwrap();
    let memory = supervisor.gpu_worker().unwrap().health(Duration::from_secs(2)).await.unwrap().memory;
    assert_eq!(memory.competing_bytes, competitor_mib * MIB);
    assert!(memory.simulated);
    let refused = supervisor.run(long.clone(), Target::Auto, |_| {}).await.unwrap();
    assert_eq!(refused.device, "cpu");
    assert!(refused.failovers[0].reason.contains("KV cache"), "{:?}", refused.failovers);
    supervisor.inject_fault(Fault::Clear).await.unwrap();
    let fits = supervisor.run(RunRequest { request_id: "fits".into(), ..long }, Target::Auto, |_| {}).await.unwrap();
    assert_eq!(fits.device, "sim");
    assert_eq!(fits.tokens, refused.tokens, "same seed, same tokens on either device");
    supervisor.shutdown().await;
}

/// Kills the GPU worker once each of `ids`' requests (started on the GPU with `Target::Auto`)
/// has streamed 3 tokens: the fault at full slots. Gives their outcomes.
async fn kill_gpu_worker_at_full_slots(supervisor: &Supervisor, ids: &[&str], max_tokens: usize) -> Vec<RunOutcome> {
    let (started_tx, mut started_rx) = tokio::sync::mpsc::unbounded_channel();
    let jobs: Vec<_> = ids
        .iter()
        .map(|id| {
            let (s, started, id) = (supervisor.clone(), started_tx.clone(), id.to_string());
            let mut told = false;
            tokio::spawn(async move {
                s.run(request(&id, max_tokens), Target::Auto, move |t| {
                    if t.index >= 3 && !told {
                        told = true;
                        let _ = started.send(());
                    }
                })
                .await
            })
        })
        .collect();
    for _ in ids {
        tokio::time::timeout(Duration::from_secs(60), started_rx.recv()).await.unwrap().unwrap();
    }
    let pid = supervisor.gpu_worker().unwrap().pid;
    assert!(std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    let mut outcomes = Vec::new();
    for job in jobs {
        outcomes.push(job.await.unwrap().unwrap());
    }
    outcomes
}

/// Waits until a GPU worker other than `pid` runs and the breaker closed again.
async fn wait_gpu_replaced(supervisor: &Supervisor, pid: u32) -> std::sync::Arc<headroom_router::Worker> {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(w) = supervisor.gpu_worker().filter(|w| w.pid != pid && !supervisor.status().degraded) {
            return w;
        }
        assert!(std::time::Instant::now() < deadline, "no new GPU worker within 20 s: {:?}", supervisor.status());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The GPU worker's layers are placed again before each launch, from the VRAM free then (the
/// plan `serve` makes at start): a program that took VRAM while the worker ran makes the
/// restarted worker hold fewer layers, and once it left the next launch holds them all. The
/// requests running at each kill (the GPU's slots full) complete on the CPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_gpu_worker_holds_the_layers_that_fit_then() {
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let memory = MemoryConfig { vram_reserve_mib: Some(0), split_min_context_tokens: 64, ..MemoryConfig::default() };
    let plan = move |room: VramRoom| headroom_memory::plan_model_split(&bundle, "sim", &memory, room.free_bytes, 1, 256, Default::default());
    let room = |total_mib: u64, competing_mib: u64| VramRoom { total_bytes: total_mib * MIB, free_bytes: (total_mib - competing_mib) * MIB };
    // The smallest sim GPU that holds every layer, and the smallest competitor that leaves
    // room for some layers but not all.
    let size = (1..4096).find(|&mib| plan(room(mib, 0)).unwrap().head_on_gpu).unwrap();
    let (competitor, shrunk) = (1..size)
        .map(|c| (c, plan(room(size, c)).unwrap()))
        .find(|(_, p)| !p.head_on_gpu)
        .unwrap();
    assert!(shrunk.gpu_layers > 0, "{}", shrunk.reason);
    let layers = shrunk.layers;

    let mut config = config();
    let gpu = config.gpu.as_mut().unwrap();
    gpu.sim_vram_mib = size;
    gpu.max_concurrency = 2;
    // The probe's canary must fit beside the split on a GPU this small.
    config.supervision.probe_canary_mib = 1;
    config.placement = Some(plan(room(size, 0)).unwrap());
    config.replan = Some(LayerPlanner(std::sync::Arc::new(plan)));
    let supervisor = Supervisor::start(config).await.unwrap();
    let mut events = supervisor.subscribe();
    let reference = straight(&supervisor, "ref", 40).await;
    let first = supervisor.gpu_worker().unwrap();
    assert_eq!(first.ready.split, None, "every layer on the GPU at start");

    // Another program takes VRAM; the worker dies with its slots full.
    supervisor.inject_fault(Fault::Compete { mib: competitor }).await.unwrap();
    supervisor.inject_fault(Fault::Slowdown { factor: 20.0 }).await.unwrap();
    for out in kill_gpu_worker_at_full_slots(&supervisor, &["a", "b"], 40).await {
        assert_eq!(out.device, "cpu");
        assert_eq!(out.tokens, reference.tokens);
    }
    let second = wait_gpu_replaced(&supervisor, first.pid).await;
    assert_eq!(
        second.ready.split,
        Some(SplitLayers { gpu_layers: shrunk.gpu_layers, layers }),
        "the restarted worker holds the layers that fit beside the {competitor} MiB competitor"
    );
    assert_eq!(supervisor.placement().map(|p| p.gpu_layers), Some(shrunk.gpu_layers));
    wait_for(&mut events, 10, "placement changed", |k| matches!(k, EventKind::PlacementChanged { gpu_layers, .. } if *gpu_layers == shrunk.gpu_layers)).await;
    supervisor.inject_fault(Fault::Slowdown { factor: 1.0 }).await.unwrap();
    let split = supervisor.run(request("split", 40), Target::Auto, |_| {}).await.unwrap();
    assert_eq!(split.device, "sim", "{:?}", split.failovers);
    assert_eq!(split.split, Some(SplitLayers { gpu_layers: shrunk.gpu_layers, layers }));
    assert_eq!(split.tokens, reference.tokens, "the split gives the same tokens");

    // The program leaves; the next launch holds every layer again.
    supervisor.inject_fault(Fault::Clear).await.unwrap();
    supervisor.inject_fault(Fault::Slowdown { factor: 20.0 }).await.unwrap();
    for out in kill_gpu_worker_at_full_slots(&supervisor, &["c", "d"], 40).await {
        assert_eq!(out.device, "cpu");
        assert_eq!(out.tokens, reference.tokens);
    }
    let third = wait_gpu_replaced(&supervisor, second.pid).await;
    assert_eq!(third.ready.split, None, "every layer on the GPU again");
    assert_eq!(supervisor.placement().map(|p| p.gpu_layers), Some(layers));
    supervisor.shutdown().await;
}

/// Its negative control: with every launch loading the start's placement, the restarted worker
/// loads every layer beside the competitor, and the GPU never takes requests again (its probe
/// finds no room).
#[test]
fn re_planning_at_restart_fails_when_switched_off() {
    headroom_model::assert_control_fails("a_restarted_gpu_worker_holds_the_layers_that_fit_then", "no-replan", "canary allocation failed");
}
