//! Random-weight Hugging Face model folders written on the spot, for tests and benchmarks that
//! need a real folder of a chosen shape without downloading one.

use std::path::Path;

use burn::tensor::backend::Backend;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer};

use crate::config::{LlamaConfig, TokenIds};
use crate::weights::{init_llama, save_llama, write_safetensors, StoreDtype};
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
        rope_freq_factors: None,
        tie_word_embeddings: false,
        attention_bias: Some(false),
        bos_token_id: None,
        eos_token_id: Some(TokenIds::One(258)),
        hidden_act: "silu".into(),
        torch_dtype: Some("float32".into()),
        layer_norm_eps: None,
        position_table_rows: None,
    }
}

/// About 1.24B parameters in Llama 3.2 1B's shape (tied head, 128k vocabulary): the ~1B model
/// of the GPU bandwidth targets.
pub fn config_1b() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 128_256,
        hidden_size: 2048,
        intermediate_size: 8192,
        num_hidden_layers: 16,
        num_attention_heads: 32,
        num_key_value_heads: Some(8),
        max_position_embeddings: 2048,
        tie_word_embeddings: true,
        ..tiny_config()
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

/// ChatML, as the fixtures' tokenizer_config.json carries it.
const CHATML_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn write_tokenizer_files(dir: &Path, tokenizer: &Tokenizer) -> Result<()> {
    tokenizer
        .save(dir.join("tokenizer.json"), false)
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    let tokenizer_config = serde_json::json!({ "eos_token": "<|im_end|>", "chat_template": CHATML_TEMPLATE });
    std::fs::write(
        dir.join("tokenizer_config.json"),
        serde_json::to_string(&tokenizer_config).expect("json"),
    )?;
    Ok(())
}

/// Writes a model whose greedy answer to any chat prompt is `pieces` concatenated, then EOS.
///
/// It is a real Llama run by the real engine: each piece is one added token, the embedding is
/// one-hot, attention and MLP weights are zero (so the residual stream is the current token),
/// and the output head maps each token to its successor: the prompt's final `\n` (ChatML ends
/// `assistant\n`) to the first piece, each piece to the next, everything else to EOS. Used where
/// a test needs a deterministic answer from a live model, e.g. a tool call. Pieces must not
/// contain spaces (the byte-level decoder would not round-trip them).
pub fn write_scripted_folder(dir: &Path, pieces: &[&str]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let mut tokenizer = byte_tokenizer()?;
    let added: Vec<AddedToken> = pieces.iter().map(|p| AddedToken::from(p.to_string(), false)).collect();
    tokenizer.add_tokens(&added);
    let id = |text: &str| -> Result<u32> {
        tokenizer
            .token_to_id(text)
            .ok_or_else(|| Error::Tokenizer(format!("no token for {text:?}")))
    };
    let newline = id("Ċ")?;
    let eos = id("<|im_end|>")?;
    let piece_ids = pieces.iter().map(|p| id(p)).collect::<Result<Vec<_>>>()?;
    let vocab = tokenizer.get_vocab_size(true);
    let hidden = vocab.next_multiple_of(8);
    let config = LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: 16,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: Some(1),
        max_position_embeddings: 4096,
        eos_token_id: Some(TokenIds::One(eos)),
        ..tiny_config()
    };
    let mut successor: Vec<u32> = vec![eos; vocab];
    let mut previous = newline;
    for &p in &piece_ids {
        successor[previous as usize] = p;
        previous = p;
    }
    let mut embed = vec![0.0f32; vocab * hidden];
    let mut head = vec![0.0f32; vocab * hidden];
    for t in 0..vocab {
        embed[t * hidden + t] = 1.0;
        head[successor[t] as usize * hidden + t] = 10.0;
    }
    let (heads, d) = (config.num_attention_heads, config.head_dim());
    let zeros = |rows: usize, cols: usize| vec![0.0f32; rows * cols];
    let p = "model.layers.0";
    let tensors = vec![
        ("model.embed_tokens.weight".to_string(), vec![vocab, hidden], embed),
        (format!("{p}.input_layernorm.weight"), vec![hidden], vec![1.0; hidden]),
        (format!("{p}.post_attention_layernorm.weight"), vec![hidden], vec![1.0; hidden]),
        (format!("{p}.self_attn.q_proj.weight"), vec![heads * d, hidden], zeros(heads * d, hidden)),
        (format!("{p}.self_attn.k_proj.weight"), vec![d, hidden], zeros(d, hidden)),
        (format!("{p}.self_attn.v_proj.weight"), vec![d, hidden], zeros(d, hidden)),
        (format!("{p}.self_attn.o_proj.weight"), vec![hidden, heads * d], zeros(hidden, heads * d)),
        (format!("{p}.mlp.gate_proj.weight"), vec![16, hidden], zeros(16, hidden)),
        (format!("{p}.mlp.up_proj.weight"), vec![16, hidden], zeros(16, hidden)),
        (format!("{p}.mlp.down_proj.weight"), vec![hidden, 16], zeros(hidden, 16)),
        ("model.norm.weight".to_string(), vec![hidden], vec![1.0; hidden]),
        ("lm_head.weight".to_string(), vec![vocab, hidden], head),
    ];
    write_safetensors(&tensors, &dir.join("model.safetensors"), StoreDtype::F32)?;
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).expect("config serialises"),
    )?;
    write_tokenizer_files(dir, &tokenizer)
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
    write_tokenizer_files(dir, &byte_tokenizer()?)
}

/// Converts a folder written by this module (safetensors, byte-level tokenizer, ChatML) into a
/// GGUF file the way llama.cpp's converter does: llama.cpp's tensor names, q/k rows permuted for
/// its RoPE, weights in `weight_type` (F32 or Q8_0; norms stay F32), the tokenizer and template
/// in the metadata. For tests of the GGUF path against the folder it came from.
pub fn write_gguf_from_folder(dir: &Path, out: &Path, weight_type: crate::quants::GgmlType) -> Result<()> {
    use crate::gguf::Value;
    use crate::quants::GgmlType;
    use crate::weights::{TensorSource, WeightFiles};
    let bundle = crate::ModelBundle::open(dir)?;
    let config = &bundle.config;
    let files = WeightFiles::open(dir)?;
    let vocab = bundle.tokenizer.get_vocab(true);
    let mut tokens = vec![String::new(); vocab.len()];
    for (text, id) in &vocab {
        tokens[*id as usize] = text.clone();
    }
    let specials: Vec<String> = bundle.tokenizer.get_added_tokens_decoder().values().filter(|t| t.special).map(|t| t.content.clone()).collect();
    let types: Vec<Value> = tokens.iter().map(|t| Value::I32(if specials.contains(t) { 3 } else { 1 })).collect();
    let eos = bundle.eos_ids.first().copied().unwrap_or(0);
    let template = bundle.template.as_ref().map(|t| t.source.clone()).unwrap_or_default();
    let u32v = |v: usize| Value::U32(v as u32);
    let metadata = vec![
        ("general.architecture", Value::String("llama".into())),
        ("llama.context_length", u32v(config.max_position_embeddings)),
        ("llama.embedding_length", u32v(config.hidden_size)),
        ("llama.block_count", u32v(config.num_hidden_layers)),
        ("llama.feed_forward_length", u32v(config.intermediate_size)),
        ("llama.attention.head_count", u32v(config.num_attention_heads)),
        ("llama.attention.head_count_kv", u32v(config.kv_heads())),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(config.rms_norm_eps as f32)),
        ("llama.rope.freq_base", Value::F32(config.rope_theta as f32)),
        ("tokenizer.ggml.model", Value::String("gpt2".into())),
        ("tokenizer.ggml.pre", Value::String("default".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens.iter().map(|t| Value::String(t.clone())).collect())),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.merges", Value::Array(vec![])),
        ("tokenizer.ggml.eos_token_id", Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token", Value::Bool(false)),
        ("tokenizer.chat_template", Value::String(template)),
    ];
    let mut names = vec![("model.embed_tokens.weight".to_string(), "token_embd.weight".to_string())];
    for i in 0..config.num_hidden_layers {
        for (hf, gguf) in [
            ("input_layernorm", "attn_norm"),
            ("self_attn.q_proj", "attn_q"),
            ("self_attn.k_proj", "attn_k"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("post_attention_layernorm", "ffn_norm"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ] {
            names.push((format!("model.layers.{i}.{hf}.weight"), format!("blk.{i}.{gguf}.weight")));
        }
    }
    names.push(("model.norm.weight".into(), "output_norm.weight".into()));
    if !config.tie_word_embeddings {
        names.push(("lm_head.weight".into(), "output.weight".into()));
    }
    let mut tensors = Vec::new();
    for (hf, gguf) in names {
        let (mut values, shape) = files.read_f32(&hf)?;
        let heads = if gguf.ends_with("attn_q.weight") {
            Some(config.num_attention_heads)
        } else if gguf.ends_with("attn_k.weight") {
            Some(config.kv_heads())
        } else {
            None
        };
        if let Some(heads) = heads {
            values = crate::gguf_model::permute_rows(&values, heads, shape[0], shape[1]);
        }
        let (ty, bytes) = match (weight_type, shape.len()) {
            (GgmlType::Q8_0, 2) => (GgmlType::Q8_0, crate::quants::quantize_q8_0(&values)),
            (GgmlType::F16, 2) => (GgmlType::F16, values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect()),
            (GgmlType::BF16, 2) => (GgmlType::BF16, values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect()),
            _ => (GgmlType::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        };
        tensors.push((gguf, shape, ty, bytes));
    }
    crate::gguf::write(out, &metadata, &tensors)
}

/// Rewrites a GGUF file with every weight matrix replaced by random but valid blocks of `ty`
/// (random quants and sub-scales, f16 scales set so the weights' standard deviation is about
/// 0.05, like a trained model's); norms and the tokenizer stay. For tests of the packed CPU path
/// against the same file dequantized: any valid block is a weight the kernels must get right,
/// and no quantizer is needed for the K-quants.
pub fn write_random_packed_gguf(src: &Path, out: &Path, ty: crate::quants::GgmlType, seed: u64) -> Result<()> {
    use rand::{Rng, SeedableRng};
    let file = crate::gguf::GgufFile::open(src)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    // Where each block keeps its f16 scale and (for types with a minimum) its f16 min.
    let scale_offsets: &[usize] = match ty {
        crate::quants::GgmlType::Q4_0 | crate::quants::GgmlType::Q8_0 | crate::quants::GgmlType::Q5_0 => &[0],
        crate::quants::GgmlType::Q4_1 | crate::quants::GgmlType::Q5_1 | crate::quants::GgmlType::Q4K | crate::quants::GgmlType::Q5K | crate::quants::GgmlType::Q2K => &[0, 2],
        crate::quants::GgmlType::Q6K => &[208],
        crate::quants::GgmlType::Q3K => &[108],
        other => return Err(Error::InvalidRequest(format!("{other} is not a block type"))),
    };
    let q2k_offsets = [80usize, 82];
    let scale_offsets: &[usize] = if ty == crate::quants::GgmlType::Q2K { &q2k_offsets } else { scale_offsets };
    let mut tensors = Vec::new();
    for (name, info) in &file.tensors {
        let (values, shape) = file.read_f32(name)?;
        let cols = *shape.last().unwrap_or(&0);
        if shape.len() != 2 || cols % ty.block_elements() != 0 {
            tensors.push((name.clone(), shape, crate::quants::GgmlType::F32, values.iter().flat_map(|v| v.to_le_bytes()).collect()));
            continue;
        }
        let _ = info;
        let blocks = values.len() / ty.block_elements();
        let mut bytes = vec![0u8; blocks * ty.block_bytes()];
        rng.fill(&mut bytes[..]);
        let set_scales = |bytes: &mut [u8], factor: f32| {
            for block in bytes.chunks_exact_mut(ty.block_bytes()) {
                for &at in scale_offsets {
                    let base = if at == scale_offsets[0] { 1.0 } else { 0.5 };
                    block[at..at + 2].copy_from_slice(&half::f16::from_f32(base * factor).to_le_bytes());
                }
            }
        };
        set_scales(&mut bytes, 1.0);
        let unit = crate::quants::dequantize(ty, &bytes, values.len()).map_err(Error::Weights)?;
        let std = (unit.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / unit.len() as f64).sqrt();
        set_scales(&mut bytes, (0.05 / std.max(1e-12)) as f32);
        tensors.push((name.clone(), shape, ty, bytes));
    }
    let metadata: Vec<(&str, crate::gguf::Value)> = file.metadata.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    crate::gguf::write(out, &metadata, &tensors)
}
