//! One decode step (a single new token) on the CPU backend, computed on the weights' memory
//! directly instead of through burn's generic tensor ops.
//!
//! Why: a decode step is a chain of matrix–vector products. Through burn-ndarray every one of the
//! ~35 ops per layer allocates its output and dispatches separately, and a one-row matmul goes
//! through a GEMM that packs the whole weight matrix on every call, so a small model's decode is
//! dominated by overhead and a large one's by repacking. Here each weight is read once, in place
//! (the tensors' own `Arc`ed storage, no copy), split over the thread pool, and the new keys and
//! values are written straight into the same KV cache tensors the burn path (prefill) uses.
//!
//! It computes what [`Llama::step`] computes for one token (same formulas and layouts as
//! `model.rs`); summation order differs, so logits agree to float rounding, not bit for bit.
//! `HEADROOM_CPU_DECODE=burn` turns it off (the benchmark compares both).

use std::any::Any;

use burn::tensor::{Tensor, TensorPrimitive};
use burn_ndarray::NdArrayTensor;
use ndarray::{ArcArray, IxDyn};
use rayon::prelude::*;

use crate::model::{KvCache, Llama, RopeTables};
use crate::CpuBackend;

type Shared = ArcArray<f32, IxDyn>;

/// Whether the direct CPU decode step is on (default) or burn's ops are used.
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HEADROOM_CPU_DECODE").map_or(true, |v| v != "burn"))
}

/// The tensor's storage, shared with it (no copy), in row-major layout.
fn storage<const D: usize>(tensor: Tensor<CpuBackend, D>) -> Shared {
    let array = match tensor.into_primitive().tensor() {
        NdArrayTensor::F32(storage) => storage.into_shared(),
        other => panic!("the CPU backend holds f32 tensors, found {other:?}"),
    };
    if array.is_standard_layout() {
        array
    } else {
        array.as_standard_layout().into_owned().into_shared()
    }
}

fn to_tensor<const D: usize>(array: Shared) -> Tensor<CpuBackend, D> {
    Tensor::from_primitive(TensorPrimitive::Float(NdArrayTensor::from(array)))
}

/// Work below this many multiply-adds per thread is not worth handing to another thread.
const MIN_WORK_PER_THREAD: usize = 32 * 1024;

/// Fills `out` in contiguous chunks, in parallel when there is enough work (`work_per_item`
/// multiply-adds per element): `fill(first_index, chunk)`.
fn fill_parallel(out: &mut [f32], work_per_item: usize, fill: impl Fn(usize, &mut [f32]) + Sync) {
    let threads = rayon::current_num_threads().max(1);
    let min_items = MIN_WORK_PER_THREAD.div_ceil(work_per_item.max(1));
    let chunk = out.len().div_ceil(threads).max(min_items).max(1);
    if chunk >= out.len() {
        fill(0, out);
    } else {
        out.par_chunks_mut(chunk).enumerate().for_each(|(i, c)| fill(i * chunk, c));
    }
}

/// Dot product with eight independent accumulators, so it vectorises.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, a_rest) = a.split_at(a.len() / 8 * 8);
    let (b8, b_rest) = b.split_at(a8.len());
    for (x, y) in a8.chunks_exact(8).zip(b8.chunks_exact(8)) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for (x, y) in a_rest.iter().zip(b_rest) {
        sum += x * y;
    }
    sum
}

/// `y[c] += a * x[c]`.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `out = x · W` for a burn `Linear` weight stored `[in, out]` row-major.
fn x_times_w(x: &[f32], w: &[f32], out: &mut [f32]) {
    let cols = out.len();
    debug_assert_eq!(w.len(), x.len() * cols);
    fill_parallel(out, x.len(), |first, chunk| {
        chunk.fill(0.0);
        for (i, &xi) in x.iter().enumerate() {
            axpy(chunk, xi, &w[i * cols + first..i * cols + first + chunk.len()]);
        }
    });
}

/// `out = W · x` for a matrix stored `[out, in]` row-major (the embedding as the output head).
fn w_times_x(w: &[f32], x: &[f32], out: &mut [f32]) {
    let inner = x.len();
    debug_assert_eq!(w.len(), out.len() * inner);
    fill_parallel(out, inner, |first, chunk| {
        for (r, o) in chunk.iter_mut().enumerate() {
            let row = first + r;
            *o = dot(&w[row * inner..(row + 1) * inner], x);
        }
    });
}

fn rms_norm(x: &[f32], weight: &[f32], eps: f64, out: &mut [f32]) {
    let mean = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (mean + eps as f32).sqrt();
    for ((o, v), w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * inv * w;
    }
}

/// Rotary embedding of each `head_dim` slice of `x` at one position (rotate-half layout).
fn rope(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let d = cos.len();
    let half = d / 2;
    for head in x.chunks_exact_mut(d) {
        let (x1, x2) = head.split_at_mut(half);
        for i in 0..half {
            let (a, b) = (x1[i], x2[i]);
            x1[i] = a * cos[i] - b * sin[i];
            x2[i] = b * cos[half + i] + a * sin[half + i];
        }
    }
}

/// `out = x · W + b` for a burn `Linear` (Qwen2-style q/k/v biases included).
fn linear(x: &[f32], layer: &burn::nn::Linear<CpuBackend>, out: &mut [f32]) {
    x_times_w(x, storage(layer.weight.val()).as_slice().unwrap(), out);
    if let Some(bias) = &layer.bias {
        axpy(out, 1.0, storage(bias.val()).as_slice().unwrap());
    }
}

/// The direct decode step when `model` runs on the CPU backend; `None` on any other backend,
/// and the caller uses burn's ops.
pub fn try_step<B: burn::tensor::backend::Backend>(
    model: &Llama<B>,
    token: u32,
    rope_tables: &RopeTables<B>,
    cache: &mut KvCache<B>,
) -> Option<Vec<f32>> {
    let model = (model as &dyn Any).downcast_ref::<Llama<CpuBackend>>()?;
    let rope_tables = (rope_tables as &dyn Any).downcast_ref::<RopeTables<CpuBackend>>()?;
    let cache = (cache as &mut dyn Any).downcast_mut::<KvCache<CpuBackend>>()?;
    Some(step(model, token, rope_tables, cache))
}

fn step(model: &Llama<CpuBackend>, token: u32, rope_tables: &RopeTables<CpuBackend>, cache: &mut KvCache<CpuBackend>) -> Vec<f32> {
    let pos = cache.len;
    assert!(pos < cache.capacity, "the KV cache holds {} tokens; it is full", cache.capacity);
    let embed = storage(model.embed_tokens.weight.val());
    let embed = embed.as_slice().expect("standard layout");
    let hidden = embed.len() / model.embed_tokens.weight.dims()[0];
    let mut x = embed[token as usize * hidden..(token as usize + 1) * hidden].to_vec();
    let cos = storage(rope_tables.cos.clone().narrow(0, pos, 1));
    let sin = storage(rope_tables.sin.clone().narrow(0, pos, 1));
    let (cos, sin) = (cos.as_slice().unwrap(), sin.as_slice().unwrap());

    let mut normed = vec![0f32; hidden];
    for (layer, (k_slot, v_slot)) in model.layers.iter().zip(cache.layers.iter_mut()) {
        let attn = &layer.self_attn;
        let (h, kvh, d) = (attn.n_heads, attn.n_kv_heads, attn.head_dim);
        let rep = h / kvh;
        let capacity = cache.capacity;

        rms_norm(&x, storage(layer.input_layernorm.weight.val()).as_slice().unwrap(), layer.input_layernorm.eps, &mut normed);
        let mut q = vec![0f32; h * d];
        let mut k = vec![0f32; kvh * d];
        let mut v = vec![0f32; kvh * d];
        linear(&normed, &attn.q_proj, &mut q);
        linear(&normed, &attn.k_proj, &mut k);
        linear(&normed, &attn.v_proj, &mut v);
        rope(&mut q, cos, sin);
        rope(&mut k, cos, sin);

        // Keys `[kv_heads, head_dim, capacity]`, values `[kv_heads, capacity, head_dim]`, as
        // the burn path lays them out; written in place (the cache owns its storage).
        let mut keys = storage::<4>(k_slot.take().expect("cache layer present between steps"));
        let mut values = storage::<4>(v_slot.take().expect("cache layer present between steps"));
        {
            let ks = keys.as_slice_mut().unwrap();
            let vs = values.as_slice_mut().unwrap();
            for g in 0..kvh {
                for i in 0..d {
                    ks[(g * d + i) * capacity + pos] = k[g * d + i];
                }
                vs[(g * capacity + pos) * d..(g * capacity + pos + 1) * d].copy_from_slice(&v[g * d..(g + 1) * d]);
            }
        }
        let ks = keys.as_slice().unwrap();
        let vs = values.as_slice().unwrap();
        let scale = 1.0 / (d as f32).sqrt();
        let seen = pos + 1;
        let mut out = vec![0f32; h * d];
        // One head per task: scores over the positions written so far, softmax, weighted values.
        let per_head = |head: usize, out_h: &mut [f32]| {
            let g = head / rep;
            let qh = &q[head * d..(head + 1) * d];
            let mut scores = vec![0f32; seen];
            for (i, &qi) in qh.iter().enumerate() {
                let row = (g * d + i) * capacity;
                axpy(&mut scores, qi, &ks[row..row + seen]);
            }
            let max = scores.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s * scale));
            let mut total = 0f32;
            for s in scores.iter_mut() {
                *s = (*s * scale - max).exp();
                total += *s;
            }
            out_h.fill(0.0);
            for (j, &p) in scores.iter().enumerate() {
                let at = (g * capacity + j) * d;
                axpy(out_h, p / total, &vs[at..at + d]);
            }
        };
        if seen * d * h >= 2 * MIN_WORK_PER_THREAD && rayon::current_num_threads() > 1 {
            out.par_chunks_mut(d).enumerate().for_each(|(head, o)| per_head(head, o));
        } else {
            out.chunks_mut(d).enumerate().for_each(|(head, o)| per_head(head, o));
        }
        *k_slot = Some(to_tensor(keys));
        *v_slot = Some(to_tensor(values));

        let mut attn_out = vec![0f32; hidden];
        linear(&out, &attn.o_proj, &mut attn_out);
        axpy(&mut x, 1.0, &attn_out);

        let mlp = &layer.mlp;
        rms_norm(&x, storage(layer.post_attention_layernorm.weight.val()).as_slice().unwrap(), layer.post_attention_layernorm.eps, &mut normed);
        let inter = mlp.gate_proj.weight.dims()[1];
        let mut gate = vec![0f32; inter];
        let mut up = vec![0f32; inter];
        linear(&normed, &mlp.gate_proj, &mut gate);
        linear(&normed, &mlp.up_proj, &mut up);
        for (g, u) in gate.iter_mut().zip(&up) {
            *g = *g / (1.0 + (-*g).exp()) * u;
        }
        let mut down = vec![0f32; hidden];
        linear(&gate, &mlp.down_proj, &mut down);
        axpy(&mut x, 1.0, &down);
    }
    cache.len = pos + 1;

    rms_norm(&x, storage(model.norm.weight.val()).as_slice().unwrap(), model.norm.eps, &mut normed);
    match &model.lm_head {
        Some(head) => {
            let mut logits = vec![0f32; head.weight.dims()[1]];
            linear(&normed, head, &mut logits);
            logits
        }
        None => {
            let mut logits = vec![0f32; embed.len() / hidden];
            w_times_x(embed, &normed, &mut logits);
            logits
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::tiny_config;
    use crate::weights::init_llama;

    /// Prefill with burn, then decode with each path from identical caches: the logits agree to
    /// float rounding at every step, with GQA, tied and untied heads and q/k/v biases, and the caches the
    /// two paths leave behind agree too (the direct step writes what burn's would).
    #[test]
    fn the_direct_step_computes_what_the_tensor_ops_compute() {
        for (tied, bias) in [(false, false), (true, false), (false, true)] {
            let config = crate::config::LlamaConfig { tie_word_embeddings: tied, attention_bias: Some(bias), ..tiny_config() };
            let device = Default::default();
            let mut model = init_llama::<CpuBackend>(&config, &device);
            // Norm weights start at one; make them matter.
            let random = |n: usize| burn::module::Param::from_tensor(Tensor::<CpuBackend, 1>::random([n], burn::tensor::Distribution::Uniform(0.5, 1.5), &device));
            for layer in &mut model.layers {
                layer.input_layernorm.weight = random(config.hidden_size);
                layer.post_attention_layernorm.weight = random(config.hidden_size);
            }
            model.norm.weight = random(config.hidden_size);
            let capacity = 40;
            let rope = RopeTables::new(&config, capacity, &device);
            let mut direct = KvCache::new(&config, capacity, &device);
            let prompt: Vec<u32> = (0..17).map(|i| (i * 37 % 290) as u32).collect();
            model.step_with_tensor_ops(&prompt, &rope, &mut direct);
            let mut burn = direct.clone();
            for (i, token) in [5u32, 77, 123, 9, 250, 31].into_iter().enumerate() {
                let a = try_step(&model, token, &rope, &mut direct).expect("the CPU backend");
                let b = model.step_with_tensor_ops(&[token], &rope, &mut burn);
                assert_eq!(a.len(), b.len());
                let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
                let scale = b.iter().map(|v| v.abs()).fold(0f32, f32::max);
                assert!(worst <= 1e-4 * scale.max(1.0), "tied={tied} step {i}: logits differ by {worst} (scale {scale})");
                assert_eq!(direct.len, burn.len);
            }
            for (l, ((dk, dv), (bk, bv))) in direct.layers.iter().zip(&burn.layers).enumerate() {
                for (x, y) in [(dk, bk), (dv, bv)] {
                    let x = x.clone().unwrap().into_data().to_vec::<f32>().unwrap();
                    let y = y.clone().unwrap().into_data().to_vec::<f32>().unwrap();
                    let worst = x.iter().zip(&y).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                    assert!(worst < 1e-4, "tied={tied} layer {l}: caches differ by {worst}");
                }
            }
        }
    }
}
