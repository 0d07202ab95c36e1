//! The Llama-family decoder: RMSNorm, rotary embeddings (rotate-half convention, as in Hugging
//! Face), grouped-query attention over a preallocated KV cache, SwiGLU, tied or untied head.
//! One implementation serves inference (any backend) and training (autodiff backends).

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use crate::config::LlamaConfig;

#[derive(Module, Debug)]
pub struct RmsNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> RmsNorm<B> {
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let variance = (x.clone() * x.clone()).mean_dim(2);
        let inv = (variance + self.eps).sqrt().recip();
        x * inv * self.weight.val().unsqueeze::<3>()
    }
}

#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

#[derive(Module, Debug)]
pub struct Mlp<B: Backend> {
    pub gate_proj: Linear<B>,
    pub up_proj: Linear<B>,
    pub down_proj: Linear<B>,
}

impl<B: Backend> Mlp<B> {
    fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        let gate = silu(self.gate_proj.forward(x.clone()));
        self.down_proj.forward(gate * self.up_proj.forward(x))
    }
}

#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    pub post_attention_layernorm: RmsNorm<B>,
    pub mlp: Mlp<B>,
}

#[derive(Module, Debug)]
pub struct Llama<B: Backend> {
    pub embed_tokens: Embedding<B>,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: RmsNorm<B>,
    /// `None` when the output head is tied to the input embedding.
    pub lm_head: Option<Linear<B>>,
}

/// Cosine and sine tables for every position up to the context length, `[positions, head_dim]`.
#[derive(Debug, Clone)]
pub struct RopeTables<B: Backend> {
    pub(crate) cos: Tensor<B, 2>,
    pub(crate) sin: Tensor<B, 2>,
    pub max_positions: usize,
}

impl<B: Backend> RopeTables<B> {
    pub fn new(config: &LlamaConfig, max_positions: usize, device: &B::Device) -> Self {
        let inv_freq = config.rope_inv_freq();
        let half = inv_freq.len();
        let dim = half * 2;
        let mut cos = Vec::with_capacity(max_positions * dim);
        let mut sin = Vec::with_capacity(max_positions * dim);
        for pos in 0..max_positions {
            // Both halves use the same frequencies (rotate-half layout).
            for _ in 0..2 {
                for f in &inv_freq {
                    let angle = pos as f64 * f;
                    cos.push(angle.cos() as f32);
                    sin.push(angle.sin() as f32);
                }
            }
        }
        Self {
            cos: Tensor::from_data(TensorData::new(cos, [max_positions, dim]), device),
            sin: Tensor::from_data(TensorData::new(sin, [max_positions, dim]), device),
            max_positions,
        }
    }

    /// Rotates `x: [batch, heads, seq, head_dim]` whose first token sits at `start`.
    fn apply(&self, x: Tensor<B, 4>, start: usize) -> Tensor<B, 4> {
        let [_, _, seq, dim] = x.dims();
        let cos = self.cos.clone().narrow(0, start, seq).unsqueeze::<4>();
        let sin = self.sin.clone().narrow(0, start, seq).unsqueeze::<4>();
        let x1 = x.clone().narrow(3, 0, dim / 2);
        let x2 = x.clone().narrow(3, dim / 2, dim / 2);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        x * cos + rotated * sin
    }
}

pub(crate) type LayerCache<B> = (Option<Tensor<B, 4>>, Option<Tensor<B, 4>>);

/// Keys and values for every layer, allocated once for the whole request (prompt + max_tokens)
/// so a running generation never grows its memory.
///
/// Layout is chosen so attention reads the cache in place: burn-ndarray re-lays out any
/// non-contiguous matmul operand (a transposed or narrowed view) by an element-wise copy, so keys
/// are stored already transposed and attention always spans the whole capacity, with positions
/// not yet written masked out, instead of narrowing the cache to the filled part.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    /// Per layer (keys `[1, kv_heads, head_dim, capacity]`, values
    /// `[1, kv_heads, capacity, head_dim]`). Held in an `Option` so a step can take sole
    /// ownership and the backend writes new entries in place, not by copy.
    pub(crate) layers: Vec<LayerCache<B>>,
    /// Tokens already stored.
    pub len: usize,
    pub capacity: usize,
}

impl<B: Backend> KvCache<B> {
    pub fn new(config: &LlamaConfig, capacity: usize, device: &B::Device) -> Self {
        let (kvh, d) = (config.kv_heads(), config.head_dim());
        let layers = (0..config.num_hidden_layers)
            .map(|_| {
                (
                    Some(Tensor::zeros([1, kvh, d, capacity], device)),
                    Some(Tensor::zeros([1, kvh, capacity, d], device)),
                )
            })
            .collect();
        Self {
            layers,
            len: 0,
            capacity,
        }
    }

    /// Bytes held by the cache: 2 × layers × kv_heads × head_dim × 4 bytes × capacity.
    pub fn bytes(config: &LlamaConfig, capacity: usize) -> usize {
        2 * config.num_hidden_layers * config.kv_heads() * config.head_dim() * 4 * capacity
    }
}

impl<B: Backend> Attention<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        start: usize,
        mask: Option<&Tensor<B, 2, Bool>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let [batch, seq, _] = x.dims();
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let q = self
            .q_proj
            .forward(x.clone())
            .reshape([batch, seq, h, d])
            .swap_dims(1, 2);
        let k = self
            .k_proj
            .forward(x.clone())
            .reshape([batch, seq, kvh, d])
            .swap_dims(1, 2);
        let v = self
            .v_proj
            .forward(x)
            .reshape([batch, seq, kvh, d])
            .swap_dims(1, 2);
        let q = rope.apply(q, start);
        // Keys as `[batch, kv_heads, head_dim, seq]`: the layout q·kᵀ wants.
        let k_t = rope.apply(k, start).swap_dims(2, 3);

        let (k_t, v) = match cache {
            Some((k_cache, v_cache)) => {
                let end = start + seq;
                let new_k = k_cache
                    .take()
                    .expect("cache layer present between steps")
                    .slice_assign([0..batch, 0..kvh, 0..d, start..end], k_t);
                let new_v = v_cache
                    .take()
                    .expect("cache layer present between steps")
                    .slice_assign([0..batch, 0..kvh, start..end, 0..d], v);
                *k_cache = Some(new_k.clone());
                *v_cache = Some(new_v.clone());
                (new_k, new_v)
            }
            None => (k_t, v),
        };

        // Grouped-query attention without copying K/V: the `rep` query heads that share a KV
        // head are stacked along the sequence axis, so one batched matmul serves them all.
        let rep = h / kvh;
        let q = q.reshape([batch, kvh, rep * seq, d]);
        let scores = q.matmul(k_t) * (1.0 / (d as f64).sqrt());
        let scores = match mask {
            Some(mask) => scores.mask_fill(mask.clone().unsqueeze::<4>(), f32::NEG_INFINITY),
            None => scores,
        };
        let probs = softmax(scores, 3);
        let out = probs
            .matmul(v)
            .reshape([batch, h, seq, d])
            .swap_dims(1, 2)
            .reshape([batch, seq, h * d]);
        self.o_proj.forward(out)
    }
}

/// `true` where a query (row `r`, absolute position `start + r % seq`) may not see key `j`.
fn causal_mask<B: Backend>(
    rep: usize,
    seq: usize,
    start: usize,
    total: usize,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    let mut mask = Vec::with_capacity(rep * seq * total);
    for _ in 0..rep {
        for i in 0..seq {
            let pos = start + i;
            mask.extend((0..total).map(|j| j > pos));
        }
    }
    Tensor::from_data(TensorData::new(mask, [rep * seq, total]), device)
}

impl<B: Backend> DecoderLayer<B> {
    fn forward(
        &self,
        x: Tensor<B, 3>,
        rope: &RopeTables<B>,
        start: usize,
        mask: Option<&Tensor<B, 2, Bool>>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let attn = self.self_attn.forward(
            self.input_layernorm.forward(x.clone()),
            rope,
            start,
            mask,
            cache,
        );
        let x = x + attn;
        let mlp = self.mlp.forward(self.post_attention_layernorm.forward(x.clone()));
        x + mlp
    }
}

impl<B: Backend> Llama<B> {
    /// Hidden states after the final norm, `[batch, seq, hidden]`.
    pub fn hidden(
        &self,
        tokens: Tensor<B, 2, Int>,
        rope: &RopeTables<B>,
        start: usize,
        mut cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let seq = tokens.dims()[1];
        let mut x = self.embed_tokens.forward(tokens);
        // With a cache, attention spans its whole capacity, so unwritten slots are masked even
        // for a single new token; without one, only a multi-token sequence needs a mask.
        let keys = cache.as_ref().map_or(seq, |c| c.capacity);
        let mask = (keys > start + 1 || seq > 1).then(|| {
            let attn = &self.layers[0].self_attn;
            causal_mask::<B>(attn.n_heads / attn.n_kv_heads, seq, start, keys, &x.device())
        });
        for (i, layer) in self.layers.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = layer.forward(x, rope, start, mask.as_ref(), layer_cache);
        }
        if let Some(cache) = cache {
            cache.len = start + seq;
        }
        self.norm.forward(x)
    }

    /// Vocabulary logits for hidden states `[batch, seq, hidden]`.
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => {
                // E·hᵀ rather than h·Eᵀ: the embedding `[vocab, hidden]` is used as stored, so
                // no `[hidden, vocab]` copy of it is made per call (for one token hᵀ is free).
                let [batch, seq, dim] = hidden.dims();
                let weight = self.embed_tokens.weight.val();
                let vocab = weight.dims()[0];
                weight
                    .matmul(hidden.reshape([batch * seq, dim]).transpose())
                    .transpose()
                    .reshape([batch, seq, vocab])
            }
        }
    }

    /// Logits for every position: what training needs.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, rope: &RopeTables<B>) -> Tensor<B, 3> {
        self.logits(self.hidden(tokens, rope, 0, None))
    }

    /// Feeds `tokens` (one sequence) at position `cache.len` and returns the logits of the last.
    /// (The CPU workers run [`crate::cpu::CpuModel`]; this is the GPU path and the reference.)
    pub fn step(&self, tokens: &[u32], rope: &RopeTables<B>, cache: &mut KvCache<B>) -> Vec<f32> {
        let device = self.embed_tokens.weight.device();
        let ids: Vec<i64> = tokens.iter().map(|&t| t as i64).collect();
        let seq = ids.len();
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, seq]), &device);
        let start = cache.len;
        let hidden = self.hidden(input, rope, start, Some(cache));
        let last = hidden.narrow(1, seq - 1, 1);
        let logits = self.logits(last);
        logits
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .expect("logits are f32 after convert")
    }
}
