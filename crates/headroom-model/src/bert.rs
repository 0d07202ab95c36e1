//! BERT encoders, the embedding models of sentence-transformers (all-MiniLM-L6-v2 and its
//! kin): post-LayerNorm layers whose tokens all attend to each other, GELU, learned absolute
//! positions. A prompt is read in one pass, never in chunks, and its last hidden states are
//! summed for mean pooling ([`crate::Session::embedding`] divides and normalizes, as the
//! model's Pooling and Normalize modules do). Nothing is generated: there is no KV cache.
//!
//! This is burn's implementation, which a CUDA worker runs; the CPU worker and the sim GPU run
//! the same model on the CPU engine's kernels ([`crate::cpu::CpuBert`], checked against this
//! one in `tests/encoder.rs`). Weights stay f32 on every device: an encoder reads each weight
//! once per prompt, not once per token, so halving them buys little, and they are small
//! (MiniLM-L6: 91 MB).

use std::path::Path;

use burn::nn::Linear;
use burn::tensor::activation::{gelu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};

use crate::config::LlamaConfig;
use crate::weights::{load_linear, TensorSource, WeightFiles};
use crate::{Error, Result};

/// Prompts are padded to a multiple of this many tokens, the padding hidden from attention and
/// pooling: a GPU compiles its kernels per shape, and this way it compiles a few lengths at
/// warm-up ([`Bert::warm_up_lengths`]) instead of one per prompt length while a request waits.
pub const LENGTH_BUCKET: usize = 16;

/// LayerNorm over the last axis: `(x − mean) / √(var + eps) · weight + bias`.
#[derive(Debug, Clone)]
struct LayerNorm<B: Backend> {
    weight: Tensor<B, 1>,
    bias: Tensor<B, 1>,
    eps: f64,
}

impl<B: Backend> LayerNorm<B> {
    fn load(files: &impl TensorSource, prefix: &str, config: &LlamaConfig, device: &B::Device) -> Result<Self> {
        let h = config.hidden_size;
        let read = |name: &str| -> Result<Tensor<B, 1>> {
            let values = files.read_shaped(&format!("{prefix}.{name}"), &[h])?;
            Ok(Tensor::from_data(TensorData::new(values, [h]), device))
        };
        Ok(Self { weight: read("weight")?, bias: read("bias")?, eps: config.layer_norm_eps.unwrap_or(1e-12) })
    }

    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let mean = x.clone().mean_dim(2);
        let centered = x - mean;
        let variance = (centered.clone() * centered.clone()).mean_dim(2);
        centered * (variance + self.eps).sqrt().recip() * self.weight.clone().unsqueeze::<3>() + self.bias.clone().unsqueeze::<3>()
    }
}

#[derive(Debug, Clone)]
struct EncoderLayer<B: Backend> {
    query: Linear<B>,
    key: Linear<B>,
    value: Linear<B>,
    attention_out: Linear<B>,
    attention_norm: LayerNorm<B>,
    intermediate: Linear<B>,
    output: Linear<B>,
    output_norm: LayerNorm<B>,
}

/// A BERT encoder loaded on a burn device.
#[derive(Debug, Clone)]
pub struct Bert<B: Backend> {
    words: Tensor<B, 2>,
    positions: Tensor<B, 2>,
    /// Token type 0's row: every token of a single input has type 0.
    token_type: Tensor<B, 1>,
    embedding_norm: LayerNorm<B>,
    layers: Vec<EncoderLayer<B>>,
    heads: usize,
}

impl<B: Backend> Bert<B> {
    /// Loads the encoder from a folder's tensors (Hugging Face names, with or without the
    /// `bert.` prefix of checkpoints saved with a head), checking every shape against `config`.
    pub fn load(files: &WeightFiles, config: &LlamaConfig, device: &B::Device, mut on_layer: impl FnMut(usize, usize)) -> Result<Self> {
        let named = tensor_names(files);
        let (h, i, layers) = (config.hidden_size, config.intermediate_size, config.num_hidden_layers);
        let table = |name: &str, rows: usize| -> Result<Tensor<B, 2>> {
            let values = files.read_shaped(&named(name), &[rows, h])?;
            Ok(Tensor::from_data(TensorData::new(values, [rows, h]), device))
        };
        let words = table("embeddings.word_embeddings.weight", config.vocab_size)?;
        let positions = table("embeddings.position_embeddings.weight", config.position_rows())?;
        let token_type = Tensor::from_data(TensorData::new(token_type_row(files, config)?, [h]), device);
        let embedding_norm = LayerNorm::load(files, &named("embeddings.LayerNorm"), config, device)?;
        let mut loaded = Vec::with_capacity(layers);
        for l in 0..layers {
            let p = named(&format!("encoder.layer.{l}"));
            let linear = |name: &str, d_in: usize, d_out: usize| load_linear::<B>(files, &format!("{p}.{name}"), d_in, d_out, true, DType::F32, device);
            loaded.push(EncoderLayer {
                query: linear("attention.self.query", h, h)?,
                key: linear("attention.self.key", h, h)?,
                value: linear("attention.self.value", h, h)?,
                attention_out: linear("attention.output.dense", h, h)?,
                attention_norm: LayerNorm::load(files, &format!("{p}.attention.output.LayerNorm"), config, device)?,
                intermediate: linear("intermediate.dense", h, i)?,
                output: linear("output.dense", i, h)?,
                output_norm: LayerNorm::load(files, &format!("{p}.output.LayerNorm"), config, device)?,
            });
            on_layer(l + 1, layers);
        }
        Ok(Self { words, positions, token_type, embedding_norm, layers: loaded, heads: config.num_attention_heads })
    }

    /// The prompt lengths a padded prompt has, up to `context` tokens: the shapes to compile.
    pub fn warm_up_lengths(&self, context: usize) -> Vec<usize> {
        let longest = self.padded(context);
        (LENGTH_BUCKET..=longest).step_by(LENGTH_BUCKET).chain((!longest.is_multiple_of(LENGTH_BUCKET)).then_some(longest)).collect()
    }

    fn padded(&self, n: usize) -> usize {
        n.div_ceil(LENGTH_BUCKET).saturating_mul(LENGTH_BUCKET).min(self.positions.dims()[0]).max(n)
    }

    /// The last hidden states of `tokens` and of the padding after them (one input,
    /// `[1, padded length, hidden]`; rows past `tokens.len()` are padding's).
    fn encode(&self, tokens: &[u32]) -> Tensor<B, 3> {
        let device = self.words.device();
        let n = tokens.len();
        let padded = self.padded(n);
        let ids: Vec<i64> = tokens.iter().map(|&id| id as i64).chain(std::iter::repeat_n(0, padded - n)).collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [padded]), &device);
        let embedded = self.words.clone().select(0, ids) + self.positions.clone().narrow(0, 0, padded) + self.token_type.clone().unsqueeze::<2>();
        let mut x = self.embedding_norm.forward(embedded.unsqueeze::<3>());
        // No token sees the padding. Test-only: nor a later token, as in a decoder (the defect
        // the embedding test's control runs). Masked even with no padding: one kernel path for
        // every length, the one the warm-up compiled.
        let causal = crate::test_defect("encoder-causal");
        let hidden: Vec<bool> = (0..padded).flat_map(|r| (0..padded).map(move |c| c >= n || (causal && c > r))).collect();
        let mask = Tensor::<B, 2, Bool>::from_data(TensorData::new(hidden, [padded, padded]), &device);
        for layer in &self.layers {
            let attended = layer.attention_out.forward(self.attend(layer, x.clone(), &mask));
            x = layer.attention_norm.forward(attended + x);
            let up = gelu(layer.intermediate.forward(x.clone()));
            x = layer.output_norm.forward(layer.output.forward(up) + x);
        }
        x
    }

    fn attend(&self, layer: &EncoderLayer<B>, x: Tensor<B, 3>, mask: &Tensor<B, 2, Bool>) -> Tensor<B, 3> {
        let [batch, n, hidden] = x.dims();
        let (h, d) = (self.heads, hidden / self.heads);
        let split = |t: Tensor<B, 3>| t.reshape([batch, n, h, d]).swap_dims(1, 2);
        let q = split(layer.query.forward(x.clone()));
        let k_t = split(layer.key.forward(x.clone())).swap_dims(2, 3);
        let v = split(layer.value.forward(x));
        let scores = q.matmul(k_t) * (1.0 / (d as f64).sqrt());
        let scores = scores.mask_fill(mask.clone().unsqueeze::<4>(), f32::NEG_INFINITY);
        softmax(scores, 3).matmul(v).swap_dims(1, 2).reshape([batch, n, hidden])
    }

    /// The sum of `tokens`' last hidden states (`hidden_size` values): what mean pooling
    /// divides by their count.
    pub fn pooled_sum(&self, tokens: &[u32]) -> Vec<f32> {
        self.encode(tokens).narrow(1, 0, tokens.len()).sum_dim(1).into_data().convert::<f32>().into_vec::<f32>().expect("hidden states are f32 after convert")
    }
}

/// A tensor's name in `files`: with the `bert.` prefix of checkpoints saved with a head, or
/// without it (sentence-transformers' folders).
pub(crate) fn tensor_names(files: &WeightFiles) -> impl Fn(&str) -> String {
    let prefix = if files.contains("bert.embeddings.word_embeddings.weight") { "bert." } else { "" };
    move |name| format!("{prefix}{name}")
}

/// Token type 0's embedding: every token of a single input has type 0.
pub(crate) fn token_type_row(files: &WeightFiles, config: &LlamaConfig) -> Result<Vec<f32>> {
    let h = config.hidden_size;
    let (types, shape) = files.read_f32(&tensor_names(files)("embeddings.token_type_embeddings.weight"))?;
    if shape.len() != 2 || shape[1] != h || shape[0] == 0 {
        return Err(Error::Weights(format!("token_type_embeddings has shape {shape:?}; expected [types, {h}]")));
    }
    Ok(types[..h].to_vec())
}

/// What a sentence-transformers folder says beside the weights: the length the model was
/// trained to embed (`sentence_bert_config.json`'s `max_seq_length`), and that it pools by
/// the mean of the tokens (`1_Pooling/config.json`), the one pooling Headroom runs.
pub(crate) fn read_folder(dir: &Path, config: &mut LlamaConfig) -> Result<()> {
    let read = |name: &str| crate::bundle::read_json(&dir.join(name));
    if let Some(pooling) = read("1_Pooling/config.json")? {
        let modes: Vec<&str> = pooling.as_object().into_iter().flatten().filter(|(k, v)| k.starts_with("pooling_mode_") && v.as_bool() == Some(true)).map(|(k, _)| k.as_str()).collect();
        if modes != ["pooling_mode_mean_tokens"] {
            return Err(Error::Config(format!(
                "{} pools with {modes:?}; Headroom embeds with mean pooling only (pooling_mode_mean_tokens)",
                dir.join("1_Pooling/config.json").display()
            )));
        }
    }
    if let Some(limit) = read("sentence_bert_config.json")?.and_then(|c| c["max_seq_length"].as_u64()) {
        let limit = limit as usize;
        if limit > 0 && limit < config.max_position_embeddings {
            config.position_table_rows = Some(config.max_position_embeddings);
            config.max_position_embeddings = limit;
        }
    }
    Ok(())
}

/// An encoder keeps nothing between calls: a prompt is read whole, in one call.
pub struct NoCache;

impl<B: Backend> crate::Decoder for Bert<B> {
    type Cache = NoCache;
    fn new_cache(&self, _config: &LlamaConfig, _capacity: usize) -> NoCache {
        NoCache
    }
    fn feed(&self, _tokens: &[u32], _cache: &mut NoCache) -> Vec<f32> {
        unreachable!("an encoder generates nothing: Session::start refuses a generation for it")
    }
    fn feed_pooled(&self, tokens: &[u32], _cache: &mut NoCache) -> Vec<f32> {
        self.pooled_sum(tokens)
    }
}
