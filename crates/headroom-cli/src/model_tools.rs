//! `headroom model …`: look inside a model file, and the probes the reference tests compare with
//! llama.cpp and the `gguf` package (tokenization, teacher-forced scores, dequantized tensors).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use headroom_model::gguf::GgufFile;
use headroom_model::ModelBundle;

#[derive(Subcommand)]
pub enum ModelCommand {
    /// What a model is: format, architecture, quantization, size, tokenizer, chat template.
    Inspect {
        #[arg(default_value = "default")]
        model: String,
        #[arg(long)]
        json: bool,
    },
    /// Token ids of each line of stdin (a JSON string per line), one JSON array per line, with the
    /// BOS token where the model adds one and special tokens parsed.
    Tokenize {
        #[arg(default_value = "default")]
        model: String,
    },
    /// Embeddings on the CPU, as `/v1/embeddings` computes them: for each line of stdin (a JSON
    /// string), the mean of its tokens' hidden states after the final norm, length 1 (a JSON
    /// array of floats per line).
    Embed {
        #[arg(default_value = "default")]
        model: String,
    },
    /// Teacher-forced scores on the CPU: for each JSON array of token ids on stdin, the top token
    /// at every position and the negative log-likelihood of the next one (JSON per line).
    Score {
        #[arg(default_value = "default")]
        model: String,
    },
    /// The CPU engine's speed on a model, as scripts/bench-engine.py compares it with llama.cpp:
    /// a prompt of `--prompt-tokens` random tokens, then `--decode-tokens` greedy steps, median of
    /// `--runs` after a warm-up; and this machine's sequential read bandwidth, measured with the
    /// same threads, so decode reads as a share of the memory-bandwidth bound. One JSON object.
    Bench {
        #[arg(default_value = "default")]
        model: String,
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 64)]
        decode_tokens: usize,
        #[arg(long, default_value_t = 3)]
        runs: usize,
        /// Threads (default: every core).
        #[arg(long)]
        threads: Option<usize>,
        /// KV cache precision.
        #[arg(long, value_enum, default_value = "f32")]
        kv: KvArg,
        /// Skip measuring the read bandwidth (no memory-bandwidth bound in the output).
        #[arg(long)]
        no_bandwidth: bool,
        /// Also decode this many sequences at once through a worker's batch (comma-separated),
        /// reporting the aggregate decode tokens/s of each count: `--concurrency 1,2,4,8`.
        #[arg(long, value_delimiter = ',')]
        concurrency: Vec<usize>,
    },
    /// Decode speed as the GPU's share of the layers varies: for each count of `--gpu-layers`
    /// (0: the CPU engine alone; all: the GPU engine alone; between: a split), one greedy
    /// generation's median tokens/s beside each device's bytes and the plan's bandwidth-bound
    /// prediction. `--device sim` runs the GPU's layers in burn's ndarray backend, as the sim
    /// GPU does (its speed is the CPU's, not a GPU's); `cuda` on CUDA device 0. One JSON object
    /// per count.
    SplitBench {
        #[arg(default_value = "default")]
        model: String,
        /// Layer counts on the GPU (comma-separated; default: 0, a quarter, half, all).
        #[arg(long, value_delimiter = ',')]
        gpu_layers: Vec<u32>,
        #[arg(long, default_value = "sim")]
        device: String,
        #[arg(long, default_value_t = 32)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 32)]
        decode_tokens: usize,
        #[arg(long, default_value_t = 3)]
        runs: usize,
    },
    /// Writes one tensor of a GGUF file, dequantized, as little-endian f32 (for comparing with
    /// other readers).
    Tensor {
        file: PathBuf,
        name: String,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Clone, Copy, clap::ValueEnum)]
pub enum KvArg {
    F32,
    F16,
}

pub fn run(command: ModelCommand) -> Result<()> {
    match command {
        ModelCommand::Bench { model, prompt_tokens, decode_tokens, runs, threads, kv, no_bandwidth, concurrency } => {
            if let Some(n) = threads {
                rayon::ThreadPoolBuilder::new().num_threads(n).build_global().context("cannot size the thread pool")?;
            }
            let shape = BenchShape { prompt_tokens, decode_tokens, runs: runs.max(1), concurrency };
            bench(&crate::open_bundle(&model)?, &shape, kv, !no_bandwidth)
        }
        ModelCommand::Inspect { model, json } => inspect(&crate::open_bundle(&model)?, json),
        ModelCommand::SplitBench { model, gpu_layers, device, prompt_tokens, decode_tokens, runs } => {
            split_bench(&crate::open_bundle(&model)?, &gpu_layers, &device, prompt_tokens, decode_tokens, runs.max(1))
        }
        ModelCommand::Tokenize { model } => {
            let bundle = crate::open_bundle(&model)?;
            let mut out = std::io::stdout().lock();
            for line in std::io::stdin().lock().lines() {
                let text: String = serde_json::from_str(&line?).context("each line of stdin must be a JSON string")?;
                let ids = bundle.encode(&text, true)?;
                writeln!(out, "{}", serde_json::to_string(&ids)?)?;
            }
            Ok(())
        }
        ModelCommand::Embed { model } => {
            let bundle = crate::open_bundle(&model)?;
            let model = bundle.load_cpu(|_, _| {})?;
            let mut out = std::io::stdout().lock();
            for line in std::io::stdin().lock().lines() {
                let text: String = serde_json::from_str(&line?).context("each line of stdin must be a JSON string")?;
                let request = headroom_model::GenerateRequest::embedding(bundle.encode(&text, true)?);
                let session = headroom_model::Session::start(&model, &bundle, &request, &headroom_model::CancelToken::new())?;
                let vector = session.embedding().context("the embedding did not finish")?;
                writeln!(out, "{}", serde_json::to_string(&vector)?)?;
            }
            Ok(())
        }
        ModelCommand::Score { model } => {
            let bundle = crate::open_bundle(&model)?;
            // The CPU engine, as the CPU worker runs it (packed weights, quantized activations).
            let model = bundle.load_cpu(|_, _| {})?;
            let mut out = std::io::stdout().lock();
            for line in std::io::stdin().lock().lines() {
                let tokens: Vec<u32> = serde_json::from_str(&line?).context("each line of stdin must be a JSON array of token ids")?;
                let scores = headroom_model::teacher_forced(&model, &bundle.config, &tokens)?;
                writeln!(out, "{}", serde_json::to_string(&scores)?)?;
            }
            Ok(())
        }
        ModelCommand::Tensor { file, name, out } => {
            let gguf = GgufFile::open(&file)?;
            let (values, _) = gguf.read_f32(&name)?;
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            std::fs::write(&out, bytes).with_context(|| format!("cannot write {}", out.display()))?;
            Ok(())
        }
    }
}

fn inspect(bundle: &ModelBundle, json: bool) -> Result<()> {
    let config = &bundle.config;
    let mut by_type = serde_json::Map::new();
    if bundle.format.container == "gguf" {
        let file = GgufFile::open(&bundle.path)?;
        for (ty, bytes) in file.bytes_by_type() {
            by_type.insert(ty.to_string(), bytes.into());
        }
    }
    let summary = serde_json::json!({
        "path": bundle.path.display().to_string(),
        "name": bundle.name(),
        "format": bundle.format,
        "architecture": config.model_type,
        "parameters": config.parameter_count(),
        "layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "heads": config.num_attention_heads,
        "kv_heads": config.kv_heads(),
        "context": config.max_position_embeddings,
        "vocab": config.vocab_size,
        "file_bytes": bundle.weight_file_bytes,
        "bytes_by_type": by_type,
        "eos_ids": bundle.eos_ids,
        "chat_template": bundle.template.is_some(),
        "hash": bundle.hash,
    });
    if json {
        println!("{}", serde_json::to_string_pretty(&summary)?);
        return Ok(());
    }
    println!("model         {} ({})", bundle.name(), bundle.path.display());
    println!("format        {} {}", bundle.format.container, bundle.format.quantization);
    println!(
        "architecture  {}: {} parameters, {} layers, hidden {}, {} heads ({} KV), context {}",
        config.model_type,
        config.parameter_count(),
        config.num_hidden_layers,
        config.hidden_size,
        config.num_attention_heads,
        config.kv_heads(),
        config.max_position_embeddings
    );
    println!("file          {:.1} MB", bundle.weight_file_bytes as f64 / 1e6);
    for (ty, bytes) in &by_type {
        println!("  {ty:<6} {:>8.1} MB", bytes.as_u64().unwrap_or(0) as f64 / 1e6);
    }
    println!("tokenizer     {} tokens, end ids {:?}", config.vocab_size, bundle.eos_ids);
    println!("chat template {}", if bundle.template.is_some() { "yes" } else { "none (plain completions only)" });
    println!("bundle        {}", bundle.short_hash());
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median prefill and decode tokens/s of `runs` greedy generations after a warm-up (on CUDA,
/// with the GPU's memory in use while the model is loaded, from NVML).
fn generation_speed<M: headroom_model::Decoder>(model: &M, bundle: &ModelBundle, request: &headroom_model::GenerateRequest, runs: usize) -> Result<(f64, f64)> {
    let cancel = headroom_model::CancelToken::new();
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for run in 0..=runs {
        let g = headroom_model::generate(model, bundle, request, &cancel, |_| {})?;
        if run > 0 {
            prefill.push(g.prefill_tokens_per_s());
            decode.push(g.decode_tokens_per_s());
        }
    }
    Ok((median(prefill), median(decode)))
}

fn split_bench(bundle: &ModelBundle, counts: &[u32], device: &str, prompt_tokens: usize, decode_tokens: usize, runs: usize) -> Result<()> {
    use headroom_model::{CpuBackend, GenerateRequest, SamplingParams, SplitModel};
    let layers = bundle.config.num_hidden_layers as u32;
    let counts = if counts.is_empty() { vec![0, layers / 4, layers / 2, layers] } else { counts.to_vec() };
    if let Some(n) = counts.iter().find(|&&n| n > layers) {
        anyhow::bail!("--gpu-layers {n}: {} has {layers} layers; give counts from 0 to {layers}", bundle.name());
    }
    let label = match device {
        "sim" => "sim".to_string(),
        "cuda" => "cuda:0".to_string(),
        other => anyhow::bail!("--device {other}: use sim (burn's ndarray backend) or cuda"),
    };
    let vocab = bundle.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|i| 1000.min(vocab / 2) + (i * 7919) % (vocab / 2)).collect();
    let mut request = GenerateRequest::new(prompt, decode_tokens, SamplingParams::default());
    request.ignore_eos = true;
    let host = headroom_model::cpu::measure_read_bandwidth();
    let gpu_bandwidth = (device == "cuda").then(|| headroom_model::device::cuda_memory_bandwidth(0)).flatten();
    let gpu_shape = headroom_memory::gpu_shape(bundle, &label);
    let cpu_shape = headroom_memory::ModelShape::for_backend(bundle, "cpu", Default::default());
    let calibration = headroom_memory::planner_for(bundle, "cpu", Default::default()).0.calibration;
    for n in counts {
        // The plan for exactly this count on a GPU with room for anything.
        let inputs = headroom_memory::SplitInputs {
            gpu_usable_bytes: u64::MAX / 4,
            min_context_tokens: (prompt_tokens + decode_tokens) as u64,
            requests: 1,
            prefill_chunk: request.prefill_chunk as u64,
            margin_percent: 0.0,
            host_bandwidth: Some(host),
            gpu_bandwidth,
        };
        let plan = headroom_memory::plan_split(&gpu_shape, &cpu_shape, &calibration, inputs, headroom_memory::GpuLayers::Count(n)).map_err(anyhow::Error::msg)?;
        let (prefill, decode, vram) = match (device, n) {
            (_, 0) => {
                let (p, d) = generation_speed(&bundle.load_cpu(|_, _| {})?, bundle, &request, runs)?;
                (p, d, None)
            }
            ("sim", n) if n == layers => {
                let (p, d) = generation_speed(&bundle.load::<CpuBackend>(&Default::default(), |_, _| {})?, bundle, &request, runs)?;
                (p, d, None)
            }
            ("sim", n) => {
                let (p, d) = generation_speed(&SplitModel::<CpuBackend>::load(bundle, n as usize, &Default::default(), burn::tensor::DType::F32)?, bundle, &request, runs)?;
                (p, d, None)
            }
            (_, n) => cuda_speed(bundle, n, &request, runs)?,
        };
        println!(
            "{}",
            serde_json::json!({
                "model": bundle.name(),
                "device": label,
                "gpu_layers": n,
                "layers": layers,
                "placement": plan.placement(),
                "prefill_tok_s": prefill,
                "decode_tok_s": decode,
                "gpu_weights_bytes": plan.gpu_weights_bytes,
                "cpu_weights_bytes": plan.cpu_weights_bytes,
                "predicted_decode_tok_s": plan.predicted_decode_tok_s,
                "host_read_bandwidth_gb_s": host / 1e9,
                "gpu_bandwidth_gb_s": gpu_bandwidth.map(|b| b / 1e9),
                "vram_used_bytes": vram,
            })
        );
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn cuda_speed(bundle: &ModelBundle, n: u32, request: &headroom_model::GenerateRequest, runs: usize) -> Result<(f64, f64, Option<u64>)> {
    if let headroom_model::device::CudaProbe::Unavailable { reason } = headroom_model::device::probe_cuda() {
        anyhow::bail!("--device cuda: {reason}");
    }
    let device = burn_cuda::CudaDevice::new(0);
    let vram = || headroom_memory::observe::gpu_memory(0).map(|m| m.used_bytes);
    if n == bundle.config.num_hidden_layers as u32 {
        let model = bundle.load_as::<burn_cuda::Cuda<f32>>(&device, bundle.gpu_matrix_dtype(), |_, _| {})?;
        let (p, d) = generation_speed(&model, bundle, request, runs)?;
        return Ok((p, d, vram()));
    }
    let model = headroom_model::SplitModel::<burn_cuda::Cuda<f32>>::load(bundle, n as usize, &device, bundle.gpu_matrix_dtype())?;
    let (p, d) = generation_speed(&model, bundle, request, runs)?;
    Ok((p, d, vram()))
}

#[cfg(not(feature = "cuda"))]
fn cuda_speed(_: &ModelBundle, _: u32, _: &headroom_model::GenerateRequest, _: usize) -> Result<(f64, f64, Option<u64>)> {
    anyhow::bail!("--device cuda: this headroom was built without the `cuda` feature")
}

struct BenchShape {
    prompt_tokens: usize,
    decode_tokens: usize,
    runs: usize,
    /// Sequence counts decoded together.
    concurrency: Vec<usize>,
}

fn bench(bundle: &ModelBundle, shape: &BenchShape, kv: KvArg, measure_bandwidth: bool) -> Result<()> {
    use headroom_memory::observe::{process_resident, reset_resident_peak};
    let BenchShape { prompt_tokens, decode_tokens, runs, .. } = *shape;
    use headroom_model::{GenerateRequest, SamplingParams};
    let kv_precision = match kv {
        KvArg::F32 => headroom_model::KvPrecision::F32,
        KvArg::F16 => headroom_model::KvPrecision::F16,
    };
    // What the process holds before the model: its code, the thread pool, the tokenizer.
    let before = process_resident();
    let peak_reset = reset_resident_peak();
    let started = std::time::Instant::now();
    let mut model = bundle.load_cpu(|_, _| {})?;
    let load_s = started.elapsed().as_secs_f64();
    model.kv_precision = kv_precision;
    let vocab = bundle.config.vocab_size as u32;
    // Fixed pseudo-random ids away from the special tokens at the start of most vocabularies.
    let prompt: Vec<u32> = (0..prompt_tokens as u32).map(|i| 1000.min(vocab / 2) + (i * 7919) % (vocab / 2)).collect();
    let mut request = GenerateRequest::new(prompt, decode_tokens, SamplingParams::default());
    request.prefill_chunk = prompt_tokens;
    request.ignore_eos = true;
    let (prefill_tok_s, decode_tok_s) = generation_speed(&model, bundle, &request, runs)?;
    // Resident memory the model and its requests added (measured before the bandwidth test's
    // buffer), against what admission predicts for this request on the CPU: weights as loaded,
    // KV cache at this precision, calibrated workspace.
    let after = process_resident();
    let (planner, calibration) = headroom_memory::planner_for(
        bundle,
        "cpu",
        headroom_memory::MemoryConfig { cpu_kv_cache: kv_precision, ..Default::default() },
    );
    let footprint = planner.footprint(headroom_memory::RequestShape {
        prompt_tokens: prompt_tokens as u64,
        max_tokens: decode_tokens as u64,
        prefill_chunk: prompt_tokens as u64,
    });
    let predicted_resident = footprint.weights_bytes + footprint.predicted_peak_bytes();
    let resident = match (before, after, peak_reset) {
        (Some(b), Some(a), true) => Some(a.peak_bytes.saturating_sub(b.now_bytes)),
        _ => None,
    };
    let mut concurrent = Vec::new();
    for &n in &shape.concurrency {
        let mut rates = Vec::new();
        for run in 0..=runs {
            let rate = headroom_model::batch::decode_throughput(&model, bundle, &request, n)?;
            if run > 0 {
                rates.push(rate);
            }
        }
        concurrent.push((n, median(rates)));
    }
    let bandwidth = measure_bandwidth.then(headroom_model::cpu::measure_read_bandwidth);
    // A decode step reads every weight once (the embedding only for its one row, unless it is
    // also the output head).
    let weight_bytes = model.bytes_read_per_token() as f64;
    let bound_tok_s = bandwidth.map(|b| b / weight_bytes);
    let out = serde_json::json!({
        "engine": "headroom",
        "model": bundle.path.display().to_string(),
        "quantization": bundle.format.quantization,
        "kernels": headroom_model::cpu::dot::Kernels::detect().name,
        "threads": rayon::current_num_threads(),
        "kv": match kv { KvArg::F32 => "f32", KvArg::F16 => "f16" },
        "load_s": load_s,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": decode_tok_s,
        "bytes_read_per_token": weight_bytes,
        "weight_bytes": model.weight_bytes(),
        "read_bandwidth_gb_s": bandwidth.map(|b| b / 1e9),
        "bandwidth_bound_tok_s": bound_tok_s,
        "share_of_bound": bound_tok_s.map(|b| decode_tok_s / b),
        "concurrent": concurrent.iter().map(|&(n, tok_s)| serde_json::json!({
            "sequences": n,
            "decode_tok_s": tok_s,
            "per_sequence_tok_s": tok_s / n as f64,
            // A step reads the weights once for every sequence.
            "bandwidth_bound_tok_s": bound_tok_s.map(|b| b * n as f64),
        })).collect::<Vec<_>>(),
        "resident_bytes": resident,
        "predicted_resident_bytes": predicted_resident,
        "resident_error_percent": resident.map(|r| (predicted_resident as f64 - r as f64) / r as f64 * 100.0),
        "calibration": calibration.source,
    });
    println!("{out}");
    Ok(())
}

