//! A worker run in-process over pipes, as the router drives one.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{PipeReader, PipeWriter};
use std::path::{Path, PathBuf};

use headroom_model::{GenerateRequest, ModelBundle, SamplingParams};
use headroom_worker::protocol::{read_frame, write_frame};
use headroom_worker::{Device, FailureKind, FromWorker, GenerateJob, ToWorker, WorkerOptions};

/// The default model (SmolLM2-135M Q4_1) where it is installed, whose greedy tokens part ways
/// at the smallest change of arithmetic; the demo model otherwise.
pub fn model_path() -> PathBuf {
    let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models");
    let default = models.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if default.exists() { default } else { models.join("kjv-demo") }
}

pub struct Worker {
    to: PipeWriter,
    from: PipeReader,
}

impl Worker {
    /// A sim worker of `max_concurrency` slots with the model loaded.
    pub fn start(max_concurrency: u32) -> Self {
        let mut options = WorkerOptions::new(Device::Sim);
        options.max_concurrency = max_concurrency;
        let (worker, ready) = Self::load(options, &model_path());
        match ready {
            FromWorker::Ready { max_concurrency: n, .. } => assert_eq!(n, max_concurrency),
            other => panic!("expected Ready, got {other:?}"),
        }
        worker
    }

    /// A worker with `options` (memory samples off) sent `model`: it and the load's answer.
    pub fn load(mut options: WorkerOptions, model: &Path) -> (Self, FromWorker) {
        let (worker_in, to) = std::io::pipe().unwrap();
        let (from, worker_out) = std::io::pipe().unwrap();
        options.memory_sample_ms = 0;
        std::thread::spawn(move || headroom_worker::runtime::run(options, worker_in, worker_out));
        let mut worker = Worker { to, from };
        assert!(matches!(worker.next(), FromWorker::Hello { .. }));
        worker.send(ToWorker::Load { model_dir: model.display().to_string() });
        let ready = worker.next();
        (worker, ready)
    }

    pub fn send(&mut self, message: ToWorker) {
        write_frame(&mut self.to, &message).unwrap();
    }

    /// Sends every request at once, as `r0`, `r1`, …; returns their ids.
    pub fn submit(&mut self, requests: &[GenerateRequest]) -> Vec<String> {
        let ids: Vec<String> = (0..requests.len()).map(|i| format!("r{i}")).collect();
        for (order, (id, request)) in ids.iter().zip(requests).enumerate() {
            self.send(ToWorker::Generate(GenerateJob { request_id: id.clone(), request: request.clone(), started_order: order as u64 }));
        }
        ids
    }

    pub fn next(&mut self) -> FromWorker {
        read_frame(&mut self.from).unwrap()
    }

    /// Reads frames until every one of `ids` has ended: what each streamed and how it ended.
    pub fn streams(&mut self, ids: &[String]) -> HashMap<String, Stream> {
        self.streams_with(ids, |_, _| None)
    }

    /// The same, sending what `on_token(request, tokens so far)` gives after each token.
    pub fn streams_with(&mut self, ids: &[String], mut on_token: impl FnMut(&str, usize) -> Option<ToWorker>) -> HashMap<String, Stream> {
        let mut streams: HashMap<String, Stream> = ids.iter().map(|id| (id.clone(), Stream::default())).collect();
        let mut frames = 0;
        while streams.values().any(|s| s.end.is_none()) {
            let frame = self.next();
            frames += 1;
            match &frame {
                FromWorker::Token { request_id, token, index, .. } => {
                    let stream = streams.get_mut(request_id).unwrap();
                    assert_eq!(*index as usize, stream.tokens.len(), "{request_id}: token indexes in order");
                    stream.first_token_frame.get_or_insert(frames);
                    stream.tokens.push(*token);
                    if let Some(message) = on_token(request_id, stream.tokens.len()) {
                        self.send(message);
                    }
                }
                FromWorker::Done { request_id, .. } | FromWorker::Failed { request_id: Some(request_id), .. } => {
                    let stream = streams.get_mut(request_id).unwrap();
                    stream.end = Some(frame.clone());
                    stream.end_frame = Some(frames);
                }
                other => panic!("unexpected frame {other:?}"),
            }
        }
        streams
    }
}

/// What each request streams: its tokens in order and how it ended.
#[derive(Debug, Default)]
pub struct Stream {
    pub tokens: Vec<u32>,
    pub end: Option<FromWorker>,
    /// Which frame, counted from the first one read, brought its first token, and its end.
    pub first_token_frame: Option<usize>,
    pub end_frame: Option<usize>,
}

impl Stream {
    /// The checkpoint of a stream that failed with a replayable out-of-memory.
    pub fn oom_checkpoint(&self, id: &str) -> headroom_model::Checkpoint {
        match &self.end {
            Some(FromWorker::Failed { kind: FailureKind::Oom, checkpoint: Some(checkpoint), replayable: true, .. }) => checkpoint.clone(),
            other => panic!("{id} should fail with a replayable out-of-memory: {other:?}"),
        }
    }
}

/// Four greedy requests of different prompt lengths and max_tokens, run past EOS.
pub fn requests(bundle: &ModelBundle) -> Vec<GenerateRequest> {
    ["In the beginning God created", "And the LORD spake unto Moses, saying", "The capital of France is", "Let there be light"]
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let prompt = bundle.encode(text, true).unwrap();
            let mut r = GenerateRequest::new(prompt, 24 + 8 * i, SamplingParams::default());
            r.ignore_eos = true;
            r
        })
        .collect()
}

