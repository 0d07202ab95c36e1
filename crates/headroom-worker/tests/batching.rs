//! A worker runs its requests together: four requests sent at once to a sim worker all run in
//! its batch (their tokens interleave), and each streams exactly the tokens it produces alone;
//! a request cancelled or failed by an injected out-of-memory mid-batch ends as it would alone
//! (cancelled; out-of-memory with a checkpoint that resumes to the lone run's tokens) while the
//! others go on untouched.

mod support;

use headroom_model::{generate, CancelToken, GenerateRequest, ModelBundle};
use headroom_worker::{FailureKind, Fault, FromWorker, GenerateJob, ToWorker};
use support::{model_path, requests, Worker};

/// The model, the test's requests, and each request's tokens run alone.
fn lone_runs() -> (ModelBundle, headroom_model::CpuModel, Vec<GenerateRequest>, Vec<Vec<u32>>) {
    let bundle = ModelBundle::open(model_path()).unwrap();
    let model = bundle.load_cpu(|_, _| {}).unwrap();
    let requests = requests(&bundle);
    let alone = requests.iter().map(|r| generate(&model, &bundle, r, &CancelToken::new(), |_| {}).unwrap().tokens).collect();
    (bundle, model, requests, alone)
}

#[test]
fn four_requests_at_once_stream_what_each_streams_alone() {
    let (_, _, requests, alone) = lone_runs();
    let mut worker = Worker::start(4);
    let ids = worker.submit(&requests);
    let streams = worker.streams(&ids);
    assert!(streams.values().all(|s| matches!(s.end, Some(FromWorker::Done { .. }))), "every request ends done: {streams:?}");
    let first_done = streams.values().filter_map(|s| s.end_frame).min().unwrap();
    let started_before_first_done = streams.values().filter(|s| s.first_token_frame.is_some_and(|f| f < first_done)).count();
    assert_eq!(started_before_first_done, 4, "every request streamed before the first one ended: they ran together");
    for (i, id) in ids.iter().enumerate() {
        assert_eq!(streams[id].tokens, alone[i], "{id}: tokens in the batch vs alone");
    }
}

/// With every slot full (four requests on a worker of four) a fifth is refused as busy and
/// replayable (the router queues it: a worker never queues), an out-of-memory fails one request
/// with a checkpoint and another is cancelled; the rest stream what they stream alone.
#[test]
fn a_cancel_and_an_out_of_memory_mid_batch_leave_the_others_untouched() {
    let (bundle, model, requests, alone) = lone_runs();
    let mut worker = Worker::start(4);
    // The first request admitted after this fault fails after 5 tokens.
    worker.send(ToWorker::Fault { fault: Fault::OomAfterTokens { tokens: 5 } });
    assert!(matches!(worker.next(), FromWorker::FaultSet { .. }));
    let mut ids = worker.submit(&requests);
    ids.push("r4".into());
    worker.send(ToWorker::Generate(GenerateJob { request_id: "r4".into(), request: requests[0].clone(), started_order: 4 }));
    // r3 is cancelled after its third token.
    let streams = worker.streams_with(&ids, |id, tokens| (id == "r3" && tokens == 3).then(|| ToWorker::Cancel { request_id: "r3".into() }));
    // r0 was admitted first: the out-of-memory is its, with a checkpoint that resumes to the
    // tokens it produces alone.
    let checkpoint = streams["r0"].oom_checkpoint("r0");
    assert_eq!(streams["r0"].tokens, alone[0][..5], "r0 streamed 5 tokens before the fault");
    let mut resumed = requests[0].clone();
    resumed.resume = Some(checkpoint);
    let rest = generate(&model, &bundle, &resumed, &CancelToken::new(), |_| {}).unwrap().tokens;
    assert_eq!(rest, alone[0], "r0 resumed from its checkpoint ends as it would alone");
    assert!(
        matches!(streams["r3"].end, Some(FromWorker::Failed { kind: FailureKind::Cancelled, .. })),
        "r3 was cancelled: {:?}",
        streams["r3"].end
    );
    assert!(streams["r3"].tokens.len() < alone[3].len() && streams["r3"].tokens == alone[3][..streams["r3"].tokens.len()]);
    assert!(
        matches!(streams["r4"].end, Some(FromWorker::Failed { kind: FailureKind::Busy, replayable: true, .. })) && streams["r4"].tokens.is_empty(),
        "r4 came with every slot full and is refused as busy, for the router to queue: {:?}",
        streams["r4"].end
    );
    for i in [1, 2] {
        assert!(matches!(streams[&ids[i]].end, Some(FromWorker::Done { .. })), "{}: {:?}", ids[i], streams[&ids[i]].end);
        assert_eq!(streams[&ids[i]].tokens, alone[i], "{}: tokens beside a cancel and a fault vs alone", ids[i]);
    }
}

/// The negative control: with the decode rows of a batched step summed in another order than a
/// lone step's (through the prefill tiles, or the repacked blocks added last to first), a
/// batched request's tokens part ways with its lone run. Needs the default model (the demo model
/// is too small to notice) and a processor where the defect changes its types' sums.
#[test]
fn tiles_in_batched_steps_fail_the_check() {
    if std::env::var_os("HEADROOM_TEST_DEFECT").is_some() || !model_path().ends_with("SmolLM2-135M-Instruct.Q4_1.gguf") {
        return;
    }
    let kernels = headroom_model::cpu::dot::Kernels::detect();
    if kernels.interleaved32.is_none() && kernels.tile32.is_none() {
        eprintln!("this processor's kernels sum a batch's steps as they sum lone steps; skipped");
        return;
    }
    headroom_model::assert_control_fails("four_requests_at_once_stream_what_each_streams_alone", "batch-tiles", "tokens in the batch vs alone");
}

/// The negative control of the refusal at full slots: a worker that takes a request beyond its
/// slots fails the check.
#[test]
fn a_worker_over_its_slots_fails_the_check() {
    headroom_model::assert_control_fails("a_cancel_and_an_out_of_memory_mid_batch_leave_the_others_untouched", "worker-over-slots", "refused as busy");
}
