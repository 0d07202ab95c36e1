//! The `headroom` command line: parses arguments and calls the libraries (`headroom-service`
//! runs the service and the workers), the pressure harness and the benchmarks.

use std::io::Write;
use std::path::PathBuf;

mod failover;
mod memory;
mod model_tools;
mod pressure;
mod pressure_report;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use headroom_model::bundle::resolve_model;
use headroom_model::device::probe_cuda;
use headroom_model::{
    generate, CancelToken, CpuBackend, GenerateRequest, ModelBundle, SamplingParams,
};

#[derive(Parser)]
#[command(name = "headroom", version, about = "Local LLM service that survives running out of VRAM")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum DeviceChoice {
    Auto,
    Cpu,
    Cuda,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API (and the web UI at /) with a GPU worker, a warm CPU
    /// worker and the request journal.
    Serve(headroom_service::ServeOptions),
    /// The memory-pressure harness: drives a real `headroom serve` through OOMs, driver resets,
    /// cancellations and shrinking VRAM; writes report.json and report.html; fails on a lost
    /// request, a duplicate side effect, host RAM over budget, an unmarked degraded response or
    /// a GPU worker that did not come back.
    Pressure(pressure::PressureArgs),
    /// Generate text from a prompt, streaming tokens to stdout.
    Generate {
        /// `default`, a .gguf file, a Hugging Face folder, or a model name (`kjv-demo`).
        #[arg(long, default_value = "default")]
        model: String,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// 0 is greedy.
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        #[arg(long, default_value_t = 0)]
        top_k: usize,
        #[arg(long, default_value_t = 1.0)]
        top_p: f32,
        #[arg(long, default_value_t = 1.0)]
        repetition_penalty: f32,
        /// Stop when this text appears (repeatable).
        #[arg(long)]
        stop: Vec<String>,
        /// Render the prompt as a user message through the model's chat template.
        #[arg(long)]
        chat: bool,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Auto)]
        device: DeviceChoice,
        /// Print timings and token counts to stderr when done.
        #[arg(long)]
        stats: bool,
        /// Generate max_tokens even past the end-of-sequence token (for benchmarks).
        #[arg(long)]
        ignore_eos: bool,
    },
    /// Look inside a model (`inspect`), and the probes the reference tests compare with llama.cpp.
    Model {
        #[command(subcommand)]
        what: model_tools::ModelCommand,
    },
    /// Predict a request's memory and show the admission decision.
    Plan {
        #[arg(long, default_value = "default")]
        model: String,
        /// A Headroom config file (TOML); its [memory] table sets the policy.
        #[arg(long, env = "HEADROOM_CONFIG")]
        config: Option<PathBuf>,
        #[command(flatten)]
        plan: memory::PlanArgs,
    },
    /// Measure this model's activation workspace on the CPU engine and store it in the model
    /// folder (headroom-calibration.json), where admission reads it.
    Calibrate {
        #[arg(long, default_value = "default")]
        model: String,
        /// Print the calibration without writing it.
        #[arg(long)]
        dry_run: bool,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// Run one worker process (started by the router; speaks the worker protocol on stdio).
    Worker(headroom_service::WorkerArgs),
    /// Train the embedded demo model (tokenizer and weights) from the King James Bible text.
    Train {
        /// Text of `bible gen1:1-rev22:21` (Debian package bible-kjv); `-` reads stdin.
        #[arg(long)]
        corpus: PathBuf,
        #[arg(long, default_value = "models/kjv-demo")]
        out: PathBuf,
        #[arg(long, default_value_t = 80.0)]
        minutes: f64,
        #[arg(long, default_value_t = 100_000)]
        steps: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 4)]
        layers: usize,
        #[arg(long, default_value_t = 256)]
        hidden: usize,
        #[arg(long, default_value_t = 256)]
        seq_len: usize,
        #[arg(long, default_value_t = 16)]
        batch: usize,
    },
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Failover and restore times on the sim GPU: GPU failure → first CPU token of the replayed
    /// request (vs CPU prefill), and GPU worker restore (vs model load).
    Failover {
        #[arg(long, default_value = "default")]
        model: String,
        #[arg(long, default_value_t = 5)]
        runs: usize,
        #[arg(long, default_value_t = 128)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 16)]
        max_tokens: usize,
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Predicted vs measured peak memory of requests on CPU, over a grid of prompt lengths and
    /// max_tokens, for the given model and a ~100M-parameter random one.
    Memory {
        #[arg(long, default_value = "default")]
        model: String,
        #[arg(long)]
        skip_100m: bool,
        #[arg(long)]
        json: Option<PathBuf>,
    },
}

/// Runs one `headroom` command line (`args` starts with the program name).
pub fn run<I, T>(args: I) -> Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    headroom_service::init_logging();
    match Cli::parse_from(args).command {
        Command::Serve(args) => headroom_service::serve(args),
        Command::Pressure(args) => pressure::pressure(args),
        Command::Generate {
            model,
            prompt,
            max_tokens,
            seed,
            temperature,
            top_k,
            top_p,
            repetition_penalty,
            stop,
            chat,
            device,
            stats,
            ignore_eos,
        } => {
            let sampling = SamplingParams {
                temperature,
                top_k,
                top_p,
                repetition_penalty,
                seed,
            };
            let args = GenerateArgs {
                model,
                prompt,
                max_tokens,
                sampling,
                stop,
                chat,
                stats,
                ignore_eos,
            };
            run_generate(args, device)
        }
        Command::Model { what } => model_tools::run(what),
        Command::Plan { model, config, plan } => {
            let bundle = open_bundle(&model)?;
            let config = headroom_memory::MemoryConfig::load(config.as_deref())?;
            memory::plan(&bundle, config, plan)
        }
        Command::Calibrate { model, dry_run } => memory::calibrate_command(&open_bundle(&model)?, dry_run),
        Command::Bench {
            what: BenchCommand::Memory { model, skip_100m, json },
        } => memory::bench_memory(&open_bundle(&model)?, !skip_100m, json.as_deref()),
        Command::Bench {
            what: BenchCommand::Failover { model, runs, prompt_tokens, max_tokens, json },
        } => failover::bench_failover(&resolve_model(&model), runs, prompt_tokens, max_tokens, json.as_deref()),
        Command::Worker(args) => std::process::exit(headroom_service::run_worker(args)?),
        Command::Train {
            corpus,
            out,
            minutes,
            steps,
            seed,
            layers,
            hidden,
            seq_len,
            batch,
        } => run_train(corpus, out, minutes, steps, seed, layers, hidden, seq_len, batch),
    }
}

struct GenerateArgs {
    model: String,
    prompt: String,
    max_tokens: usize,
    sampling: SamplingParams,
    stop: Vec<String>,
    chat: bool,
    stats: bool,
    ignore_eos: bool,
}

pub(crate) fn open_bundle(model: &str) -> Result<ModelBundle> {
    let dir = resolve_model(model);
    ModelBundle::open(&dir).with_context(|| format!("cannot open the model in {}", dir.display()))
}

/// Whether `choice` runs on CUDA: `cuda` insists (and fails with the reason when it cannot),
/// `auto` falls back to the CPU and says why in one line. Never touches burn-cuda without a driver.
fn use_cuda(choice: DeviceChoice) -> Result<bool> {
    Ok(match choice {
        DeviceChoice::Cpu => false,
        DeviceChoice::Cuda | DeviceChoice::Auto => {
            let probe = probe_cuda();
            match (&probe, choice) {
                (headroom_model::device::CudaProbe::Available { .. }, _) => {
                    if !cfg!(feature = "cuda") {
                        if choice == DeviceChoice::Cuda {
                            bail!("this headroom was built without the `cuda` feature; rebuild with default features");
                        }
                        eprintln!("headroom: running on CPU: this build has no CUDA support");
                        false
                    } else {
                        true
                    }
                }
                (headroom_model::device::CudaProbe::Unavailable { reason }, DeviceChoice::Cuda) => {
                    bail!("--device cuda: {reason}; use --device cpu")
                }
                (headroom_model::device::CudaProbe::Unavailable { reason }, _) => {
                    eprintln!("headroom: running on CPU: {reason}");
                    false
                }
            }
        }
    })
}

fn run_generate(args: GenerateArgs, device: DeviceChoice) -> Result<()> {
    let bundle = open_bundle(&args.model)?;
    let use_cuda = use_cuda(device)?;
    if use_cuda {
        #[cfg(feature = "cuda")]
        {
            headroom_worker::kernel_cache::configure();
            let device = burn_cuda::CudaDevice::new(0);
            return generate_on(&bundle, &args, "cuda:0", |on_layer| {
                Ok(bundle.load_as::<burn_cuda::Cuda<f32>>(&device, bundle.gpu_matrix_dtype(), on_layer)?)
            });
        }
    }
    generate_on(&bundle, &args, "cpu", |on_layer| Ok(bundle.load_cpu(on_layer)?))
}

fn generate_on<M: headroom_model::Decoder>(
    bundle: &ModelBundle,
    args: &GenerateArgs,
    device_name: &str,
    load: impl FnOnce(&mut dyn FnMut(usize, usize)) -> Result<M>,
) -> Result<()> {
    let bar = indicatif::ProgressBar::new(bundle.config.num_hidden_layers as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} layers")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(format!("{} on {device_name}", bundle.path.display()));
    let model = load(&mut |done, _| bar.set_position(done as u64))?;
    bar.finish_and_clear();

    let prompt_tokens = if args.chat {
        bundle.chat_prompt(&[headroom_model::ChatMessage::new("user", &args.prompt)], None)?
    } else {
        bundle.encode(&args.prompt, true)?
    };
    let mut request = GenerateRequest::new(prompt_tokens, args.max_tokens, args.sampling.clone());
    request.stop = args.stop.clone();
    request.ignore_eos = args.ignore_eos;
    let cancel = CancelToken::new();
    let mut stdout = std::io::stdout().lock();
    let generation = generate(&model, bundle, &request, &cancel, |event| {
        let _ = stdout.write_all(event.text.as_bytes());
        let _ = stdout.flush();
    })?;
    let _ = writeln!(stdout);
    if args.stats {
        eprintln!(
            "device {device_name} | prompt {} tokens, prefill {:.1} tok/s | generated {} tokens, decode {:.1} tok/s | finish {:?}",
            generation.prompt_tokens,
            generation.prefill_tokens_per_s(),
            generation.tokens.len(),
            generation.decode_tokens_per_s(),
            generation.finish_reason
        );
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_train(
    corpus: PathBuf,
    out: PathBuf,
    minutes: f64,
    steps: usize,
    seed: u64,
    layers: usize,
    hidden: usize,
    seq_len: usize,
    batch: usize,
) -> Result<()> {
    let text = if corpus.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(&corpus).with_context(|| {
            format!(
                "cannot read {}; make it with `bible gen1:1-rev22:21 > {}` (apt-get install bible-kjv)",
                corpus.display(),
                corpus.display()
            )
        })?
    };
    let options = headroom_model::train::TrainOptions {
        max_minutes: minutes,
        max_steps: steps,
        seed,
        layers,
        hidden_size: hidden,
        intermediate_size: (hidden * 11 / 4).div_ceil(32) * 32,
        seq_len,
        batch,
        ..Default::default()
    };
    type TrainBackend = burn_autodiff::Autodiff<CpuBackend>;
    let report = headroom_model::train::train::<TrainBackend>(
        &text,
        &out,
        &options,
        &Default::default(),
        |line| eprintln!("train: {line}"),
    )?;
    let summary = serde_json::json!({ "options": options, "report": report });
    std::fs::write(out.join("train_report.json"), serde_json::to_string_pretty(&summary)?)?;
    println!(
        "trained {} steps in {:.0} s, final loss {:.3}; wrote {}",
        report.steps,
        report.wall_s,
        report.final_loss,
        out.display()
    );
    Ok(())
}
