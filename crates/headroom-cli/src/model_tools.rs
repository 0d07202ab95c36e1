//! `headroom model …`: look inside a model file, and the probes the reference tests compare with
//! llama.cpp and the `gguf` package (tokenization, teacher-forced scores, dequantized tensors).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Subcommand;
use headroom_model::gguf::GgufFile;
use headroom_model::{CpuBackend, Llama, ModelBundle};

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
    /// Teacher-forced scores on the CPU: for each JSON array of token ids on stdin, the top token
    /// at every position and the negative log-likelihood of the next one (JSON per line).
    Score {
        #[arg(default_value = "default")]
        model: String,
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

pub fn run(command: ModelCommand) -> Result<()> {
    match command {
        ModelCommand::Inspect { model, json } => inspect(&crate::open_bundle(&model)?, json),
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
        ModelCommand::Score { model } => {
            let bundle = crate::open_bundle(&model)?;
            let llama: Llama<CpuBackend> = bundle.load(&Default::default(), |_, _| {})?;
            let mut out = std::io::stdout().lock();
            for line in std::io::stdin().lock().lines() {
                let tokens: Vec<u32> = serde_json::from_str(&line?).context("each line of stdin must be a JSON array of token ids")?;
                let scores = headroom_model::teacher_forced(&llama, &bundle.config, &tokens)?;
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
