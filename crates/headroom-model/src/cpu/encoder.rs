//! A BERT encoder on the CPU engine's kernels: the embedding model of the CPU worker and the sim
//! GPU. The same model as [`crate::bert::Bert`] (burn's, which CUDA runs), its products through
//! [`PackedMatrix`] (f32 rows, the team's threads, the tiled prefill kernels) instead of burn's
//! ndarray backend, which was 4× slower than llama.cpp on all-MiniLM-L6-v2
//! (`scripts/bench-embed.py`). No padding: the CPU compiles nothing per shape.

use std::sync::Mutex;

use crate::config::LlamaConfig;
use crate::cpu::matrix::{multiply_all, Activations, PackedMatrix};
use crate::cpu::team::Team;
use crate::weights::{TensorSource, WeightFiles};
use crate::Result;

struct Norm {
    weight: Vec<f32>,
    bias: Vec<f32>,
    eps: f32,
}

impl Norm {
    fn load(files: &WeightFiles, prefix: &str, config: &LlamaConfig) -> Result<Self> {
        let h = config.hidden_size;
        Ok(Self {
            weight: files.read_shaped(&format!("{prefix}.weight"), &[h])?,
            bias: files.read_shaped(&format!("{prefix}.bias"), &[h])?,
            eps: config.layer_norm_eps.unwrap_or(1e-12) as f32,
        })
    }

    /// Normalizes each row of `x` in place.
    fn apply(&self, x: &mut [f32]) {
        for row in x.chunks_exact_mut(self.weight.len()) {
            let n = row.len() as f32;
            let mean = row.iter().sum::<f32>() / n;
            let variance = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
            let scale = 1.0 / (variance + self.eps).sqrt();
            for ((v, w), b) in row.iter_mut().zip(&self.weight).zip(&self.bias) {
                *v = (*v - mean) * scale * w + b;
            }
        }
    }
}

/// A linear layer: `[out, in]` weights (Hugging Face's layout, the engine's rows) and a bias.
struct Dense {
    weight: PackedMatrix,
    bias: Vec<f32>,
}

impl Dense {
    fn load(files: &WeightFiles, prefix: &str, d_in: usize, d_out: usize) -> Result<Self> {
        let weight = files.read_shaped(&format!("{prefix}.weight"), &[d_out, d_in])?;
        Ok(Self { weight: PackedMatrix::from_f32(&weight, d_out, d_in), bias: files.read_shaped(&format!("{prefix}.bias"), &[d_out])? })
    }

    fn add_bias(&self, out: &mut [f32]) {
        for row in out.chunks_exact_mut(self.bias.len()) {
            row.iter_mut().zip(&self.bias).for_each(|(v, b)| *v += b);
        }
    }
}

struct Layer {
    query: Dense,
    key: Dense,
    value: Dense,
    attention_out: Dense,
    attention_norm: Norm,
    intermediate: Dense,
    output: Dense,
    output_norm: Norm,
}

/// A BERT encoder on the CPU engine.
pub struct CpuBert {
    words: Vec<f32>,
    positions: Vec<f32>,
    /// Token type 0's row: every token of a single input has type 0.
    token_type: Vec<f32>,
    embedding_norm: Norm,
    layers: Vec<Layer>,
    hidden: usize,
    heads: usize,
    vocab: usize,
}

impl CpuBert {
    /// Loads the encoder from a folder's tensors (with or without the `bert.` prefix),
    /// checking every shape against `config`.
    pub fn load(files: &WeightFiles, config: &LlamaConfig) -> Result<Self> {
        let named = crate::bert::tensor_names(files);
        let (h, i) = (config.hidden_size, config.intermediate_size);
        let words = files.read_shaped(&named("embeddings.word_embeddings.weight"), &[config.vocab_size, h])?;
        let positions = files.read_shaped(&named("embeddings.position_embeddings.weight"), &[config.position_rows(), h])?;
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for l in 0..config.num_hidden_layers {
            let p = named(&format!("encoder.layer.{l}"));
            layers.push(Layer {
                query: Dense::load(files, &format!("{p}.attention.self.query"), h, h)?,
                key: Dense::load(files, &format!("{p}.attention.self.key"), h, h)?,
                value: Dense::load(files, &format!("{p}.attention.self.value"), h, h)?,
                attention_out: Dense::load(files, &format!("{p}.attention.output.dense"), h, h)?,
                attention_norm: Norm::load(files, &format!("{p}.attention.output.LayerNorm"), config)?,
                intermediate: Dense::load(files, &format!("{p}.intermediate.dense"), h, i)?,
                output: Dense::load(files, &format!("{p}.output.dense"), i, h)?,
                output_norm: Norm::load(files, &format!("{p}.output.LayerNorm"), config)?,
            });
        }
        let embedding_norm = Norm::load(files, &named("embeddings.LayerNorm"), config)?;
        Ok(Self { words, positions, token_type: crate::bert::token_type_row(files, config)?, embedding_norm, layers, hidden: h, heads: config.num_attention_heads, vocab: config.vocab_size })
    }

    /// The sum of `tokens`' last hidden states (`hidden_size` values): what mean pooling
    /// divides by their count.
    pub fn pooled_sum(&self, tokens: &[u32]) -> Vec<f32> {
        self.pooled_sums(&[tokens]).pop().expect("one input")
    }

    /// [`Self::pooled_sum`] of several inputs in one pass: their rows go through every product
    /// together (each weight read once for all), each attending only to its own.
    pub fn pooled_sums(&self, inputs: &[&[u32]]) -> Vec<Vec<f32>> {
        let h = self.hidden;
        let n: usize = inputs.iter().map(|t| t.len()).sum();
        let mut x = Vec::with_capacity(n * h);
        let mut spans = Vec::with_capacity(inputs.len());
        for tokens in inputs {
            assert!(tokens.len() * h <= self.positions.len(), "{} tokens are past the position table", tokens.len());
            spans.push(x.len() / h..x.len() / h + tokens.len());
            for (t, &id) in tokens.iter().enumerate() {
                let id = (id as usize).min(self.vocab - 1);
                let word = &self.words[id * h..(id + 1) * h];
                let position = &self.positions[t * h..(t + 1) * h];
                x.extend(word.iter().zip(position).zip(&self.token_type).map(|((w, p), ty)| w + p + ty));
            }
        }
        self.embedding_norm.apply(&mut x);
        Team::run(|team| {
            for layer in &self.layers {
                self.layer(layer, &mut x, n, &spans, team);
            }
        });
        spans
            .iter()
            .map(|span| {
                let mut sum = vec![0.0; h];
                for row in x[span.start * h..span.end * h].chunks_exact(h) {
                    sum.iter_mut().zip(row).for_each(|(s, v)| *s += v);
                }
                sum
            })
            .collect()
    }

    /// One layer over `n` rows, the inputs' `spans` of them.
    fn layer(&self, layer: &Layer, x: &mut [f32], n: usize, spans: &[std::ops::Range<usize>], team: &Team) {
        let h = self.hidden;
        let (mut q, mut k, mut v) = (vec![0.0; n * h], vec![0.0; n * h], vec![0.0; n * h]);
        {
            let input = Activations::new(x, n, h);
            multiply_all(&mut [(&layer.query.weight, &mut q), (&layer.key.weight, &mut k), (&layer.value.weight, &mut v)], &input, team);
        }
        layer.query.add_bias(&mut q);
        layer.key.add_bias(&mut k);
        layer.value.add_bias(&mut v);
        let context = self.attend(&q, &k, &v, n, spans, team);
        let mut attended = vec![0.0; n * h];
        layer.attention_out.weight.multiply(&Activations::new(&context, n, h), &mut attended, team);
        layer.attention_out.add_bias(&mut attended);
        x.iter_mut().zip(&attended).for_each(|(r, a)| *r += a);
        layer.attention_norm.apply(x);
        let wide = layer.intermediate.bias.len();
        let mut up = vec![0.0; n * wide];
        layer.intermediate.weight.multiply(&Activations::new(x, n, h), &mut up, team);
        layer.intermediate.add_bias(&mut up);
        // GELU, the exact (erf) form BERT was trained with.
        up.iter_mut().for_each(|u| *u = 0.5 * *u * (1.0 + libm::erff(*u * std::f32::consts::FRAC_1_SQRT_2)));
        let mut down = vec![0.0; n * h];
        layer.output.weight.multiply(&Activations::new(&up, n, wide), &mut down, team);
        layer.output.add_bias(&mut down);
        x.iter_mut().zip(&down).for_each(|(r, d)| *r += d);
        layer.output_norm.apply(x);
    }

    /// Every token attends to every other of its input (test-only `encoder-causal`: only to
    /// earlier ones, as in a decoder); one task per head.
    fn attend(&self, q: &[f32], k: &[f32], v: &[f32], n: usize, spans: &[std::ops::Range<usize>], team: &Team) -> Vec<f32> {
        let (h, heads) = (self.hidden, self.heads);
        let d = h / heads;
        let scale = 1.0 / (d as f32).sqrt();
        let causal = crate::test_defect("encoder-causal");
        let per_head: Vec<Mutex<Vec<f32>>> = (0..heads).map(|_| Mutex::new(Vec::new())).collect();
        team.for_each(heads, |head| {
            fn at(m: &[f32], t: usize, h: usize, head: usize, d: usize) -> &[f32] {
                &m[t * h + head * d..t * h + (head + 1) * d]
            }
            let mut out = vec![0.0; n * d];
            let mut scores = vec![0.0f32; n];
            for (start, len, i) in spans.iter().flat_map(|span| span.clone().map(move |i| (span.start, span.len(), i))) {
                let seen = if causal { i + 1 - start } else { len };
                let qi = at(q, i, h, head, d);
                for (j, s) in scores[..seen].iter_mut().enumerate() {
                    *s = qi.iter().zip(at(k, start + j, h, head, d)).map(|(a, b)| a * b).sum::<f32>() * scale;
                }
                let max = scores[..seen].iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let mut total = 0.0;
                for s in &mut scores[..seen] {
                    *s = (*s - max).exp();
                    total += *s;
                }
                let row = &mut out[i * d..(i + 1) * d];
                for (j, s) in scores[..seen].iter().enumerate() {
                    let p = s / total;
                    row.iter_mut().zip(at(v, start + j, h, head, d)).for_each(|(o, vj)| *o += p * vj);
                }
            }
            *per_head[head].lock().unwrap() = out;
        });
        let mut context = vec![0.0; n * h];
        for (head, out) in per_head.into_iter().enumerate() {
            let out = out.into_inner().unwrap();
            for t in 0..n {
                context[t * h + head * d..t * h + (head + 1) * d].copy_from_slice(&out[t * d..(t + 1) * d]);
            }
        }
        context
    }
}

impl crate::Decoder for CpuBert {
    type Cache = crate::bert::NoCache;
    fn new_cache(&self, _config: &LlamaConfig, _capacity: usize) -> crate::bert::NoCache {
        crate::bert::NoCache
    }
    fn feed(&self, _tokens: &[u32], _cache: &mut crate::bert::NoCache) -> Vec<f32> {
        unreachable!("an encoder generates nothing: Session::start refuses a generation for it")
    }
    fn feed_pooled(&self, tokens: &[u32], _cache: &mut crate::bert::NoCache) -> Vec<f32> {
        self.pooled_sum(tokens)
    }
    fn pools_prompts_together(&self) -> bool {
        true
    }
    fn feed_pooled_many(&self, prompts: &mut [(&[u32], &mut crate::bert::NoCache)]) -> Vec<Vec<f32>> {
        let inputs: Vec<&[u32]> = prompts.iter().map(|(tokens, _)| *tokens).collect();
        self.pooled_sums(&inputs)
    }
}
