//! A model split between the CPU engine and a burn device (ndarray here, standing in for the
//! sim GPU as it does in the workers; CUDA on a GPU) computes what the all-CPU model computes:
//! at every split point, through chunked prefill and decode steps, alone and batched.

mod support;

use std::path::Path;

use burn::tensor::DType;
use headroom_model::batch::generate_together;
use support::lone_steps;
use headroom_model::fixture::{tiny_config, write_gguf_from_folder, write_random_folder};
use headroom_model::quants::GgmlType;
use headroom_model::{generate, CancelToken, CpuBackend, Decoder, GenerateRequest, LlamaConfig, ModelBundle, Next, SamplingParams, SplitModel, StoreDtype};

/// Four layers (three split points), grouped-query attention, an untied head.
fn split_config() -> LlamaConfig {
    LlamaConfig { hidden_size: 128, intermediate_size: 256, num_hidden_layers: 4, num_attention_heads: 4, num_key_value_heads: Some(2), ..tiny_config() }
}

/// A llama GGUF (q/k rows permuted as llama.cpp stores them: the CPU part rotates in the file's
/// order, burn in rotate-half order) of `ty`.
fn gguf(dir: &Path, ty: GgmlType) -> ModelBundle {
    let folder = dir.join("folder");
    write_random_folder(&folder, &split_config(), 23, StoreDtype::F32).unwrap();
    let file = dir.join(format!("{ty}.gguf"));
    write_gguf_from_folder(&folder, &file, ty).unwrap();
    ModelBundle::open(&file).unwrap()
}

fn split(bundle: &ModelBundle, gpu_layers: usize) -> SplitModel<CpuBackend> {
    SplitModel::load(bundle, gpu_layers, &Default::default(), DType::F32).unwrap()
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0
}

/// A prompt fed in two chunks (the second attends over the first's cache), then decode steps
/// fed one token at a time: the logits of every feed.
fn feeds<M: Decoder>(model: &M, config: &LlamaConfig) -> Vec<Vec<f32>> {
    let vocab = config.vocab_size as u32;
    let prompt: Vec<u32> = (0..9u32).map(|i| (i * 41 + 5) % vocab).collect();
    let steps = 8;
    let mut cache = model.new_cache(config, prompt.len() + steps);
    let mut out = vec![model.feed(&prompt[..5], &mut cache), model.feed(&prompt[5..], &mut cache)];
    out.extend((0..steps as u32).map(|i| model.feed(&[(i * 67 + 2) % vocab], &mut cache)));
    out
}

/// At each split point (1, 2 and 3 of 4 layers on the GPU) every feed's logits equal the
/// all-CPU model's to float rounding (the parts sum in different orders), with the same argmax.
#[test]
fn split_models_give_the_all_cpu_logits() {
    for ty in [GgmlType::F32, GgmlType::F16] {
        let dir = tempfile::tempdir().unwrap();
        let bundle = gguf(dir.path(), ty);
        let want = feeds(&bundle.load_cpu(|_, _| {}).unwrap(), &bundle.config);
        for gpu_layers in 1..bundle.config.num_hidden_layers {
            let model = split(&bundle, gpu_layers);
            assert_eq!((model.cpu_layers(), model.gpu_layers()), (4 - gpu_layers, gpu_layers));
            for (i, (got, want)) in feeds(&model, &bundle.config).iter().zip(&want).enumerate() {
                let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                assert!(
                    diff < 1e-3 && argmax(got) == argmax(want),
                    "{ty}, {gpu_layers} of 4 layers on the GPU: feed {i}'s logits differ from the all-CPU model's by {diff}"
                );
            }
        }
    }
}

/// Its negative control: with the GPU's layers keeping no KV cache (each step attends to its
/// new tokens alone), the split's logits differ.
#[test]
fn split_logits_check_fails_when_the_gpu_layers_forget_their_cache() {
    headroom_model::assert_control_fails("split_models_give_the_all_cpu_logits", "split-gpu-no-cache", "logits differ from the all-CPU");
}

/// Batched decode steps of a split give each sequence its lone step's logits.
#[test]
fn split_batched_steps_equal_lone_steps() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = gguf(dir.path(), GgmlType::F32);
    let model = split(&bundle, 2);
    let vocab = bundle.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [1usize, 4, 11].iter().map(|&n| (0..n as u32).map(|i| (i * 29 + n as u32) % vocab).collect()).collect();
    let steps = 6;
    let token = |s: usize, i: usize| ((s * 101 + i * 13 + 1) as u32) % vocab;
    let alone = lone_steps(&model, &bundle.config, &prompts, steps, token);
    let mut caches: Vec<_> = prompts.iter().map(|p| model.new_cache(&bundle.config, p.len() + steps)).collect();
    for (prompt, cache) in prompts.iter().zip(&mut caches) {
        model.feed(prompt, cache);
    }
    for i in 0..steps {
        let mut batch: Vec<(u32, &mut _)> = caches.iter_mut().enumerate().map(|(s, c)| (token(s, i), c)).collect();
        let next = model.feed_batch(&mut batch, &[true, false, true]);
        for (s, got) in next.iter().enumerate() {
            let Next::Logits(got) = got else { panic!("a split's head is on the CPU: it gives logits") };
            let diff = got.iter().zip(&alone[s][i]).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(diff < 1e-4, "sequence {s} step {i}: batched logits differ from its lone step by {diff}");
        }
    }
}

/// Whole requests: greedy generation on a split gives the all-CPU model's tokens, and requests
/// batched together on a split give the tokens they give alone (a sampled one among them).
#[test]
fn split_requests_give_the_all_cpu_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = gguf(dir.path(), GgmlType::F32);
    let cpu = bundle.load_cpu(|_, _| {}).unwrap();
    let model = split(&bundle, 3);
    let vocab = bundle.config.vocab_size as u32;
    let mut requests: Vec<GenerateRequest> = [3usize, 8, 1]
        .iter()
        .map(|&n| GenerateRequest::new((0..n as u32).map(|i| (i * 53 + 7) % vocab).collect(), 10, SamplingParams::default()))
        .collect();
    requests.iter_mut().for_each(|r| r.ignore_eos = true);
    for (i, request) in requests.iter().enumerate() {
        let want = generate(&cpu, &bundle, request, &CancelToken::new(), |_| {}).unwrap().tokens;
        let got = generate(&model, &bundle, request, &CancelToken::new(), |_| {}).unwrap().tokens;
        assert_eq!(got, want, "request {i}: the split's greedy tokens differ from the all-CPU model's");
    }
    requests[1].sampling = SamplingParams { temperature: 0.8, top_p: 0.95, seed: 3, ..SamplingParams::default() };
    let alone: Vec<Vec<u32>> = requests.iter().map(|r| generate(&model, &bundle, r, &CancelToken::new(), |_| {}).unwrap().tokens).collect();
    assert_eq!(generate_together(&model, &bundle, &requests).unwrap(), alone, "a split's requests batched vs alone");
}

/// A split keeps layers on both devices: all or none on the GPU is refused, saying what fits.
#[test]
fn a_split_with_no_layers_on_one_side_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = gguf(dir.path(), GgmlType::F32);
    for n in [0, 4, 9] {
        let err = SplitModel::<CpuBackend>::load(&bundle, n, &Default::default(), DType::F32).unwrap_err().to_string();
        assert!(err.contains("between 1 and 3 of the model's 4 layers"), "{n}: {err}");
    }
}
