//! A CPU worker's prefix cache through the protocol: four requests that share a system prompt,
//! sent again, start from the blocks the first round left (each `Done` says how many prompt
//! tokens it did not compute) and stream the tokens they streamed the first time, batched
//! together; `DropPrefixCache` empties it, as admission asks before refusing a request for the
//! host RAM it holds.

mod support;

use headroom_model::{ChatMessage, GenerateRequest, ModelBundle, SamplingParams};
use headroom_worker::{Device, FromWorker, ToWorker, WorkerOptions};
use support::{model_path, Worker};

fn requests(bundle: &ModelBundle) -> Vec<GenerateRequest> {
    let system = "You are the assistant of a home server. Answer in one short sentence and name the command that helps.";
    ["How do I see the free memory?", "How do I list the disks?", "How do I restart the network?", "How do I see the GPU?"]
        .iter()
        .enumerate()
        .map(|(i, question)| {
            let prompt = bundle.chat_prompt(&[ChatMessage::new("system", system), ChatMessage::new("user", *question)], None).unwrap();
            let mut r = GenerateRequest::new(prompt, 16 + 4 * i, SamplingParams::default());
            r.ignore_eos = true;
            r
        })
        .collect()
}

/// Each request's tokens and the prompt tokens its worker took from the prefix cache.
fn round(worker: &mut Worker, requests: &[GenerateRequest]) -> Vec<(Vec<u32>, u32)> {
    let ids = worker.submit(requests);
    let mut streams = worker.streams(&ids);
    ids.iter()
        .map(|id| {
            let stream = streams.remove(id).unwrap();
            match stream.end {
                Some(FromWorker::Done { cached_prompt_tokens, .. }) => (stream.tokens, cached_prompt_tokens),
                other => panic!("{id} ended {other:?}"),
            }
        })
        .collect()
}

fn prefix_blocks(worker: &mut Worker) -> u64 {
    worker.send(ToWorker::Health { nonce: 7 });
    match worker.next() {
        FromWorker::HealthOk { memory, .. } => memory.prefix_cache.expect("a CPU worker reports its prefix cache").blocks,
        other => panic!("expected HealthOk, got {other:?}"),
    }
}

#[test]
fn requests_that_share_a_system_prompt_reuse_its_blocks_in_a_batch_and_stream_the_same() {
    let bundle = ModelBundle::open(model_path()).unwrap();
    let reuses = bundle.load_cpu(|_, _| {}).unwrap().prefill_is_chunk_invariant();
    let mut options = WorkerOptions::new(Device::Cpu);
    options.prefix_cache_mib = 64;
    let (mut worker, ready) = Worker::load(options, &model_path());
    assert!(matches!(ready, FromWorker::Ready { .. }), "{ready:?}");
    let requests = requests(&bundle);
    let first = round(&mut worker, &requests);
    let second = round(&mut worker, &requests);
    for (i, (a, b)) in first.iter().zip(&second).enumerate() {
        assert_eq!(a.0, b.0, "request {i}: other tokens from the prefix cache");
        if reuses {
            assert!(b.1 >= 16 && (b.1 as usize) < requests[i].prompt_tokens.len(), "request {i} reused {} tokens", b.1);
        } else {
            assert_eq!(b.1, 0, "request {i}: reuse where prefill depends on chunks");
        }
    }
    worker.send(ToWorker::DropPrefixCache);
    assert_eq!(prefix_blocks(&mut worker), 0, "the prefix cache was not dropped");
    let third = round(&mut worker, &requests);
    assert_eq!(third[0], (first[0].0.clone(), 0), "the first request after the drop found blocks, or other tokens");
    if !reuses {
        eprintln!("prefill depends on chunks here (no AVX-512 VNNI or not the default model): reuse was off");
    }
}
