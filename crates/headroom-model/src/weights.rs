//! Moving weights between Hugging Face safetensors (names and `[out, in]` layout of
//! `transformers`) and the burn modules of [`crate::model`]. bf16/f16 are read as f32, then stored in
//! the type the matrices are loaded in (f32, or f16/bf16 on a GPU).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::nn::{Embedding, Initializer, Linear, LinearConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};

use crate::config::LlamaConfig;
use crate::model::{Attention, DecoderLayer, LayerStack, Llama, Mlp, RmsNorm};
use crate::{Error, Result};

/// The safetensors files of a model folder, memory-mapped.
pub struct WeightFiles {
    maps: Vec<(PathBuf, memmap2::Mmap)>,
    /// Tensor name → index into `maps`.
    index: BTreeMap<String, usize>,
}

impl WeightFiles {
    /// Opens `model.safetensors`, or the shards named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join("model.safetensors");
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<PathBuf> = if single.exists() {
            vec![single]
        } else if index_path.exists() {
            let text = std::fs::read_to_string(&index_path)?;
            let index: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                Error::Weights(format!("{} is not valid JSON: {e}", index_path.display()))
            })?;
            let map = index["weight_map"].as_object().ok_or_else(|| {
                Error::Weights(format!("{} has no weight_map", index_path.display()))
            })?;
            let mut shards: Vec<String> = map
                .values()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect();
            shards.sort();
            shards.dedup();
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else {
            return Err(Error::Weights(format!(
                "no model.safetensors or model.safetensors.index.json in {}; \
                 point --model at a Hugging Face model folder with safetensors weights",
                dir.display()
            )));
        };

        let mut maps = Vec::new();
        let mut index = BTreeMap::new();
        for path in files {
            let file = std::fs::File::open(&path).map_err(|e| {
                Error::Weights(format!("cannot open {}: {e}", path.display()))
            })?;
            // SAFETY: the file is opened read-only and not modified while mapped.
            let map = unsafe { memmap2::Mmap::map(&file)? };
            let tensors = SafeTensors::deserialize(&map).map_err(|e| {
                Error::Weights(format!(
                    "{} is not a valid safetensors file ({e}); re-download or re-export it",
                    path.display()
                ))
            })?;
            for name in tensors.names() {
                index.insert(name.to_string(), maps.len());
            }
            maps.push((path, map));
        }
        Ok(Self { maps, index })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Bytes the CPU engine holds for these tensors: f16/bf16 matrices in their 16 bits (see
    /// [`TensorSource::read_half`]), everything else as f32.
    pub fn cpu_bytes(&self) -> Result<u64> {
        let mut total = 0u64;
        for (path, map) in &self.maps {
            let tensors = SafeTensors::deserialize(map).map_err(|e| Error::Weights(format!("{}: {e}", path.display())))?;
            for (_, view) in tensors.tensors() {
                let elements: usize = view.shape().iter().product();
                let half = view.shape().len() == 2 && matches!(view.dtype(), Dtype::F16 | Dtype::BF16);
                total += (elements * if half { 2 } else { 4 }) as u64;
            }
        }
        Ok(total)
    }

    /// Runs `read` on tensor `name`'s view.
    fn view<R>(&self, name: &str, read: impl FnOnce(safetensors::tensor::TensorView<'_>) -> Result<R>) -> Result<R> {
        let &file = self
            .index
            .get(name)
            .ok_or_else(|| Error::Weights(format!("tensor `{name}` is missing from the weights")))?;
        let (path, map) = &self.maps[file];
        let tensors = SafeTensors::deserialize(map)
            .map_err(|e| Error::Weights(format!("{}: {e}", path.display())))?;
        let view = tensors
            .tensor(name)
            .map_err(|e| Error::Weights(format!("{name} in {}: {e}", path.display())))?;
        read(view)
    }
}

/// Where a model's tensors come from, under Hugging Face names and `[out, in]` layouts:
/// safetensors files ([`WeightFiles`]) or a GGUF file.
pub trait TensorSource {
    /// Reads a tensor as f32 with its shape.
    fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)>;

    /// A tensor's bytes as stored, with its type and shape, where it is stored as 16-bit floats
    /// (f16, bf16), which the CPU engine multiplies without widening them first; `None` for
    /// other types (read them with [`TensorSource::read_f32`]).
    fn read_half(&self, _name: &str) -> Result<Option<(crate::quants::GgmlType, Vec<u8>, Vec<usize>)>> {
        Ok(None)
    }

    /// Reads a tensor and checks its shape.
    fn read_shaped(&self, name: &str, expected: &[usize]) -> Result<Vec<f32>> {
        let (values, shape) = self.read_f32(name)?;
        if shape != expected {
            return Err(Error::Weights(format!(
                "tensor `{name}` has shape {shape:?} but the model's configuration implies {expected:?}; \
                 the weights and the configuration do not belong together"
            )));
        }
        Ok(values)
    }
}

impl TensorSource for WeightFiles {
    fn read_half(&self, name: &str) -> Result<Option<(crate::quants::GgmlType, Vec<u8>, Vec<usize>)>> {
        use crate::quants::GgmlType;
        self.view(name, |view| {
            let ty = match view.dtype() {
                Dtype::F16 => GgmlType::F16,
                Dtype::BF16 => GgmlType::BF16,
                _ => return Ok(None),
            };
            Ok(Some((ty, view.data().to_vec(), view.shape().to_vec())))
        })
    }

    fn read_f32(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        self.view(name, |view| {
            let bytes = view.data();
            let values: Vec<f32> = match view.dtype() {
                Dtype::F32 => bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
                Dtype::F16 => bytes
                    .chunks_exact(2)
                    .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                Dtype::BF16 => bytes
                    .chunks_exact(2)
                    .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                    .collect(),
                other => {
                    return Err(Error::Weights(format!(
                        "tensor `{name}` has dtype {other:?}; only f32, f16 and bf16 are supported \
                         (quantized checkpoints are not)"
                    )))
                }
            };
            Ok((values, view.shape().to_vec()))
        })
    }
}

fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

fn param2<B: Backend>(values: Vec<f32>, shape: [usize; 2], dtype: DType, device: &B::Device) -> Param<Tensor<B, 2>> {
    Param::from_tensor(Tensor::from_data(TensorData::new(values, shape), (device, dtype)))
}

fn param1<B: Backend>(values: Vec<f32>, dtype: DType, device: &B::Device) -> Param<Tensor<B, 1>> {
    let len = values.len();
    Param::from_tensor(Tensor::from_data(TensorData::new(values, [len]), (device, dtype)))
}

/// A linear layer from a Hugging Face `[out, in]` weight (burn stores `[in, out]`).
pub(crate) fn load_linear<B: Backend>(
    files: &impl TensorSource,
    prefix: &str,
    d_in: usize,
    d_out: usize,
    bias: bool,
    dtype: DType,
    device: &B::Device,
) -> Result<Linear<B>> {
    let weight = files.read_shaped(&format!("{prefix}.weight"), &[d_out, d_in])?;
    let weight = param2(transpose(&weight, d_out, d_in), [d_in, d_out], dtype, device);
    // The bias is added to the product, which comes out in the weight's type.
    let bias = if bias {
        Some(param1(files.read_shaped(&format!("{prefix}.bias"), &[d_out])?, dtype, device))
    } else {
        None
    };
    Ok(Linear { weight, bias })
}

fn load_norm<B: Backend>(
    files: &impl TensorSource,
    name: &str,
    config: &LlamaConfig,
    device: &B::Device,
) -> Result<RmsNorm<B>> {
    Ok(RmsNorm {
        weight: param1(files.read_shaped(name, &[config.hidden_size])?, DType::F32, device),
        eps: config.rms_norm_eps,
    })
}

/// Builds the model from a folder's weights, checking every shape against `config`. The
/// matrices and the embedding are stored as `matrices` (f32, or f16/bf16 on a GPU, which halves
/// what a decode step reads); the norms stay f32.
pub fn load_llama<B: Backend>(
    files: &impl TensorSource,
    config: &LlamaConfig,
    matrices: DType,
    device: &B::Device,
    mut on_layer: impl FnMut(usize, usize),
) -> Result<Llama<B>> {
    let matrices = stored_type(matrices);
    let h = config.hidden_size;
    let embed = files.read_shaped("model.embed_tokens.weight", &[config.vocab_size, h])?;
    let embed_tokens = Embedding {
        weight: param2(embed, [config.vocab_size, h], matrices, device),
    };
    let mut layers = Vec::with_capacity(config.num_hidden_layers);
    for i in 0..config.num_hidden_layers {
        layers.push(load_layer(files, config, i, matrices, device)?);
        on_layer(i + 1, config.num_hidden_layers);
    }
    let norm = load_norm(files, "model.norm.weight", config, device)?;
    // Some tied checkpoints still ship lm_head.weight; honour the config either way.
    let lm_head = if config.tie_word_embeddings {
        None
    } else {
        Some(load_linear(files, "lm_head", h, config.vocab_size, false, matrices, device)?)
    };
    Ok(Llama {
        embed_tokens,
        layers,
        norm,
        lm_head,
    })
}

/// The type matrices are stored in when `asked` is. Test-only: the type asked for is ignored,
/// as before GPUs held 16-bit matrices.
fn stored_type(asked: DType) -> DType {
    if crate::test_defect("matrices-f32") {
        DType::F32
    } else {
        asked
    }
}

/// Layer `i` of the model, its matrices stored as `matrices`.
fn load_layer<B: Backend>(files: &impl TensorSource, config: &LlamaConfig, i: usize, matrices: DType, device: &B::Device) -> Result<DecoderLayer<B>> {
    let h = config.hidden_size;
    let (nh, kvh, d) = (config.num_attention_heads, config.kv_heads(), config.head_dim());
    let inter = config.intermediate_size;
    let bias = config.has_qkv_bias();
    let p = format!("model.layers.{i}");
    Ok(DecoderLayer {
        input_layernorm: load_norm(files, &format!("{p}.input_layernorm.weight"), config, device)?,
        self_attn: Attention {
            q_proj: load_linear(files, &format!("{p}.self_attn.q_proj"), h, nh * d, bias, matrices, device)?,
            k_proj: load_linear(files, &format!("{p}.self_attn.k_proj"), h, kvh * d, bias, matrices, device)?,
            v_proj: load_linear(files, &format!("{p}.self_attn.v_proj"), h, kvh * d, bias, matrices, device)?,
            o_proj: load_linear(files, &format!("{p}.self_attn.o_proj"), nh * d, h, false, matrices, device)?,
            n_heads: nh,
            n_kv_heads: kvh,
            head_dim: d,
        },
        post_attention_layernorm: load_norm(
            files,
            &format!("{p}.post_attention_layernorm.weight"),
            config,
            device,
        )?,
        mlp: Mlp {
            gate_proj: load_linear(files, &format!("{p}.mlp.gate_proj"), h, inter, false, matrices, device)?,
            up_proj: load_linear(files, &format!("{p}.mlp.up_proj"), h, inter, false, matrices, device)?,
            down_proj: load_linear(files, &format!("{p}.mlp.down_proj"), inter, h, false, matrices, device)?,
        },
    })
}

/// The layers `layers` of the model alone (a split model's GPU part), matrices as `matrices`.
pub fn load_layer_stack<B: Backend>(
    files: &impl TensorSource,
    config: &LlamaConfig,
    layers: std::ops::Range<usize>,
    matrices: DType,
    device: &B::Device,
    mut on_layer: impl FnMut(usize, usize),
) -> Result<LayerStack<B>> {
    let matrices = stored_type(matrices);
    let total = layers.len();
    let mut stack = Vec::with_capacity(total);
    for i in layers {
        stack.push(load_layer(files, config, i, matrices, device)?);
        on_layer(stack.len(), total);
    }
    Ok(LayerStack { layers: stack })
}

/// A freshly initialised model (normal(0, 0.02) weights, unit norms), for training and
/// for random-weight fixtures and benchmarks.
pub fn init_llama<B: Backend>(config: &LlamaConfig, device: &B::Device) -> Llama<B> {
    let init = Initializer::Normal {
        mean: 0.0,
        std: 0.02,
    };
    let h = config.hidden_size;
    let (nh, kvh, d) = (config.num_attention_heads, config.kv_heads(), config.head_dim());
    let bias = config.has_qkv_bias();
    let linear = |d_in: usize, d_out: usize, bias: bool| {
        LinearConfig::new(d_in, d_out)
            .with_bias(bias)
            .with_initializer(init.clone())
            .init::<B>(device)
    };
    let norm = || RmsNorm {
        weight: Param::from_tensor(Tensor::ones([h], device)),
        eps: config.rms_norm_eps,
    };
    let embed_tokens = Embedding {
        weight: init.init_with([config.vocab_size, h], None, None, device),
    };
    let layers = (0..config.num_hidden_layers)
        .map(|_| DecoderLayer {
            input_layernorm: norm(),
            self_attn: Attention {
                q_proj: linear(h, nh * d, bias),
                k_proj: linear(h, kvh * d, bias),
                v_proj: linear(h, kvh * d, bias),
                o_proj: linear(nh * d, h, false),
                n_heads: nh,
                n_kv_heads: kvh,
                head_dim: d,
            },
            post_attention_layernorm: norm(),
            mlp: Mlp {
                gate_proj: linear(h, config.intermediate_size, false),
                up_proj: linear(h, config.intermediate_size, false),
                down_proj: linear(config.intermediate_size, h, false),
            },
        })
        .collect();
    Llama {
        embed_tokens,
        layers,
        norm: norm(),
        lm_head: (!config.tie_word_embeddings).then(|| linear(h, config.vocab_size, false)),
    }
}

/// How to store weights in a written safetensors file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreDtype {
    F32,
    F16,
    BF16,
}

fn tensor_values<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .expect("converted to f32")
}

/// Writes the model as a Hugging Face `model.safetensors` (names and layouts of `transformers`).
pub fn save_llama<B: Backend>(model: &Llama<B>, path: &Path, dtype: StoreDtype) -> Result<()> {
    let mut tensors: Vec<(String, Vec<usize>, Vec<f32>)> = Vec::new();
    let mut linear = |name: String, l: &Linear<B>| {
        let [d_in, d_out] = l.weight.val().dims();
        let w = tensor_values(l.weight.val());
        tensors.push((format!("{name}.weight"), vec![d_out, d_in], transpose(&w, d_in, d_out)));
        if let Some(b) = &l.bias {
            tensors.push((format!("{name}.bias"), vec![d_out], tensor_values(b.val())));
        }
    };
    for (i, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        linear(format!("{p}.self_attn.q_proj"), &layer.self_attn.q_proj);
        linear(format!("{p}.self_attn.k_proj"), &layer.self_attn.k_proj);
        linear(format!("{p}.self_attn.v_proj"), &layer.self_attn.v_proj);
        linear(format!("{p}.self_attn.o_proj"), &layer.self_attn.o_proj);
        linear(format!("{p}.mlp.gate_proj"), &layer.mlp.gate_proj);
        linear(format!("{p}.mlp.up_proj"), &layer.mlp.up_proj);
        linear(format!("{p}.mlp.down_proj"), &layer.mlp.down_proj);
    }
    if let Some(head) = &model.lm_head {
        linear("lm_head".into(), head);
    }
    for (i, layer) in model.layers.iter().enumerate() {
        let p = format!("model.layers.{i}");
        for (name, norm) in [
            ("input_layernorm", &layer.input_layernorm),
            ("post_attention_layernorm", &layer.post_attention_layernorm),
        ] {
            let w = tensor_values(norm.weight.val());
            tensors.push((format!("{p}.{name}.weight"), vec![w.len()], w));
        }
    }
    let w = tensor_values(model.norm.weight.val());
    tensors.push(("model.norm.weight".into(), vec![w.len()], w));
    let [vocab, hidden] = model.embed_tokens.weight.val().dims();
    tensors.push((
        "model.embed_tokens.weight".into(),
        vec![vocab, hidden],
        tensor_values(model.embed_tokens.weight.val()),
    ));
    write_safetensors(&tensors, path, dtype)
}

/// Writes named f32 tensors in the requested dtype.
pub fn write_safetensors(
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    path: &Path,
    dtype: StoreDtype,
) -> Result<()> {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape, values)| {
            let bytes: Vec<u8> = match dtype {
                StoreDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                StoreDtype::F16 => values
                    .iter()
                    .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
                    .collect(),
                StoreDtype::BF16 => values
                    .iter()
                    .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                    .collect(),
            };
            (name.clone(), shape.clone(), bytes)
        })
        .collect();
    let st_dtype = match dtype {
        StoreDtype::F32 => Dtype::F32,
        StoreDtype::F16 => Dtype::F16,
        StoreDtype::BF16 => Dtype::BF16,
    };
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = encoded
        .iter()
        .map(|(name, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(st_dtype, shape.clone(), bytes)
                .map_err(|e| Error::Weights(format!("{name}: {e}")))?;
            Ok((name.clone(), view))
        })
        .collect::<Result<_>>()?;
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|e| Error::Weights(format!("writing {}: {e}", path.display())))
}
