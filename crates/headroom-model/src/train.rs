//! Training of the embedded demo model: a byte-level BPE tokenizer (tokenizers crate) and a small
//! Llama (burn autodiff on ndarray), written out as a Hugging Face model folder.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{AdamWConfig, GradientsParams, Optimizer};
use burn::grad_clipping::GradientClippingConfig;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder};

use crate::config::{LlamaConfig, TokenIds};
use crate::model::RopeTables;
use crate::weights::{init_llama, save_llama, StoreDtype};
use crate::{Error, Result};

pub const EOS: &str = "<|endoftext|>";
pub const IM_START: &str = "<|im_start|>";
pub const IM_END: &str = "<|im_end|>";

/// ChatML, the template the demo model is trained on.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainOptions {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub context: usize,
    pub seq_len: usize,
    pub batch: usize,
    pub learning_rate: f64,
    pub warmup_steps: usize,
    /// Stop after this many steps or minutes, whichever comes first.
    pub max_steps: usize,
    pub max_minutes: f64,
    pub seed: u64,
    /// Share of training sequences that are ChatML conversations.
    pub chat_fraction: f64,
    pub save_every_steps: usize,
}

impl Default for TrainOptions {
    fn default() -> Self {
        Self {
            vocab_size: 4096,
            hidden_size: 256,
            intermediate_size: 704,
            layers: 4,
            heads: 8,
            kv_heads: 4,
            context: 1024,
            seq_len: 256,
            batch: 16,
            learning_rate: 2e-3,
            warmup_steps: 100,
            max_steps: 100_000,
            max_minutes: 80.0,
            seed: 1,
            chat_fraction: 0.2,
            save_every_steps: 100,
        }
    }
}

/// A verse with its reference, from the `bible` program's output.
#[derive(Debug, Clone)]
pub struct Verse {
    pub reference: String,
    pub text: String,
}

/// Parses `bible gen1:1-rev22:21` output: a "Book N" heading per chapter, then verses that start
/// with their number and wrap onto unindented lines.
pub fn parse_bible(text: &str) -> Vec<Verse> {
    let mut verses: Vec<Verse> = Vec::new();
    let mut chapter = String::new();
    for line in text.lines() {
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        if line.starts_with("  ") {
            let mut parts = trimmed.splitn(2, ' ');
            let number = parts.next().unwrap_or_default();
            if number.chars().all(|c| c.is_ascii_digit()) {
                verses.push(Verse {
                    reference: format!("{chapter}:{number}"),
                    text: parts.next().unwrap_or_default().trim().to_string(),
                });
                continue;
            }
        }
        let is_heading = trimmed
            .rsplit_once(' ')
            .is_some_and(|(_, n)| n.chars().all(|c| c.is_ascii_digit()))
            && !line.starts_with(' ');
        if is_heading && verses.last().is_none_or(|v| v.text.ends_with(['.', '?', '!', ':', ';', ',', ')'])) {
            chapter = trimmed.to_string();
        } else if let Some(last) = verses.last_mut() {
            last.text.push(' ');
            last.text.push_str(trimmed);
        }
    }
    verses
}

/// Training documents: chapters of plain text, and ChatML exchanges in which the user names a
/// verse and the assistant recites one.
pub fn build_documents(verses: &[Verse], chat_fraction: f64, seed: u64) -> Vec<String> {
    let mut rng = ChaCha20Rng::seed_from_u64(seed);
    let mut docs = Vec::new();
    let mut chapter_name = String::new();
    let mut chapter = String::new();
    for verse in verses {
        let name = verse.reference.split(':').next().unwrap_or_default();
        if name != chapter_name {
            if !chapter.is_empty() {
                docs.push(std::mem::take(&mut chapter));
            }
            chapter_name = name.to_string();
            chapter.push_str(name);
            chapter.push('\n');
        }
        chapter.push_str(&verse.text);
        chapter.push('\n');
        if rng.random::<f64>() < chat_fraction {
            docs.push(format!(
                "{IM_START}user\n{}{IM_END}\n{IM_START}assistant\n{}{IM_END}\n",
                verse.reference, verse.text
            ));
        }
    }
    if !chapter.is_empty() {
        docs.push(chapter);
    }
    docs
}

pub fn train_tokenizer(docs: &[String], vocab_size: usize) -> Result<Tokenizer> {
    let specials: Vec<AddedToken> = [EOS, IM_START, IM_END]
        .iter()
        .map(|t| AddedToken::from(t.to_string(), true))
        .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials.clone())
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tokenizer = TokenizerBuilder::<
        BPE,
        tokenizers::NormalizerWrapper,
        ByteLevel,
        ByteLevel,
        ByteLevelDecoder,
    >::new()
    .with_model(BPE::default())
    .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
    .with_post_processor(Some(ByteLevel::new(false, true, true)))
    .with_decoder(Some(ByteLevelDecoder::default()))
    .build()
    .map_err(|e| Error::Tokenizer(e.to_string()))?;
    tokenizer
        .train(&mut trainer, docs.iter().map(String::as_str))
        .map_err(|e| Error::Tokenizer(format!("training failed: {e}")))?;
    tokenizer.add_special_tokens(&specials);
    let json = tokenizer
        .to_string(false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    json.parse::<Tokenizer>()
        .map_err(|e| Error::Tokenizer(e.to_string()))
}

pub fn demo_config(options: &TrainOptions, tokenizer: &Tokenizer) -> LlamaConfig {
    let eos = tokenizer.token_to_id(EOS).expect("special token added");
    let im_end = tokenizer.token_to_id(IM_END).expect("special token added");
    LlamaConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        vocab_size: tokenizer.get_vocab_size(true),
        hidden_size: options.hidden_size,
        intermediate_size: options.intermediate_size,
        num_hidden_layers: options.layers,
        num_attention_heads: options.heads,
        num_key_value_heads: Some(options.kv_heads),
        head_dim: None,
        max_position_embeddings: options.context,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        rope_freq_factors: None,
        tie_word_embeddings: true,
        attention_bias: Some(false),
        bos_token_id: Some(TokenIds::One(eos)),
        eos_token_id: Some(TokenIds::Many(vec![eos, im_end])),
        hidden_act: "silu".into(),
        torch_dtype: Some("float32".into()),
        layer_norm_eps: None,
        position_table_rows: None,
    }
}

/// Writes tokenizer, config and template files of a Hugging Face folder (weights separately).
pub fn write_folder_metadata(dir: &Path, config: &LlamaConfig, tokenizer: &Tokenizer) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).expect("config serialises"),
    )?;
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let tokenizer_config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": IM_END,
        "pad_token": EOS,
        "unk_token": null,
        "model_max_length": config.max_position_embeddings,
        "add_bos_token": false,
        "chat_template": CHATML_TEMPLATE,
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string_pretty(&tokenizer_config).expect("json"),
    )?;
    let generation = serde_json::json!({
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
    });
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::to_string_pretty(&generation).expect("json"),
    )?;
    Ok(())
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainReport {
    pub steps: usize,
    pub tokens_seen: usize,
    pub corpus_tokens: usize,
    pub parameters: usize,
    pub wall_s: f64,
    pub final_loss: f64,
    /// (step, mean loss over the last interval, elapsed seconds)
    pub loss_curve: Vec<(usize, f64, f64)>,
}

/// Warmup by steps, then cosine decay to a tenth over the run's progress (0..1), where progress
/// is the larger of the step share and the time share, so a time-bounded run still decays fully.
fn lr_at(step: usize, progress: f64, options: &TrainOptions) -> f64 {
    if step < options.warmup_steps {
        return options.learning_rate * (step + 1) as f64 / options.warmup_steps as f64;
    }
    let min = options.learning_rate * 0.1;
    min + 0.5 * (options.learning_rate - min) * (1.0 + (std::f64::consts::PI * progress.clamp(0.0, 1.0)).cos())
}

/// Trains and writes a complete model folder into `out`. `log` receives one line per report.
pub fn train<B: burn::tensor::backend::AutodiffBackend>(
    corpus_text: &str,
    out: &Path,
    options: &TrainOptions,
    device: &B::Device,
    mut log: impl FnMut(&str),
) -> Result<TrainReport> {
    let started = Instant::now();
    let verses = parse_bible(corpus_text);
    if verses.len() < 100 {
        return Err(Error::InvalidRequest(format!(
            "the corpus has {} verses; expected the output of `bible gen1:1-rev22:21`",
            verses.len()
        )));
    }
    let docs = build_documents(&verses, options.chat_fraction, options.seed);
    log(&format!("corpus: {} verses, {} documents", verses.len(), docs.len()));
    let tokenizer = train_tokenizer(&docs, options.vocab_size)?;
    let eos = tokenizer.token_to_id(EOS).expect("special token");
    let mut stream: Vec<u32> = Vec::new();
    for doc in &docs {
        let enc = tokenizer
            .encode(doc.as_str(), false)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        stream.extend_from_slice(enc.get_ids());
        stream.push(eos);
    }
    let config = demo_config(options, &tokenizer);
    write_folder_metadata(out, &config, &tokenizer)?;
    log(&format!(
        "tokenizer: vocab {}, corpus {} tokens ({:.2} chars/token); model {} parameters",
        config.vocab_size,
        stream.len(),
        corpus_text.len() as f64 / stream.len() as f64,
        config.parameter_count()
    ));

    B::seed(device, options.seed);
    let mut model = init_llama::<B>(&config, device);
    let mut optim = AdamWConfig::new()
        .with_weight_decay(0.1)
        .with_beta_2(0.95)
        .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
        .init();
    let rope = RopeTables::<B>::new(&config, options.seq_len, device);
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let mut rng = ChaCha20Rng::seed_from_u64(options.seed ^ 0x5eed);
    let mut curve = Vec::new();
    let mut interval_loss = 0.0;
    let mut interval_steps = 0;
    let mut last_loss = f64::NAN;
    let mut step = 0;
    let budget_s = options.max_minutes * 60.0;
    let mut curve_file = std::fs::File::create(out.join("train_loss.csv"))?;
    writeln!(curve_file, "step,loss,elapsed_s,lr")?;
    while step < options.max_steps {
        let (inputs, targets) = sample_batch(&stream, options.batch, options.seq_len, &mut rng);
        let inputs = Tensor::<B, 2, Int>::from_data(
            TensorData::new(inputs, [options.batch, options.seq_len]),
            device,
        );
        let targets = Tensor::<B, 1, Int>::from_data(
            TensorData::new(targets, [options.batch * options.seq_len]),
            device,
        );
        let logits = model.forward(inputs, &rope);
        let logits = logits.reshape([options.batch * options.seq_len, config.vocab_size]);
        let loss = loss_fn.forward(logits, targets);
        let loss_value: f64 = loss.clone().into_scalar().elem::<f64>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let progress = (step as f64 / options.max_steps as f64)
            .max(started.elapsed().as_secs_f64() / budget_s);
        let lr = lr_at(step, progress, options);
        model = optim.step(lr, model, grads);
        step += 1;
        interval_loss += loss_value;
        interval_steps += 1;
        let elapsed = started.elapsed().as_secs_f64();
        if step % 10 == 0 {
            last_loss = interval_loss / interval_steps as f64;
            writeln!(curve_file, "{step},{last_loss:.4},{elapsed:.1},{lr:.6}")?;
            curve.push((step, last_loss, elapsed));
            log(&format!("step {step} loss {last_loss:.3} lr {lr:.5} {elapsed:.0}s"));
            interval_loss = 0.0;
            interval_steps = 0;
        }
        if step % options.save_every_steps == 0 {
            save_llama(&model.valid(), &out.join("model.safetensors"), StoreDtype::F32)?;
        }
        if elapsed > budget_s {
            break;
        }
    }
    save_llama(&model.valid(), &out.join("model.safetensors"), StoreDtype::F32)?;
    Ok(TrainReport {
        steps: step,
        tokens_seen: step * options.batch * options.seq_len,
        corpus_tokens: stream.len(),
        parameters: config.parameter_count(),
        wall_s: started.elapsed().as_secs_f64(),
        final_loss: last_loss,
        loss_curve: curve,
    })
}

fn sample_batch(stream: &[u32], batch: usize, seq_len: usize, rng: &mut ChaCha20Rng) -> (Vec<i64>, Vec<i64>) {
    let mut inputs = Vec::with_capacity(batch * seq_len);
    let mut targets = Vec::with_capacity(batch * seq_len);
    for _ in 0..batch {
        let start = rng.random_range(0..stream.len() - seq_len - 1);
        inputs.extend(stream[start..start + seq_len].iter().map(|&t| t as i64));
        targets.extend(stream[start + 1..start + seq_len + 1].iter().map(|&t| t as i64));
    }
    (inputs, targets)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXCERPT: &str = "\nGenesis 1\n\n  1 In the beginning God created the heaven and the earth.\n  2 And the earth was without form, and void; and darkness was upon the face of\nthe deep. And the Spirit of God moved upon the face of the waters.\n\nGenesis 2\n\n  1 Thus the heavens and the earth were finished, and all the host of them.\n";

    #[test]
    fn parses_bible_output_with_wrapped_verses() {
        let verses = parse_bible(EXCERPT);
        assert_eq!(verses.len(), 3);
        assert_eq!(verses[0].reference, "Genesis 1:1");
        assert!(verses[1].text.ends_with("the face of the deep. And the Spirit of God moved upon the face of the waters."));
        assert_eq!(verses[2].reference, "Genesis 2:1");
    }

    #[test]
    fn documents_are_chapters_plus_chatml_exchanges() {
        let verses = parse_bible(EXCERPT);
        let docs = build_documents(&verses, 1.0, 3);
        assert!(docs.iter().any(|d| d.starts_with("Genesis 1\nIn the beginning")));
        assert!(docs.iter().any(|d| d == "<|im_start|>user\nGenesis 2:1<|im_end|>\n<|im_start|>assistant\nThus the heavens and the earth were finished, and all the host of them.<|im_end|>\n"));
    }
}
