//! `headroom plan` and `headroom bench memory`: the memory model's breakdown and decision for one
//! request, and its accuracy against the real peak allocation measured on CPU.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use headroom_memory::footprint::human_bytes;
use headroom_memory::observe::{gpu_memory, host_memory};
use headroom_memory::{
    plan_model_split, planner_for, Allowances, Bandwidths, Budget, Calibration, CalibrationEntry, CalibrationFile,
    CountingAllocator, MemoryConfig, ModelShape, Planner, RequestShape, WorkspaceSample, MIB,
};
use headroom_model::{generate, CancelToken, CpuModel, GenerateRequest, ModelBundle, SamplingParams};

#[global_allocator]
pub static ALLOCATOR: CountingAllocator = CountingAllocator::new();

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    #[arg(long)]
    pub prompt_tokens: u64,
    #[arg(long)]
    pub max_tokens: u64,
    #[arg(long, default_value_t = 256)]
    pub prefill_chunk: u64,
    /// Plan for a GPU of this size instead of the one NVML reports.
    #[arg(long)]
    pub vram_total_mib: Option<u64>,
    /// Free VRAM to assume (default: NVML's reading, or all of it with --vram-total-mib).
    #[arg(long)]
    pub vram_free_mib: Option<u64>,
    #[arg(long)]
    pub vram_reserve_mib: Option<u64>,
    /// The client accepts a smaller max_tokens.
    #[arg(long)]
    pub allow_shrink: bool,
    /// Transformer layers on the GPU: `auto` (as many as fit) or a count (default: the
    /// `[memory] gpu_layers` setting).
    #[arg(long)]
    pub gpu_layers: Option<headroom_memory::GpuLayers>,
    /// Requests guaranteed the split's minimum context on the GPU at once. `headroom serve`
    /// plans for one; more run there as memory allows (admission queues or redirects the rest).
    #[arg(long, default_value_t = 1)]
    pub concurrency: u64,
    /// The GPU's memory bandwidth in GB/s for the split's speed estimate (default: the
    /// driver's figure for GPU 0; none without a GPU).
    #[arg(long)]
    pub gpu_bandwidth_gbs: Option<f64>,
    /// The host's read bandwidth in GB/s for that estimate (default: measured, ~2 s).
    #[arg(long)]
    pub host_bandwidth_gbs: Option<f64>,
    #[arg(long)]
    pub json: bool,
}

pub fn plan(bundle: &ModelBundle, mut config: MemoryConfig, args: PlanArgs) -> Result<()> {
    if let Some(mib) = args.vram_reserve_mib {
        config.vram_reserve_mib = Some(mib);
    }
    // A GPU plan uses the CUDA calibration when one was measured; a CPU-only plan the CPU one.
    let gpu_reading = gpu_memory(0);
    let backend = if args.vram_total_mib.is_some() || gpu_reading.is_some() { "cuda" } else { "cpu" };
    let (planner, calibration) = planner_for(bundle, backend, config.clone());
    let shape = planner.shape.clone();
    let request = RequestShape {
        prompt_tokens: args.prompt_tokens,
        max_tokens: args.max_tokens,
        prefill_chunk: args.prefill_chunk,
    };
    let gpu = match (args.vram_total_mib, gpu_reading) {
        (Some(total_mib), _) => Some(Budget {
            total_bytes: total_mib * MIB,
            reserve_bytes: config.vram_reserve_bytes(total_mib * MIB),
            weights_bytes: shape.weights_bytes(),
            held_bytes: 0,
            observed_free_bytes: args.vram_free_mib.map(|f| f * MIB),
        }),
        (None, Some(reading)) => Some(Budget {
            total_bytes: reading.total_bytes,
            reserve_bytes: config.vram_reserve_bytes(reading.total_bytes),
            weights_bytes: shape.weights_bytes(),
            held_bytes: 0,
            observed_free_bytes: Some(
                args.vram_free_mib
                    .map(|f| f * MIB)
                    .unwrap_or(reading.free_bytes),
            ),
        }),
        (None, None) => None,
    };
    let host = host_memory().context("cannot read host memory")?;
    let host_budget = Budget {
        total_bytes: host.total_bytes,
        reserve_bytes: config.host_reserve_bytes(host.total_bytes),
        // A CPU worker would load its own copy of the weights, as the CPU engine holds them
        // (a GGUF file's packed tensors), whatever the GPU holds.
        weights_bytes: bundle.cpu_weight_bytes,
        held_bytes: 0,
        observed_free_bytes: Some(host.available_bytes.saturating_sub(bundle.cpu_weight_bytes)),
    };
    let footprint = planner.footprint(request);
    let allow = Allowances {
        shrink: args.allow_shrink,
        ..Allowances::default()
    };
    let decision = planner.decide(request, allow, gpu.as_ref(), &host_budget, |_| None);
    let split = gpu.as_ref().map(|g| {
        // What the model may take: free VRAM (other programs' use out) less the reserve.
        let usable = g.observed_free_bytes.unwrap_or(g.total_bytes).min(g.total_bytes).saturating_sub(g.reserve_bytes);
        let config = MemoryConfig { gpu_layers: args.gpu_layers.unwrap_or(config.gpu_layers), ..config.clone() };
        let bandwidths = Bandwidths {
            host: Some(args.host_bandwidth_gbs.map_or_else(headroom_model::cpu::measure_read_bandwidth, |g| g * 1e9)),
            gpu: args.gpu_bandwidth_gbs.map(|g| g * 1e9).or_else(|| headroom_model::device::cuda_memory_bandwidth(0)),
        };
        plan_model_split(bundle, "cuda:0", &config, usable, args.concurrency, args.prefill_chunk, bandwidths)
    });
    let split = split
        .transpose()
        .map_err(|e| anyhow::anyhow!("{e}. Set `gpu_layers` in [memory] (or pass --gpu-layers) to a count that fits, or to \"auto\"."))?;
    let held_as = serde_json::json!({
        "gpu": (backend == "cuda").then(|| format!("{:?}", bundle.gpu_matrix_dtype())),
        "cpu": format!("{} {}", bundle.format.container, bundle.format.quantization),
    });
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "model": bundle.path.display().to_string(),
                "bundle_hash": bundle.hash,
                "stored": bundle.format,
                "held_as": held_as,
                "shape": shape,
                "request": request,
                "footprint": footprint,
                "calibration": calibration,
                "request_bytes": footprint.request_bytes(),
                "gpu_budget": gpu,
                "gpu_available_bytes": gpu.map(|g| g.available_bytes()),
                "host_budget": host_budget,
                "admission": decision,
                "split": split,
            }))?
        );
        return Ok(());
    }
    println!("model      {} ({} parameters, bundle {})", bundle.path.display(), shape.parameters, bundle.short_hash());
    if backend == "cuda" {
        println!(
            "weights    {} on the GPU (matrices {:?}, norms f32); {} on the CPU (the file's {} tensors)",
            human_bytes(footprint.weights_bytes),
            bundle.gpu_matrix_dtype(),
            human_bytes(bundle.cpu_weight_bytes),
            bundle.format.quantization
        );
    } else {
        println!("weights    {} on the CPU (the file's {} {} tensors)", human_bytes(footprint.weights_bytes), bundle.format.container, bundle.format.quantization);
    }
    let block_tokens = shape.kv_block_tokens.max(1);
    let (held_blocks, all_blocks) = (footprint.kv_tokens.div_ceil(block_tokens), footprint.tokens.div_ceil(block_tokens));
    if shape.encoder {
        println!("KV cache   none: an encoder reads its {} prompt tokens in one pass and keeps nothing", args.prompt_tokens);
    } else {
        println!(
        "KV cache   {} = {} blocks × {} (a block: {} tokens × {} per token); {} tokens fill {} blocks ({} prompt + {} max_tokens)",
        human_bytes(footprint.kv_bytes),
        held_blocks,
        human_bytes(block_tokens * shape.kv_bytes_per_token()),
        block_tokens,
        human_bytes(shape.kv_bytes_per_token()),
        footprint.tokens,
        all_blocks,
        args.prompt_tokens,
        args.max_tokens
        );
    }
    if held_blocks < all_blocks && !shape.encoder {
        println!(
            "           overcommit {}×: {held_blocks} of the {all_blocks} blocks reserved, the rest taken as written; when none is left the request that started last is preempted and resumes on the CPU, or waits for the GPU if it does not allow the CPU (headroom serve overcommits on the sim GPU only for now)",
            config.kv_overcommit
        );
    }
    println!(
        "workspace  {} (prefill chunk {}; {})",
        human_bytes(footprint.workspace_bytes),
        if shape.encoder { args.prompt_tokens } else { args.prefill_chunk },
        calibration.source
    );
    println!("margin     {} ({}%)", human_bytes(footprint.margin_bytes), config.fragmentation_margin_percent);
    println!("request    {}", human_bytes(footprint.request_bytes()));
    match &gpu {
        Some(g) => println!(
            "GPU        total {}, reserve {}, weights {}, available {}",
            human_bytes(g.total_bytes),
            human_bytes(g.reserve_bytes),
            human_bytes(g.weights_bytes),
            human_bytes(g.available_bytes())
        ),
        None => println!("GPU        none found (pass --vram-total-mib to plan for one)"),
    }
    println!(
        "host       available {}, reserve {}, free for CPU requests {}",
        human_bytes(host.available_bytes),
        human_bytes(host_budget.reserve_bytes),
        human_bytes(host_budget.available_bytes())
    );
    println!("decision   {}", serde_json::to_string(&decision)?);
    if let Some(split) = &split {
        println!("placement  {}", split.reason);
        println!(
            "           GPU {} (weights {}, KV cache {}, workspace and margin {}); CPU weights {}, KV cache {}",
            human_bytes(split.gpu_bytes()),
            human_bytes(split.gpu_weights_bytes),
            human_bytes(split.gpu_kv_bytes),
            human_bytes(split.gpu_workspace_bytes + split.gpu_margin_bytes),
            human_bytes(split.cpu_weights_bytes),
            human_bytes(split.cpu_kv_bytes)
        );
        match split.predicted_decode_tok_s {
            Some(rate) => println!("           decode at most {rate:.1} tok/s for one sequence (each part streaming its weights at its device's bandwidth)"),
            None => println!("           no speed estimate: no GPU bandwidth (pass --gpu-bandwidth-gbs)"),
        }
    }
    Ok(())
}

/// Runs one request on CPU and returns the peak bytes allocated above the level before it.
/// `decode_cap` stops generation after that many tokens: the KV cache is allocated for
/// prompt + max_tokens before the first token, so it is in the peak either way; only the decode
/// workspace's slow growth with position (heads × position × 4 bytes a buffer) is not reached.
fn measure_peak(
    model: &CpuModel,
    bundle: &ModelBundle,
    prompt: usize,
    max_tokens: usize,
    chunk: usize,
    decode_cap: Option<usize>,
) -> Result<u64> {
    let mut bundle = bundle.clone();
    bundle.eos_ids.clear(); // run exactly max_tokens steps
    let tokens: Vec<u32> = (0..prompt).map(|i| (i % 200) as u32 + 3).collect();
    let mut request = GenerateRequest::new(tokens, max_tokens, SamplingParams::default());
    request.prefill_chunk = chunk;
    let before = ALLOCATOR.current_bytes();
    ALLOCATOR.reset_peak();
    let cancel = CancelToken::new();
    let generation = generate(model, &bundle, &request, &cancel, |event| {
        if decode_cap.is_some_and(|cap| event.index + 1 >= cap) {
            cancel.cancel();
        }
    })?;
    let peak = ALLOCATOR.peak_bytes().saturating_sub(before);
    drop(generation);
    Ok(peak)
}

/// Measures workspace at a few (chunk, length) points that the accuracy grid does not use, and
/// fits the calibration factors to them.
pub fn calibrate(model: &CpuModel, bundle: &ModelBundle, shape: &ModelShape) -> Result<Calibration> {
    Ok(measure_calibration(model, bundle, shape)?.0)
}

fn measure_calibration(
    model: &CpuModel,
    bundle: &ModelBundle,
    shape: &ModelShape,
) -> Result<(Calibration, Vec<WorkspaceSample>)> {
    let context = shape.context as usize;
    // Small points find the floor (a stage that does not grow with the request); the large
    // ones put attention's score matrices above it so its growth can be fitted.
    let points: Vec<(usize, usize)> = [(24, 24), (40, 160), (96, 96), (200, 200), (72, 400), (128, 700), (192, 1000), (256, 1000)]
        .into_iter()
        .filter(|&(_, l)| l < context)
        .collect();
    let mut samples = Vec::new();
    for (chunk, len) in points {
        let peak = measure_peak(model, bundle, len, 1, chunk, None)? as f64;
        let tokens = (len + 1) as u64;
        // The cache as the engine allocates it (whole key blocks).
        let kv = headroom_model::cpu::CpuCache::bytes(&bundle.config, tokens as usize, model.kv_precision) as f64;
        let rope = (2 * tokens * shape.head_dim * shape.dtype_bytes) as f64;
        samples.push(WorkspaceSample {
            chunk: chunk as u64,
            // Attention spans the whole cache: prompt and the one generated token.
            attended: tokens,
            workspace_bytes: peak - kv - rope,
        });
    }
    Ok((Calibration::fit(shape, &samples), samples))
}

/// `headroom calibrate`: measures the CPU engine's workspace for this model and stores it in the
/// model folder, where workers and `headroom plan` find it.
pub fn calibrate_command(bundle: &ModelBundle, dry_run: bool) -> Result<()> {
    if ALLOCATOR.current_bytes() == 0 {
        bail!("the counting allocator is not installed in this binary");
    }
    let mut model = bundle.load_cpu(|_, _| {})?;
    // Admission reserves a request's whole cache: measure the workspace beside all of it.
    model.preallocate_kv = true;
    let shape = ModelShape::from_config(&bundle.config);
    let started = Instant::now();
    let (calibration, samples) = measure_calibration(&model, bundle, &shape)?;
    println!("{:>6} {:>9} {:>12} {:>12} {:>7}", "chunk", "attended", "measured", "fitted", "error");
    let fit_error_percent = samples
        .iter()
        .map(|s| {
            let predicted = calibration.workspace_bytes(&shape, s.chunk, s.attended) as f64;
            let error = (predicted - s.workspace_bytes) / s.workspace_bytes.max(1.0) * 100.0;
            println!("{:>6} {:>9} {:>12} {:>12} {:>6.1}%", s.chunk, s.attended, human_bytes(s.workspace_bytes as u64), human_bytes(predicted as u64), error);
            error.abs()
        })
        .fold(0.0, f64::max);
    println!(
        "measured {} points in {:.1} s: {calibration:?}, fit within {fit_error_percent:.1}%",
        samples.len(),
        started.elapsed().as_secs_f64()
    );
    if dry_run {
        return Ok(());
    }
    let entry = CalibrationEntry {
        bundle_hash: bundle.hash.clone(),
        calibration,
        samples,
        fit_error_percent,
        headroom_version: env!("CARGO_PKG_VERSION").to_string(),
        measured_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let path = CalibrationFile::update(&bundle.path, "cpu", entry).map_err(anyhow::Error::msg)?;
    println!("wrote the cpu entry of {}", path.display());
    Ok(())
}

pub fn accuracy(
    bundle: &ModelBundle,
    label: &str,
    prompts: &[u64],
    max_tokens: &[u64],
    chunk: u64,
    decode_cap: Option<usize>,
) -> Result<serde_json::Value> {
    let mut model = bundle.load_cpu(|_, _| {})?;
    // Admission reserves a request's whole cache: measure the workspace beside all of it.
    model.preallocate_kv = true;
    let shape = ModelShape::from_config(&bundle.config);
    // The stored calibration is what admission uses, so that is what is checked; a model without
    // one is calibrated here, on points the grid does not use.
    let stored = headroom_memory::calibration::resolve(&bundle.path, &bundle.hash, "cpu");
    let (calibration, source) = if stored.measured {
        (stored.calibration, stored.source)
    } else {
        let started = Instant::now();
        let fitted = calibrate(&model, bundle, &shape)?;
        (fitted, format!("fitted now in {:.1} s", started.elapsed().as_secs_f64()))
    };
    let planner = Planner::new(shape.clone(), calibration, MemoryConfig::default());
    println!("\n{label}: {} parameters; calibration {calibration:?} ({source})", shape.parameters);
    println!("{:>8} {:>10} {:>14} {:>14} {:>8}", "prompt", "max_tok", "predicted", "measured", "error");
    let mut rows = Vec::new();
    let mut worst: f64 = 0.0;
    for &p in prompts {
        for &m in max_tokens {
            if p + m > shape.context {
                continue;
            }
            let request = RequestShape { prompt_tokens: p, max_tokens: m, prefill_chunk: chunk };
            let predicted = planner.footprint(request).predicted_peak_bytes();
            let measured = measure_peak(&model, bundle, p as usize, m as usize, chunk as usize, decode_cap)?;
            let error = (predicted as f64 - measured as f64) / measured as f64 * 100.0;
            worst = worst.max(error.abs());
            println!(
                "{p:>8} {m:>10} {:>14} {:>14} {error:>+7.1}%",
                human_bytes(predicted),
                human_bytes(measured)
            );
            rows.push(serde_json::json!({
                "prompt_tokens": p, "max_tokens": m, "predicted_bytes": predicted,
                "measured_bytes": measured, "error_percent": error,
            }));
        }
    }
    println!("worst error {worst:.1}% over {} points", rows.len());
    if let Some(cap) = decode_cap {
        println!("(generation stopped after {cap} tokens per point; the KV cache for prompt + max_tokens is allocated before the first)");
    }
    Ok(serde_json::json!({
        "model": label, "parameters": shape.parameters, "calibration": calibration, "calibration_source": source,
        "prefill_chunk": chunk, "rows": rows, "worst_error_percent": worst, "decode_cap": decode_cap,
    }))
}

pub fn bench_memory(bundle: &ModelBundle, include_100m: bool, json_out: Option<&std::path::Path>) -> Result<()> {
    if ALLOCATOR.current_bytes() == 0 {
        bail!("the counting allocator is not installed in this binary");
    }
    let mut reports = vec![accuracy(bundle, "default", &[16, 64, 256, 512], &[16, 128, 256, 480], 128, None)?];
    if include_100m {
        let tmp = tempfile_dir()?;
        headroom_model::fixture::write_random_folder(
            &tmp,
            &headroom_model::fixture::config_100m(),
            7,
            headroom_model::StoreDtype::F32,
        )?;
        let big = ModelBundle::open(&tmp)?;
        // Decoding 1,000 tokens of a 100M model on two cores takes many minutes a point.
        reports.push(accuracy(&big, "random ~100M", &[16, 128, 512, 1024], &[16, 256, 1024], 256, Some(32))?);
        let _ = std::fs::remove_dir_all(&tmp);
    }
    if let Some(path) = json_out {
        std::fs::write(path, serde_json::to_string_pretty(&reports)?)?;
    }
    Ok(())
}

fn tempfile_dir() -> Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("headroom-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}
