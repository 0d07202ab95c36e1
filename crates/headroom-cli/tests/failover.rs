//! Failover across real processes: a router (the supervisor, in this test process) with a `sim`
//! GPU worker and a warm CPU worker, both `headroom worker` processes on the embedded model.
//! Faults are injected into the sim worker; the CPU worker must never notice.

use std::path::PathBuf;
use std::time::Duration;

use headroom_memory::{MemoryConfig, ModelShape, RequestShape, MIB};
use headroom_model::{GenerateRequest, ModelBundle, SamplingParams};
use headroom_router::{BreakerState, EventKind, RunOutcome, RunRequest, ServiceEvent, Supervisor, SupervisorConfig, Target};
use headroom_worker::{Device, Fault, WorkerOptions};
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
