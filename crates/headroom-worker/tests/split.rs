//! A sim GPU worker told to hold only the model's last layers runs it split (the rest on the
//! CPU in the same process, `headroom_model::split`): it says so when ready, its device holds
//! only its layers' weights, and at full load (every slot taken, one more refused for the router
//! to queue, an out-of-memory mid-stream) each request streams what the all-CPU model gives it,
//! and the one that failed resumes on the CPU engine, as failover does, to the same tokens.
//! The demo model is f32, so the two engines' greedy tokens agree exactly.

mod support;

use std::path::{Path, PathBuf};

use headroom_model::{generate, CancelToken, ModelBundle};
use headroom_worker::{Device, FailureKind, Fault, FromWorker, GenerateJob, SplitLayers, ToWorker, WorkerOptions};
use support::{requests, Worker};

fn demo_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/kjv-demo")
}

fn split_worker(gpu_layers: u32) -> (Worker, FromWorker) {
    let mut options = WorkerOptions::new(Device::Sim);
    options.max_concurrency = 4;
    options.gpu_layers = Some(gpu_layers);
    Worker::load(options, &demo_model())
}

#[test]
fn a_split_sim_worker_at_full_load_streams_the_all_cpu_tokens() {
    let bundle = ModelBundle::open(demo_model()).unwrap();
    let cpu = bundle.load_cpu(|_, _| {}).unwrap();
    let requests = requests(&bundle);
    let alone: Vec<Vec<u32>> = requests.iter().map(|r| generate(&cpu, &bundle, r, &CancelToken::new(), |_| {}).unwrap().tokens).collect();
    let c = &bundle.config;
    let layers = c.num_hidden_layers as u32;
    let (mut worker, ready) = split_worker(layers / 2);
    let FromWorker::Ready { split, memory, .. } = ready else { panic!("expected Ready, got {ready:?}") };
    assert_eq!(split, Some(SplitLayers { gpu_layers: layers / 2, layers }), "the worker says it runs split");
    // The sim device holds its layers' f32 weights alone: no embedding, head or other layers.
    let (h, q, kv) = (c.hidden_size, c.num_attention_heads * c.head_dim(), c.kv_heads() * c.head_dim());
    let layer_bytes = (2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h) as u64 * 4;
    assert_eq!(memory.weights_bytes, layer_bytes * (layers / 2) as u64, "the device's weights are its layers'");

    worker.send(ToWorker::Fault { fault: Fault::OomAfterTokens { tokens: 5 } });
    assert!(matches!(worker.next(), FromWorker::FaultSet { .. }));
    let mut ids = worker.submit(&requests);
    ids.push("r4".into());
    worker.send(ToWorker::Generate(GenerateJob { request_id: "r4".into(), request: requests[0].clone(), started_order: 4 }));
    let streams = worker.streams(&ids);
    assert!(
        matches!(streams["r4"].end, Some(FromWorker::Failed { kind: FailureKind::Busy, replayable: true, .. })),
        "r4 came with every slot full and is refused as busy, for the router to queue: {:?}",
        streams["r4"].end
    );
    let checkpoint = streams["r0"].oom_checkpoint("r0");
    assert_eq!(streams["r0"].tokens, alone[0][..5], "r0: the split's tokens before the fault vs the all-CPU model's");
    let mut resumed = requests[0].clone();
    resumed.resume = Some(checkpoint);
    let rest = generate(&cpu, &bundle, &resumed, &CancelToken::new(), |_| {}).unwrap().tokens;
    assert_eq!(rest, alone[0], "r0 resumed on the CPU engine from the split's checkpoint");
    for i in 1..4 {
        assert!(matches!(streams[&ids[i]].end, Some(FromWorker::Done { .. })), "{}: {:?}", ids[i], streams[&ids[i]].end);
        assert_eq!(streams[&ids[i]].tokens, alone[i], "{}: the split's tokens vs the all-CPU model's", ids[i]);
    }
}

/// Its negative control: with the GPU layers keeping no KV cache, the split's tokens part ways
/// with the all-CPU model's.
#[test]
fn a_split_whose_gpu_layers_forget_their_cache_fails_the_check() {
    headroom_model::assert_control_fails("a_split_sim_worker_at_full_load_streams_the_all_cpu_tokens", "split-gpu-no-cache", "the split's tokens");
}

/// No layers on the GPU, or more than the model has, is refused at load, saying what to do.
#[test]
fn gpu_layers_outside_the_model_are_refused_at_load() {
    for (n, says) in [(0, "leaves nothing on the GPU"), (5, "but kjv-demo has 4 layers; use at most 4")] {
        let (_, answer) = split_worker(n);
        let FromWorker::Failed { kind: FailureKind::Invalid, message, .. } = answer else { panic!("{n}: expected a refusal, got {answer:?}") };
        assert!(message.contains(says), "{n}: {message}");
    }
}
