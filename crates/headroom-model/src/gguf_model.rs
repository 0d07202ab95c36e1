//! A GGUF file as a Headroom model: its metadata as a [`LlamaConfig`], its tokenizer and chat
//! template, and its tensors under Hugging Face names (dequantized, q/k rows put back in the
//! order `transformers` uses).

use std::collections::HashMap;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::config::{LlamaConfig, RopeScaling, TokenIds};
use crate::gguf::GgufFile;
use crate::template::ChatTemplate;
use crate::weights::TensorSource;
use crate::{Error, Result};

pub const ARCHITECTURES: &[&str] = &["llama", "qwen2"];

fn error(file: &GgufFile, reason: impl Into<String>) -> Error {
    Error::Gguf { path: file.path.display().to_string(), reason: reason.into() }
}

/// The decoder's configuration from the file's `general.architecture` and `<arch>.*` keys.
pub fn config(file: &GgufFile) -> Result<LlamaConfig> {
    let arch = file
        .string("general.architecture")
        .ok_or_else(|| error(file, "has no general.architecture; it is not a model file"))?
        .to_owned();
    if !ARCHITECTURES.contains(&arch.as_str()) {
        return Err(error(
            file,
            format!(
                "holds a `{arch}` model; Headroom runs the architectures {} (Llama 2/3, SmolLM, TinyLlama, Mistral, Qwen2)",
                ARCHITECTURES.join(", ")
            ),
        ));
    }
    let key = |k: &str| format!("{arch}.{k}");
    let int = |k: &str| -> Result<usize> { Ok(file.require_u64(&key(k))? as usize) };
    let opt_int = |k: &str| file.get(&key(k)).and_then(|v| v.as_u64()).map(|v| v as usize);
    let opt_f64 = |k: &str| file.get(&key(k)).and_then(|v| v.as_f64());
    if let Some(window) = opt_int("attention.sliding_window") {
        return Err(error(file, format!("uses sliding-window attention ({window} tokens), which Headroom does not run")));
    }
    let embed = file.tensor("token_embd.weight")?;
    let vocab_size = opt_int("vocab_size").unwrap_or(embed.shape[0]);
    let heads = int("attention.head_count")?;
    let rope_scaling = match file.string(&key("rope.scaling.type")) {
        None | Some("none") => None,
        Some("linear") => Some(RopeScaling {
            rope_type: "linear".into(),
            factor: opt_f64("rope.scaling.factor"),
            low_freq_factor: None,
            high_freq_factor: None,
            original_max_position_embeddings: None,
        }),
        Some(other) => {
            return Err(error(file, format!("uses rope scaling `{other}`; Headroom runs none, linear, and Llama 3's frequency factors")))
        }
    };
    let rope_freq_factors = match file.tensors.contains_key("rope_freqs.weight") {
        true => Some(file.read_f32("rope_freqs.weight")?.0.into_iter().map(f64::from).collect()),
        false => None,
    };
    let token_id = |k: &str| file.get(k).and_then(|v| v.as_u64()).map(|v| v as u32);
    let config = LlamaConfig {
        architectures: vec![],
        model_type: arch.clone(),
        vocab_size,
        hidden_size: int("embedding_length")?,
        intermediate_size: int("feed_forward_length")?,
        num_hidden_layers: int("block_count")?,
        num_attention_heads: heads,
        num_key_value_heads: Some(opt_int("attention.head_count_kv").unwrap_or(heads)),
        head_dim: opt_int("attention.key_length"),
        max_position_embeddings: int("context_length")?,
        rms_norm_eps: opt_f64("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        rope_theta: opt_f64("rope.freq_base").unwrap_or(10_000.0),
        rope_scaling,
        rope_freq_factors,
        tie_word_embeddings: !file.tensors.contains_key("output.weight"),
        attention_bias: Some(file.tensors.contains_key("blk.0.attn_q.bias")),
        bos_token_id: token_id("tokenizer.ggml.bos_token_id").map(TokenIds::One),
        eos_token_id: token_id("tokenizer.ggml.eos_token_id").map(TokenIds::One),
        hidden_act: "silu".into(),
        torch_dtype: None,
        layer_norm_eps: None,
        position_table_rows: None,
    };
    config.validate().map_err(|e| error(file, e.to_string()))?;
    Ok(config)
}

/// The GGUF name of a Hugging Face tensor name.
pub(crate) fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(name) = fixed {
        return Some(name.to_owned());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let (module, suffix) = part.rsplit_once('.')?;
    let gguf = match module {
        "input_layernorm" => "attn_norm",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "post_attention_layernorm" => "ffn_norm",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf}.{suffix}"))
}

/// llama.cpp's converter reorders each head's q/k rows from `transformers`' (first half, second
/// half) to interleaved pairs for its RoPE kernel; this puts them back.
fn unpermute_rows(values: &[f32], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for which in 0..2 {
                let from = h * head_dim + 2 * i + which;
                let to = h * head_dim + which * half + i;
                out[to * cols..(to + 1) * cols].copy_from_slice(&values[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// The converter's permutation (the inverse of [`unpermute_rows`]), for fixtures written as
/// llama.cpp writes them.
pub fn permute_rows(values: &[f32], heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let head_dim = rows / heads;
    let half = head_dim / 2;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..half {
            for which in 0..2 {
                let to = h * head_dim + 2 * i + which;
                let from = h * head_dim + which * half + i;
                out[to * cols..(to + 1) * cols].copy_from_slice(&values[from * cols..(from + 1) * cols]);
            }
        }
    }
    out
}

/// A GGUF file's tensors under Hugging Face names, as f32.
pub struct GgufWeights<'a> {
    pub file: &'a GgufFile,
    pub config: &'a LlamaConfig,
}

impl TensorSource for GgufWeights<'_> {
    fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let gguf = gguf_name(name).ok_or_else(|| Error::Weights(format!("no GGUF tensor corresponds to `{name}`")))?;
        let (values, shape) = self.file.read_f32(&gguf)?;
        // Only the llama architecture's converter permutes; qwen2 keeps transformers' order.
        let permuted_heads = match self.config.model_type.as_str() {
            "llama" if gguf.ends_with("attn_q.weight") => Some(self.config.num_attention_heads),
            "llama" if gguf.ends_with("attn_k.weight") => Some(self.config.kv_heads()),
            _ => None,
        };
        let permuted_heads = permuted_heads.filter(|_| !crate::test_defect("keep-qk-permutation"));
        match (permuted_heads, shape.as_slice()) {
            (Some(heads), &[rows, cols]) => Ok((unpermute_rows(&values, heads, rows, cols), shape)),
            _ => Ok((values, shape)),
        }
    }
}

/// llama.cpp's pre-tokenizer regexes, by `tokenizer.ggml.pre`.
fn pre_tokenizer_regexes(pre: &str) -> Option<&'static [&'static str]> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    Some(match pre {
        "default" | "gpt2" | "gpt-2" => &[GPT2],
        // StarCoder-style vocabularies split every digit first.
        "smollm" | "starcoder" | "refact" | "codeshell" => &[r"\p{N}", GPT2],
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => &[LLAMA3],
        "qwen2" | "deepseek-r1-qwen" => &[QWEN2],
        _ => return None,
    })
}

const PRE_TOKENIZERS: &str = "default, gpt2, smollm, starcoder, llama-bpe, llama3, qwen2";

/// Token types of `tokenizer.ggml.token_type` (llama.cpp's `llama_token_type`).
const TOKEN_CONTROL: u64 = 3;
const TOKEN_USER_DEFINED: u64 = 4;

/// Tokens llama.cpp treats as ending a turn when the metadata does not name them.
const END_OF_TURN_TEXTS: &[&str] = &["<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "</s>"];

/// What the tokenizer metadata gives besides the tokenizer itself.
pub struct FileTokenizer {
    pub tokenizer: Tokenizer,
    pub eos_ids: Vec<u32>,
    pub bos_token: Option<String>,
    pub template: Option<ChatTemplate>,
}

/// Builds the tokenizer (`gpt2` byte-level BPE) and chat template stored in the file.
pub fn tokenizer(file: &GgufFile) -> Result<FileTokenizer> {
    let model = file
        .string("tokenizer.ggml.model")
        .ok_or_else(|| error(file, "has no tokenizer (tokenizer.ggml.model); Headroom needs the tokenizer inside the GGUF"))?;
    let tokens = file.strings("tokenizer.ggml.tokens")?;
    let types: Vec<u64> = match file.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
        Some(items) => items.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    let id = |k: &str| file.get(k).and_then(|v| v.as_u64()).map(|v| v as u32).filter(|&i| (i as usize) < tokens.len());
    let bos_id = id("tokenizer.ggml.bos_token_id");
    let (mut tokenizer, add_bos_default) = match model {
        "gpt2" => (byte_level_bpe(file, &tokens)?, false),
        "llama" => (sentencepiece_bpe(file, &tokens, &types)?, true),
        other => {
            return Err(error(
                file,
                format!(
                    "has a `{other}` tokenizer; Headroom builds `gpt2` (byte-level BPE) and `llama` \
                     (SentencePiece BPE) tokenizers from GGUF files"
                ),
            ))
        }
    };
    let specials: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &t)| t == TOKEN_CONTROL || t == TOKEN_USER_DEFINED)
        .map(|(text, &t)| AddedToken::from(text.to_string(), t == TOKEN_CONTROL))
        .collect();
    tokenizer.add_special_tokens(&specials);
    let add_bos = file
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(add_bos_default);
    let bos_token = bos_id.map(|i| tokens[i as usize].to_owned());
    if let (true, Some(bos), Some(bos_id)) = (add_bos, &bos_token, bos_id) {
        let processor = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .and_then(|b| b.try_pair(format!("{bos} $A {bos} $B")))
            .map_err(|e| error(file, format!("BOS token: {e}")))?
            .special_tokens(vec![(bos.clone(), bos_id)])
            .build()
            .map_err(|e| error(file, format!("BOS token: {e}")))?;
        tokenizer.with_post_processor(Some(processor));
    }
    let mut eos_ids: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
        .iter()
        .filter_map(|k| id(k))
        .collect();
    for (i, (text, &t)) in tokens.iter().zip(&types).enumerate() {
        if t == TOKEN_CONTROL && END_OF_TURN_TEXTS.contains(text) {
            eos_ids.push(i as u32);
        }
    }
    eos_ids.sort_unstable();
    eos_ids.dedup();
    let template = match file.string("tokenizer.chat_template") {
        Some(source) => {
            let text_of = |k: &str| id(k).map(|i| tokens[i as usize].to_owned()).unwrap_or_default();
            let config = serde_json::json!({
                "chat_template": source,
                "bos_token": text_of("tokenizer.ggml.bos_token_id"),
                "eos_token": text_of("tokenizer.ggml.eos_token_id"),
            });
            ChatTemplate::from_tokenizer_config(&config)?
        }
        None => None,
    };
    Ok(FileTokenizer { tokenizer, eos_ids, bos_token, template })
}

fn byte_level_bpe(file: &GgufFile, tokens: &[&str]) -> Result<Tokenizer> {
    let pre = match file.string("tokenizer.ggml.pre").unwrap_or("default") {
        _ if crate::test_defect("gpt2-pre-tokenizer") => "gpt2",
        pre => pre,
    };
    let regexes = pre_tokenizer_regexes(pre).ok_or_else(|| {
        error(file, format!("names the pre-tokenizer `{pre}`, which Headroom does not know (it knows {PRE_TOKENIZERS})"))
    })?;
    let vocab: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    let merges: Vec<(String, String)> = file
        .strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| error(file, format!("has a malformed merge `{m}` in tokenizer.ggml.merges")))
        })
        .collect::<Result<_>>()?;
    // Llama 3's tokenizer takes a whole pre-token that is in the vocabulary as is.
    let ignore_merges = matches!(pre, "llama3" | "llama-v3" | "llama-bpe" | "falcon3");
    let bpe = BPE::builder()
        .vocab_and_merges(vocab.into_iter().collect::<tokenizers::models::bpe::Vocab>(), merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| error(file, format!("tokenizer does not build: {e}")))?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    for regex in regexes {
        let split = Split::new(SplitPattern::Regex(regex.to_string()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| error(file, format!("pre-tokenizer `{pre}`: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer
        .with_pre_tokenizer(Some(Sequence::new(steps)))
        .with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

/// SentencePiece-style BPE (`tokenizer.ggml.model = llama`: Llama 2, TinyLlama, Mistral): pieces
/// with scores and `<0xNN>` byte tokens. llama.cpp merges the adjacent pair whose joined piece
/// scores highest; as BPE, a merge's rank is its joined piece's score (best first). A space
/// becomes `▁` and each stretch of text between special tokens gets one in front (unless the file
/// says `add_space_prefix = false`); unknown characters fall back to their bytes.
fn sentencepiece_bpe(file: &GgufFile, tokens: &[&str], types: &[u64]) -> Result<Tokenizer> {
    use tokenizers::decoders::{byte_fallback::ByteFallback, fuse::Fuse, sequence::Sequence as DecoderSequence, strip::Strip};
    use tokenizers::normalizers::{prepend::Prepend, replace::Replace, NormalizerWrapper, Sequence as NormalizerSequence};
    let scores: Vec<f64> = match file.get("tokenizer.ggml.scores").and_then(|v| v.as_array()) {
        Some(items) if items.len() == tokens.len() => items.iter().map(|v| v.as_f64().unwrap_or(0.0)).collect(),
        _ => return Err(error(file, "has a `llama` tokenizer without one score per token (tokenizer.ggml.scores)")),
    };
    let vocab: HashMap<String, u32> = tokens.iter().enumerate().map(|(i, t)| (t.to_string(), i as u32)).collect();
    const TOKEN_NORMAL: u64 = 1;
    let mut merges: Vec<(f64, u32, u32, String, String)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types.get(id).copied().unwrap_or(TOKEN_NORMAL) != TOKEN_NORMAL {
            continue;
        }
        // SentencePiece vocabularies hold every character their pieces are made of, so both
        // halves of a reachable merge are pieces.
        for (at, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(at);
            if let (Some(&l), Some(&r)) = (vocab.get(left), vocab.get(right)) {
                merges.push((scores[id], l, r, left.to_owned(), right.to_owned()));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let unk = id_text(file, tokens, "tokenizer.ggml.unknown_token_id").unwrap_or("<unk>").to_owned();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab.into_iter().collect::<tokenizers::models::bpe::Vocab>(), merges.into_iter().map(|m| (m.3, m.4)).collect())
        .unk_token(unk)
        .fuse_unk(true)
        .byte_fallback(true)
        .build()
        .map_err(|e| error(file, format!("tokenizer does not build: {e}")))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let mut steps: Vec<NormalizerWrapper> = Vec::new();
    let space_prefix = file.get("tokenizer.ggml.add_space_prefix").and_then(|v| v.as_bool()).unwrap_or(true);
    if space_prefix && !crate::test_defect("no-space-prefix") {
        steps.push(Prepend::new("▁".into()).into());
    }
    steps.push(Replace::new(" ", "▁").map_err(|e| error(file, e.to_string()))?.into());
    tokenizer.with_normalizer(Some(NormalizerSequence::new(steps)));
    tokenizer.with_decoder(Some(DecoderSequence::new(vec![
        Replace::new("▁", " ").map_err(|e| error(file, e.to_string()))?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
        Strip::new(' ', 1, 0).into(),
    ])));
    Ok(tokenizer)
}

fn id_text<'a>(file: &GgufFile, tokens: &[&'a str], key: &str) -> Option<&'a str> {
    let id = file.get(key)?.as_u64()? as usize;
    tokens.get(id).copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_and_unpermute_are_inverses() {
        let values: Vec<f32> = (0..48).map(|v| v as f32).collect();
        assert_eq!(unpermute_rows(&permute_rows(&values, 2, 8, 6), 2, 8, 6), values);
    }

    #[test]
    fn names_map_to_llama_cpp_names() {
        assert_eq!(gguf_name("model.layers.3.self_attn.k_proj.weight").unwrap(), "blk.3.attn_k.weight");
        assert_eq!(gguf_name("model.layers.0.self_attn.q_proj.bias").unwrap(), "blk.0.attn_q.bias");
        assert_eq!(gguf_name("model.layers.11.mlp.down_proj.weight").unwrap(), "blk.11.ffn_down.weight");
        assert_eq!(gguf_name("lm_head.weight").unwrap(), "output.weight");
        assert!(gguf_name("model.rotary.inv_freq").is_none());
    }

    #[test]
    fn unpermute_inverts_the_converters_permutation() {
        // One head of dim 4, one column: transformers' rows [a0 a1 b0 b1] are stored [a0 b0 a1 b1].
        let stored = [0.0, 2.0, 1.0, 3.0];
        assert_eq!(unpermute_rows(&stored, 1, 4, 1), vec![0.0, 1.0, 2.0, 3.0]);
    }
}
