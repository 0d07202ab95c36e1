//! Embeddings: the mean of a prompt's hidden states after the final norm, scaled to length 1.
//! The CPU engine, burn (the engine of the sim GPU and of CUDA; ndarray here) and a split model
//! give the same vector to float rounding; a prompt fed in chunks gives what it gives whole; an
//! embedding that shares a batch with generations is the one it gets alone.

use std::path::Path;

use burn::tensor::DType;
use headroom_model::fixture::{tiny_config, write_gguf_from_folder, write_random_folder};
use headroom_model::quants::GgmlType;
use headroom_model::{
    Batch, CancelToken, CpuBackend, Decoder, FinishReason, GenerateRequest, Llama, LlamaConfig, ModelBundle, SamplingParams, Session,
    SplitModel, StoreDtype,
};

fn config() -> LlamaConfig {
    LlamaConfig { hidden_size: 128, intermediate_size: 256, num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: Some(2), ..tiny_config() }
}

fn gguf(dir: &Path, ty: GgmlType) -> ModelBundle {
    let folder = dir.join("folder");
    write_random_folder(&folder, &config(), 31, StoreDtype::F32).unwrap();
    let file = dir.join(format!("{ty}.gguf"));
    write_gguf_from_folder(&folder, &file, ty).unwrap();
    ModelBundle::open(&file).unwrap()
}

fn prompt(seed: u32, n: u32, vocab: u32) -> Vec<u32> {
    (0..n).map(|i| (i * 41 + seed * 7 + 5) % vocab).collect()
}

/// The embedding of `tokens`, its prompt fed `chunk` tokens at a time.
fn embed<M: Decoder>(model: &M, bundle: &ModelBundle, tokens: &[u32], chunk: usize) -> Vec<f32> {
    let mut request = GenerateRequest::embedding(tokens.to_vec());
    request.prefill_chunk = chunk;
    let session = Session::start(model, bundle, &request, &CancelToken::new()).unwrap();
    assert_eq!(session.finished(), Some(FinishReason::Stop), "an embedding ends once its prompt is in");
    assert!(session.generated().is_empty(), "an embedding generates nothing");
    session.embedding().expect("a finished embedding has its vector")
}

fn max_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Whole and in chunks of 5, on the three engines: the same vector of length 1, the width of
/// the hidden state; the engines agree to rounding; another prompt gives another vector.
#[test]
fn embeddings_agree_across_engines_and_chunks() {
    for ty in [GgmlType::F32, GgmlType::F16] {
        let dir = tempfile::tempdir().unwrap();
        let bundle = gguf(dir.path(), ty);
        let vocab = bundle.config.vocab_size as u32;
        let tokens = prompt(1, 23, vocab);
        let cpu = bundle.load_cpu(|_, _| {}).unwrap();
        let burn: Llama<CpuBackend> = bundle.load(&Default::default(), |_, _| {}).unwrap();
        let split = SplitModel::<CpuBackend>::load(&bundle, 2, &Default::default(), DType::F32).unwrap();
        let reference = embed(&cpu, &bundle, &tokens, 64);
        assert_eq!(reference.len(), bundle.config.hidden_size);
        assert!((dot(&reference, &reference) - 1.0).abs() < 1e-5, "{ty}: the embedding has length 1");
        for (engine, whole, chunked) in [
            ("cpu", reference.clone(), embed(&cpu, &bundle, &tokens, 5)),
            ("burn", embed(&burn, &bundle, &tokens, 64), embed(&burn, &bundle, &tokens, 5)),
            ("split", embed(&split, &bundle, &tokens, 64), embed(&split, &bundle, &tokens, 5)),
        ] {
            let chunks = max_difference(&whole, &chunked);
            assert!(chunks < 1e-5, "{ty} {engine}: the chunked embedding differs from the whole one by {chunks}");
            let engines = max_difference(&reference, &whole);
            assert!(engines < 1e-4, "{ty} {engine}: the embedding differs from the CPU engine's by {engines}");
        }
        let other = embed(&cpu, &bundle, &prompt(2, 23, vocab), 64);
        assert!(dot(&reference, &other) < 0.999, "{ty}: two prompts gave one vector");
    }
}

/// Its negative control: with each chunk replacing the sum of those before it, it fails.
#[test]
fn embeddings_fail_when_a_chunk_replaces_the_sum() {
    headroom_model::assert_control_fails("embeddings_agree_across_engines_and_chunks", "embed-last-chunk", "chunked embedding differs");
}

/// An embedding that joins a batch of two running generations gives, bit for bit, the vector it
/// gets alone, and the generations their lone tokens.
#[test]
fn an_embedding_in_a_batch_is_the_one_alone() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = gguf(dir.path(), GgmlType::F32);
    let vocab = bundle.config.vocab_size as u32;
    let model = bundle.load_cpu(|_, _| {}).unwrap();
    let tokens = prompt(3, 30, vocab);
    let mut request = GenerateRequest::embedding(tokens.clone());
    request.prefill_chunk = 8;
    let alone = embed(&model, &bundle, &tokens, 8);
    let generations: Vec<GenerateRequest> = (0..2).map(|s| GenerateRequest::new(prompt(10 + s, 6, vocab), 12, SamplingParams::default())).collect();
    let lone_tokens: Vec<Vec<u32>> = generations
        .iter()
        .map(|r| {
            let mut session = Session::start(&model, &bundle, r, &CancelToken::new()).unwrap();
            while session.next(&CancelToken::new()).unwrap().is_some() {}
            session.generated().to_vec()
        })
        .collect();
    let mut batch = Batch::new(&model);
    for (key, r) in generations.iter().enumerate() {
        batch.join(key, Session::new(&model, &bundle, r).unwrap(), CancelToken::new());
    }
    let mut left = Vec::new();
    for step in 0.. {
        if step == 3 {
            batch.join(9, Session::new(&model, &bundle, &request).unwrap(), CancelToken::new());
        }
        left.extend(batch.step(|_, _, _, _| true));
        if batch.is_empty() && step > 3 {
            break;
        }
    }
    for l in &left {
        assert!(l.error.is_none());
        match l.key {
            9 => assert!(l.session.embedding().unwrap() == alone, "the embedding differs in a batch"),
            s => assert_eq!(l.session.generated(), &lone_tokens[s][..], "generation {s} differs beside an embedding"),
        }
    }
    assert_eq!(left.len(), 3);
}

/// An input longer than the context, an empty one, or one that asks for tokens is refused with
/// a message that names the limit or the rule.
#[test]
fn bad_embedding_requests_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = gguf(dir.path(), GgmlType::F32);
    let model = bundle.load_cpu(|_, _| {}).unwrap();
    let context = bundle.config.max_position_embeddings;
    let refusal = |request: GenerateRequest| match Session::new(&model, &bundle, &request) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("accepted"),
    };
    let long = refusal(GenerateRequest::embedding(vec![1; context + 1]));
    assert!(long.contains(&format!("{} tokens", context + 1)) && long.contains(&format!("at most {context}")), "{long}");
    assert!(refusal(GenerateRequest::embedding(Vec::new())).contains("empty"));
    let mut asks = GenerateRequest::embedding(vec![1, 2]);
    asks.max_tokens = 3;
    assert!(refusal(asks).contains("max_tokens must be 0"));
    assert!(Session::new(&model, &bundle, &GenerateRequest::embedding(vec![1; context])).is_ok(), "a whole context embeds");
}
