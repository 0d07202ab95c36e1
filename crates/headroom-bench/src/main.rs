//! Side-by-side engine benchmark: Headroom's burn Llama against candle-transformers' Llama on the
//! same safetensors, in one process, on the same prompt. Prints prefill and decode tokens/s and
//! their ratios, and checks that both engines pick the same greedy tokens. Never fails on a time.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor as CTensor};
use candle_nn::VarBuilder;
use clap::Parser;
use headroom_model::fixture::{config_100m, config_1b, write_random_folder};
use headroom_model::sampler::argmax;
use headroom_model::{
    generate, CancelToken, GenerateRequest, ModelBundle, SamplingParams, StoreDtype,
};

#[derive(Parser)]
#[command(about = "Headroom engine vs candle-transformers, side by side")]
struct Args {
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Timed runs per engine and model (after one warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Extra model folders to include.
    #[arg(long)]
    model: Vec<PathBuf>,
    /// Skip the ~100M-parameter random model.
    #[arg(long)]
    skip_100m: bool,
    /// Also write and run a random ~1.24B-parameter model in Llama 3.2 1B's shape, stored f16
    /// (the GPU's bandwidth target; about 2.5 GB written to a temporary folder).
    #[arg(long)]
    random_1b: bool,
    /// Run Headroom on CUDA only: no CPU engine, no candle (with --cuda; for models too slow to
    /// run on the CPU in a device's time).
    #[arg(long, requires = "cuda")]
    only_cuda: bool,
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also run Headroom's engine on CUDA device 0 (needs the `cuda` feature and a driver) and
    /// report its speed against the CPU engine's and whether its greedy tokens match.
    #[arg(long)]
    cuda: bool,
    /// Sequences decoded together through a worker's batch (comma-separated): the aggregate
    /// decode tokens/s of each count, for Headroom's CPU engine and (with --cuda) on CUDA.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
    concurrency: Vec<usize>,
}

#[derive(Debug, Clone, serde::Serialize)]
struct EngineRun {
    prefill_tok_s: f64,
    decode_tok_s: f64,
    tokens: Vec<u32>,
    /// (sequences, aggregate decode tokens/s) through a worker's batch.
    concurrent: Vec<(usize, f64)>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn prompt_for(bundle: &ModelBundle, n: usize) -> Result<Vec<u32>> {
    let text = "And God said, Let there be light: and there was light. And God saw the light, that it was good. ";
    let mut tokens = Vec::new();
    while tokens.len() < n {
        tokens.extend(bundle.encode(text, false)?);
    }
    tokens.truncate(n);
    Ok(tokens)
}

fn run_headroom<M: headroom_model::Decoder>(
    model: &M,
    bundle: &ModelBundle,
    prompt: &[u32],
    decode: usize,
    runs: usize,
    concurrency: &[usize],
) -> Result<EngineRun> {
    let mut request = GenerateRequest::new(prompt.to_vec(), decode, SamplingParams::default());
    request.prefill_chunk = prompt.len();
    // Random weights may emit an EOS id early; the benchmark wants a fixed number of steps.
    let mut bundle = bundle.clone();
    bundle.eos_ids.clear();
    let cancel = CancelToken::new();
    let mut prefill = Vec::new();
    let mut decode_rates = Vec::new();
    let mut tokens = Vec::new();
    for i in 0..=runs {
        let g = generate(model, &bundle, &request, &cancel, |_| {})?;
        if i > 0 {
            prefill.push(g.prefill_tokens_per_s());
            decode_rates.push(g.decode_tokens_per_s());
        }
        tokens = g.tokens;
    }
    let mut concurrent = Vec::new();
    for &n in concurrency {
        let mut rates = Vec::new();
        for i in 0..=runs {
            let rate = headroom_model::batch::decode_throughput(model, &bundle, &request, n)?;
            if i > 0 {
                rates.push(rate);
            }
        }
        concurrent.push((n, median(rates)));
    }
    Ok(EngineRun {
        prefill_tok_s: median(prefill),
        decode_tok_s: median(decode_rates),
        tokens,
        concurrent,
    })
}

/// What memory bandwidth allows a decode step that reads every weight once.
#[derive(Debug, Clone, serde::Serialize)]
struct BandwidthBound {
    weight_bytes: u64,
    bytes_per_s: f64,
    /// Where the bandwidth figure comes from.
    source: &'static str,
}

impl BandwidthBound {
    /// Steps per second at that bandwidth: one sequence's tokens/s, and a batch's steps/s.
    fn steps_per_s(&self) -> f64 {
        self.bytes_per_s / self.weight_bytes as f64
    }
}

/// One line per engine: aggregate decode tokens/s at each sequence count, and its ratio to one;
/// then the bandwidth bound of one sequence.
fn print_concurrent(label: &str, run: &EngineRun, bound: &BandwidthBound) {
    if run.concurrent.is_empty() {
        return;
    }
    let one = run.concurrent.iter().find(|(n, _)| *n == 1).map(|(_, r)| *r);
    let cells: Vec<String> = run
        .concurrent
        .iter()
        .map(|(n, r)| match one {
            Some(one) => format!("{n}: {r:.1} tok/s ({:.2}×)", r / one),
            None => format!("{n}: {r:.1} tok/s"),
        })
        .collect();
    println!("  {label} decode, sequences together: {}", cells.join(", "));
    println!(
        "  {label} bandwidth bound: {:.1} tok/s for one sequence ({:.1} MB of weights per step at {:.1} GB/s, {}); one sequence at {:.1}% of it",
        bound.steps_per_s(),
        bound.weight_bytes as f64 / 1e6,
        bound.bytes_per_s / 1e9,
        bound.source,
        100.0 * run.decode_tok_s / bound.steps_per_s()
    );
}

/// How many greedy tokens two runs share before they first differ.
fn agreeing(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(feature = "cuda")]
fn run_cuda(bundle: &ModelBundle, prompt: &[u32], decode: usize, runs: usize, concurrency: &[usize]) -> Result<EngineRun> {
    if let headroom_model::device::CudaProbe::Unavailable { reason } = headroom_model::device::probe_cuda() {
        anyhow::bail!("--cuda: {reason}");
    }
    let model = bundle.load_as::<burn_cuda::Cuda<f32>>(&burn_cuda::CudaDevice::new(0), bundle.gpu_matrix_dtype(), |_, _| {})?;
    run_headroom(&model, bundle, prompt, decode, runs, concurrency)
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &ModelBundle, _: &[u32], _: usize, _: usize, _: &[usize]) -> Result<EngineRun> {
    anyhow::bail!("--cuda: this headroom-bench was built without the `cuda` feature; build with `--features cuda`")
}

fn run_candle(dir: &Path, prompt: &[u32], decode: usize, runs: usize) -> Result<EngineRun> {
    use candle_transformers::models::llama as cl;
    let device = Device::Cpu;
    let config: cl::LlamaConfig = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let config = config.into_config(false);
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, &device)?
    };
    let model = cl::Llama::load(vb, &config)?;
    let mut prefill = Vec::new();
    let mut decode_rates = Vec::new();
    let mut tokens = Vec::new();
    for i in 0..=runs {
        let mut cache = cl::Cache::new(true, DType::F32, &config, &device)?;
        let started = Instant::now();
        let input = CTensor::new(prompt, &device)?.unsqueeze(0)?;
        let logits = model.forward(&input, 0, &mut cache)?.squeeze(0)?;
        let mut next = argmax(&logits.to_vec1::<f32>()?);
        let prefill_s = started.elapsed().as_secs_f64();
        let mut out = vec![next];
        let started = Instant::now();
        for step in 1..decode {
            let input = CTensor::new(&[next], &device)?.unsqueeze(0)?;
            let logits = model.forward(&input, prompt.len() + step - 1, &mut cache)?.squeeze(0)?;
            next = argmax(&logits.to_vec1::<f32>()?);
            out.push(next);
        }
        let decode_s = started.elapsed().as_secs_f64();
        if i > 0 {
            prefill.push(prompt.len() as f64 / prefill_s);
            decode_rates.push((decode - 1) as f64 / decode_s);
        }
        tokens = out;
    }
    Ok(EngineRun {
        prefill_tok_s: median(prefill),
        decode_tok_s: median(decode_rates),
        tokens,
        concurrent: Vec::new(),
    })
}

/// Headroom's CPU engine and candle on one model: prints their line and the CPU engine's
/// concurrency and bandwidth lines, adds them to `report`, and gives the CPU engine's run.
fn run_cpu_engines(
    bundle: &ModelBundle,
    dir: &Path,
    name: &str,
    prompt: &[u32],
    args: &Args,
    host_bandwidth: f64,
    report: &mut Vec<serde_json::Value>,
) -> Result<EngineRun> {
    let cpu_model = bundle.load_cpu(|_, _| {})?;
    let ours = run_headroom(&cpu_model, bundle, prompt, args.decode_tokens, args.runs, &args.concurrency)?;
    let cpu_bound = BandwidthBound { weight_bytes: cpu_model.weight_bytes() as u64, bytes_per_s: host_bandwidth, source: "host reads, measured" };
    drop(cpu_model);
    let theirs = run_candle(dir, prompt, args.decode_tokens, args.runs)?;
    let agree = agreeing(&ours.tokens, &theirs.tokens);
    println!(
        "{:<26} {:>10} {:>14.1} {:>14.1} {:>14.1} {:>14.1} {:>9.2} {:>9.2} {:>5}/{}",
        name,
        bundle.config.parameter_count(),
        ours.prefill_tok_s,
        theirs.prefill_tok_s,
        ours.decode_tok_s,
        theirs.decode_tok_s,
        ours.prefill_tok_s / theirs.prefill_tok_s,
        ours.decode_tok_s / theirs.decode_tok_s,
        agree,
        args.decode_tokens
    );
    print_concurrent("headroom cpu", &ours, &cpu_bound);
    report.push(serde_json::json!({
        "model": name,
        "cpu_bandwidth_bound": cpu_bound,
        "parameters": bundle.config.parameter_count(),
        "headroom": ours,
        "candle": theirs,
        "prefill_ratio": ours.prefill_tok_s / theirs.prefill_tok_s,
        "decode_ratio": ours.decode_tok_s / theirs.decode_tok_s,
        "greedy_tokens_agreeing": agree,
        "blas": cfg!(feature = "blas"),
    }));
    Ok(ours)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let mut folders: Vec<(String, PathBuf)> = Vec::new();
    let default_dir = headroom_model::bundle::resolve_model(headroom_model::bundle::DEMO_MODEL);
    if default_dir.join("model.safetensors").exists() {
        folders.push(("default (embedded demo)".into(), default_dir));
    }
    let tmp = tempfile::tempdir()?;
    if !args.skip_100m {
        let dir = tmp.path().join("random-100m");
        eprintln!("writing a random-weight ~100M-parameter Llama to {}", dir.display());
        write_random_folder(&dir, &config_100m(), 7, StoreDtype::F32)?;
        folders.push(("random ~100M".into(), dir));
    }
    if args.random_1b {
        let dir = tmp.path().join("random-1b");
        eprintln!("writing a random-weight ~1.24B-parameter Llama (f16) to {}", dir.display());
        write_random_folder(&dir, &config_1b(), 7, StoreDtype::F16)?;
        folders.push(("random ~1.24B f16".into(), dir));
    }
    for m in &args.model {
        folders.push((m.display().to_string(), m.clone()));
    }
    println!(
        "prompt {} tokens, decode {} tokens, median of {} runs, threads: {} cores",
        args.prompt_tokens,
        args.decode_tokens,
        args.runs,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    println!(
        "{:<26} {:>10} {:>14} {:>14} {:>14} {:>14} {:>9} {:>9} {:>8}",
        "model", "params", "hr prefill/s", "cd prefill/s", "hr decode/s", "cd decode/s", "prefill×", "decode×", "agree"
    );
    let host_bandwidth = if args.only_cuda { f64::NAN } else { headroom_model::cpu::measure_read_bandwidth() };
    let mut report = Vec::new();
    for (name, dir) in &folders {
        let bundle = ModelBundle::open(dir).with_context(|| format!("opening {}", dir.display()))?;
        let prompt = prompt_for(&bundle, args.prompt_tokens)?;
        let ours = if args.only_cuda { None } else { Some(run_cpu_engines(&bundle, dir, name, &prompt, &args, host_bandwidth, &mut report)?) };
        if args.cuda {
            let gpu = run_cuda(&bundle, &prompt, args.decode_tokens, args.runs, &args.concurrency)?;
            match &ours {
                Some(ours) => println!(
                    "{:<26} {:>10} {:>14.1} {:>14} {:>14.1} {:>14} {:>9.2} {:>9.2} {:>5}/{}  (headroom on cuda:0; ratios and agreement against headroom on cpu)",
                    format!("  └ cuda:0"),
                    "",
                    gpu.prefill_tok_s,
                    "",
                    gpu.decode_tok_s,
                    "",
                    gpu.prefill_tok_s / ours.prefill_tok_s,
                    gpu.decode_tok_s / ours.decode_tok_s,
                    agreeing(&gpu.tokens, &ours.tokens),
                    args.decode_tokens
                ),
                None => println!(
                    "{:<26} {:>10} {:>14.1} {:>14} {:>14.1}  (headroom on cuda:0)",
                    name,
                    bundle.config.parameter_count(),
                    gpu.prefill_tok_s,
                    "",
                    gpu.decode_tok_s
                ),
            }
            let gpu_bound = BandwidthBound {
                weight_bytes: bundle.gpu_weight_bytes(),
                bytes_per_s: headroom_model::device::cuda_memory_bandwidth(0).unwrap_or(f64::NAN),
                source: "driver's memory clock × bus width",
            };
            print_concurrent("headroom cuda:0", &gpu, &gpu_bound);
            report.push(serde_json::json!({
                "model": name,
                "cuda_bandwidth_bound": gpu_bound,
                "headroom_cuda": gpu,
                "cuda_vs_cpu_prefill": ours.as_ref().map(|o| gpu.prefill_tok_s / o.prefill_tok_s),
                "cuda_vs_cpu_decode": ours.as_ref().map(|o| gpu.decode_tok_s / o.decode_tok_s),
                "cuda_greedy_tokens_agreeing_with_cpu": ours.as_ref().map(|o| agreeing(&gpu.tokens, &o.tokens)),
            }));
        }
    }
    if let Some(path) = args.json {
        std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    }
    Ok(())
}
