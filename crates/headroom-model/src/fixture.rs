//! Random-weight Hugging Face model folders written on the spot, for tests and benchmarks that
//! need a real folder of a chosen shape without downloading one.

use std::path::Path;

use burn::tensor::backend::Backend;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::config::{LlamaConfig, TokenIds};
use crate::weights::{init_llama, save_llama, StoreDtype};
use crate::{CpuBackend, Error, Result};

/// A byte-level tokenizer with one token per byte and no merges, plus ChatML specials.
pub fn byte_tokenizer() -> Result<Tokenizer> {
    let mut alphabet: Vec<char> = ByteLevel::alphabet().into_iter().collect();
    alphabet.sort_unstable();
    let vocab: tokenizers::models::bpe::Vocab = alphabet
        .iter()
        .enumerate()
        .map(|(i, c)| (c.to_string(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, vec![])
        .build()
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true)))
        .with_decoder(Some(ByteLevelDecoder::default()));
    tokenizer.add_special_tokens(&[
        AddedToken::from("<|endoftext|>", true),
        AddedToken::from("<|im_start|>", true),
        AddedToken::from("<|im_end|>", true),
    ]);
    Ok(tokenizer)
}

/// A small Llama config with grouped-query attention and untied embeddings.
pub fn tiny_config() -> LlamaConfig {
    LlamaConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        vocab_size: 300,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(2),
        head_dim: None,
        max_position_embeddings: 128,
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        tie_word_embeddings: false,
        attention_bias: Some(false),
        bos_token_id: None,
        eos_token_id: Some(TokenIds::One(258)),
        hidden_act: "silu".into(),
        torch_dtype: Some("float32".into()),
    }
}

/// About 100M parameters, shaped like the small Llamas people run locally.
pub fn config_100m() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 32_000,
        hidden_size: 768,
        intermediate_size: 2048,
        num_hidden_layers: 10,
        num_attention_heads: 12,
        num_key_value_heads: Some(4),
        max_position_embeddings: 2048,
        tie_word_embeddings: true,
        ..tiny_config()
    }
}

/// Writes a complete folder: config.json, model.safetensors (random weights from `seed`),
/// tokenizer.json, tokenizer_config.json with a ChatML template.
pub fn write_random_folder(dir: &Path, config: &LlamaConfig, seed: u64, dtype: StoreDtype) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let device = Default::default();
    // The backend's RNG is process-global and burn initialises parameters lazily, on first use:
    // seeding, initialising and saving (which draws every value) must happen under one lock, or
    // fixtures written by parallel tests interleave their draws and one seed gives two models.
    static SEEDED_INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    {
        let _one_at_a_time = SEEDED_INIT.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        CpuBackend::seed(&device, seed);
        let model = init_llama::<CpuBackend>(config, &device);
        save_llama(&model, &dir.join("model.safetensors"), dtype)?;
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).expect("config serialises"),
    )?;
    byte_tokenizer()?
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let tokenizer_config = serde_json::json!({
        "eos_token": "<|im_end|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string(&tokenizer_config).expect("json"),
    )?;
    Ok(())
}
