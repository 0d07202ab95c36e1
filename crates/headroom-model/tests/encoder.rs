//! The BERT encoder (all-MiniLM-L6-v2, installed by scripts/install.sh): the CPU engine's
//! (`CpuBert`, the CPU worker's and the sim GPU's) and burn's (`Bert`, CUDA's; ndarray here,
//! its prompts padded to 16-token buckets with the padding masked) give one vector to float
//! rounding, at lengths under, at and over a bucket; a prompt's chunk size does not matter (an
//! encoder reads it whole); a generation is refused. The vectors against an independent numpy
//! BERT: `tests/python/test_embedding_model.py`.

use std::path::PathBuf;
use std::time::Instant;

use headroom_model::{CancelToken, CpuBackend, Decoder, GenerateRequest, ModelBundle, Session};

fn minilm() -> ModelBundle {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/all-MiniLM-L6-v2");
    ModelBundle::open(&path).unwrap_or_else(|e| panic!("{}: {e}; run ./scripts/install.sh, which installs it", path.display()))
}

fn embed<M: Decoder>(model: &M, bundle: &ModelBundle, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut request = GenerateRequest::embedding(tokens.to_vec());
    request.prefill_chunk = chunk;
    Session::start(model, bundle, &request, &CancelToken::new()).unwrap().embedding().unwrap()
}

#[test]
fn the_cpu_engine_and_burn_encode_alike_with_or_without_padding() {
    let bundle = minilm();
    assert!(bundle.config.is_encoder());
    assert_eq!(bundle.config.max_position_embeddings, 256, "sentence_bert_config.json's max_seq_length");
    let cpu = bundle.load_cpu_encoder().unwrap();
    let burn = bundle.load_encoder::<CpuBackend>(&Default::default(), |_, _| {}).unwrap();
    let text = "Headroom keeps every accepted request alive when the GPU runs out of memory, failing over to a warm CPU worker. ".repeat(3);
    let all = bundle.encode(&text, true).unwrap();
    for n in [3, 16, 17, 40, all.len()] {
        let mut tokens = all[..n].to_vec();
        *tokens.last_mut().unwrap() = 102; // [SEP]
        let started = Instant::now();
        let a = embed(&cpu, &bundle, &tokens, 512);
        let cpu_ms = started.elapsed().as_secs_f64() * 1e3;
        let b = embed(&burn, &bundle, &tokens, 512);
        let largest = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        eprintln!("{n} tokens: largest difference {largest:.2e}, CPU engine {cpu_ms:.1} ms");
        assert!(largest < 2e-5, "{n} tokens: the engines differ by {largest}");
        assert_eq!(embed(&cpu, &bundle, &tokens, 4), a, "{n} tokens: an encoder's prompt is read whole, whatever the chunk");
    }
    let generation = GenerateRequest::new(all[..8].to_vec(), 4, Default::default());
    let refused = Session::start(&cpu, &bundle, &generation, &CancelToken::new()).err().expect("a generation is refused");
    assert!(refused.to_string().contains("embedding model"), "{refused}");
}

#[test]
fn prompts_pooled_together_in_one_step_embed_as_they_do_alone() {
    let bundle = minilm();
    let cpu = bundle.load_cpu_encoder().unwrap();
    let texts = ["A man is eating food.", "The new movie is awesome, and the popcorn was fresh.", "In the beginning God created the heaven and the earth."];
    let prompts: Vec<Vec<u32>> = texts.iter().map(|t| bundle.encode(t, true).unwrap()).collect();
    let mut batch = headroom_model::Batch::new(&cpu);
    for (i, prompt) in prompts.iter().enumerate() {
        batch.join(i, Session::new(&cpu, &bundle, &GenerateRequest::embedding(prompt.clone())).unwrap(), CancelToken::new());
    }
    let left = batch.step(|_, _, _, _| true);
    assert_eq!(left.len(), texts.len(), "one step pools every waiting prompt");
    for done in left {
        let alone = embed(&cpu, &bundle, &prompts[done.key], 512);
        let together = done.session.embedding().unwrap();
        let largest = alone.iter().zip(&together).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        assert!(largest < 1e-6, "{}: together differs from alone by {largest}", texts[done.key]);
    }
}
