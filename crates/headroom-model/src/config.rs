//! The subset of a Hugging Face `config.json` that a Llama-family decoder, or a BERT encoder
//! (an embedding model, see [`crate::bert`]), needs. Field names follow Hugging Face so a
//! config round-trips through `transformers`.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Missing means multi-head attention (as many KV heads as query heads).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Missing means hidden_size / num_attention_heads.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Per-frequency divisors of the rotary embedding (Llama 3.1+ GGUF files store them as
    /// `rope_freqs.weight` instead of `rope_scaling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_freq_factors: Option<Vec<f64>>,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Qwen2 puts biases on q/k/v projections.
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub bos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub torch_dtype: Option<String>,
    /// A BERT encoder's LayerNorm epsilon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_norm_eps: Option<f64>,
    /// A BERT encoder's position table rows, where its context (`max_position_embeddings`, as
    /// requests see it) was set below them: sentence-transformers' `max_seq_length`, the length
    /// the model was trained to embed (see [`crate::bert`]).
    #[serde(skip)]
    pub position_table_rows: Option<usize>,
}

/// `eos_token_id` is a number in most configs and a list in Llama 3's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default)]
    pub low_freq_factor: Option<f64>,
    #[serde(default)]
    pub high_freq_factor: Option<f64>,
    #[serde(default)]
    pub original_max_position_embeddings: Option<usize>,
}

fn default_model_type() -> String {
    "llama".into()
}
fn default_max_pos() -> usize {
    2048
}
fn default_rms_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_act() -> String {
    "silu".into()
}

impl LlamaConfig {
    pub fn from_json(text: &str) -> Result<Self> {
        let config: LlamaConfig = serde_json::from_str(text)
            .map_err(|e| Error::Config(format!("config.json is not a Llama-family config: {e}")))?;
        config.validate()?;
        Ok(config)
    }

    /// Whether this is an encoder (BERT): every token attends to every other, the prompt is
    /// read in one pass and pooled into an embedding, and nothing is generated.
    pub fn is_encoder(&self) -> bool {
        self.model_type == "bert"
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    pub fn has_qkv_bias(&self) -> bool {
        self.attention_bias.unwrap_or(self.model_type == "qwen2")
    }

    pub fn eos_ids(&self) -> Vec<u32> {
        self.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default()
    }

    /// Number of weights, counting a tied embedding once.
    pub fn parameter_count(&self) -> usize {
        let h = self.hidden_size;
        if self.is_encoder() {
            // q, k, v, o and the two MLP matrices with their biases, two LayerNorms per layer;
            // token, position and token-type embeddings and their LayerNorm.
            let (i, l) = (self.intermediate_size, self.num_hidden_layers);
            let layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 4 * h;
            return l * layer + (self.vocab_size + self.position_rows() + 2) * h + 2 * h;
        }
        let q = self.num_attention_heads * self.head_dim();
        let kv = self.kv_heads() * self.head_dim();
        let bias = if self.has_qkv_bias() { q + 2 * kv } else { 0 };
        let attn = h * q + 2 * h * kv + q * h + bias;
        let mlp = 3 * h * self.intermediate_size;
        let norms = 2 * h;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        self.num_hidden_layers * (attn + mlp + norms) + embed + head + h
    }

    /// Parameters of the RMSNorm weights (two per layer and the final one), which every engine
    /// keeps in f32.
    pub fn norm_parameter_count(&self) -> usize {
        if self.is_encoder() {
            // Weight and bias of two LayerNorms per layer and the embeddings'.
            return (4 * self.num_hidden_layers + 2) * self.hidden_size;
        }
        (2 * self.num_hidden_layers + 1) * self.hidden_size
    }

    /// Rows of a BERT encoder's position table (at least its context).
    pub fn position_rows(&self) -> usize {
        self.position_table_rows.unwrap_or(self.max_position_embeddings)
    }

    pub fn validate(&self) -> Result<()> {
        if self.is_encoder() {
            return self.validate_encoder();
        }
        let supported = ["llama", "qwen2", "mistral"];
        if !supported.contains(&self.model_type.as_str()) {
            return Err(Error::Config(format!(
                "model_type `{}` is not supported; Headroom runs Llama-family models ({}) and BERT encoders (bert) for embeddings",
                self.model_type,
                supported.join(", ")
            )));
        }
        if self.hidden_act != "silu" {
            return Err(Error::Config(format!(
                "hidden_act `{}` is not supported (only silu, as in Llama)",
                self.hidden_act
            )));
        }
        if self.num_attention_heads == 0 || self.num_hidden_layers == 0 || self.hidden_size == 0 {
            return Err(Error::Config(
                "hidden_size, num_hidden_layers and num_attention_heads must be positive".into(),
            ));
        }
        if self.num_attention_heads % self.kv_heads() != 0 {
            return Err(Error::Config(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.kv_heads()
            )));
        }
        if self.head_dim() % 2 != 0 {
            return Err(Error::Config(format!(
                "head_dim {} must be even for rotary embeddings",
                self.head_dim()
            )));
        }
        if let Some(scaling) = &self.rope_scaling {
            match scaling.rope_type.as_str() {
                "linear" | "llama3" | "default" => {}
                other => {
                    return Err(Error::Config(format!(
                        "rope_scaling type `{other}` is not supported (linear, llama3)"
                    )))
                }
            }
        }
        Ok(())
    }

    fn validate_encoder(&self) -> Result<()> {
        if self.hidden_act != "gelu" {
            return Err(Error::Config(format!("hidden_act `{}` is not supported in a BERT encoder (only gelu)", self.hidden_act)));
        }
        if self.num_attention_heads == 0 || self.num_hidden_layers == 0 || !self.hidden_size.is_multiple_of(self.num_attention_heads.max(1)) {
            return Err(Error::Config("num_hidden_layers and num_attention_heads must be positive, and hidden_size a multiple of num_attention_heads".into()));
        }
        Ok(())
    }

    /// Inverse frequencies of the rotary embedding, with `rope_scaling` applied.
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let freqs = self.scaled_inv_freq();
        match &self.rope_freq_factors {
            Some(factors) => freqs.iter().zip(factors.iter().chain(std::iter::repeat(&1.0))).map(|(f, d)| f / d).collect(),
            None => freqs,
        }
    }

    fn scaled_inv_freq(&self) -> Vec<f64> {
        let dim = self.head_dim();
        let base: Vec<f64> = (0..dim / 2)
            .map(|i| 1.0 / self.rope_theta.powf(2.0 * i as f64 / dim as f64))
            .collect();
        let Some(scaling) = &self.rope_scaling else {
            return base;
        };
        let factor = scaling.factor.unwrap_or(1.0);
        match scaling.rope_type.as_str() {
            "linear" => base.into_iter().map(|f| f / factor).collect(),
            "llama3" => {
                let low = scaling.low_freq_factor.unwrap_or(1.0);
                let high = scaling.high_freq_factor.unwrap_or(4.0);
                let old_ctx = scaling.original_max_position_embeddings.unwrap_or(8192) as f64;
                let low_wavelen = old_ctx / low;
                let high_wavelen = old_ctx / high;
                base.into_iter()
                    .map(|freq| {
                        let wavelen = 2.0 * std::f64::consts::PI / freq;
                        if wavelen < high_wavelen {
                            freq
                        } else if wavelen > low_wavelen {
                            freq / factor
                        } else {
                            let smooth = (old_ctx / wavelen - low) / (high - low);
                            (1.0 - smooth) * freq / factor + smooth * freq
                        }
                    })
                    .collect()
            }
            _ => base,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// all-MiniLM-L6-v2's config.json (models/PROVENANCE.md).
    const MINILM: &str = r#"{"architectures": ["BertModel"], "hidden_act": "gelu", "hidden_size": 384, "intermediate_size": 1536,
        "layer_norm_eps": 1e-12, "max_position_embeddings": 512, "model_type": "bert", "num_attention_heads": 12,
        "num_hidden_layers": 6, "pad_token_id": 0, "position_embedding_type": "absolute", "type_vocab_size": 2, "vocab_size": 30522}"#;

    #[test]
    fn a_bert_config_is_an_encoder_counted_as_its_weights_load() {
        let config = LlamaConfig::from_json(MINILM).unwrap();
        assert!(config.is_encoder());
        // The file's 22,713,216 f32 values less the pooler (384 × 384 + 384), which embeddings
        // do not use and the encoder does not load.
        assert_eq!(config.parameter_count(), 22_713_216 - 147_840);
        assert_eq!(config.norm_parameter_count(), 9_984, "the file's LayerNorm values");
        let relu = MINILM.replace("\"gelu\"", "\"relu\"");
        assert!(LlamaConfig::from_json(&relu).unwrap_err().to_string().contains("only gelu"));
        let other = MINILM.replace("\"bert\"", "\"t5\"");
        assert!(LlamaConfig::from_json(&other).unwrap_err().to_string().contains("BERT encoders"));
    }
}
