//! Continuous batching: a sequence's logits and tokens do not depend on which other sequences
//! share its steps. Checked on random packed models of every type the CPU multiplies packed and
//! on the default model, with sequences of different lengths joining and leaving at different
//! steps, a resumed checkpoint and a sampled request among them.

mod support;

use std::path::Path;

use headroom_model::batch::generate_together;
use headroom_model::fixture::{tiny_config, write_gguf_from_folder, write_random_folder, write_random_packed_gguf};
use headroom_model::quants::GgmlType;
use headroom_model::{generate, CancelToken, CpuBackend, Decoder, GenerateRequest, Llama, LlamaConfig, ModelBundle, Next, SamplingParams, StoreDtype};
use support::lone_steps;

/// Hidden sizes that are whole K-quant super-blocks (256).
fn packed_config() -> LlamaConfig {
    LlamaConfig { hidden_size: 256, intermediate_size: 512, num_attention_heads: 4, num_key_value_heads: Some(2), ..tiny_config() }
}

fn packed_file(dir: &Path, ty: GgmlType) -> ModelBundle {
    let folder = dir.join("folder");
    write_random_folder(&folder, &packed_config(), 9, StoreDtype::F32).unwrap();
    let file = dir.join(format!("{ty}.gguf"));
    if matches!(ty, GgmlType::F32 | GgmlType::F16) {
        write_gguf_from_folder(&folder, &file, ty).unwrap();
    } else {
        let f32_file = dir.join("f32.gguf");
        write_gguf_from_folder(&folder, &f32_file, GgmlType::F32).unwrap();
        write_random_packed_gguf(&f32_file, &file, ty, 17).unwrap();
    }
    ModelBundle::open(&file).unwrap()
}

const TYPES: [GgmlType; 8] =
    [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::F16, GgmlType::F32];

/// Four sequences at different positions (prompts of 1, 3, 7 and 19 tokens), fed one token
/// each per batched step for 12 steps: every step's logits equal, bit for bit, what the same
/// sequence gets fed alone. A fifth sequence joins at step 5 (the batch's size changes).
#[test]
fn batched_decode_steps_equal_lone_steps_exactly() {
    for ty in TYPES {
        let dir = tempfile::tempdir().unwrap();
        let bundle = packed_file(dir.path(), ty);
        let model = bundle.load_cpu(|_, _| {}).unwrap();
        let vocab = bundle.config.vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [1usize, 3, 7, 19, 5].iter().map(|&n| (0..n as u32).map(|i| (i * 37 + n as u32) % vocab).collect()).collect();
        let steps = 12;
        let token = |s: usize, i: usize| ((s * 131 + i * 17 + 3) as u32) % vocab;
        // Alone: a prefill, then one token per step.
        let alone = lone_steps(&model, &bundle.config, &prompts, steps, token);
        let mut caches: Vec<_> = prompts.iter().map(|p| Decoder::new_cache(&model, &bundle.config, p.len() + steps)).collect();
        let mut step_of = vec![0usize; prompts.len()];
        for (s, prompt) in prompts.iter().enumerate().take(4) {
            model.feed(prompt, &mut caches[s]);
        }
        for round in 0..steps + 5 {
            if round == 5 {
                model.feed(&prompts[4], &mut caches[4]);
            }
            let members: Vec<usize> = (0..prompts.len()).filter(|&s| (s < 4 || round >= 5) && step_of[s] < steps).collect();
            let mut batch: Vec<(u32, &mut _)> = Vec::new();
            for (s, cache) in caches.iter_mut().enumerate() {
                if members.contains(&s) {
                    batch.push((token(s, step_of[s]), cache));
                }
            }
            let pick = vec![false; batch.len()];
            let logits = model.feed_batch(&mut batch, &pick);
            for (&s, got) in members.iter().zip(&logits) {
                let want = &Next::Logits(alone[s][step_of[s]].clone());
                assert!(got == want, "{ty}: sequence {s} step {}: batched logits differ from its lone step (batch of {})", step_of[s], members.len());
                step_of[s] += 1;
            }
        }
        assert!(step_of.iter().all(|&n| n == steps));
    }
}

/// Runs `test` of this binary with a batch's decode rows summed in another order than a lone
/// step's (the K-quants and floats through the prefill tiles instead of the row kernels; repacked
/// blocks added last to first) and asserts that it fails saying `says`.
fn fails_with_tiles_in_batches(test: &str, says: &str) {
    headroom_model::assert_control_fails(test, "batch-tiles", says)
}

/// Whether a negative control can run here: not inside another control, and on a processor
/// where the defect changes the sums of the types a test runs (`q32`: Q4_0, Q4_1 and Q8_0 only;
/// otherwise the K-quants too): through tiles or repacked weights.
fn controls_apply(q32: bool) -> bool {
    if std::env::var_os("HEADROOM_TEST_DEFECT").is_some() {
        return false;
    }
    let k = headroom_model::cpu::dot::Kernels::detect();
    let applies = k.interleaved32.is_some() || k.tile32.is_some() || (!q32 && (k.k_tile.is_some() || k.interleaved256.is_some()));
    if !applies {
        eprintln!("this processor's kernels sum a batch's steps as they sum lone steps; the control is skipped");
    }
    applies
}

/// The negative control of the exact check.
#[test]
fn batched_decode_through_tiles_fails_the_exact_check() {
    if controls_apply(false) {
        fails_with_tiles_in_batches("batched_decode_steps_equal_lone_steps_exactly", "batched logits differ");
    }
}

/// Requests of a batch: different prompt lengths and max_tokens (they leave at different
/// steps), a resumed checkpoint, one sampled with a seed.
fn requests(bundle: &ModelBundle, prompts: &[Vec<u32>]) -> Vec<GenerateRequest> {
    let mut out: Vec<GenerateRequest> =
        prompts.iter().enumerate().map(|(i, p)| GenerateRequest::new(p.clone(), 6 + 5 * i, SamplingParams::default())).collect();
    out[1].sampling = SamplingParams { temperature: 0.8, top_p: 0.95, seed: 7, ..SamplingParams::default() };
    // A resume: the checkpoint of a lone run stopped after 4 tokens.
    let mut first = out[2].clone();
    first.max_tokens = 4;
    let checkpoint = generate(&bundle_model(bundle), bundle, &first, &CancelToken::new(), |_| {}).unwrap().checkpoint;
    out[2].resume = Some(checkpoint);
    for r in &mut out {
        r.ignore_eos = true;
    }
    out
}

fn bundle_model(bundle: &ModelBundle) -> headroom_model::CpuModel {
    bundle.load_cpu(|_, _| {}).unwrap()
}

fn alone_and_together<M: Decoder>(model: &M, bundle: &ModelBundle, prompts: &[Vec<u32>]) {
    let requests = requests(bundle, prompts);
    let alone: Vec<Vec<u32>> = requests.iter().map(|r| generate(model, bundle, r, &CancelToken::new(), |_| {}).unwrap().tokens).collect();
    let together = generate_together(model, bundle, &requests).unwrap();
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "request {i}: tokens alone vs in a batch of {}", requests.len());
        assert_eq!(a.len(), requests[i].max_tokens, "request {i} ran to its max_tokens");
    }
}

/// Whole requests through the batch scheduler give the tokens they give alone, every type.
#[test]
fn requests_give_the_same_tokens_alone_and_in_a_batch_of_four() {
    for ty in TYPES {
        let dir = tempfile::tempdir().unwrap();
        let bundle = packed_file(dir.path(), ty);
        let vocab = bundle.config.vocab_size as u32;
        let prompts: Vec<Vec<u32>> = [3usize, 9, 21, 1].iter().map(|&n| (0..n as u32).map(|i| (i * 53 + 11 * n as u32) % vocab).collect()).collect();
        alone_and_together(&bundle_model(&bundle), &bundle, &prompts);
    }
}

/// The same on the default model (SmolLM2-135M Q4_1) with chat prompts.
#[test]
fn the_default_model_gives_the_same_tokens_alone_and_in_a_batch_of_four() {
    let Some(bundle) = default_model() else { return };
    let prompts: Vec<Vec<u32>> = ["What is the capital of France?", "Write a haiku about rain.", "Hi", "List three prime numbers and explain why each is prime."]
        .iter()
        .map(|q| bundle.chat_prompt(&[headroom_model::ChatMessage::new("user", *q)], None).unwrap())
        .collect();
    alone_and_together(&bundle_model(&bundle), &bundle, &prompts);
}

fn default_model() -> Option<ModelBundle> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("{} is not installed; skipped", path.display());
        return None;
    }
    Some(ModelBundle::open(&path).unwrap())
}

/// Its negative control: with tiles in batched steps the default model's tokens part ways.
#[test]
fn the_default_model_check_fails_with_tiles_in_batches() {
    if controls_apply(true) && default_model().is_some() {
        fails_with_tiles_in_batches("the_default_model_gives_the_same_tokens_alone_and_in_a_batch_of_four", "tokens alone vs in a batch");
    }
}

/// The burn decoder (the CUDA path) batches decode steps too: the same four sequences at
/// different positions and a fifth joining late, fed one token each per batched step, get the
/// logits each gets alone and the same greedy token. (To float rounding: a GPU's matrix product
/// of several rows need not sum in a lone row's order.) Every other sequence, alternating by
/// step, has its token picked on the device instead: it is its lone logits' argmax.
#[test]
fn burn_batched_decode_steps_equal_lone_steps() {
    let dir = tempfile::tempdir().unwrap();
    write_random_folder(dir.path(), &packed_config(), 9, StoreDtype::F32).unwrap();
    let bundle = ModelBundle::open(dir.path()).unwrap();
    let model: Llama<CpuBackend> = bundle.load(&Default::default(), |_, _| {}).unwrap();
    let vocab = bundle.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [1usize, 3, 7, 19, 5].iter().map(|&n| (0..n as u32).map(|i| (i * 37 + n as u32) % vocab).collect()).collect();
    let steps = 8;
    let token = |s: usize, i: usize| ((s * 131 + i * 17 + 3) as u32) % vocab;
    let alone = lone_steps(&model, &bundle.config, &prompts, steps, token);
    let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    let mut caches: Vec<_> = prompts.iter().map(|p| Decoder::new_cache(&model, &bundle.config, p.len() + steps)).collect();
    let mut step_of = vec![0usize; prompts.len()];
    for (s, prompt) in prompts.iter().enumerate().take(4) {
        model.feed(prompt, &mut caches[s]);
    }
    for round in 0..steps + 3 {
        if round == 3 {
            model.feed(&prompts[4], &mut caches[4]);
        }
        let members: Vec<usize> = (0..prompts.len()).filter(|&s| (s < 4 || round >= 3) && step_of[s] < steps).collect();
        let mut batch: Vec<(u32, &mut _)> = Vec::new();
        for (s, cache) in caches.iter_mut().enumerate() {
            if members.contains(&s) {
                batch.push((token(s, step_of[s]), cache));
            }
        }
        let pick: Vec<bool> = members.iter().map(|&s| (s + round) % 2 == 0).collect();
        let next = model.feed_batch(&mut batch, &pick);
        for (&s, got) in members.iter().zip(&next) {
            let want = &alone[s][step_of[s]];
            match got {
                Next::Logits(got) => {
                    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
                    assert!(
                        diff < 1e-4 && argmax(got) == argmax(want),
                        "sequence {s} step {}: batched logits differ from its lone step by {diff} (batch of {})",
                        step_of[s],
                        members.len()
                    );
                }
                &Next::Token(got) => assert_eq!(
                    got as usize,
                    argmax(want),
                    "sequence {s} step {}: the token picked on the device is not its lone logits' argmax (batch of {})",
                    step_of[s],
                    members.len()
                ),
            }
            step_of[s] += 1;
        }
    }
    assert!(step_of.iter().all(|&n| n == steps));
}

/// Its negative control: with every sequence of a batch at the first one's position, it fails.
#[test]
fn burn_batched_decode_fails_with_shared_positions() {
    headroom_model::assert_control_fails("burn_batched_decode_steps_equal_lone_steps", "batch-positions", "batched logits differ");
}

/// Its negative control for picking: with every sequence given the first one's picked token,
/// it fails.
#[test]
fn burn_batched_decode_fails_with_tokens_picked_from_one_row() {
    headroom_model::assert_control_fails("burn_batched_decode_steps_equal_lone_steps", "device-pick-first-row", "picked on the device is not");
}

/// Whole requests through the batch scheduler on the burn decoder give the tokens they give
/// alone.
#[test]
fn burn_requests_give_the_same_tokens_alone_and_in_a_batch_of_four() {
    let dir = tempfile::tempdir().unwrap();
    write_random_folder(dir.path(), &packed_config(), 9, StoreDtype::F32).unwrap();
    let bundle = ModelBundle::open(dir.path()).unwrap();
    let model: Llama<CpuBackend> = bundle.load(&Default::default(), |_, _| {}).unwrap();
    let vocab = bundle.config.vocab_size as u32;
    let prompts: Vec<Vec<u32>> = [3usize, 9, 21, 1].iter().map(|&n| (0..n as u32).map(|i| (i * 53 + 11 * n as u32) % vocab).collect()).collect();
    alone_and_together(&model, &bundle, &prompts);
}
