//! The CPU model: the Llama-family decoder of `model.rs`, computed on packed weights with the
//! kernels of this module instead of burn's tensors.

use std::sync::Arc;

use half::f16;
use super::attention::{self, attend, KvBlock, KvBuffer, KvLayout, Query, Tally, KEY_BLOCK};
use super::prefix::PrefixCache;
use super::matrix::{multiply_all, Activations, Bytes, PackedMatrix};
use super::team::Team;
use crate::config::LlamaConfig;
use crate::gguf::GgufFile;
use crate::quants::GgmlType;
use crate::weights::TensorSource;
use crate::{Error, Result};

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopePairs {
    /// `(i, i + d/2)`: Hugging Face's rotate-half layout (and GGUF qwen2).
    Half,
    /// `(2i, 2i + 1)`: llama.cpp's layout for the q/k rows its llama converter permuted. Using it
    /// on the file's row order computes the same attention as un-permuting the rows (q and k are
    /// permuted alike, so every q·k is unchanged) and leaves the weights mapped as they are.
    Interleaved,
}

/// Precision of the CPU KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvPrecision {
    #[default]
    F32,
    /// Half the memory; attention reads it back as f32.
    F16,
}

impl std::str::FromStr for KvPrecision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            other => Err(format!("KV cache precision {other:?}: use \"f32\" or \"f16\"")),
        }
    }
}

impl std::fmt::Display for KvPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
        })
    }
}

impl KvPrecision {
    pub fn bytes_per_value(self) -> usize {
        match self {
            KvPrecision::F32 => 4,
            KvPrecision::F16 => 2,
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    q: PackedMatrix,
    k: PackedMatrix,
    v: PackedMatrix,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    o: PackedMatrix,
    mlp_norm: Vec<f32>,
    gate: PackedMatrix,
    up: PackedMatrix,
    down: PackedMatrix,
}

/// A loaded model for the CPU.
pub struct CpuModel {
    pub config: LlamaConfig,
    embed: PackedMatrix,
    layers: Vec<Layer>,
    norm: Vec<f32>,
    /// `None`: the head is tied to the embedding.
    head: Option<PackedMatrix>,
    rope_pairs: RopePairs,
    inv_freq: Vec<f64>,
    pub kv_precision: KvPrecision,
    /// Blocks of earlier sequences' caches, for requests that begin the same way. Empty (and
    /// off) unless set: a worker sizes it from its options.
    pub prefix_cache: PrefixCache,
    /// Bytes of the KV blocks alive now: every running sequence's, the prefix cache's, each
    /// shared block once.
    kv_resident: Arc<std::sync::atomic::AtomicUsize>,
    /// Allocate every block of a new cache at once, as a contiguous cache would: what
    /// `headroom calibrate` measures the workspace beside, since admission reserves the whole.
    pub preallocate_kv: bool,
}

impl std::fmt::Debug for CpuModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuModel").field("layers", &self.layers.len()).field("rope_pairs", &self.rope_pairs).finish_non_exhaustive()
    }
}

/// Where the CPU model's weights come from.
trait WeightReader {
    fn matrix(&self, hf_name: &str, rows: usize, cols: usize) -> Result<PackedMatrix>;
    fn vector(&self, hf_name: &str, len: usize) -> Result<Vec<f32>>;
}

/// A GGUF file: packed types stay mapped; the others are converted once at load.
struct GgufReader<'a> {
    file: &'a GgufFile,
    config: &'a LlamaConfig,
}

impl WeightReader for GgufReader<'_> {
    fn matrix(&self, hf_name: &str, rows: usize, cols: usize) -> Result<PackedMatrix> {
        let name = crate::gguf_model::gguf_name(hf_name).ok_or_else(|| Error::Weights(format!("no GGUF tensor corresponds to `{hf_name}`")))?;
        let info = self.file.tensor(&name)?;
        if info.shape != [rows, cols] {
            return Err(Error::Weights(format!(
                "tensor `{name}` has shape {:?} but the model's configuration implies [{rows}, {cols}]",
                info.shape
            )));
        }
        let fail = |e: String| Error::Weights(format!("tensor `{name}`: {e}"));
        // The test-only defect expands packed weights to f32 at load, as engines without packed
        // kernels do: the resident-memory check must catch it.
        if crate::test_defect("unpack-weights") {
            return Ok(PackedMatrix::from_f32(&self.file.read_f32(&name)?.0, rows, cols));
        }
        if super::dot::activation_kind(info.ggml_type).is_some() {
            return PackedMatrix::new(info.ggml_type, rows, cols, self.file.mapped(info)).map_err(fail);
        }
        // Q5_0, Q5_1, Q2_K and Q3_K are multiplied as Q8_0 (more bits than the file has, so
        // nothing is lost beyond Q8_0's rounding), or as f32 where rows are not whole blocks.
        let (values, _) = self.file.read_f32(&name)?;
        let _ = self.config;
        Ok(if cols % 32 == 0 {
            PackedMatrix::q8_0_from_f32(&values, rows, cols)
        } else {
            PackedMatrix::from_f32(&values, rows, cols)
        })
    }

    fn vector(&self, hf_name: &str, len: usize) -> Result<Vec<f32>> {
        let name = crate::gguf_model::gguf_name(hf_name).ok_or_else(|| Error::Weights(format!("no GGUF tensor corresponds to `{hf_name}`")))?;
        let (values, shape) = self.file.read_f32(&name)?;
        if shape != [len] {
            return Err(Error::Weights(format!("tensor `{name}` has shape {shape:?}, expected [{len}]")));
        }
        Ok(values)
    }
}

/// Bytes the CPU engine holds for a GGUF file's tensors: packed types as stored, the types it
/// converts at their converted size (see [`GgufReader::matrix`]), vectors as f32.
pub fn gguf_weight_bytes(file: &GgufFile) -> u64 {
    file.tensors
        .values()
        .map(|info| {
            let cols = *info.shape.last().unwrap_or(&0);
            if info.shape.len() != 2 {
                info.elements() * 4
            } else if super::dot::activation_kind(info.ggml_type).is_some() {
                info.bytes
            } else if cols % 32 == 0 {
                info.elements() / 32 * GgmlType::Q8_0.block_bytes()
            } else {
                info.elements() * 4
            }
        })
        .sum::<usize>() as u64
}

/// A Hugging Face folder (safetensors): weights in `[out, in]` rows, f16 and bf16 as stored
/// (half the bytes of f32 to hold and to read per token), f32 as f32.
struct FolderReader<'a>(&'a dyn TensorSource);

impl WeightReader for FolderReader<'_> {
    fn matrix(&self, hf_name: &str, rows: usize, cols: usize) -> Result<PackedMatrix> {
        if let Some((ty, bytes, shape)) = self.0.read_half(hf_name)? {
            if shape == [rows, cols] {
                return PackedMatrix::new(ty, rows, cols, Bytes::Owned(bytes)).map_err(|e| Error::Weights(format!("tensor `{hf_name}`: {e}")));
            }
        }
        Ok(PackedMatrix::from_f32(&self.0.read_shaped(hf_name, &[rows, cols])?, rows, cols))
    }
    fn vector(&self, hf_name: &str, len: usize) -> Result<Vec<f32>> {
        self.0.read_shaped(hf_name, &[len])
    }
}

impl CpuModel {
    /// Loads a GGUF file's weights, packed types memory-mapped in place.
    /// `layers`: how many of the model's layers, from the first, it holds (all but a split
    /// model's CPU part).
    pub fn from_gguf(file: &GgufFile, config: &LlamaConfig, layers: usize, on_layer: impl FnMut(usize, usize)) -> Result<Self> {
        // Start reading the whole file in now (the kernels will read every weight on the first
        // token): page faults at load instead of in the first request's decode steps.
        let _ = file.map.advise(memmap2::Advice::WillNeed);
        let permuted = config.model_type == "llama";
        let rope_pairs = if permuted && !crate::test_defect("keep-qk-permutation") { RopePairs::Interleaved } else { RopePairs::Half };
        Self::load(&GgufReader { file, config }, config, rope_pairs, layers, on_layer)
    }

    /// Loads the first `layers` layers from a Hugging Face folder's tensors (f16 and bf16 as
    /// stored, the rest f32).
    pub fn from_tensors(source: &dyn TensorSource, config: &LlamaConfig, layers: usize, on_layer: impl FnMut(usize, usize)) -> Result<Self> {
        Self::load(&FolderReader(source), config, RopePairs::Half, layers, on_layer)
    }

    fn load(files: &dyn WeightReader, config: &LlamaConfig, rope_pairs: RopePairs, count: usize, mut on_layer: impl FnMut(usize, usize)) -> Result<Self> {
        assert!(count <= config.num_hidden_layers, "the model has {} layers, not {count}", config.num_hidden_layers);
        let h = config.hidden_size;
        let (nh, kvh, d) = (config.num_attention_heads, config.kv_heads(), config.head_dim());
        let inter = config.intermediate_size;
        let bias = config.has_qkv_bias();
        let embed = files.matrix("model.embed_tokens.weight", config.vocab_size, h)?;
        let mut layers = Vec::with_capacity(count);
        for i in 0..count {
            let p = format!("model.layers.{i}");
            let opt = |name: &str, len: usize| -> Result<Option<Vec<f32>>> {
                if bias { files.vector(&format!("{p}.self_attn.{name}.bias"), len).map(Some) } else { Ok(None) }
            };
            layers.push(Layer {
                attn_norm: files.vector(&format!("{p}.input_layernorm.weight"), h)?,
                q: files.matrix(&format!("{p}.self_attn.q_proj.weight"), nh * d, h)?,
                k: files.matrix(&format!("{p}.self_attn.k_proj.weight"), kvh * d, h)?,
                v: files.matrix(&format!("{p}.self_attn.v_proj.weight"), kvh * d, h)?,
                q_bias: opt("q_proj", nh * d)?,
                k_bias: opt("k_proj", kvh * d)?,
                v_bias: opt("v_proj", kvh * d)?,
                o: files.matrix(&format!("{p}.self_attn.o_proj.weight"), h, nh * d)?,
                mlp_norm: files.vector(&format!("{p}.post_attention_layernorm.weight"), h)?,
                gate: files.matrix(&format!("{p}.mlp.gate_proj.weight"), inter, h)?,
                up: files.matrix(&format!("{p}.mlp.up_proj.weight"), inter, h)?,
                down: files.matrix(&format!("{p}.mlp.down_proj.weight"), h, inter)?,
            });
            on_layer(i + 1, count);
        }
        let norm = files.vector("model.norm.weight", h)?;
        let head = if config.tie_word_embeddings { None } else { Some(files.matrix("lm_head.weight", config.vocab_size, h)?) };
        Ok(Self {
            config: config.clone(),
            embed,
            layers,
            norm,
            head,
            rope_pairs,
            inv_freq: config.rope_inv_freq(),
            kv_precision: KvPrecision::default(),
            prefix_cache: PrefixCache::default(),
            kv_resident: Arc::default(),
            preallocate_kv: false,
        })
    }

    /// Bytes of weights: mapped file ranges and converted copies alike.
    pub fn weight_bytes(&self) -> usize {
        let vectors = |l: &Layer| {
            (l.attn_norm.len() + l.mlp_norm.len() + [&l.q_bias, &l.k_bias, &l.v_bias].iter().map(|b| b.as_ref().map_or(0, Vec::len)).sum::<usize>()) * 4
        };
        let layers: usize = self
            .layers
            .iter()
            .map(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].iter().map(|m| m.bytes()).sum::<usize>() + vectors(l))
            .sum();
        self.embed.bytes() + self.head.as_ref().map_or(0, PackedMatrix::bytes) + layers + self.norm.len() * 4
    }

    /// Weight bytes one decode step reads: all of them, but for an untied model's embedding,
    /// of which it reads one row.
    pub fn bytes_read_per_token(&self) -> usize {
        match &self.head {
            Some(_) => self.weight_bytes() - self.embed.bytes() + self.embed.bytes() / self.embed.rows.max(1),
            None => self.weight_bytes(),
        }
    }

    /// An empty KV cache for `capacity` tokens at the model's configured precision: its blocks
    /// are allocated as positions are written.
    pub fn new_cache(&self, capacity: usize) -> CpuCache {
        let mut cache = CpuCache {
            resident: self.kv_resident.clone(),
            blocks: Vec::new(),
            layout: KvLayout { kv_heads: self.config.kv_heads(), head_dim: self.config.head_dim() },
            layers: self.layers.len(),
            precision: self.kv_precision,
            len: 0,
            capacity,
        };
        if self.preallocate_kv {
            cache.blocks = (0..capacity.div_ceil(KEY_BLOCK)).map(|_| cache.new_block()).collect();
        }
        cache
    }

    /// A KV cache for `capacity` tokens that already holds what the prefix cache has of
    /// `prompt`'s beginning (whole blocks, never the last token, whose logits the request
    /// needs): its `len` says how many of the prompt's tokens need no feeding. Only where a
    /// prompt's keys and values come out the same whatever chunks feed it
    /// ([`Self::prefill_is_chunk_invariant`]): a request's tokens never depend on what ran
    /// before it.
    pub fn cache_for_prompt(&self, prompt: &[u32], capacity: usize) -> CpuCache {
        let mut cache = self.new_cache(capacity);
        if self.prefill_is_chunk_invariant() {
            let cached = self.prefix_cache.lookup(prompt);
            cache.len = cached.len() * KEY_BLOCK;
            // A preallocated cache keeps its own blocks past the cached ones (test-only: all
            // dropped, as they were).
            let replaced = if crate::test_defect("prefix-drops-preallocation") { cache.blocks.len() } else { cached.len().min(cache.blocks.len()) };
            cache.blocks.splice(..replaced, cached);
        }
        cache
    }

    /// Hands a finished sequence's cache to the prefix cache; `tokens` are the ones it holds,
    /// in order (its prompt, then what it generated).
    pub fn retire(&self, cache: &mut CpuCache, tokens: &[u32]) {
        let blocks = std::mem::take(&mut cache.blocks);
        if self.prefill_is_chunk_invariant() {
            self.prefix_cache.insert(&tokens[..cache.len.min(tokens.len())], &blocks);
        }
        cache.len = 0;
    }

    /// Bytes of the KV blocks alive now: every running sequence's and the prefix cache's, each
    /// shared block once. What the CPU worker reports as its KV cache's resident memory.
    pub fn kv_resident_bytes(&self) -> usize {
        self.kv_resident.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether every layer's products take the same steps for a token whatever else shares
    /// its call (the repacked Q4_0/Q4_1/Q8_0 kernel): then keys and values computed in one
    /// request's prefill chunks are bit for bit those another request's chunks would compute.
    /// The prefill tiles of other types add in another order than the row kernels that feed
    /// short chunks, so there a reused prefix could change a later token.
    pub fn prefill_is_chunk_invariant(&self) -> bool {
        self.layers.iter().all(|l| [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down].iter().all(|m| m.is_interleaved()))
    }

    /// Feeds `tokens` at position `cache.len` and returns the logits of the last one.
    pub fn step(&self, tokens: &[u32], cache: &mut CpuCache) -> Vec<f32> {
        Team::run(|team| {
            let hidden = self.hidden(&mut [Segment { tokens, cache }], false, team);
            let last = &hidden[hidden.len() - self.config.hidden_size..];
            self.logits(&Activations::new(last, 1, self.config.hidden_size), team)
        })
    }

    /// Feeds `tokens` at position `cache.len` and gives the sum of their hidden states after the
    /// final norm (`hidden_size` values): what an embedding pools.
    pub fn step_pooled(&self, tokens: &[u32], cache: &mut CpuCache) -> Vec<f32> {
        Team::run(|team| {
            let mut segments = [Segment { tokens, cache }];
            let mut x = self.embed_rows(&segments);
            self.run_layers(&mut x, &mut segments, false, team);
            let normed = self.finish(&x, &mut segments);
            // Test-only: pool the residual stream before the final norm.
            let pooled = if crate::test_defect("embed-before-norm") { &x } else { &normed };
            sum_rows(pooled, self.config.hidden_size)
        })
    }

    /// One decode step of several sequences at once, each `(token, its cache)`: every matrix is
    /// read once for all of them. Each sequence's logits are exactly those [`Self::step`] gives
    /// it alone (the rows go through the same row kernels, attention reads its own cache).
    pub fn step_batch(&self, batch: &mut [(u32, &mut CpuCache)]) -> Vec<Vec<f32>> {
        if batch.is_empty() {
            return Vec::new();
        }
        let tokens: Vec<u32> = batch.iter().map(|(t, _)| *t).collect();
        let mut segments: Vec<Segment> =
            batch.iter_mut().zip(&tokens).map(|((_, cache), t)| Segment { tokens: std::slice::from_ref(t), cache }).collect();
        Team::run(|team| {
            let hidden = self.hidden(&mut segments, true, team);
            let logits = self.logits(&Activations::decode_steps(&hidden, tokens.len(), self.config.hidden_size), team);
            logits.chunks_exact(self.config.vocab_size).map(<[f32]>::to_vec).collect()
        })
    }

    /// The head's product with final hidden states, `[rows, vocab]`.
    fn logits(&self, hidden: &Activations, team: &Team) -> Vec<f32> {
        let head = self.head.as_ref().unwrap_or(&self.embed);
        let mut logits = vec![0f32; hidden.rows * head.rows];
        head.multiply(hidden, &mut logits, team);
        logits
    }

    /// One step of a split model ([`crate::split::SplitModel`]): the embedding and this
    /// model's layers (the first ones) on `inputs`, each `(tokens, cache)`, then `rest` (the
    /// remaining layers, elsewhere) on the residual stream `[tokens, hidden]`, then the final
    /// norm and the head here. Gives each input's logits of its last token, or (`pooled`) the
    /// sum of its tokens' final hidden states. `decode_steps`: every input is one sequence's
    /// single decode token.
    pub(crate) fn step_around(
        &self,
        inputs: &mut [(&[u32], &mut CpuCache)],
        decode_steps: bool,
        pooled: bool,
        rest: impl FnOnce(Vec<f32>) -> Vec<f32>,
    ) -> Vec<Vec<f32>> {
        let mut segments: Vec<Segment> = inputs.iter_mut().map(|(tokens, cache)| Segment { tokens, cache }).collect();
        // Two teams: the rest's backend has threads of its own to run on.
        let x = Team::run(|team| {
            let mut x = self.embed_rows(&segments);
            self.run_layers(&mut x, &mut segments, decode_steps, team);
            x
        });
        let x = rest(x);
        let h = self.config.hidden_size;
        assert_eq!(x.len(), segments.iter().map(|s| s.tokens.len()).sum::<usize>() * h, "the rest of the layers gives a row per token");
        let normed = self.finish(&x, &mut segments);
        if pooled {
            let mut start = 0;
            return segments
                .iter()
                .map(|s| {
                    start += s.tokens.len();
                    sum_rows(&normed[(start - s.tokens.len()) * h..start * h], h)
                })
                .collect();
        }
        Team::run(|team| {
            let mut last = Vec::with_capacity(segments.len() * h);
            let mut end = 0;
            for s in &segments {
                end += s.tokens.len();
                last.extend_from_slice(&normed[(end - 1) * h..end * h]);
            }
            let logits = self.logits(&Activations::decode_steps(&last, segments.len(), h), team);
            logits.chunks_exact(self.config.vocab_size).map(<[f32]>::to_vec).collect()
        })
    }

    /// Hidden states after the final norm, `[tokens, hidden]`, of every segment's tokens in
    /// order. `decode_steps`: each segment is one sequence's single decode token (see
    /// [`Activations::decode_steps`]).
    fn hidden(&self, segments: &mut [Segment], decode_steps: bool, team: &Team) -> Vec<f32> {
        let mut x = self.embed_rows(segments);
        self.run_layers(&mut x, segments, decode_steps, team);
        self.finish(&x, segments)
    }

    /// The embedding rows of every segment's tokens, in order: the residual stream.
    fn embed_rows(&self, segments: &[Segment]) -> Vec<f32> {
        let n: usize = segments.iter().map(|s| s.tokens.len()).sum();
        assert!(segments.iter().all(|s| !s.tokens.is_empty()), "at least one token per segment");
        for s in segments.iter() {
            let end = s.cache.len + s.tokens.len();
            assert!(end <= s.cache.capacity, "the KV cache holds {} tokens; {end} do not fit", s.cache.capacity);
        }
        let mut x = Vec::with_capacity(n * self.config.hidden_size);
        for &t in segments.iter().flat_map(|s| s.tokens) {
            x.extend(self.embed.dequantize_row(t as usize));
        }
        x
    }

    /// Advances the segments' caches past their tokens and gives the final norm of `x`.
    fn finish(&self, x: &[f32], segments: &mut [Segment]) -> Vec<f32> {
        for s in segments.iter_mut() {
            s.cache.len += s.tokens.len();
        }
        let mut normed = vec![0f32; x.len()];
        rms_norm_rows(x, &self.norm, self.config.rms_norm_eps, &mut normed);
        normed
    }

    /// Runs the residual stream `x` of the segments' tokens through this model's layers,
    /// writing their keys and values at each segment's `cache.len` (not advanced here).
    fn run_layers(&self, x: &mut [f32], segments: &mut [Segment], decode_steps: bool, team: &Team) {
        let c = &self.config;
        let n: usize = segments.iter().map(|s| s.tokens.len()).sum();
        let (h, nh, kvh, d) = (c.hidden_size, c.num_attention_heads, c.kv_heads(), c.head_dim());
        let inter = c.intermediate_size;
        fn acts(values: &[f32], n: usize, cols: usize, decode_steps: bool) -> Activations<'_> {
            if decode_steps { Activations::decode_steps(values, n, cols) } else { Activations::new(values, n, cols) }
        }
        // Each token's position: its segment's cache length plus its place in the segment.
        let mut cos = Vec::with_capacity(n * d / 2);
        let mut sin = Vec::with_capacity(n * d / 2);
        for s in segments.iter() {
            let (c, s) = self.rope_tables(s.cache.len, s.tokens.len());
            cos.extend(c);
            sin.extend(s);
        }
        let mut normed = vec![0f32; n * h];
        let mut q = vec![0f32; n * nh * d];
        let mut k = vec![0f32; n * kvh * d];
        let mut v = vec![0f32; n * kvh * d];
        let mut attn = vec![0f32; n * nh * d];
        let mut proj = vec![0f32; n * h];
        let mut gate = vec![0f32; n * inter];
        let mut up = vec![0f32; n * inter];
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm_rows(&x, &layer.attn_norm, c.rms_norm_eps, &mut normed);
            multiply_all(&mut [(&layer.q, &mut q[..]), (&layer.k, &mut k[..]), (&layer.v, &mut v[..])], &acts(&normed, n, h, decode_steps), team);
            for (out, bias) in [(&mut q, &layer.q_bias), (&mut k, &layer.k_bias), (&mut v, &layer.v_bias)] {
                if let Some(bias) = bias {
                    out.chunks_exact_mut(bias.len()).for_each(|row| row.iter_mut().zip(bias).for_each(|(o, b)| *o += b));
                }
            }
            for t in 0..n {
                let (cos, sin) = (&cos[t * d / 2..(t + 1) * d / 2], &sin[t * d / 2..(t + 1) * d / 2]);
                self.rope(&mut q[t * nh * d..(t + 1) * nh * d], cos, sin, d);
                self.rope(&mut k[t * kvh * d..(t + 1) * kvh * d], cos, sin, d);
            }
            let mut first = 0;
            for s in segments.iter_mut() {
                let len = s.tokens.len();
                s.cache.write(li, s.cache.len, len, kvh, d, &k[first * kvh * d..(first + len) * kvh * d], &v[first * kvh * d..(first + len) * kvh * d]);
                first += len;
            }
            let queries: Vec<Query> = segments
                .iter()
                .flat_map(|s| {
                    let cache = &*s.cache;
                    (0..s.tokens.len()).map(move |t| Query { blocks: &cache.blocks, layout: cache.layout, layer: li, seen: cache.len + t + 1 })
                })
                .collect();
            attend(&queries, nh, kvh, d, &q, &mut attn, team);
            layer.o.multiply(&acts(&attn, n, nh * d, decode_steps), &mut proj, team);
            x.iter_mut().zip(&proj).for_each(|(x, p)| *x += p);

            rms_norm_rows(&x, &layer.mlp_norm, c.rms_norm_eps, &mut normed);
            multiply_all(&mut [(&layer.gate, &mut gate[..]), (&layer.up, &mut up[..])], &acts(&normed, n, h, decode_steps), team);
            // SiLU: g · σ(g), with e^(-g) from the vector exp, a piece at a time on the stack.
            for (g, u) in gate.chunks_mut(64).zip(up.chunks(64)) {
                let mut e = [0f32; 64];
                let e = &mut e[..g.len()];
                e.iter_mut().zip(g.iter()).for_each(|(e, g)| *e = -g);
                attention::exp(e);
                g.iter_mut().zip(u).zip(e.iter()).for_each(|((g, u), e)| *g = *g / (1.0 + e) * u);
            }
            layer.down.multiply(&acts(&gate, n, inter, decode_steps), &mut proj, team);
            x.iter_mut().zip(&proj).for_each(|(x, p)| *x += p);
        }
    }

    /// cos and sin of every frequency at positions `start..start + n` (`[n, d/2]`), computed in
    /// f64 as `RopeTables` does.
    fn rope_tables(&self, start: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let mut cos = Vec::with_capacity(n * self.inv_freq.len());
        let mut sin = Vec::with_capacity(n * self.inv_freq.len());
        for pos in start..start + n {
            for f in &self.inv_freq {
                let angle = pos as f64 * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        (cos, sin)
    }

    fn rope(&self, x: &mut [f32], cos: &[f32], sin: &[f32], d: usize) {
        let half = d / 2;
        for head in x.chunks_exact_mut(d) {
            for i in 0..half {
                let (a, b) = match self.rope_pairs {
                    RopePairs::Half => (i, i + half),
                    RopePairs::Interleaved => (2 * i, 2 * i + 1),
                };
                let (x1, x2) = (head[a], head[b]);
                head[a] = x1 * cos[i] - x2 * sin[i];
                head[b] = x2 * cos[i] + x1 * sin[i];
            }
        }
    }
}

/// The sum of `rows`' rows of `width` values.
fn sum_rows(rows: &[f32], width: usize) -> Vec<f32> {
    let mut sum = vec![0f32; width];
    for row in rows.chunks_exact(width) {
        sum.iter_mut().zip(row).for_each(|(s, v)| *s += v);
    }
    sum
}

fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let h = weight.len();
    for (x, out) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
        let mean = x.iter().map(|v| v * v).sum::<f32>() / h as f32;
        let inv = 1.0 / (mean + eps as f32).sqrt();
        for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// A sequence's keys and values: a table of blocks of [`KEY_BLOCK`] positions of every layer
/// (layout: [`super::attention`]), allocated as positions are written, up to `capacity`
/// (prompt + max_tokens), which admission reserved. Blocks of a prefix another sequence
/// computed are shared with it; a write into a shared block copies it first.
pub struct CpuCache {
    blocks: Vec<Arc<KvBlock>>,
    /// The model's count of live block bytes, which this cache's blocks add to.
    resident: Arc<std::sync::atomic::AtomicUsize>,
    layout: KvLayout,
    layers: usize,
    precision: KvPrecision,
    /// Tokens already stored.
    pub len: usize,
    pub capacity: usize,
}

impl CpuCache {
    /// Positions the cache holds room for: `capacity` rounded up to whole key blocks.
    pub fn slots(capacity: usize) -> usize {
        capacity.next_multiple_of(KEY_BLOCK)
    }

    /// Bytes of the cache: 2 × layers × kv_heads × head_dim × slots × bytes per value.
    pub fn bytes(config: &LlamaConfig, capacity: usize, precision: KvPrecision) -> usize {
        2 * config.num_hidden_layers * config.kv_heads() * config.head_dim() * Self::slots(capacity) * precision.bytes_per_value()
    }

    fn new_block(&self) -> Arc<KvBlock> {
        let values = self.layout.block_len(self.layers);
        let buffer = match self.precision {
            KvPrecision::F32 => KvBuffer::F32(vec![0.0; values]),
            KvPrecision::F16 => KvBuffer::F16(vec![f16::ZERO; values]),
        };
        let tally = Tally::count(&self.resident, values * self.precision.bytes_per_value());
        Arc::new(KvBlock { values: buffer, _live: tally })
    }

    /// Bytes of the blocks this cache holds now (some may be shared).
    pub fn resident_bytes(&self) -> usize {
        self.blocks.iter().map(|b| b.bytes()).sum()
    }

    /// Stores the keys and values (`[n, kvh, d]` each) of positions `start..start + n`.
    #[allow(clippy::too_many_arguments)]
    fn write(&mut self, layer: usize, start: usize, n: usize, kvh: usize, d: usize, k: &[f32], v: &[f32]) {
        for t in 0..n {
            let p = start + t;
            while self.blocks.len() <= p / KEY_BLOCK {
                let block = self.new_block();
                self.blocks.push(block);
            }
            let block = &mut Arc::make_mut(&mut self.blocks[p / KEY_BLOCK]).values;
            for g in 0..kvh {
                let at = (t * kvh + g) * d..(t * kvh + g + 1) * d;
                self.layout.write(block, layer, g, p % KEY_BLOCK, &k[at.clone()], &v[at]);
            }
        }
    }
}

/// One sequence's tokens in a forward pass, and its KV cache.
struct Segment<'a> {
    tokens: &'a [u32],
    cache: &'a mut CpuCache,
}

impl GgufFile {
    /// A tensor's bytes as a range of the shared mapping (no copy).
    pub(crate) fn mapped(&self, info: &crate::gguf::TensorInfo) -> Bytes {
        Bytes::Mapped { map: self.map.clone(), start: info.offset, len: info.bytes }
    }
}
