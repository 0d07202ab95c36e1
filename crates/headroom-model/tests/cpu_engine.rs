//! The CPU engine (packed weights, SIMD kernels) against burn's tensor ops, the reference
//! implementation of the decoder: on f32 weights they agree to float rounding; on packed weights
//! the engine differs from the same file dequantized only by its 8-bit activations.

use std::path::Path;

use headroom_model::fixture::{tiny_config, write_gguf_from_folder, write_random_folder, write_random_packed_gguf};
use headroom_model::quants::GgmlType;
use headroom_model::{CpuBackend, Decoder, KvPrecision, Llama, LlamaConfig, ModelBundle, StoreDtype};

/// Logits of a prefill of `prompt` then one decode step per token of `decode`, for any decoder.
fn run<M: Decoder>(model: &M, config: &LlamaConfig, prompt: &[u32], decode: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(config, prompt.len() + decode.len());
    let mut out = vec![model.feed(prompt, &mut cache)];
    for &t in decode {
        out.push(model.feed(&[t], &mut cache));
    }
    out
}

fn burn_model(bundle: &ModelBundle) -> Llama<CpuBackend> {
    bundle.load(&Default::default(), |_, _| {}).unwrap()
}

/// Largest difference relative to the largest logit, over every step.
fn worst_relative(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
            x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max) / scale
        })
        .fold(0f32, f32::max)
}

const PROMPT: &[u32] = &[3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 8];
const DECODE: &[u32] = &[41, 97, 169, 39, 93, 7];

/// f32 weights from a folder: the same logits as burn at every step, with grouped-query
/// attention, tied and untied heads and q/k/v biases, in both KV precisions (f16 within its
/// rounding).
#[test]
fn f32_weights_compute_what_burn_computes() {
    for (tied, bias) in [(false, false), (true, false), (false, true)] {
        let dir = tempfile::tempdir().unwrap();
        let config = LlamaConfig { tie_word_embeddings: tied, attention_bias: Some(bias), ..tiny_config() };
        write_random_folder(dir.path(), &config, 3, StoreDtype::F32).unwrap();
        let bundle = ModelBundle::open(dir.path()).unwrap();
        let reference = run(&burn_model(&bundle), &bundle.config, PROMPT, DECODE);
        let mut cpu = bundle.load_cpu(|_, _| {}).unwrap();
        let worst = worst_relative(&run(&cpu, &bundle.config, PROMPT, DECODE), &reference);
        assert!(worst < 1e-4, "tied={tied} bias={bias}: logits differ by {worst} of the largest");
        cpu.kv_precision = KvPrecision::F16;
        let worst = worst_relative(&run(&cpu, &bundle.config, PROMPT, DECODE), &reference);
        assert!(worst < 5e-3, "f16 KV: logits differ by {worst} of the largest");
    }
}

/// A GGUF with llama.cpp's permuted q/k rows, run on the file's row order with interleaved RoPE
/// pairs: the same logits as burn on the un-permuted folder.
#[test]
fn a_permuted_f32_gguf_computes_what_its_folder_computes() {
    let dir = tempfile::tempdir().unwrap();
    let folder = dir.path().join("folder");
    write_random_folder(&folder, &tiny_config(), 5, StoreDtype::F32).unwrap();
    let file = dir.path().join("model.gguf");
    write_gguf_from_folder(&folder, &file, GgmlType::F32).unwrap();
    let (folder, file) = (ModelBundle::open(&folder).unwrap(), ModelBundle::open(&file).unwrap());
    let reference = run(&burn_model(&folder), &folder.config, PROMPT, DECODE);
    let cpu = file.load_cpu(|_, _| {}).unwrap();
    let worst = worst_relative(&run(&cpu, &file.config, PROMPT, DECODE), &reference);
    assert!(worst < 1e-4, "logits differ by {worst} of the largest");
}

/// F16 and BF16 files stay in their 16-bit rows (the engine holds the file's bytes) and compute
/// what burn computes on the same file widened to f32.
#[test]
fn half_precision_files_stay_16_bit_and_compute_what_the_file_says() {
    for ty in [GgmlType::F16, GgmlType::BF16] {
        let dir = tempfile::tempdir().unwrap();
        let folder = dir.path().join("folder");
        write_random_folder(&folder, &tiny_config(), 5, StoreDtype::F32).unwrap();
        let path = dir.path().join(format!("{ty}.gguf"));
        write_gguf_from_folder(&folder, &path, ty).unwrap();
        let bundle = ModelBundle::open(&path).unwrap();
        let reference = run(&burn_model(&bundle), &bundle.config, PROMPT, DECODE);
        let cpu = bundle.load_cpu(|_, _| {}).unwrap();
        let worst = worst_relative(&run(&cpu, &bundle.config, PROMPT, DECODE), &reference);
        assert!(worst < 1e-4, "{ty}: logits differ by {worst} of the largest");
        let file = headroom_model::gguf::GgufFile::open(&bundle.path).unwrap();
        let tensor_bytes: usize = file.tensors.values().map(|t| t.bytes).sum();
        assert_eq!(cpu.weight_bytes(), tensor_bytes, "{ty}: the engine holds other bytes than the file's");
        assert_eq!(bundle.cpu_weight_bytes, tensor_bytes as u64, "{ty}: admission counts other bytes than the engine holds");
    }
}

/// A folder of f16 or bf16 safetensors keeps its matrices 16-bit (half the bytes of f32, which
/// admission counts) and computes what burn computes on the same weights widened to f32.
#[test]
fn half_precision_folders_stay_16_bit_and_compute_what_burn_computes() {
    for dtype in [StoreDtype::F16, StoreDtype::BF16] {
        let dir = tempfile::tempdir().unwrap();
        write_random_folder(dir.path(), &tiny_config(), 5, dtype).unwrap();
        let bundle = ModelBundle::open(dir.path()).unwrap();
        let reference = run(&burn_model(&bundle), &bundle.config, PROMPT, DECODE);
        let cpu = bundle.load_cpu(|_, _| {}).unwrap();
        let worst = worst_relative(&run(&cpu, &bundle.config, PROMPT, DECODE), &reference);
        assert!(worst < 1e-4, "{dtype:?}: logits differ by {worst} of the largest");
        assert_eq!(cpu.weight_bytes() as u64, bundle.cpu_weight_bytes, "{dtype:?}: admission counts other bytes than the engine holds");
        assert!(bundle.cpu_weight_bytes < bundle.config.parameter_count() as u64 * 3, "{dtype:?}: matrices were widened to f32");
    }
}

/// Hidden sizes that are whole K-quant super-blocks (256).
fn packed_config() -> LlamaConfig {
    LlamaConfig { hidden_size: 256, intermediate_size: 512, num_attention_heads: 4, num_key_value_heads: Some(2), ..tiny_config() }
}

fn packed_file(dir: &Path, ty: GgmlType) -> ModelBundle {
    let folder = dir.join("folder");
    write_random_folder(&folder, &packed_config(), 9, StoreDtype::F32).unwrap();
    let f32_file = dir.join("f32.gguf");
    write_gguf_from_folder(&folder, &f32_file, GgmlType::F32).unwrap();
    let packed = dir.join(format!("{ty}.gguf"));
    write_random_packed_gguf(&f32_file, &packed, ty, 17).unwrap();
    ModelBundle::open(&packed).unwrap()
}

/// Every packed type, prefill and decode: close to the same file dequantized to f32 and run by
/// burn (8-bit activations are the only difference), with the same top token at nearly every
/// step. The engine keeps the file's bytes: its weights occupy the file's tensor bytes.
#[test]
fn packed_weights_compute_what_the_dequantized_file_computes() {
    for ty in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K] {
        let dir = tempfile::tempdir().unwrap();
        let bundle = packed_file(dir.path(), ty);
        let reference = run(&burn_model(&bundle), &bundle.config, PROMPT, DECODE);
        let cpu = bundle.load_cpu(|_, _| {}).unwrap();
        let got = run(&cpu, &bundle.config, PROMPT, DECODE);
        let worst = worst_relative(&got, &reference);
        eprintln!("{ty}: worst relative difference {worst}");
        assert!(worst < 0.05, "{ty}: logits differ by {worst} of the largest");
        let argmax = |v: &[f32]| v.iter().enumerate().fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b }).0;
        let same = got.iter().zip(&reference).filter(|(a, b)| argmax(a) == argmax(b)).count();
        assert!(same + 1 >= got.len(), "{ty}: top token equal at {same} of {} steps", got.len());
        let file = headroom_model::gguf::GgufFile::open(&bundle.path).unwrap();
        let tensor_bytes: usize = file.tensors.values().map(|t| t.bytes).sum();
        assert_eq!(cpu.weight_bytes(), tensor_bytes, "{ty}: the engine holds other bytes than the file's");
    }
}

/// Types the CPU does not multiply packed (Q5_0 here) load as Q8_0 and still compute what the
/// file says.
#[test]
fn other_types_are_converted_once_and_stay_close() {
    let dir = tempfile::tempdir().unwrap();
    let bundle = packed_file(dir.path(), GgmlType::Q5_0);
    let reference = run(&burn_model(&bundle), &bundle.config, PROMPT, DECODE);
    let cpu = bundle.load_cpu(|_, _| {}).unwrap();
    let worst = worst_relative(&run(&cpu, &bundle.config, PROMPT, DECODE), &reference);
    assert!(worst < 0.05, "logits differ by {worst} of the largest");
}

/// On the real default model (when installed): a prefill of the whole prompt gives the logits
/// that feeding it one token at a time gives — exactly with the scalar kernels (checked in a
/// child process that picks them), and within the 8-bit activations' noise with the SIMD ones,
/// whose prefill tiles add in the reference's order while their decode rows do not (a rounding
/// difference that flips one activation's 8-bit rounding moves the logits by a few percent).
#[test]
fn prefill_equals_token_by_token_on_the_default_model() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("{} is not installed; skipped", path.display());
        return;
    }
    let bundle = ModelBundle::open(&path).unwrap();
    let cpu = bundle.load_cpu(|_, _| {}).unwrap();
    let prompt = bundle.chat_prompt(&[headroom_model::ChatMessage::new("user", "What is the capital of France?")], None).unwrap();
    let mut all = cpu.new_cache(prompt.len());
    let together = cpu.step(&prompt, &mut all);
    let mut one = cpu.new_cache(prompt.len());
    let mut alone = Vec::new();
    for &t in &prompt {
        alone = cpu.step(&[t], &mut one);
    }
    let worst = worst_relative(&[together.clone()], &[alone.clone()]);
    let argmax = |l: &[f32]| l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
    if headroom_model::cpu::dot::Kernels::detect().name == "scalar" {
        assert_eq!(worst, 0.0, "with the scalar kernels, prefill and token-by-token differ by {worst} of the largest logit");
        return;
    }
    assert!(worst < 0.15, "prefill and token-by-token differ by {worst} of the largest logit");
    assert_eq!(argmax(&together), argmax(&alone), "prefill and token-by-token pick different tokens");
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "prefill_equals_token_by_token_on_the_default_model", "--test-threads", "1"])
        .env("HEADROOM_CPU_KERNELS", "scalar")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success() && stdout.contains("1 passed"), "with the scalar kernels: {stdout}{}", String::from_utf8_lossy(&output.stderr));
}
