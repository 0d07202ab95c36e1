//! What one request will cost in device memory, predicted before it touches the device:
//! KV cache for prompt + max_tokens, the activation workspace of one prefill chunk (calibrated by
//! measurement), and a fragmentation margin. Weights are counted once per loaded model.
//!
//! A worker runs its requests in one batch (`headroom_model::batch`): a step holds at most one
//! prefill chunk and one decode row per sequence, so the sum of the running requests' footprints
//! (each with its own chunk's workspace) bounds the batch's workspace.

use headroom_model::{GenerateRequest, KvPrecision, LlamaConfig};
use serde::{Deserialize, Serialize};

pub const MIB: u64 = 1024 * 1024;
pub const GIB: u64 = 1024 * MIB;

/// The parts of a model's shape that decide its memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub hidden: u64,
    pub intermediate: u64,
    pub vocab: u64,
    pub parameters: u64,
    /// Bytes per element as the backend holds the weights and activations.
    pub dtype_bytes: u64,
    pub context: u64,
    /// Bytes of weights where they are not `parameters × dtype_bytes`: the CPU engine holds a
    /// GGUF file's packed tensors, a CUDA GPU the matrices in f16 or bf16. 0:
    /// `parameters × dtype_bytes`.
    #[serde(default)]
    pub packed_weights_bytes: u64,
    /// Bytes per KV cache value where the cache is not held at `dtype_bytes`: the CPU engine's
    /// f16 cache (the `cpu_kv_cache` setting). 0: `dtype_bytes`.
    #[serde(default)]
    pub kv_value_bytes: u64,
    /// Positions a KV cache is allocated in multiples of (the engines' blocks). 0: 1.
    #[serde(default)]
    pub kv_block_tokens: u64,
    /// An encoder (BERT): no KV cache, and a prompt read in one pass (its whole length is the
    /// prefill chunk), its keys and values living only in that pass's workspace.
    #[serde(default)]
    pub encoder: bool,
}

impl ModelShape {
    /// Headroom's engine holds weights, KV cache and activations as f32.
    pub fn from_config(config: &LlamaConfig) -> Self {
        Self {
            layers: config.num_hidden_layers as u64,
            heads: config.num_attention_heads as u64,
            kv_heads: config.kv_heads() as u64,
            head_dim: config.head_dim() as u64,
            hidden: config.hidden_size as u64,
            intermediate: config.intermediate_size as u64,
            vocab: config.vocab_size as u64,
            parameters: config.parameter_count() as u64,
            dtype_bytes: 4,
            context: config.max_position_embeddings as u64,
            packed_weights_bytes: 0,
            kv_value_bytes: 0,
            // Every engine's cache is a table of blocks of this many positions.
            kv_block_tokens: headroom_model::model::KV_BLOCK as u64,
            encoder: config.is_encoder(),
        }
    }

    /// The shape on `backend`: on the CPU, the engine's weights are the file's packed bytes
    /// ([`headroom_model::ModelBundle::cpu_weight_bytes`]) and its KV cache has the precision
    /// `cpu_kv`; CUDA holds the matrices in 16 bits
    /// ([`headroom_model::ModelBundle::gpu_weight_bytes`]) and the KV cache in f32; any other
    /// backend holds both as f32.
    pub fn for_backend(bundle: &headroom_model::ModelBundle, backend: &str, cpu_kv: KvPrecision) -> Self {
        let mut shape = Self::from_config(&bundle.config);
        match backend {
            "cpu" => shape.on_cpu(bundle.cpu_weight_bytes, cpu_kv),
            "cuda" => {
                shape.packed_weights_bytes = bundle.gpu_weight_bytes();
                shape
            }
            _ => shape,
        }
    }

    /// This shape as the CPU engine holds it: `packed_weights_bytes` of weights (0: as
    /// `dtype_bytes`), the KV cache at `kv`.
    pub fn on_cpu(mut self, packed_weights_bytes: u64, kv: KvPrecision) -> Self {
        self.packed_weights_bytes = packed_weights_bytes;
        self.with_cpu_cache(kv)
    }

    /// This shape's KV cache as the CPU engine allocates it: values at `kv`, whole key blocks.
    pub fn with_cpu_cache(mut self, kv: KvPrecision) -> Self {
        self.kv_value_bytes = kv.bytes_per_value() as u64;
        self.kv_block_tokens = headroom_model::cpu::KEY_BLOCK as u64;
        self
    }

    pub fn weights_bytes(&self) -> u64 {
        if self.packed_weights_bytes > 0 {
            self.packed_weights_bytes
        } else {
            self.parameters * self.dtype_bytes
        }
    }

    /// 2 (K and V) × layers × kv_heads × head_dim × bytes per value.
    pub fn kv_bytes_per_token(&self) -> u64 {
        if self.encoder {
            return 0;
        }
        let value = if self.kv_value_bytes > 0 { self.kv_value_bytes } else { self.dtype_bytes };
        2 * self.layers * self.kv_heads * self.head_dim * value
    }
}

/// How activation workspace grows with the prefill chunk `c` and the attended length `l`:
/// `score_factor × heads·c·l·dtype + token_factor × c·(hidden + intermediate)·dtype + fixed`.
/// The factors count how many such buffers are alive at the peak; [`Calibration::fit`] measures
/// them for a model instead of guessing.
///
/// The peak is the larger of two stages, not their sum: a stage that does not grow with the
/// request (the output head's logits, say) sets `floor_bytes`, and attention's score matrices
/// take over above it. A linear fit through both regimes was 35% low on long requests.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub score_factor: f64,
    pub token_factor: f64,
    pub fixed_bytes: f64,
    /// The workspace never falls below this (0 in calibrations written before it existed).
    #[serde(default)]
    pub floor_bytes: f64,
}

impl Default for Calibration {
    /// An analytic starting point for Headroom's eager engine: scores, masked scores and
    /// probabilities alive together; about six hidden/intermediate-wide buffers per token.
    fn default() -> Self {
        Self {
            score_factor: 3.0,
            token_factor: 6.0,
            fixed_bytes: 0.0,
            floor_bytes: 0.0,
        }
    }
}

/// One measured point for calibration: prefill chunk, attended length, and the workspace bytes
/// observed beyond the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct WorkspaceSample {
    pub chunk: u64,
    pub attended: u64,
    pub workspace_bytes: f64,
}

impl Calibration {
    fn terms(shape: &ModelShape, chunk: u64, attended: u64) -> (f64, f64) {
        let score = (shape.heads * chunk * attended * shape.dtype_bytes) as f64;
        let token = (chunk * (shape.hidden + shape.intermediate) * shape.dtype_bytes) as f64;
        (score, token)
    }

    pub fn workspace_bytes(&self, shape: &ModelShape, chunk: u64, attended: u64) -> u64 {
        let (score, token) = Self::terms(shape, chunk, attended);
        (self.score_factor * score + self.token_factor * token + self.fixed_bytes).max(self.floor_bytes).max(0.0) as u64
    }

    /// Fits the two-stage model to measured samples. The smallest sample is the floor; samples
    /// clearly above it (5%) are in attention's regime and get a least-squares fit of the
    /// linear part (three or more samples: all three factors; two: score factor and constant).
    /// With fewer, the linear part stays the analytic default, which over-predicts: safe.
    pub fn fit(shape: &ModelShape, samples: &[WorkspaceSample]) -> Self {
        let floor = samples.iter().map(|s| s.workspace_bytes).fold(f64::INFINITY, f64::min);
        if !floor.is_finite() {
            return Self::default();
        }
        let above: Vec<WorkspaceSample> = samples.iter().copied().filter(|s| s.workspace_bytes > floor * 1.05).collect();
        let linear = match above.len() {
            0 | 1 => Self::default(),
            2 => {
                let (p, q) = (above[0], above[1]);
                let (sp, _) = Self::terms(shape, p.chunk, p.attended);
                let (sq, _) = Self::terms(shape, q.chunk, q.attended);
                if (sq - sp).abs() < 1.0 {
                    Self::default()
                } else {
                    let a = ((q.workspace_bytes - p.workspace_bytes) / (sq - sp)).max(0.0);
                    Self { score_factor: a, token_factor: 0.0, fixed_bytes: p.workspace_bytes - a * sp, floor_bytes: 0.0 }
                }
            }
            _ => Self::fit_linear(shape, &above),
        };
        Self { floor_bytes: floor, ..linear }
    }

    /// Least-squares fit of the three linear factors (at least three samples, spanning different
    /// chunk and length mixes). Falls back to the default when the system is singular.
    fn fit_linear(shape: &ModelShape, samples: &[WorkspaceSample]) -> Self {
        // Normal equations for y = a·s + b·t + c.
        let mut m = [[0.0f64; 3]; 3];
        let mut v = [0.0f64; 3];
        for s in samples {
            let (score, token) = Self::terms(shape, s.chunk, s.attended);
            let x = [score, token, 1.0];
            for i in 0..3 {
                for j in 0..3 {
                    m[i][j] += x[i] * x[j];
                }
                v[i] += x[i] * s.workspace_bytes;
            }
        }
        match solve3(m, v) {
            Some([a, b, c]) if a.is_finite() && b.is_finite() && c.is_finite() => Self {
                score_factor: a.max(0.0),
                token_factor: b.max(0.0),
                fixed_bytes: c,
                floor_bytes: 0.0,
            },
            _ => Self::default(),
        }
    }
}

fn solve3(mut m: [[f64; 3]; 3], mut v: [f64; 3]) -> Option<[f64; 3]> {
    for col in 0..3 {
        let pivot = (col..3).max_by(|&a, &b| m[a][col].abs().total_cmp(&m[b][col].abs()))?;
        if m[pivot][col].abs() < 1e-30 {
            return None;
        }
        m.swap(col, pivot);
        v.swap(col, pivot);
        for row in 0..3 {
            if row != col {
                let f = m[row][col] / m[col][col];
                for k in 0..3 {
                    m[row][k] -= f * m[col][k];
                }
                v[row] -= f * v[col];
            }
        }
    }
    Some([v[0] / m[0][0], v[1] / m[1][1], v[2] / m[2][2]])
}

/// A request as the memory model sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestShape {
    pub prompt_tokens: u64,
    pub max_tokens: u64,
    pub prefill_chunk: u64,
}

impl RequestShape {
    /// The shape of a generation request: its prompt, its max_tokens, its prefill chunk.
    pub fn of(request: &GenerateRequest) -> Self {
        Self { prompt_tokens: request.prompt_tokens.len() as u64, max_tokens: request.max_tokens as u64, prefill_chunk: request.prefill_chunk as u64 }
    }
}

/// Predicted memory of one request on one device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Footprint {
    /// The model's weights (held once per worker, not per request).
    pub weights_bytes: u64,
    pub kv_bytes: u64,
    pub workspace_bytes: u64,
    pub margin_bytes: u64,
    pub tokens: u64,
    /// Positions whose KV cache `kv_bytes` reserves, in whole blocks: `tokens` rounded up to a
    /// block, or fewer under KV overcommit (the rest is taken as it is written).
    #[serde(default)]
    pub kv_tokens: u64,
}

impl Footprint {
    pub fn estimate(
        shape: &ModelShape,
        request: RequestShape,
        calibration: &Calibration,
        margin_percent: f64,
    ) -> Self {
        Self::overcommitted(shape, request, calibration, margin_percent, 1.0)
    }

    /// The request holding only 1/`overcommit` of its KV blocks up front, and never fewer than
    /// its prompt's and one more (see `MemoryConfig::kv_overcommit`).
    pub fn overcommitted(
        shape: &ModelShape,
        request: RequestShape,
        calibration: &Calibration,
        margin_percent: f64,
        overcommit: f64,
    ) -> Self {
        let tokens = request.prompt_tokens + request.max_tokens;
        let block = shape.kv_block_tokens.max(1);
        let kv_tokens = if overcommit > 1.0 {
            ((tokens as f64 / overcommit).ceil() as u64).max(request.prompt_tokens + 1).min(tokens)
        } else {
            tokens
        }
        .next_multiple_of(block);
        let kv_bytes = shape.kv_bytes_per_token() * kv_tokens;
        let chunk = if shape.encoder { request.prompt_tokens.max(1) } else { request.prefill_chunk.clamp(1, request.prompt_tokens.max(1)) };
        // Attention spans the cache's whole capacity (prompt + max_tokens, unwritten slots
        // masked), so every prefill chunk's score matrix is chunk × capacity.
        let workspace_prefill = calibration.workspace_bytes(shape, chunk, tokens);
        let workspace_decode = calibration.workspace_bytes(shape, 1, tokens);
        // Rotary tables for every position of the request: cos and sin (an encoder has none).
        let rope = if shape.encoder { 0 } else { 2 * tokens * shape.head_dim * shape.dtype_bytes };
        let workspace_bytes = workspace_prefill.max(workspace_decode) + rope;
        let margin_bytes = ((kv_bytes + workspace_bytes) as f64 * margin_percent / 100.0) as u64;
        Self {
            weights_bytes: shape.weights_bytes(),
            kv_bytes,
            workspace_bytes,
            margin_bytes,
            tokens,
            kv_tokens,
        }
    }

    /// What the request adds on a device that already holds the weights.
    pub fn request_bytes(&self) -> u64 {
        self.kv_bytes + self.workspace_bytes + self.margin_bytes
    }

    /// The request without its safety margin: what an exact prediction of the peak would be.
    pub fn predicted_peak_bytes(&self) -> u64 {
        self.kv_bytes + self.workspace_bytes
    }
}

/// Bytes in MiB with one decimal, or GiB past 1 GiB, for human reasons.
pub fn human_bytes(bytes: u64) -> String {
    if bytes >= GIB {
        format!("{:.2} GiB", bytes as f64 / GIB as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape() -> ModelShape {
        ModelShape {
            layers: 16,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            hidden: 2048,
            intermediate: 8192,
            vocab: 128_256,
            parameters: 1_235_814_400,
            dtype_bytes: 2,
            context: 131_072,
            packed_weights_bytes: 0,
            kv_value_bytes: 0,
            kv_block_tokens: 0,
            encoder: false,
        }
    }

    #[test]
    fn an_encoder_holds_no_kv_cache_and_reads_its_prompt_in_one_pass() {
        let encoder = ModelShape { encoder: true, ..shape() };
        assert_eq!(encoder.kv_bytes_per_token(), 0);
        let request = RequestShape { prompt_tokens: 200, max_tokens: 0, prefill_chunk: 16 };
        let fp = Footprint::estimate(&encoder, request, &Calibration::default(), 0.0);
        assert_eq!(fp.kv_bytes, 0);
        // The whole prompt is the chunk, whatever the request's prefill chunk says.
        assert_eq!(fp.workspace_bytes, Calibration::default().workspace_bytes(&encoder, 200, 200));
        assert!(fp.workspace_bytes > Footprint::estimate(&shape(), request, &Calibration::default(), 0.0).workspace_bytes);
    }

    #[test]
    fn kv_bytes_follow_the_formula() {
        // Llama 3.2 1B in f16: 2 × 16 × 8 × 64 × 2 = 32 KiB per token.
        assert_eq!(shape().kv_bytes_per_token(), 32 * 1024);
        let f = Footprint::estimate(
            &shape(),
            RequestShape { prompt_tokens: 1000, max_tokens: 24, prefill_chunk: 256 },
            &Calibration::default(),
            5.0,
        );
        assert_eq!(f.kv_bytes, 1024 * 32 * 1024);
        assert!(f.margin_bytes > 0);
    }

    #[test]
    fn calibration_fit_recovers_known_factors() {
        let s = shape();
        let truth = Calibration { score_factor: 2.5, token_factor: 7.0, fixed_bytes: 12345.0, floor_bytes: 0.0 };
        let samples: Vec<WorkspaceSample> = [(16, 64), (64, 64), (64, 512), (256, 512), (128, 1024)]
            .iter()
            .map(|&(c, l)| WorkspaceSample {
                chunk: c,
                attended: l,
                workspace_bytes: truth.workspace_bytes(&s, c, l) as f64,
            })
            .collect();
        let fit = Calibration::fit(&s, &samples);
        assert!((fit.score_factor - 2.5).abs() < 1e-3, "{fit:?}");
        assert!((fit.token_factor - 7.0).abs() < 1e-3, "{fit:?}");
    }

    #[test]
    fn a_floor_stage_and_attention_above_it_are_both_recovered() {
        let s = shape();
        // A logits-like stage that small requests never exceed; attention above it.
        let attention = Calibration { score_factor: 2.2, token_factor: 0.0, fixed_bytes: 230_000.0, floor_bytes: 0.0 };
        let floor = attention.workspace_bytes(&s, 128, 400) as f64;
        let truth = Calibration { floor_bytes: floor, ..attention };
        let points = [(24, 24), (40, 160), (96, 96), (200, 200), (128, 700), (256, 1000), (192, 1000)];
        let samples: Vec<WorkspaceSample> = points
            .iter()
            .map(|&(c, l)| WorkspaceSample { chunk: c, attended: l, workspace_bytes: truth.workspace_bytes(&s, c, l) as f64 })
            .collect();
        assert!(samples.iter().filter(|x| x.workspace_bytes > floor * 1.05).count() >= 3, "the test needs points above the floor");
        let fit = Calibration::fit(&s, &samples);
        assert!((fit.floor_bytes - floor).abs() < 1.0, "{fit:?}");
        for (c, l) in [(16, 16), (128, 1000), (512, 2048)] {
            let (want, got) = (truth.workspace_bytes(&s, c, l) as f64, fit.workspace_bytes(&s, c, l) as f64);
            assert!((got - want).abs() / want < 0.01, "({c}, {l}): fit {got} vs truth {want}: {fit:?}");
        }
        // What this replaced: one linear fit over points that all sit on the floor, as the old
        // calibration points did, misses attention's growth entirely.
        let on_the_floor: Vec<WorkspaceSample> = samples.iter().copied().filter(|x| x.workspace_bytes <= floor).collect();
        assert!(on_the_floor.len() >= 3);
        let linear_only = Calibration::fit_linear(&s, &on_the_floor);
        let long = truth.workspace_bytes(&s, 512, 2048) as f64;
        assert!((linear_only.workspace_bytes(&s, 512, 2048) as f64 - long).abs() / long > 0.05, "the linear fit alone misses it");
    }
}
