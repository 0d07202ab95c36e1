//! The request path across real worker processes: journal, admission, bounded queues,
//! idempotency, cancellation and recovery after a crash.

use std::path::PathBuf;
use std::time::Duration;

use headroom_memory::{Allowances, MemoryConfig};
use headroom_model::{GenerateRequest, ModelBundle, SamplingParams};
use headroom_router::journal::{NewRequest, TransitionRecord};
use headroom_router::{
    Dispatcher, Journal, QueueConfig, RequestState, RunRequest, Settings, Submission, SubmitError, Supervisor, SupervisorConfig, Transition,
};
use headroom_worker::{DeviceKind, Fault, WorkerOptions};

fn model_dir() -> PathBuf {
    headroom_model::bundle::resolve_model_dir("default")
}

fn supervisor_config(with_sim_gpu: bool) -> SupervisorConfig {
    let sim = with_sim_gpu.then(|| {
        let mut sim = WorkerOptions::new(DeviceKind::Sim);
        sim.memory_sample_ms = 0;
        sim
    });
    let mut config = SupervisorConfig::new(PathBuf::from(env!("CARGO_BIN_EXE_headroom")), model_dir(), sim);
    config.cpu.max_concurrency = 1;
    config.supervision.health_interval_ms = 200;
    config
}

async fn dispatcher(with_sim_gpu: bool, journal: Journal, queues: QueueConfig) -> Dispatcher {
    let supervisor = Supervisor::start(supervisor_config(with_sim_gpu)).await.unwrap();
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let memory = MemoryConfig::default();
    let (planner, _) = headroom_memory::planner_for(&bundle, "cpu", memory.clone());
    Dispatcher::start(supervisor, journal, planner, memory, queues, Settings::default(), None).unwrap().0
}

fn submission(id: &str, body: &str, max_tokens: usize, key: Option<&str>) -> Submission {
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let prompt = bundle.encode(body, true).unwrap();
    let sampling = SamplingParams { temperature: 0.8, top_k: 40, top_p: 0.95, repetition_penalty: 1.1, seed: 3 };
    let mut request = GenerateRequest::new(prompt, max_tokens, sampling);
    // Run every step: no early EOS, so the lengths below are exact.
    request.ignore_eos = true;
    Submission {
        run: RunRequest { request_id: id.into(), request, allow_resume: true },
        idempotency_key: key.map(str::to_string),
        body_hash: format!("{body}/{max_tokens}"),
        stream: false,
        allow: Allowances::default(),
    }
}

fn states(journal: &Journal, id: &str) -> Vec<RequestState> {
    journal.transitions(id).unwrap().iter().map(|t: &TransitionRecord| t.state).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_retry_returns_the_stored_completion_and_runs_nothing_twice() {
    let d = dispatcher(false, Journal::in_memory().unwrap(), QueueConfig::default()).await;
    let first = d.submit(submission("r1", "And God said", 12, Some("key-1"))).unwrap().finish().await.unwrap();
    assert!(!first.from_journal);
    let again = d.submit(submission("r2", "And God said", 12, Some("key-1"))).unwrap().finish().await.unwrap();
    assert!(again.from_journal);
    assert_eq!(again.outcome.tokens, first.outcome.tokens);
    assert_eq!(again.outcome.request_id, "r1");
    assert!(matches!(d.journal().get("r2"), Err(headroom_router::JournalError::NotFound(_))));
    assert_eq!(states(d.journal(), "r1").iter().filter(|s| **s == RequestState::Running).count(), 1, "ran once");
    // Same key, other body: a conflict, and the first request is untouched.
    let err = d.submit(submission("r3", "Something else", 12, Some("key-1"))).err().unwrap();
    assert!(matches!(err, SubmitError::Conflict(_)), "{err}");
    assert_eq!(d.journal().get("r1").unwrap().state, RequestState::Completed);
    d.supervisor().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_while_running_attaches_to_the_same_request() {
    let d = dispatcher(false, Journal::in_memory().unwrap(), QueueConfig::default()).await;
    let running = d.submit(submission("r1", "In the beginning", 60, Some("k"))).unwrap();
    let attached = d.submit(submission("r1-retry", "In the beginning", 60, Some("k"))).unwrap();
    assert_eq!(attached.request_id, "r1");
    let (a, b) = tokio::join!(running.finish(), attached.finish());
    assert_eq!(a.unwrap().outcome.tokens, b.unwrap().outcome.tokens);
    d.supervisor().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_a_queued_cpu_request_frees_its_place_and_leaves_the_running_one_alone() {
    let d = dispatcher(false, Journal::in_memory().unwrap(), QueueConfig::default()).await;
    let mut running = d.submit(submission("long", "And it came to pass", 80, None)).unwrap();
    assert_eq!(running.device_queue, "cpu");
    running.next_token().await.expect("the first request started");
    let queued = d.submit(submission("queued", "And it came to pass", 80, None)).unwrap();
    assert_eq!(d.queues().iter().find(|q| q.device == "cpu").unwrap().waiting, 1);
    queued.cancel();
    assert!(matches!(queued.finish().await, Err(SubmitError::Cancelled)));
    assert_eq!(d.journal().get("queued").unwrap().state, RequestState::Cancelled);
    assert_eq!(d.queues().iter().find(|q| q.device == "cpu").unwrap().waiting, 0);
    let done = running.finish().await.unwrap();
    assert_eq!(done.outcome.tokens.len(), 80);
    d.supervisor().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_its_running_request() {
    let d = dispatcher(false, Journal::in_memory().unwrap(), QueueConfig::default()).await;
    let mut ticket = d.submit(submission("gone", "And the LORD spake", 400, None)).unwrap();
    ticket.next_token().await.unwrap();
    drop(ticket);
    let journal = d.journal();
    let mut state = journal.get("gone").unwrap().state;
    for _ in 0..100 {
        if state.is_terminal() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        state = journal.get("gone").unwrap().state;
    }
    assert_eq!(state, RequestState::Cancelled);
    // The CPU worker is free again at once: the next request runs and finishes.
    let next = d.submit(submission("next", "And the LORD spake", 8, None)).unwrap().finish().await.unwrap();
    assert_eq!(next.outcome.tokens.len(), 8);
    d.supervisor().shutdown().await;
}

/// 500 clients at once: returns (accepted, refused). Every accepted request must finish.
async fn flood(d: &Dispatcher, round: usize) -> (usize, usize) {
    let template = submission("template", "Blessed are", 4, None);
    let mut clients = tokio::task::JoinSet::new();
    for i in 0..500 {
        let d = d.clone();
        let mut sub = template.clone();
        sub.run.request_id = format!("flood-{round}-{i}");
        clients.spawn(async move {
            let result = d.submit(sub);
            let q = d.queues()[0].clone();
            assert!(q.waiting <= q.capacity, "bounded: {q:?}");
            match result {
                Ok(t) => {
                    assert_eq!(t.finish().await.unwrap().outcome.tokens.len(), 4);
                    true
                }
                Err(SubmitError::Capacity { reason, retry_after_s, .. }) => {
                    assert!(reason.contains("queue is full"), "{reason}");
                    assert!(retry_after_s.unwrap() >= 1);
                    false
                }
                Err(e) => panic!("{e}"),
            }
        });
    }
    let (mut accepted, mut refused) = (0, 0);
    while let Some(r) = clients.join_next().await {
        if r.unwrap() {
            accepted += 1;
        } else {
            refused += 1;
        }
    }
    (accepted, refused)
}

fn resident_mib() -> f64 {
    headroom_memory::observe::host_memory().unwrap().process_bytes as f64 / (1 << 20) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_is_bounded_by_the_queue_and_the_excess_is_refused_cleanly_with_flat_memory() {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(&dir.path().join("journal.sqlite")).unwrap();
    let queues = QueueConfig { gpu_queue_capacity: 4, cpu_queue_capacity: 4 };
    let d = dispatcher(false, journal, queues).await;
    let mut refused_total = 0u64;
    let mut resident = Vec::new();
    for round in 0..3 {
        let (accepted, refused) = flood(&d, round).await;
        // Never more than 4 wait at once (checked by every client), and the excess is refused.
        assert!(refused > 0 && accepted >= 1, "{accepted} accepted, {refused} refused");
        assert_eq!(accepted + refused, 500);
        refused_total += refused as u64;
        resident.push(resident_mib());
        println!("flood round {round}: {accepted} accepted, {refused} refused, router RSS {:.1} MiB", resident[round]);
    }
    // Memory flat: later floods do not grow the router (the first one warms up the allocator).
    assert!(resident[2] <= resident[0] + 16.0, "router RSS grew across floods: {resident:?} MiB");
    let q = &d.queues()[0];
    assert_eq!((q.waiting, q.running), (0, 0), "everything accepted ended");
    // Every refusal is on record too: none vanished.
    let counts: std::collections::HashMap<_, _> = d.journal().counts().unwrap().into_iter().collect();
    assert_eq!(counts.get(&RequestState::Refused).copied().unwrap_or(0), refused_total);
    d.supervisor().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_failure_is_journaled_as_a_replay_on_the_cpu() {
    let d = dispatcher(true, Journal::in_memory().unwrap(), QueueConfig::default()).await;
    d.supervisor().inject_fault(Fault::OomNextAllocation).await.unwrap();
    let done = d.submit(submission("oom", "And God said", 10, None)).unwrap().finish().await.unwrap();
    assert_eq!(done.outcome.device, "cpu");
    let steps: Vec<Transition> = d.journal().transitions("oom").unwrap().into_iter().map(|t| t.transition).collect();
    assert!(matches!(steps[0], Transition::Queued { .. }));
    assert!(steps.iter().any(|t| matches!(t, Transition::AttemptFailed { device, .. } if device == "sim")), "{steps:?}");
    assert!(steps.iter().any(|t| matches!(t, Transition::Replayed { to, attempt: 2 } if to == "cpu")), "{steps:?}");
    assert!(matches!(steps.last(), Some(Transition::Completed { device, .. }) if device == "cpu"));
    d.supervisor().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_crash_the_journal_reruns_what_was_accepted_and_unfinished() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("journal.sqlite");
    let orphan = submission("orphan", "And Jesus answered", 6, Some("orphan-key"));
    {
        // What a service killed right after accepting a request leaves behind.
        let journal = Journal::open(&path).unwrap();
        let body = serde_json::json!({ "run": orphan.run, "allow": orphan.allow });
        journal
            .accept(&NewRequest {
                id: "orphan".into(),
                idempotency_key: orphan.idempotency_key.clone(),
                body_hash: orphan.body_hash.clone(),
                body,
                stream: false,
                allow_resume: true,
            })
            .unwrap();
        journal.record("orphan", &Transition::Running { device: "cpu".into(), attempt: 1 }).unwrap();
    }
    let d = dispatcher(false, Journal::open(&path).unwrap(), QueueConfig::default()).await;
    // The client comes back with its idempotency key and collects the result.
    let collected = d.submit(orphan).unwrap().finish().await.unwrap();
    assert_eq!(collected.outcome.tokens.len(), 6);
    let record = d.journal().get("orphan").unwrap();
    assert_eq!((record.state, record.attempt), (RequestState::Completed, 2));
    d.supervisor().shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_would_outlast_the_client_timeout_is_refused_up_front() {
    let d = dispatcher(false, Journal::in_memory().unwrap(), QueueConfig::default()).await;
    // One finished request gives the CPU lane a measured rate.
    d.submit(submission("warm", "And God said", 16, None)).unwrap().finish().await.unwrap();
    let cpu = d.queues().into_iter().find(|q| q.device == "cpu").unwrap();
    assert!(cpu.ms_per_token.unwrap() > 0.0);
    let mut impatient = submission("impatient", "And God said", 400, None);
    impatient.allow.max_wait_ms = Some(1);
    match d.submit(impatient) {
        Err(SubmitError::Capacity { reason, retry_after_s, .. }) => {
            assert!(reason.contains("timeout"), "{reason}");
            assert!(retry_after_s.is_some());
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a 400-token CPU request cannot finish within 1 ms"),
    }
    assert_eq!(d.journal().get("impatient").unwrap().state, RequestState::Refused);
    // Without a stated timeout it is accepted.
    let patient = d.submit(submission("patient", "And God said", 8, None)).unwrap();
    assert_eq!(patient.finish().await.unwrap().outcome.tokens.len(), 8);
    d.supervisor().shutdown().await;
}

const BURST_PROMPT: &str = "In the beginning God created";

/// A dispatcher whose sim GPU has room for one and a half 24-token requests of
/// [`BURST_PROMPT`] besides weights and a 64 MiB reserve, after one warm-up request (so the GPU
/// lane has measured rates to estimate a wait from). The worker's memory samples are off
/// (memory_sample_ms = 0): only the router's own accounting can see a grant.
async fn one_request_gpu(memory: MemoryConfig) -> Dispatcher {
    use headroom_memory::footprint::{ModelShape, MIB};
    use headroom_memory::RequestShape;
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let memory = MemoryConfig { vram_reserve_mib: Some(64), ..memory };
    let (planner, _) = headroom_memory::planner_for(&bundle, "cpu", memory.clone());
    let r = submission("probe", BURST_PROMPT, 24, None).run.request;
    let needs = planner.footprint(RequestShape { prompt_tokens: r.prompt_tokens.len() as u64, max_tokens: 24, prefill_chunk: r.prefill_chunk as u64 }).request_bytes();
    let weights = ModelShape::from_config(&bundle.config).weights_bytes();
    let mut config = supervisor_config(true);
    config.gpu.as_mut().unwrap().sim_vram_mib = (weights + needs * 3 / 2) / MIB + 64;
    let supervisor = Supervisor::start(config).await.unwrap();
    let d = Dispatcher::start(supervisor, Journal::in_memory().unwrap(), planner, memory, QueueConfig::default(), Settings::default(), None).unwrap().0;
    d.submit(submission("warm", BURST_PROMPT, 24, None)).unwrap().finish().await.unwrap();
    d
}

/// A free GPU slot is not free GPU memory: on a sim GPU whose budget holds one request, a burst
/// of four runs one at a time on it (the others wait for its memory), and all finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_gpu_requests_start_only_when_their_memory_is_free() {
    let d = one_request_gpu(MemoryConfig::default()).await;
    let mut events = d.supervisor().subscribe();
    let burst: Vec<Submission> = (0..4).map(|i| submission(&format!("b{i}"), BURST_PROMPT, 24, None)).collect();
    let tickets: Vec<_> = burst.into_iter().map(|s| d.submit(s).unwrap()).collect();
    let mut ends = Vec::new();
    for t in tickets {
        ends.push(t.finish().await.unwrap());
    }
    let mut most_running_on_gpu = 0;
    while let Ok(e) = events.try_recv() {
        if let headroom_router::EventKind::QueueChanged { device, running, .. } = e.kind {
            if device == "gpu" {
                most_running_on_gpu = most_running_on_gpu.max(running);
            }
        }
    }
    assert_eq!(most_running_on_gpu, 1, "the GPU budget holds one request at a time");
    assert!(ends.iter().all(|c| c.outcome.tokens.len() == 24));
    assert!(ends.iter().filter(|c| c.outcome.device == "sim").count() >= 2, "waiting for GPU memory, not sent away at once: {:?}", ends.iter().map(|c| &c.outcome.device).collect::<Vec<_>>());
    d.supervisor().shutdown().await;
}

/// GPU-queued requests whose memory does not free within the queue wait move to the CPU queue
/// (one CPU slot: they take turns there), and every one finishes, marked degraded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gpu_requests_whose_memory_never_frees_in_time_take_turns_on_the_cpu() {
    let d = one_request_gpu(MemoryConfig { max_queue_wait_ms: 300, ..MemoryConfig::default() }).await;
    let burst: Vec<Submission> = (0..4).map(|i| submission(&format!("m{i}"), BURST_PROMPT, 24, None)).collect();
    // The GPU's one request now outlasts the others' queue wait.
    d.supervisor().inject_fault(Fault::Slowdown { factor: 8.0 }).await.unwrap();
    let tickets: Vec<_> = burst.into_iter().map(|s| d.submit(s).unwrap()).collect();
    let mut ends = Vec::new();
    for t in tickets {
        ends.push(t.finish().await.expect("every request finishes"));
    }
    assert!(ends.iter().all(|c| c.outcome.tokens.len() == 24));
    let moved: Vec<_> = ends.iter().filter(|c| c.outcome.device == "cpu").collect();
    assert!(!moved.is_empty(), "some waited past the queue wait: {:?}", ends.iter().map(|c| &c.outcome.device).collect::<Vec<_>>());
    for c in &moved {
        assert!(c.outcome.degraded);
        assert!(c.outcome.degraded_reason.as_deref().unwrap_or("").contains("GPU memory that did not free"), "{:?}", c.outcome.degraded_reason);
        let states = states(d.journal(), &c.outcome.request_id);
        assert_eq!(states.iter().filter(|s| **s == RequestState::Queued).count(), 2, "queued for the GPU, then for the CPU: {states:?}");
    }
    d.supervisor().inject_fault(Fault::Clear).await.unwrap();
    d.supervisor().shutdown().await;
}
