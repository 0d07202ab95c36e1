//! The request path across real worker processes: journal, admission, bounded queues,
//! idempotency, cancellation and recovery after a crash.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use headroom_memory::{Allowances, MemoryConfig};
use headroom_model::{GenerateRequest, ModelBundle, SamplingParams};
use headroom_router::journal::{NewRequest, TransitionRecord};
use headroom_router::{
    Completion, Defect, Dispatcher, Journal, QueueConfig, RequestState, RunRequest, Settings, Submission, SubmitError, Supervisor, SupervisorConfig, Ticket,
    Lane, Transition,
};
use headroom_worker::{Device, Fault, WorkerOptions};

fn model_dir() -> PathBuf {
    headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL)
}

fn supervisor_config(with_sim_gpu: bool) -> SupervisorConfig {
    let sim = with_sim_gpu.then(|| {
        let mut sim = WorkerOptions::new(Device::Sim);
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
    assert_eq!(running.device_queue, Some(Lane::Cpu));
    running.next_token().await.expect("the first request started");
    let queued = d.submit(submission("queued", "And it came to pass", 80, None)).unwrap();
    assert_eq!(d.queues().iter().find(|q| q.device == Lane::Cpu).unwrap().waiting, 1);
    queued.cancel();
    assert!(matches!(queued.finish().await, Err(SubmitError::Cancelled)));
    assert_eq!(d.journal().get("queued").unwrap().state, RequestState::Cancelled);
    assert_eq!(d.queues().iter().find(|q| q.device == Lane::Cpu).unwrap().waiting, 0);
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
        journal.record("orphan", &Transition::Running { device: Device::Cpu, attempt: 1 }).unwrap();
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
    let cpu = d.queues().into_iter().find(|q| q.device == Lane::Cpu).unwrap();
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

/// A dispatcher whose sim GPU has room for one (not two) 24-token requests of
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
    // The smallest whole MiB budget that holds one request; it must not hold two.
    let vram_mib = (weights + needs).div_ceil(MIB) + 64;
    let free = (vram_mib - 64) * MIB - weights;
    assert!(free >= needs && free < 2 * needs, "a budget of {vram_mib} MiB leaves {free} bytes for requests of {needs}");
    config.gpu.as_mut().unwrap().sim_vram_mib = vram_mib;
    let supervisor = Supervisor::start(config).await.unwrap();
    let d = Dispatcher::start(supervisor, Journal::in_memory().unwrap(), planner, memory, QueueConfig::default(), Settings::default(), None).unwrap().0;
    d.submit(submission("warm", BURST_PROMPT, 24, None)).unwrap().finish().await.unwrap();
    d
}

/// A dispatcher over a sim GPU worker holding 2 of the demo model's 4 layers, sized so that a
/// long request's KV cache for those two layers fits beside their weights and its cache for
/// all four would not; and that long request.
async fn split_gpu_with_room_for_its_share() -> (Dispatcher, Submission) {
    use headroom_memory::footprint::{ModelShape, MIB};
    use headroom_memory::RequestShape;
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let memory = MemoryConfig { vram_reserve_mib: Some(64), ..MemoryConfig::default() };
    let (planner, _) = headroom_memory::planner_for(&bundle, "cpu", memory.clone());
    let long = submission("long", &"And God said, Let there be light: and there was light. ".repeat(40), 24, None);
    let r = &long.run.request;
    let shape = RequestShape { prompt_tokens: r.prompt_tokens.len() as u64, max_tokens: 24, prefill_chunk: r.prefill_chunk as u64 };
    let (whole, share) = (planner.footprint(shape).request_bytes(), planner.clone().split(2).footprint(shape).request_bytes());
    // The sim device holds the split's f32 layers: 2 of the 4.
    let c = &bundle.config;
    let (h, q, kv) = (c.hidden_size, c.num_attention_heads * c.head_dim(), c.kv_heads() * c.head_dim());
    let weights = 2 * (2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h) as u64 * 4;
    assert!(weights < ModelShape::from_config(c).weights_bytes());
    let vram_mib = (65..4096u64)
        .find(|mib| ((mib - 64) * MIB).checked_sub(weights).is_some_and(|free| free >= share && free < whole))
        .unwrap_or_else(|| panic!("no whole-MiB sim GPU holds {share} bytes but not {whole} beside {weights}"));
    let mut config = supervisor_config(true);
    let gpu = config.gpu.as_mut().unwrap();
    gpu.sim_vram_mib = vram_mib;
    gpu.gpu_layers = Some(2);
    let supervisor = Supervisor::start(config).await.unwrap();
    let d = Dispatcher::start(supervisor, Journal::in_memory().unwrap(), planner, memory, QueueConfig::default(), Settings::default(), None).unwrap().0;
    (d, long)
}

/// A split GPU worker is charged for the layers it holds: a long request whose KV cache for the
/// whole model would not fit beside the weights, but whose share for the GPU's 2 of 4 layers
/// does, runs there, split.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_gpu_worker_is_charged_its_layers_share_of_a_request() {
    let (d, long) = split_gpu_with_room_for_its_share().await;
    d.submit(submission("warm", "And God said", 8, None)).unwrap().finish().await.unwrap();
    let done = d.submit(long).unwrap().finish().await.unwrap();
    assert_eq!(done.outcome.device, "sim", "the long request ran on {} ({:?}): admission charged the split GPU more than its layers hold", done.outcome.device, done.outcome.degraded_reason);
    assert_eq!(done.outcome.split, Some(headroom_worker::SplitLayers { gpu_layers: 2, layers: 4 }));
    d.supervisor().shutdown().await;
}

/// Its negative control: charged for the whole model's KV cache, the request leaves the GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_split_gpu_worker_charged_for_the_whole_model_fails_the_check() {
    let (d, long) = split_gpu_with_room_for_its_share().await;
    d.reintroduce_defect_for_test(Defect::SplitChargedWhole);
    d.submit(submission("warm", "And God said", 8, None)).unwrap().finish().await.unwrap();
    let done = d.submit(long).unwrap().finish().await.unwrap();
    assert_eq!(done.outcome.device, "cpu", "charged for the whole model the request does not fit the split GPU");
    d.supervisor().shutdown().await;
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
            if device == Lane::Gpu {
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

async fn dispatcher_with(config: SupervisorConfig) -> Dispatcher {
    let supervisor = Supervisor::start(config).await.unwrap();
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let memory = MemoryConfig::default();
    let (planner, _) = headroom_memory::planner_for(&bundle, "cpu", memory.clone());
    Dispatcher::start(supervisor, Journal::in_memory().unwrap(), planner, memory, QueueConfig::default(), Settings::default(), None).unwrap().0
}

// `ends`, `until`: the same helpers as the router's own dispatch tests.
#[path = "../../headroom-router/tests/support/flow.rs"]
mod flow;
use flow::{ends, until, Ends};

/// The texts of the embedding requests queued in [`gpu_killed_at_full_load`].
const EMBEDDED: [&str; 4] = ["In the beginning God created the heaven and the earth.", "And the LORD spake unto Moses", "Blessed are the meek", "And God said, Let there be light"];

/// An embedding request of `text` (`GenerateRequest::embed`), as the embeddings routes submit it.
fn embedding_submission(id: &str, text: &str) -> Submission {
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let request = GenerateRequest::embedding(bundle.encode(text, true).unwrap());
    Submission {
        run: RunRequest { request_id: id.into(), request, allow_resume: true },
        idempotency_key: None,
        body_hash: format!("embed/{text}"),
        stream: false,
        allow: Allowances::default(),
    }
}

/// The sim GPU's 4 slots full and 4 more requests queued behind them (half of all of them
/// streaming), then `embeddings` embedding requests of [`EMBEDDED`] queued behind those, one
/// CPU slot: then the GPU worker is killed with SIGKILL.
async fn gpu_killed_at_full_load(defect: Option<Defect>, embeddings: usize) -> (Dispatcher, Ends) {
    gpu_killed_at_full_load_after(defect, embeddings, false).await
}

/// The same; with `unloaded_first`, the model's keep_alive (300 ms) has unloaded it from the
/// GPU before the load arrives, so the requests wait for its reload, fill it, and lose it.
async fn gpu_killed_at_full_load_after(defect: Option<Defect>, embeddings: usize, unloaded_first: bool) -> (Dispatcher, Ends) {
    let mut config = supervisor_config(true);
    config.gpu.as_mut().unwrap().max_concurrency = 4;
    if unloaded_first {
        config.keep_alive = headroom_memory::KeepAlive::For(std::time::Duration::from_millis(300));
    }
    let d = dispatcher_with(config).await;
    if let Some(defect) = defect {
        d.reintroduce_defect_for_test(defect);
    }
    if unloaded_first {
        let first = ends(vec![d.submit(submission("first", "In the beginning", 4, None)).unwrap()]).await;
        assert_eq!(first.completed[0].outcome.device, Device::Sim);
        until(20, "the model to unload after its keep_alive", || d.status().gpu_residency.is_some_and(|r| r.state == "unloaded") && d.supervisor().gpu_worker().is_none()).await;
    }
    // Slow enough that all eight are still in flight when the worker dies.
    d.supervisor().inject_fault(Fault::Slowdown { factor: 8.0 }).await.unwrap();
    let mut tickets: Vec<Ticket> = (0..8)
        .map(|i| {
            let mut sub = submission(&format!("full-{i}"), "And the LORD spake unto Moses", 48, None);
            sub.stream = i % 2 == 0;
            d.submit(sub).unwrap()
        })
        .collect();
    tickets.extend(EMBEDDED.iter().take(embeddings).enumerate().map(|(i, text)| d.submit(embedding_submission(&format!("embed-{i}"), text)).unwrap()));
    let gpu = |d: &Dispatcher| d.queues().into_iter().find(|q| q.device == Lane::Gpu).unwrap();
    until(20, "4 running and the rest queued on the GPU", || {
        let q = gpu(&d);
        q.running == 4 && q.waiting == 4 + embeddings
    })
    .await;
    // The lane counts a request as running just before its journal says so, and which four
    // took the slots first is the scheduler's choice: wait for four journaled as running.
    let journaled_running = || (0..8).filter(|i| d.journal().transitions(&format!("full-{i}")).unwrap().iter().any(|t| t.state == RequestState::Running)).count();
    until(20, "4 requests journaled as running", || journaled_running() >= 4).await;
    let pid = d.supervisor().gpu_worker().unwrap().pid;
    assert!(std::process::Command::new("kill").args(["-9", &pid.to_string()]).status().unwrap().success());
    let e = ends(tickets).await;
    (d, e)
}

/// Fault at full load: a GPU worker killed with its slots full and requests queued behind it
/// loses nothing. The running requests fail over through the CPU queue (one CPU slot: they
/// take turns there, told they wait), the queued ones follow, every failover is journaled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_worker_killed_at_full_load_loses_no_request() {
    let (d, e) = gpu_killed_at_full_load(None, 0).await;
    assert!(e.lost.is_empty(), "lost after acceptance: {:?}", e.lost);
    assert_eq!(e.completed.len(), 8);
    assert!(e.completed.iter().all(|c| c.outcome.tokens.len() == 48));
    let failed_over: Vec<_> = e.completed.iter().filter(|c| !c.outcome.failovers.is_empty()).collect();
    assert!(failed_over.len() >= 4, "the 4 running requests failed over: {}", failed_over.len());
    for c in &failed_over {
        let steps = d.journal().transitions(&c.outcome.request_id).unwrap();
        let kinds: Vec<&Transition> = steps.iter().map(|t| &t.transition).collect();
        assert!(kinds.iter().any(|t| matches!(t, Transition::AttemptFailed { .. })), "{kinds:?}");
        assert!(kinds.iter().any(|t| matches!(t, Transition::Queued { device } if *device == Lane::Cpu)), "{kinds:?}");
    }
    assert!(e.waiting_notices >= 1, "streams waiting for a CPU slot are told so");
    let cpu = d.queues().into_iter().find(|q| q.device == Lane::Cpu).unwrap();
    assert_eq!((cpu.waiting, cpu.running), (0, 0));
    assert_eq!(cpu.failover_room, 64 + 4, "the CPU queue keeps a place for every request the GPU lane can hold");
    d.supervisor().shutdown().await;
}

/// Fault at full load on a model its keep_alive had unloaded: the requests wait for the reload
/// on the GPU (none is sent to the CPU for it), fill its 4 slots with 4 queued behind them, and
/// its worker process is killed: nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_gpu_worker_killed_at_full_load_loses_no_request() {
    let (d, e) = gpu_killed_at_full_load_after(None, 0, true).await;
    assert!(e.lost.is_empty(), "lost after acceptance: {:?}", e.lost);
    assert_eq!(e.completed.len(), 8);
    assert!(e.completed.iter().all(|c| c.outcome.tokens.len() == 48));
    assert!(e.completed.iter().any(|c| c.load_ms > 0.0), "the first ones waited for the reload");
    d.supervisor().shutdown().await;
}

/// Negative control: when a request that finds the model unloaded goes to the CPU instead of
/// loading it, the GPU's slots never fill on a reloaded worker and the run above fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[should_panic(expected = "4 running and the rest queued on the GPU")]
async fn negative_control_a_reload_that_redirects_to_the_cpu_never_fills_the_gpu() {
    gpu_killed_at_full_load_after(Some(Defect::UnloadedModelRedirects), 0, true).await;
}

/// Negative control: with failover going straight to the (busy) CPU worker, as before, the
/// same run loses requests, so the test above can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_failover_that_bypasses_the_cpu_queue_loses_requests() {
    let (d, e) = gpu_killed_at_full_load(Some(Defect::FailoverBypassesCpuQueue), 0).await;
    assert!(!e.lost.is_empty(), "the defect must lose requests");
    assert!(e.lost.iter().any(|l| l.contains("at most 1 requests at once")), "{:?}", e.lost);
    d.supervisor().shutdown().await;
}

/// Embeddings queued behind a full GPU when its worker is killed: every one ends with its
/// vector, the one the CPU engine computes for its text (the sim GPU's burn engine and the CPU
/// engine agree to rounding), and the generations beside them lose nothing either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embeddings_queued_behind_a_full_gpu_survive_its_kill() {
    let (d, e) = gpu_killed_at_full_load(None, EMBEDDED.len()).await;
    assert!(e.lost.is_empty(), "lost after acceptance: {:?}", e.lost);
    assert_eq!(e.completed.len(), 8 + EMBEDDED.len());
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let engine = bundle.load_cpu(|_, _| {}).unwrap();
    for (i, text) in EMBEDDED.iter().enumerate() {
        let c = e.completed.iter().find(|c| c.outcome.request_id == format!("embed-{i}")).unwrap();
        let request = GenerateRequest::embedding(bundle.encode(text, true).unwrap());
        let want = headroom_model::Session::start(&engine, &bundle, &request, &headroom_model::CancelToken::new()).unwrap().embedding().unwrap();
        let got = c.outcome.embedding.as_ref().expect("an embedding's completion holds its vector");
        let off = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(off < 1e-3, "embed-{i} on {}: off the CPU engine's vector by {off}", c.outcome.device);
        assert!(c.outcome.tokens.is_empty() && c.outcome.completion_tokens == 0);
        eprintln!("embed-{i}: {} after {} failovers, off by {off}", c.outcome.device, c.outcome.failovers.len());
    }
    assert!(e.completed.iter().filter(|c| c.outcome.request_id.starts_with("full-")).all(|c| c.outcome.tokens.len() == 48));
    d.supervisor().shutdown().await;
}

/// Its negative control: with failover going straight to the busy CPU worker, embeddings are
/// lost too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_embeddings_are_lost_when_failover_bypasses_the_cpu_queue() {
    let (d, e) = gpu_killed_at_full_load(Some(Defect::FailoverBypassesCpuQueue), EMBEDDED.len()).await;
    assert!(!e.lost.is_empty(), "the defect must lose requests");
    d.supervisor().shutdown().await;
}

/// Admission checks every lane: a request the CPU worker's context could not hold is refused
/// up front (naming that worker's limit), unless the client opts out of failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_the_cpu_worker_could_not_hold_is_refused_up_front_unless_it_opts_out() {
    let mut config = supervisor_config(true);
    config.cpu.max_context_tokens = Some(40);
    let d = dispatcher_with(config).await;
    match d.submit(submission("long", "And God said", 48, None)) {
        Err(SubmitError::Invalid(m)) => {
            assert!(m.contains("CPU worker's context limit of 40 tokens") && m.contains("allow_cpu"), "{m}");
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted a request that could not fail over"),
    }
    assert!(matches!(d.journal().get("long"), Err(headroom_router::JournalError::NotFound(_))), "refused before it was accepted");
    let mut gpu_only = submission("gpu-only", "And God said", 48, None);
    gpu_only.allow.cpu = false;
    let c = d.submit(gpu_only).unwrap().finish().await.unwrap();
    assert_eq!(c.outcome.device, "sim");
    assert!(!c.cpu_failover, "the response says it ran without failover");
    assert!(d.submit(submission("short", "And God said", 8, None)).unwrap().finish().await.unwrap().cpu_failover);
    d.supervisor().shutdown().await;
    // Without a GPU the CPU worker's limit is the only one, and it is named.
    let mut cpu_only = supervisor_config(false);
    cpu_only.cpu.max_context_tokens = Some(40);
    let d = dispatcher_with(cpu_only).await;
    let Err(SubmitError::Invalid(m)) = d.submit(submission("long", "And God said", 48, None)) else { panic!("accepted") };
    assert!(m.contains("CPU worker's context limit of 40 tokens") && m.contains("cpu_max_context_tokens"), "{m}");
    d.supervisor().shutdown().await;
}

/// Negative control: without the lane check the same request is accepted, and a GPU failure
/// sends it to a CPU worker that cannot hold it: lost after acceptance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_without_the_lane_check_a_gpu_failure_loses_the_request() {
    let mut config = supervisor_config(true);
    config.cpu.max_context_tokens = Some(40);
    let d = dispatcher_with(config).await;
    d.reintroduce_defect_for_test(Defect::NoCpuLaneCheck);
    d.supervisor().inject_fault(Fault::OomNextAllocation).await.unwrap();
    let lost = d.submit(submission("long", "And God said", 48, None)).expect("accepted without the check").finish().await;
    assert!(lost.is_err(), "accepted, failed over to a CPU worker that cannot hold it, and lost");
    d.supervisor().shutdown().await;
}

/// A chat request whose tokens the served model made, for a fallback test.
fn chat_submission(id: &str, served: &ModelBundle, messages: &[headroom_model::ChatMessage], max_tokens: usize) -> Submission {
    let mut sub = submission(id, "", max_tokens, None);
    sub.run.request.prompt_tokens = served.chat_prompt(messages, None).unwrap();
    sub.run.request.source = Some(headroom_model::PromptSource {
        bundle_hash: served.hash.clone(),
        input: headroom_model::PromptInput::Chat { messages: messages.to_vec(), tools: None },
    });
    sub
}

/// A GPU failure served by a fallback model whose tokenizer differs from the served model's:
/// returns the completion and the fallback's own token count for the prompt.
async fn fail_over_to_another_tokenizer(worker_env: Vec<(String, String)>) -> (Result<Completion, SubmitError>, usize, String) {
    let fallback_dir = tempfile::tempdir().unwrap();
    headroom_model::fixture::write_random_folder(fallback_dir.path(), &headroom_model::fixture::tiny_config(), 11, headroom_model::StoreDtype::F32).unwrap();
    let mut config = supervisor_config(true);
    config.cpu_fallback_model_dir = Some(fallback_dir.path().to_path_buf());
    config.worker_env = worker_env;
    let d = dispatcher_with(config).await;
    let served = ModelBundle::open(model_dir()).unwrap();
    let fallback = ModelBundle::open(fallback_dir.path()).unwrap();
    let messages = vec![headroom_model::ChatMessage { role: "user".into(), content: "And God said".into(), tool_calls: None, tool_call_id: None, name: None }];
    let own = fallback.chat_prompt(&messages, None).unwrap().len();
    assert_ne!(own, served.chat_prompt(&messages, None).unwrap().len(), "the two tokenizers differ");
    d.supervisor().inject_fault(Fault::OomNextAllocation).await.unwrap();
    let result = d.submit(chat_submission("fallback", &served, &messages, 8)).unwrap().finish().await;
    d.supervisor().shutdown().await;
    (result, own, fallback.name())
}

/// A dispatcher whose CPU worker holds a fallback model of 128 tokens of context with a
/// byte-sized vocabulary, and a chat whose messages that model counts past its context while
/// the served model counts them well within it.
async fn fallback_and_a_chat_it_counts_longer(defect: Option<Defect>) -> (Dispatcher, Submission, tempfile::TempDir) {
    let folder = tempfile::tempdir().unwrap();
    let fallback_dir = folder.path().to_path_buf();
    headroom_model::fixture::write_random_folder(&fallback_dir, &headroom_model::fixture::tiny_config(), 11, headroom_model::StoreDtype::F32).unwrap();
    let mut config = supervisor_config(true);
    config.cpu_fallback_model_dir = Some(fallback_dir.clone());
    let d = dispatcher_with(config).await;
    if let Some(defect) = defect {
        d.reintroduce_defect_for_test(defect);
    }
    let served = ModelBundle::open(model_dir()).unwrap();
    let fallback = ModelBundle::open(&fallback_dir).unwrap();
    let text = "And God said, Let there be light: and there was light. And God saw the light, that it was good: and God divided the light from the darkness.";
    let messages = vec![headroom_model::ChatMessage { role: "user".into(), content: text.into(), tool_calls: None, tool_call_id: None, name: None }];
    let (theirs, ours) = (fallback.chat_prompt(&messages, None).unwrap().len(), served.chat_prompt(&messages, None).unwrap().len());
    let context = fallback.config.max_position_embeddings;
    assert!(ours + 8 <= context && theirs + 8 > context, "the fixture: served {ours}, fallback {theirs} tokens, context {context}");
    (d, chat_submission("counted-long", &served, &messages, 8), folder)
}

/// Admission counts a prompt as the fallback model will: one it counts past its context is
/// refused before it is accepted, naming the fallback, instead of accepted and then failed by
/// the fallback's worker when the GPU cannot take it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_the_fallback_counts_past_its_context_is_refused_up_front() {
    let (d, sub, _folder) = fallback_and_a_chat_it_counts_longer(None).await;
    match d.submit(sub) {
        Err(SubmitError::Invalid(m)) => assert!(m.contains("as the fallback model counts it") && m.contains("allow_cpu"), "{m}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted a prompt the fallback model cannot hold"),
    }
    assert!(matches!(d.journal().get("counted-long"), Err(headroom_router::JournalError::NotFound(_))), "refused before it was accepted");
    d.supervisor().shutdown().await;
}

/// Its negative control: counted with the served model's tokens, the request is accepted, and
/// when the GPU runs out of memory the fallback worker refuses it: lost after acceptance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_counting_the_served_tokens_loses_the_request() {
    let (d, sub, _folder) = fallback_and_a_chat_it_counts_longer(Some(Defect::FallbackCountedAsServed)).await;
    d.supervisor().inject_fault(Fault::OomNextAllocation).await.unwrap();
    let ended = d.submit(sub).expect("accepted with the defect").finish().await;
    assert!(ended.is_err(), "the fallback worker should have refused it: {ended:?}");
    d.supervisor().shutdown().await;
}

/// A fallback model is a different model: its worker renders and tokenizes the client's
/// messages with its own bundle, the failover is a replay, and the response names it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_model_with_another_tokenizer_replays_from_the_messages() {
    let (result, own, name) = fail_over_to_another_tokenizer(Vec::new()).await;
    let c = result.expect("served by the fallback model");
    assert_eq!(c.outcome.device, "cpu");
    assert_eq!(c.outcome.fallback_model.as_deref(), Some(name.as_str()));
    assert_eq!(c.outcome.prompt_tokens as usize, own, "the fallback's own tokens for the messages");
    assert_eq!(c.outcome.failovers[0].resumed_after_tokens, 0, "a replay, never a token-level resume");
}

/// Negative control: a worker that runs the served model's tokens (as before) does not give
/// the fallback's own prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_fallback_fed_the_served_models_tokens_is_caught() {
    let (result, own, _) = fail_over_to_another_tokenizer(vec![("HEADROOM_TEST_IGNORE_PROMPT_SOURCE".into(), "1".into())]).await;
    assert!(result.map_or(true, |c| c.outcome.prompt_tokens as usize != own), "the defect must show");
}

/// A GPU worker compiling kernels (simulated: the device is held 4 s, as NVRTC does on a cold
/// cache) while requests wait is busy, not hung. Returns whether a health check failed and
/// where the requests finished.
async fn compiling_gpu_worker(worker_env: Vec<(String, String)>) -> (bool, Vec<String>) {
    let mut config = supervisor_config(true);
    config.supervision.health_timeout_ms = 1000;
    config.worker_env = worker_env;
    let d = dispatcher_with(config).await;
    let mut events = d.supervisor().subscribe();
    d.supervisor().inject_fault(Fault::Compile { ms: 4000 }).await.unwrap();
    let tickets: Vec<Ticket> = (0..3).map(|i| d.submit(submission(&format!("busy-{i}"), "And God said", 8, None)).unwrap()).collect();
    let e = ends(tickets).await;
    assert!(e.lost.is_empty(), "{:?}", e.lost);
    let mut health_failed = false;
    while let Ok(event) = events.try_recv() {
        health_failed |= matches!(event.kind, headroom_router::EventKind::HealthCheckFailed { .. });
    }
    d.supervisor().shutdown().await;
    (health_failed, e.completed.iter().map(|c| c.outcome.device.label()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_worker_busy_compiling_answers_health_and_is_not_killed() {
    let (health_failed, devices) = compiling_gpu_worker(Vec::new()).await;
    assert!(!health_failed, "a busy worker is not hung");
    assert!(devices.iter().all(|d| d == "sim"), "{devices:?}");
}

/// Negative control: a worker whose health answer reads the device live (as before) misses
/// its health checks while compiling and is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_health_that_waits_for_the_device_kills_a_busy_worker() {
    let (health_failed, _) = compiling_gpu_worker(vec![("HEADROOM_TEST_HEALTH_READS_DEVICE".into(), "1".into())]).await;
    assert!(health_failed, "the defect must show as a failed health check");
}

/// A worker that answers health checks but makes no progress with requests running is hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_makes_no_progress_is_hung_and_its_requests_fail_over() {
    let mut config = supervisor_config(true);
    config.supervision.stall_timeout_ms = 1000;
    let d = dispatcher_with(config).await;
    let mut events = d.supervisor().subscribe();
    d.supervisor().inject_fault(Fault::Compile { ms: 8000 }).await.unwrap();
    let c = d.submit(submission("stalled", "And God said", 8, None)).unwrap().finish().await.unwrap();
    assert_eq!(c.outcome.device, "cpu");
    let mut reason = None;
    while let Ok(event) = events.try_recv() {
        if let headroom_router::EventKind::HealthCheckFailed { reason: r, .. } = event.kind {
            reason = Some(r);
        }
    }
    assert!(reason.as_deref().unwrap_or("").contains("produced nothing"), "{reason:?}");
    d.supervisor().shutdown().await;
}

/// Runs a request while the journal starts refusing writes: returns how the client saw it end
/// and the journal's own state for it.
async fn journal_breaks_mid_request(defect: Option<Defect>) -> (Dispatcher, Result<Completion, SubmitError>, RequestState) {
    let d = dispatcher(false, Journal::in_memory().unwrap(), QueueConfig::default()).await;
    if let Some(defect) = defect {
        d.reintroduce_defect_for_test(defect);
    }
    let mut ticket = d.submit(submission("j", "And God said", 40, None)).unwrap();
    ticket.next_token().await.unwrap();
    d.journal().refuse_writes_for_test();
    let result = ticket.finish().await;
    let state = d.journal().get("j").unwrap().state;
    (d, result, state)
}

/// The journal never fails silently: a write that fails fails its request loudly, and the
/// dispatcher reports why (what /readyz says).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_write_that_fails_fails_its_request_loudly() {
    let (d, result, state) = journal_breaks_mid_request(None).await;
    match result {
        Err(SubmitError::Failed { reason, resumable: true }) => assert!(reason.contains("journal"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert_ne!(state, RequestState::Completed);
    assert!(d.journal_fault().unwrap().contains("journal"));
    d.supervisor().shutdown().await;
}

/// Negative control: with write errors dropped (as before) the client is told it completed
/// while the journal never recorded it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_dropped_journal_errors_complete_unrecorded() {
    let (d, result, state) = journal_breaks_mid_request(Some(Defect::IgnoreJournalErrors)).await;
    assert!(result.is_ok() && state != RequestState::Completed, "the defect must show: {state:?}");
    assert!(d.journal_fault().is_none());
    d.supervisor().shutdown().await;
}

/// The prompt and length of the overcommit tests: 8 requests of 96 tokens each, ignoring EOS.
const OVERCOMMIT_PROMPT: &str = "And the LORD spake unto Moses";
const OVERCOMMIT_TOKENS: usize = 96;

/// KV overcommit 4× at full load: the sim GPU's 4 slots full and 4 requests queued, VRAM for
/// the 4 running requests' reservations (a quarter of their KV blocks each) and two blocks
/// more, so the pool runs dry as they write past their reservations; once the journal shows a
/// preemption, the GPU worker is killed with SIGKILL. `worker_env` reaches both workers (a
/// defect for the negative control).
async fn overcommitted_gpu_run_dry_then_killed(worker_env: Vec<(String, String)>) -> (Dispatcher, Ends) {
    overcommitted_gpu_run_dry(worker_env, true, None).await
}

/// The run above; `allow_cpu`: whether the requests allow the CPU (without it, the GPU worker
/// is not killed: a request that may not use the CPU cannot outlive its GPU).
async fn overcommitted_gpu_run_dry(worker_env: Vec<(String, String)>, allow_cpu: bool, defect: Option<Defect>) -> (Dispatcher, Ends) {
    use headroom_memory::footprint::{ModelShape, MIB};
    use headroom_memory::RequestShape;
    let bundle = ModelBundle::open(model_dir()).unwrap();
    let memory = MemoryConfig { vram_reserve_mib: Some(64), kv_overcommit: 4.0, ..MemoryConfig::default() };
    let (planner, _) = headroom_memory::planner_for(&bundle, "cpu", memory.clone());
    let r = submission("probe", OVERCOMMIT_PROMPT, OVERCOMMIT_TOKENS, None).run.request;
    let shape = RequestShape { prompt_tokens: r.prompt_tokens.len() as u64, max_tokens: OVERCOMMIT_TOKENS as u64, prefill_chunk: r.prefill_chunk as u64 };
    let footprint = planner.footprint(shape);
    let block = planner.kv_block_bytes();
    let all_blocks = footprint.tokens.div_ceil(16);
    assert!(footprint.kv_tokens.div_ceil(16) * 3 <= all_blocks, "overcommit leaves most blocks out: {footprint:?}");
    let weights = ModelShape::from_config(&bundle.config).weights_bytes();
    // Whole MiB: up to one more MiB beyond two blocks; the growth of four requests is far more.
    let vram_mib = (weights + 4 * footprint.request_bytes() + 2 * block).div_ceil(MIB) + 64;
    let spare = (vram_mib - 64) * MIB - weights - 4 * footprint.request_bytes();
    assert!(spare < 4 * (all_blocks - footprint.kv_tokens.div_ceil(16)) * block, "the pool must run dry: {spare} bytes spare");

    let mut config = supervisor_config(true);
    let sim = config.gpu.as_mut().unwrap();
    sim.max_concurrency = 4;
    sim.sim_vram_mib = vram_mib;
    sim.kv_overcommit = memory.kv_overcommit;
    sim.vram_reserve_mib = 64;
    config.worker_env = worker_env;
    let supervisor = Supervisor::start(config).await.unwrap();
    let d = Dispatcher::start(supervisor, Journal::in_memory().unwrap(), planner, memory, QueueConfig::default(), Settings::default(), None).unwrap().0;
    if let Some(defect) = defect {
        d.reintroduce_defect_for_test(defect);
    }
    // One request first, so the GPU lane has measured rates: requests beyond the GPU's memory
    // then wait in its queue for memory to free (an expected wait) instead of going to the CPU.
    d.submit(submission("warm", OVERCOMMIT_PROMPT, 8, None)).unwrap().finish().await.unwrap();
    d.supervisor().inject_fault(Fault::Slowdown { factor: 8.0 }).await.unwrap();
    let tickets: Vec<Ticket> = (0..8)
        .map(|i| {
            let mut sub = submission(&format!("oc-{i}"), OVERCOMMIT_PROMPT, OVERCOMMIT_TOKENS, None);
            sub.stream = i % 2 == 0;
            sub.allow.cpu = allow_cpu;
            d.submit(sub).unwrap()
        })
        .collect();
    let gpu = |d: &Dispatcher| d.queues().into_iter().find(|q| q.device == Lane::Gpu).unwrap();
    until(20, "4 running and 4 queued on the GPU", || {
        let q = gpu(&d);
        q.running == 4 && q.waiting == 4
    })
    .await;
    until(60, "a preemption or the end of the run", || {
        (0..8).any(|i| preempted(d.journal(), &format!("oc-{i}"))) || d.queues().iter().all(|q| q.running == 0 && q.waiting == 0)
    })
    .await;
    if let Some(gpu) = d.supervisor().gpu_worker().filter(|_| allow_cpu) {
        assert!(std::process::Command::new("kill").args(["-9", &gpu.pid.to_string()]).status().unwrap().success());
    }
    let e = ends(tickets).await;
    (d, e)
}

/// Whether the journal shows request `id` preempted on the GPU.
fn preempted(journal: &Journal, id: &str) -> bool {
    journal.transitions(id).unwrap_or_default().iter().any(|t| matches!(&t.transition, Transition::AttemptFailed { kind: headroom_worker::FailureKind::Preempted, .. }))
}

/// The overcommit runs' common outcome: none of the 8 lost, each with all its tokens, the same
/// tokens (one prompt, one seed) wherever it ran, and at least one preempted. Gives those ids.
fn none_lost_alike_some_preempted(d: &Dispatcher, e: &Ends) -> Vec<String> {
    assert!(e.lost.is_empty(), "lost after acceptance: {:?}", e.lost);
    assert_eq!(e.completed.len(), 8);
    let first = &e.completed[0].outcome.tokens;
    assert_eq!(first.len(), OVERCOMMIT_TOKENS);
    assert!(e.completed.iter().all(|c| &c.outcome.tokens == first), "a preempted or failed-over request's tokens are those it would have made");
    let preempted_ids: Vec<String> = (0..8).map(|i| format!("oc-{i}")).filter(|id| preempted(d.journal(), id)).collect();
    assert!(!preempted_ids.is_empty(), "the pool ran dry: at least one request was preempted");
    preempted_ids
}

/// Overcommit's promise: requests admitted on a quarter of their KV blocks run the pool dry,
/// the newest are preempted (journaled, resumed on the CPU from their checkpoints), the GPU
/// worker is then killed with its slots full, and nothing accepted is lost: every request ends
/// with all its tokens, the same tokens (one prompt, one seed) wherever it ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overcommitted_gpu_that_runs_dry_and_dies_loses_no_request() {
    let (d, e) = overcommitted_gpu_run_dry_then_killed(Vec::new()).await;
    let preempted_ids = none_lost_alike_some_preempted(&d, &e);
    for id in &preempted_ids {
        let steps: Vec<Transition> = d.journal().transitions(id).unwrap().into_iter().map(|t| t.transition).collect();
        assert!(steps.iter().any(|t| matches!(t, Transition::Queued { device } if *device == Lane::Cpu)), "{id} went to the CPU queue: {steps:?}");
        let c = e.completed.iter().find(|c| &c.outcome.request_id == id).unwrap();
        assert!(c.outcome.degraded && c.outcome.failovers.iter().any(|f| f.kind == Some(headroom_worker::FailureKind::Preempted)), "{id}: {:?}", c.outcome.failovers);
    }
    assert!(d.metrics_text().contains("headroom_preemptions_total"), "preemptions are counted");
    d.supervisor().shutdown().await;
}

/// Overcommit's promise for requests that may not use the CPU (`allow_cpu: false`): the pool
/// runs dry with the GPU's slots full and requests queued, the newest are preempted, wait in the
/// GPU queue for the blocks the others give back, and resume there from their checkpoints;
/// nothing accepted is lost, nothing runs on the CPU, and every request has all its tokens, the
/// same tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gpu_only_request_preempted_by_a_dry_pool_resumes_on_the_gpu() {
    let (d, e) = overcommitted_gpu_run_dry(Vec::new(), false, None).await;
    let preempted_ids = none_lost_alike_some_preempted(&d, &e);
    for c in &e.completed {
        assert!(c.outcome.device.is_gpu(), "{} finished on the GPU: {}", c.outcome.request_id, c.outcome.device);
    }
    for id in &preempted_ids {
        let steps: Vec<Transition> = d.journal().transitions(id).unwrap().into_iter().map(|t| t.transition).collect();
        let after = steps.iter().position(|t| matches!(t, Transition::AttemptFailed { kind: headroom_worker::FailureKind::Preempted, .. })).unwrap();
        assert!(steps[after..].iter().any(|t| matches!(t, Transition::Queued { device } if *device == Lane::Gpu)), "{id} went back to the GPU queue: {steps:?}");
        assert!(!steps.iter().any(|t| matches!(t, Transition::Queued { device } if *device == Lane::Cpu)), "{id} never queued for the CPU: {steps:?}");
    }
    assert!(!d.metrics_text().contains("to=\"cpu\""), "a preemption back to the GPU queue is not a failover");
    // The worker preempts the request that started last: one resumed after a preemption (the
    // last to join the batch) does not go again while later ones run.
    let unfair = preempted_before_later_ones(d.journal());
    assert!(unfair.is_empty(), "preempted while a request that started later ran: {unfair:?}");
    d.supervisor().shutdown().await;
}

/// Negative control: a worker that preempts the request that joined its batch last (a resumed
/// one) preempts requests while later ones run, so the check above can fail. Whether a resumed
/// request meets a later one in the batch depends on the queue's timing (one of the first runs
/// here did not), so up to three runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_preempting_the_last_to_join_preempts_before_later_ones() {
    let mut runs = 0;
    loop {
        let (d, e) = overcommitted_gpu_run_dry(vec![("HEADROOM_TEST_DEFECT".into(), "preempt-joined-last".into())], false, None).await;
        assert!(e.lost.is_empty(), "lost after acceptance: {:?}", e.lost);
        let unfair = preempted_before_later_ones(d.journal());
        d.supervisor().shutdown().await;
        runs += 1;
        if !unfair.is_empty() {
            break;
        }
        assert!(runs < 3, "in {runs} runs the defect never preempted a request while a later one ran");
    }
}

/// Preemptions of a request while one that started later ran on the GPU beside it: the
/// journal's spans on the GPU (times are the router's, a step and a few ms from the worker's,
/// hence the margins), as "oc-2 at 1234 ms while oc-5 ran".
fn preempted_before_later_ones(journal: &Journal) -> Vec<String> {
    const MARGIN_MS: u64 = 60;
    let ids: Vec<String> = (0..8).map(|i| format!("oc-{i}")).collect();
    let (mut first, mut spans, mut preemptions) = (HashMap::new(), HashMap::<&str, Vec<(u64, u64)>>::new(), Vec::new());
    for id in &ids {
        let mut open = None;
        for t in journal.transitions(id).unwrap() {
            let at = t.at_unix_ms;
            match &t.transition {
                Transition::Running { device, .. } if device.is_gpu() => {
                    first.entry(id.as_str()).or_insert(at);
                    open = Some(at);
                }
                Transition::AttemptFailed { .. } | Transition::Completed { .. } | Transition::Failed { .. } | Transition::Cancelled { .. } => {
                    if let Some(start) = open.take() {
                        spans.entry(id.as_str()).or_default().push((start, at));
                    }
                    if matches!(t.transition, Transition::AttemptFailed { kind: headroom_worker::FailureKind::Preempted, .. }) {
                        preemptions.push((id.as_str(), at));
                    }
                }
                _ => {}
            }
        }
    }
    let mut found = Vec::new();
    for (x, at) in preemptions {
        for y in &ids {
            let later = first.get(y.as_str()).is_some_and(|&f| f >= first[x] + 20);
            let ran = spans.get(y.as_str()).into_iter().flatten().any(|&(start, end)| start + MARGIN_MS <= at && end >= at + MARGIN_MS);
            if later && ran {
                found.push(format!("{x} at {at} ms while {y} ran"));
            }
        }
    }
    found
}

/// Negative control: a GPU-only request preempted by the dry pool ends there, as before, and is
/// lost, so the test above can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_a_gpu_only_request_that_ends_when_preempted_is_lost() {
    let (d, e) = overcommitted_gpu_run_dry(Vec::new(), false, Some(Defect::PreemptedGpuOnlyEnds)).await;
    assert!(!e.lost.is_empty(), "the defect must lose requests");
    d.supervisor().shutdown().await;
}

/// Negative control: a preempted request that fails like a plain error (not replayable), as a
/// naive pool would, is lost, so the test above can fail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_control_an_overcommit_preemption_that_is_not_replayable_loses_requests() {
    let (d, e) = overcommitted_gpu_run_dry_then_killed(vec![("HEADROOM_TEST_DEFECT".into(), "preempt-unreplayable".into())]).await;
    assert!(!e.lost.is_empty(), "the defect must lose requests");
    assert!(e.lost.iter().any(|l| l.contains("preempted after")), "{:?}", e.lost);
    d.supervisor().shutdown().await;
}
