//! The Llama-family decoder: RMSNorm, rotary embeddings (rotate-half convention, as in Hugging
//! Face), grouped-query attention over a preallocated KV cache, SwiGLU, tied or untied head.
//! One implementation serves inference (any backend) and training (autodiff backends).

use burn::module::{Module, Param};
use burn::nn::{Embedding, Linear};
use burn::tensor::activation::{silu, softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};

use crate::config::LlamaConfig;
use crate::generate::Next;

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
        // Cast once for the two products that read it.
        let x = as_type(x, matrix_type(&self.gate_proj));
        let gate = silu(project(&self.gate_proj, x.clone()));
        project(&self.down_proj, gate * project(&self.up_proj, x))
    }
}

/// `x·W + b` with `W` (and `b`) in the type they were loaded as, f16 or bf16 on a GPU: `x` is
/// cast to it for the product (where the caller has not already) and the product comes back in
/// f32, so norms, RoPE, softmax and the residual stream stay f32.
fn project<B: Backend>(layer: &Linear<B>, x: Tensor<B, 3>) -> Tensor<B, 3> {
    as_type(layer.forward(as_type(x, matrix_type(layer))), DType::F32)
}

fn matrix_type<B: Backend>(layer: &Linear<B>) -> DType {
    layer.weight.val().dtype()
}

/// `x` in `dtype`, not copied when it already is.
fn as_type<B: Backend, const D: usize>(x: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    if x.dtype() == dtype {
        x
    } else {
        x.cast(dtype)
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

/// How many positions a block of the cache holds: the CPU engine's block, so both engines and
/// admission count the cache in the same units.
pub const KV_BLOCK: usize = crate::cpu::KEY_BLOCK;

/// Blocks a cache of `capacity` positions holding `blocks` blocks holds once it has `positions`:
/// twice as many as before when it must grow (whole blocks, at most its capacity), so a
/// sequence grows its cache a handful of times, each time by one copy.
pub fn grown_blocks(blocks: usize, positions: usize, capacity: usize) -> usize {
    let needed = positions.div_ceil(KV_BLOCK);
    if needed <= blocks {
        blocks
    } else {
        needed.max(2 * blocks).min(capacity.div_ceil(KV_BLOCK).max(needed))
    }
}

/// One layer's keys and values: whole blocks of [`KV_BLOCK`] positions laid end to end, grown
/// (see [`grown_blocks`]) as positions are written, so a request holds about the memory it used
/// rather than its whole capacity. Attention reads them in place.
#[derive(Debug, Clone)]
pub(crate) struct LayerBlocks<B: Backend> {
    /// `[1, kv_heads, head_dim, blocks × KV_BLOCK]`: keys stored transposed, the layout q·kᵀ
    /// wants. `None` before the first write, and while a step writes.
    keys: Option<Tensor<B, 4>>,
    /// `[1, kv_heads, blocks × KV_BLOCK, head_dim]`.
    values: Option<Tensor<B, 4>>,
    blocks: usize,
}

impl<B: Backend> LayerBlocks<B> {
    fn new() -> Self {
        Self { keys: None, values: None, blocks: 0 }
    }

    /// Stores the new keys `k_t: [1, kv_heads, head_dim, seq]` and values
    /// `v: [1, kv_heads, seq, head_dim]` at positions `start..start + seq` of a cache of
    /// `capacity` positions and gives all its keys and values (positions past the written ones
    /// are zeros, which the causal mask hides).
    fn write(&mut self, k_t: Tensor<B, 4>, v: Tensor<B, 4>, start: usize, capacity: usize) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [batch, kvh, d, seq] = k_t.dims();
        let end = start + seq;
        let device = k_t.device();
        let blocks = grown_blocks(self.blocks, end, capacity);
        let (mut keys, mut values) = (self.keys.take(), self.values.take());
        if blocks > self.blocks {
            let more = (blocks - self.blocks) * KV_BLOCK;
            let zeros_k = Tensor::zeros([batch, kvh, d, more], &device);
            let zeros_v = Tensor::zeros([batch, kvh, more, d], &device);
            // Test-only: growing drops what was written (the defect growth invites).
            let keep = !crate::test_defect("kv-grow-drops-old");
            keys = Some(match keys.filter(|_| keep) {
                Some(old) => Tensor::cat(vec![old, zeros_k], 3),
                None => Tensor::zeros([batch, kvh, d, blocks * KV_BLOCK], &device),
            });
            values = Some(match values.filter(|_| keep) {
                Some(old) => Tensor::cat(vec![old, zeros_v], 2),
                None => Tensor::zeros([batch, kvh, blocks * KV_BLOCK, d], &device),
            });
            self.blocks = blocks;
        }
        // Sole handles: the backend writes in place.
        let keys = keys.expect("a cache layer holds keys once grown").slice_assign([0..batch, 0..kvh, 0..d, start..end], k_t);
        let values = values.expect("a cache layer holds values once grown").slice_assign([0..batch, 0..kvh, start..end, 0..d], v);
        self.keys = Some(keys.clone());
        self.values = Some(values.clone());
        (keys, values)
    }
}

/// Keys and values for every layer, in whole blocks of [`KV_BLOCK`] positions grown as they are
/// written (see [`grown_blocks`]), up to the request's capacity (prompt + max_tokens), which
/// admission reserves.
///
/// Attention spans the blocks held, with positions not yet written masked out, and reads them
/// in place: keys are stored already transposed, since burn-ndarray re-lays out any
/// non-contiguous matmul operand by an element-wise copy. (A table of separate blocks would make
/// attention gather them every step: one copy, and on CUDA a launch per block.)
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    pub(crate) layers: Vec<LayerBlocks<B>>,
    /// Tokens already stored.
    pub len: usize,
    pub capacity: usize,
    /// Bytes of one block of every layer.
    block_bytes: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache of every layer (its blocks are made on the device of the first keys
    /// written).
    pub fn new(config: &LlamaConfig, capacity: usize) -> Self {
        Self::for_layers(config, config.num_hidden_layers, capacity)
    }

    /// A cache of `layers` layers (a split model's GPU part holds only its own).
    pub fn for_layers(config: &LlamaConfig, layers: usize, capacity: usize) -> Self {
        let block_bytes = 2 * layers * config.kv_heads() * config.head_dim() * 4 * KV_BLOCK;
        Self { layers: (0..layers).map(|_| LayerBlocks::new()).collect(), len: 0, capacity, block_bytes }
    }

    /// Bytes the cache may grow to: 2 × layers × kv_heads × head_dim × 4 bytes × capacity.
    pub fn bytes(config: &LlamaConfig, capacity: usize) -> usize {
        2 * config.num_hidden_layers * config.kv_heads() * config.head_dim() * 4 * capacity
    }

    /// Blocks held now (of every layer).
    pub fn blocks(&self) -> usize {
        self.layers.first().map_or(0, |layer| layer.blocks)
    }

    /// Bytes held now.
    pub fn resident_bytes(&self) -> usize {
        self.blocks() * self.block_bytes
    }
}

/// One sequence's place in a step through one layer: the RoPE table of its positions, where its
/// new tokens start, its causal mask and (when decoding) its cache of that layer.
struct Row<'a, B: Backend> {
    rope: &'a RopeTables<B>,
    start: usize,
    mask: Option<&'a Tensor<B, 2, Bool>>,
    cache: Option<&'a mut LayerBlocks<B>>,
    /// Positions the cache may hold (prompt + max_tokens).
    capacity: usize,
}

impl<B: Backend> Attention<B> {
    /// `rows` holds one row for the whole batch (training, or a lone sequence) or one per
    /// sequence (a batched decode step). The projections read their weights once for the whole
    /// batch either way; each sequence then attends over its own cache at its own position.
    fn forward(&self, x: Tensor<B, 3>, rows: &mut [Row<'_, B>]) -> Tensor<B, 3> {
        // Cast once for the three products that read it.
        let x = as_type(x, matrix_type(&self.q_proj));
        let q = project(&self.q_proj, x.clone());
        let k = project(&self.k_proj, x.clone());
        let v = project(&self.v_proj, x);
        let out = match rows {
            [row] => self.attend(q, k, v, row),
            rows => {
                assert_eq!(rows.len(), q.dims()[0], "one row per sequence of the batch");
                let outs = rows
                    .iter_mut()
                    .enumerate()
                    .map(|(b, row)| self.attend(q.clone().narrow(0, b, 1), k.clone().narrow(0, b, 1), v.clone().narrow(0, b, 1), row))
                    .collect();
                Tensor::cat(outs, 0)
            }
        };
        project(&self.o_proj, out)
    }

    /// Attention of projected queries, keys and values `[batch, seq, heads × head_dim]` that
    /// share `row`'s positions and cache.
    fn attend(&self, q: Tensor<B, 3>, k: Tensor<B, 3>, v: Tensor<B, 3>, row: &mut Row<'_, B>) -> Tensor<B, 3> {
        let [batch, seq, _] = q.dims();
        let (h, kvh, d) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let start = row.start;
        let q = q.reshape([batch, seq, h, d]).swap_dims(1, 2);
        let k = k.reshape([batch, seq, kvh, d]).swap_dims(1, 2);
        let v = v.reshape([batch, seq, kvh, d]).swap_dims(1, 2);
        let q = row.rope.apply(q, start);
        // Keys as `[batch, kv_heads, head_dim, seq]`: the layout q·kᵀ wants.
        let k_t = row.rope.apply(k, start).swap_dims(2, 3);

        let (k_t, v) = match row.cache.as_deref_mut() {
            Some(blocks) => blocks.write(k_t, v, start, row.capacity),
            None => (k_t, v),
        };

        // Grouped-query attention without copying K/V: the `rep` query heads that share a KV
        // head are stacked along the sequence axis, so one batched matmul serves them all.
        let rep = h / kvh;
        let q = q.reshape([batch, kvh, rep * seq, d]);
        let scores = q.matmul(k_t) * (1.0 / (d as f64).sqrt());
        let scores = match row.mask {
            Some(mask) => scores.mask_fill(mask.clone().unsqueeze::<4>(), f32::NEG_INFINITY),
            None => scores,
        };
        let probs = softmax(scores, 3);
        probs
            .matmul(v)
            .reshape([batch, h, seq, d])
            .swap_dims(1, 2)
            .reshape([batch, seq, h * d])
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
    fn forward(&self, x: Tensor<B, 3>, rows: &mut [Row<'_, B>]) -> Tensor<B, 3> {
        let attn = self.self_attn.forward(self.input_layernorm.forward(x.clone()), rows);
        let x = x + attn;
        let mlp = self.mlp.forward(self.post_attention_layernorm.forward(x.clone()));
        x + mlp
    }
}

/// Where one sequence stands at a step: the RoPE table of its positions, the position of its
/// first new token, and its cache (none in training, where whole sequences start at 0).
pub struct Place<'a, B: Backend> {
    pub rope: &'a RopeTables<B>,
    pub start: usize,
    pub cache: Option<&'a mut KvCache<B>>,
}

/// Runs the residual stream `x: [batch, seq, hidden]` through `layers`, each place's cache
/// holding exactly those layers, and advances the caches past the new tokens.
fn run_layers<B: Backend>(layers: &[DecoderLayer<B>], mut x: Tensor<B, 3>, places: &mut [Place<'_, B>]) -> Tensor<B, 3> {
    let seq = x.dims()[1];
    // Test-only: every sequence of a batch takes the first one's position (the defect that
    // batching sequences of different lengths invites).
    if places.len() > 1 && crate::test_defect("batch-positions") {
        let first = places[0].start;
        places.iter_mut().for_each(|p| p.start = first);
    }
    for place in places.iter() {
        if let Some(cache) = place.cache.as_deref() {
            assert_eq!(cache.layers.len(), layers.len(), "a cache holds the layers it is run through");
            assert!(place.start + seq <= cache.capacity, "a cache holds at most its capacity of positions");
        }
    }
    // With a cache, attention spans the blocks it holds, so unwritten slots are masked even for
    // a single new token; without one, only a multi-token sequence needs a mask.
    let attn = &layers[0].self_attn;
    let masks: Vec<Option<Tensor<B, 2, Bool>>> = places
        .iter()
        .map(|place| {
            let keys = place.cache.as_ref().map_or(seq, |c| grown_blocks(c.blocks(), place.start + seq, c.capacity) * KV_BLOCK);
            (keys > place.start + 1 || seq > 1)
                .then(|| causal_mask::<B>(attn.n_heads / attn.n_kv_heads, seq, place.start, keys, &x.device()))
        })
        .collect();
    for (i, layer) in layers.iter().enumerate() {
        let mut rows: Vec<Row<'_, B>> = places
            .iter_mut()
            .zip(&masks)
            .map(|(place, mask)| Row {
                rope: place.rope,
                start: place.start,
                mask: mask.as_ref(),
                capacity: place.cache.as_ref().map_or(0, |c| c.capacity),
                cache: place.cache.as_deref_mut().map(|c| &mut c.layers[i]),
            })
            .collect();
        x = layer.forward(x, &mut rows);
    }
    for place in places.iter_mut() {
        if let Some(cache) = place.cache.as_deref_mut() {
            cache.len = place.start + seq;
        }
    }
    x
}

/// Consecutive decoder layers without the embedding, final norm or head: the GPU's part of a
/// split model ([`crate::split::SplitModel`]), which takes the residual stream from the CPU's
/// layers and hands it back for the rest.
#[derive(Module, Debug)]
pub struct LayerStack<B: Backend> {
    pub layers: Vec<DecoderLayer<B>>,
}

impl<B: Backend> LayerStack<B> {
    /// Runs the residual stream `x: [batch, seq, hidden]` through the layers (see
    /// [`Llama::hidden`] for `places`) and returns it, not normed.
    pub fn forward(&self, x: Tensor<B, 3>, places: &mut [Place<'_, B>]) -> Tensor<B, 3> {
        run_layers(&self.layers, x, places)
    }
}

impl<B: Backend> Llama<B> {
    /// Hidden states after the final norm, `[batch, seq, hidden]`. `places` holds one place
    /// for the whole batch or one per sequence (each with its own position and cache).
    pub fn hidden(&self, tokens: Tensor<B, 2, Int>, places: &mut [Place<'_, B>]) -> Tensor<B, 3> {
        // The residual stream is f32 whatever type the embedding is stored in.
        let x = as_type(self.embed_tokens.forward(tokens), DType::F32);
        self.norm.forward(run_layers(&self.layers, x, places))
    }

    /// Vocabulary logits for hidden states `[batch, seq, hidden]`.
    pub fn logits(&self, hidden: Tensor<B, 3>) -> Tensor<B, 3> {
        match &self.lm_head {
            Some(head) => project(head, hidden),
            None => {
                // E·hᵀ rather than h·Eᵀ: the embedding `[vocab, hidden]` is used as stored, so
                // no `[hidden, vocab]` copy of it is made per call (for one token hᵀ is free).
                let [batch, seq, dim] = hidden.dims();
                let weight = self.embed_tokens.weight.val();
                let vocab = weight.dims()[0];
                let hidden = as_type(hidden.reshape([batch * seq, dim]), weight.dtype());
                as_type(weight.matmul(hidden.transpose()).transpose().reshape([batch, seq, vocab]), DType::F32)
            }
        }
    }

    /// Logits for every position: what training needs.
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, rope: &RopeTables<B>) -> Tensor<B, 3> {
        self.logits(self.hidden(tokens, &mut [Place { rope, start: 0, cache: None }]))
    }

    /// Feeds `tokens` (one sequence) at position `cache.len` and returns the logits of the last.
    /// (The CPU workers run [`crate::cpu::CpuModel`]; this is the GPU path and the reference.)
    pub fn step(&self, tokens: &[u32], rope: &RopeTables<B>, cache: &mut KvCache<B>) -> Vec<f32> {
        let start = cache.len;
        match self.last(&[tokens], &mut [Place { rope, start, cache: Some(cache) }], &[false]).pop() {
            Some(Next::Logits(logits)) => logits,
            _ => unreachable!("logits were asked for"),
        }
    }

    /// Feeds `tokens` at the cache's position and gives the sum of their hidden states after the
    /// final norm (`hidden_size` values, summed on the device): what an embedding pools.
    pub fn step_pooled(&self, tokens: &[u32], rope: &RopeTables<B>, cache: &mut KvCache<B>) -> Vec<f32> {
        let device = self.embed_tokens.weight.device();
        let ids: Vec<i64> = tokens.iter().map(|&id| id as i64).collect();
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, tokens.len()]), &device);
        let start = cache.len;
        let hidden = self.hidden(input, &mut [Place { rope, start, cache: Some(cache) }]);
        hidden.sum_dim(1).into_data().convert::<f32>().into_vec::<f32>().expect("hidden states are f32 after convert")
    }

    /// Feeds one token to each of several sequences, each at its own cache's position, in one
    /// pass: every weight is read once for the whole batch. Gives each sequence its logits, or,
    /// where `pick`, its most likely token, chosen on the device.
    pub fn step_batch(&self, batch: &mut [(u32, &RopeTables<B>, &mut KvCache<B>)], pick: &[bool]) -> Vec<Next> {
        let tokens: Vec<[u32; 1]> = batch.iter().map(|(token, _, _)| [*token]).collect();
        let tokens: Vec<&[u32]> = tokens.iter().map(|t| &t[..]).collect();
        let mut places: Vec<Place<'_, B>> =
            batch.iter_mut().map(|(_, rope, cache)| Place { rope: *rope, start: cache.len, cache: Some(&mut **cache) }).collect();
        self.last(&tokens, &mut places, pick)
    }

    /// Runs sequences of equal length (one per place) and gives, for each one's last token, the
    /// logits or (where `pick`) the argmax. Picked tokens come back from the device in one
    /// transfer, the other sequences' logits in another.
    fn last(&self, tokens: &[&[u32]], places: &mut [Place<'_, B>], pick: &[bool]) -> Vec<Next> {
        let device = self.embed_tokens.weight.device();
        let (batch, seq) = (tokens.len(), tokens[0].len());
        assert!(tokens.iter().all(|t| t.len() == seq), "sequences of a step have equal lengths");
        assert_eq!(pick.len(), batch, "one pick flag per sequence");
        let ids: Vec<i64> = tokens.iter().flat_map(|t| t.iter().map(|&id| id as i64)).collect();
        let input = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [batch, seq]), &device);
        let hidden = self.hidden(input, places);
        let logits = self.logits(hidden.narrow(1, seq - 1, 1));
        let vocab = logits.dims()[2];
        let logits: Tensor<B, 2> = logits.reshape([batch, vocab]);
        let mut picked = if pick.iter().any(|&p| p) {
            let ids = logits.clone().argmax(1).into_data().convert::<i64>().into_vec::<i64>().expect("ids are i64 after convert");
            // Test-only: every sequence gets the first one's token.
            if crate::test_defect("device-pick-first-row") {
                vec![ids[0]; batch]
            } else {
                ids
            }
        } else {
            Vec::new()
        };
        let wanted: Vec<i64> = (0..batch).filter(|&i| !pick[i]).map(|i| i as i64).collect();
        let mut rows = Vec::new();
        if !wanted.is_empty() {
            let all = wanted.len() == batch;
            let index = Tensor::<B, 1, Int>::from_data(TensorData::new(wanted.clone(), [wanted.len()]), &device);
            let logits = if all { logits } else { logits.select(0, index) };
            rows = logits.into_data().convert::<f32>().into_vec::<f32>().expect("logits are f32 after convert");
        }
        let mut rows = rows.chunks_exact(vocab);
        (0..batch)
            .map(|i| match pick[i] {
                true => Next::Token(std::mem::take(&mut picked[i]) as u32),
                false => Next::Logits(rows.next().expect("a row per unpicked sequence").to_vec()),
            })
            .collect()
    }
}
