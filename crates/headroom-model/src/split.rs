//! A model split between the CPU and a GPU: the CPU engine holds the embedding, the first
//! layers, the final norm and the head; a burn backend (CUDA, or burn's ndarray standing in for
//! the sim GPU) holds the last layers. `headroom_memory::split` plans how many.
//!
//! **Design: one worker process drives both backends.** Each step, the CPU runs the embedding
//! and its layers, hands the residual stream (`tokens × hidden` f32: 2 KiB per token for a
//! 576-wide model, 8 KiB for 2048) to the GPU once, takes it back once after the GPU's layers,
//! and runs the norm and the head. The other design, a GPU worker and a CPU worker each holding
//! their layers and passing activations over the worker protocol, was rejected: it puts two
//! process hops and two frame encodings on every decode step, it makes one request live in two
//! workers (a fault in either loses both halves, and the journal, the breaker and failover all
//! reason about one worker per request), and it needs a CPU worker that is not the failover
//! worker, since the failover worker must stay free for the requests it catches. In one process
//! a split request is an ordinary GPU-worker request: it fails over, resumes and is journaled
//! exactly like one, and the CPU worker stays the untouched fallback.
//!
//! Each layer's KV cache lives on that layer's device ([`SplitCache`]). The two parts keep RoPE
//! their own way (the CPU engine in the file's row order, burn in rotate-half order): a layer's
//! rotation is internal to its attention, and what crosses between them, the residual stream,
//! is the same either way.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor, TensorData};

use crate::cpu::{CpuCache, CpuModel};
use crate::generate::{Decoder, Next};
use crate::model::{KvCache, LayerStack, Place, RopeTables};
use crate::{Error, LlamaConfig, ModelBundle, Result};

/// A model whose last `gpu_layers` layers run on a burn device and the rest on the CPU engine.
pub struct SplitModel<B: Backend> {
    cpu: CpuModel,
    gpu: LayerStack<B>,
    device: B::Device,
}

impl<B: Backend> std::fmt::Debug for SplitModel<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SplitModel").field("cpu_layers", &self.cpu_layers()).field("gpu_layers", &self.gpu_layers()).finish()
    }
}

/// A split sequence's caches: the CPU layers' in host memory, the GPU layers' (and their RoPE
/// tables) on the device.
pub struct SplitCache<B: Backend> {
    cpu: CpuCache,
    rope: RopeTables<B>,
    gpu: KvCache<B>,
}

impl<B: Backend> SplitModel<B> {
    /// Loads `bundle` with its last `gpu_layers` layers on `device`, their matrices stored as
    /// `matrices`, and the rest on the CPU. A split has layers on both sides: all layers on the
    /// GPU is the GPU engine, none the CPU engine.
    pub fn load(bundle: &ModelBundle, gpu_layers: usize, device: &B::Device, matrices: DType) -> Result<Self> {
        let layers = bundle.config.num_hidden_layers;
        if gpu_layers == 0 || gpu_layers >= layers {
            return Err(Error::InvalidRequest(format!(
                "a split puts between 1 and {} of the model's {layers} layers on the GPU, not {gpu_layers}",
                layers.saturating_sub(1)
            )));
        }
        let cpu_layers = layers - gpu_layers;
        let cpu = bundle.load_cpu_layers(cpu_layers, |_, _| {})?;
        let gpu = bundle.load_layer_stack(device, matrices, cpu_layers..layers, |_, _| {})?;
        Ok(Self { cpu, gpu, device: device.clone() })
    }

    pub fn cpu_layers(&self) -> usize {
        self.cpu.config.num_hidden_layers - self.gpu_layers()
    }

    pub fn gpu_layers(&self) -> usize {
        self.gpu.layers.len()
    }

    /// Bytes the CPU part holds (embedding, its layers, norm and head).
    pub fn cpu_weight_bytes(&self) -> usize {
        self.cpu.weight_bytes()
    }

    /// Runs `inputs`, each `(tokens, cache)`, through the CPU's layers, the GPU's and the head;
    /// gives each input's logits of its last token, or (`pooled`) the sum of its tokens' final
    /// hidden states. `decode_steps`: every input is one token of its own sequence; otherwise
    /// there is one input (a prefill chunk).
    fn run(&self, inputs: &mut [(&[u32], &mut SplitCache<B>)], decode_steps: bool, pooled: bool) -> Vec<Vec<f32>> {
        let h = self.cpu.config.hidden_size;
        let shape = match &*inputs {
            [(tokens, _)] => [1, tokens.len(), h],
            inputs => {
                assert!(decode_steps && inputs.iter().all(|(t, _)| t.len() == 1), "several sequences step one token each");
                [inputs.len(), 1, h]
            }
        };
        let mut cpu_inputs = Vec::with_capacity(inputs.len());
        let mut gpu_parts = Vec::with_capacity(inputs.len());
        for (tokens, cache) in inputs.iter_mut() {
            let SplitCache { cpu, rope, gpu } = &mut **cache;
            assert_eq!(cpu.len, gpu.len, "both parts of a split cache hold the same tokens");
            cpu_inputs.push((*tokens, cpu));
            gpu_parts.push((&*rope, gpu));
        }
        let device = &self.device;
        let gpu = &self.gpu;
        self.cpu.step_around(&mut cpu_inputs, decode_steps, pooled, move |x| {
            // Test-only: the GPU layers keep no cache and attend to the new tokens alone.
            let forget = crate::test_defect("split-gpu-no-cache");
            let mut places: Vec<Place<'_, B>> = gpu_parts
                .iter_mut()
                .map(|(rope, cache)| Place { rope: *rope, start: cache.len, cache: (!forget).then_some(&mut **cache) })
                .collect();
            let x = Tensor::<B, 3>::from_data(TensorData::new(x, shape), device);
            let out = gpu.forward(x, &mut places);
            if forget {
                gpu_parts.iter_mut().for_each(|(_, cache)| cache.len += shape[1]);
            }
            out.into_data().convert::<f32>().into_vec::<f32>().expect("hidden states are f32 after convert")
        })
    }
}

impl<B: Backend> Decoder for SplitModel<B> {
    type Cache = SplitCache<B>;

    fn new_cache(&self, config: &LlamaConfig, capacity: usize) -> SplitCache<B> {
        SplitCache {
            cpu: self.cpu.new_cache(capacity),
            rope: RopeTables::new(config, capacity, &self.device),
            gpu: KvCache::for_layers(config, self.gpu_layers(), capacity),
        }
    }

    fn feed(&self, tokens: &[u32], cache: &mut SplitCache<B>) -> Vec<f32> {
        self.run(&mut [(tokens, cache)], false, false).pop().expect("one input gives one row of logits")
    }

    fn feed_pooled(&self, tokens: &[u32], cache: &mut SplitCache<B>) -> Vec<f32> {
        self.run(&mut [(tokens, cache)], false, true).pop().expect("one input gives one pooled row")
    }

    /// Always logits: the head is on the CPU, where the sampler's argmax is as cheap.
    fn feed_batch(&self, batch: &mut [(u32, &mut SplitCache<B>)], _pick: &[bool]) -> Vec<Next> {
        if batch.is_empty() {
            return Vec::new();
        }
        let mut inputs: Vec<(&[u32], &mut SplitCache<B>)> =
            batch.iter_mut().map(|(token, cache)| (std::slice::from_ref(&*token), &mut **cache)).collect();
        self.run(&mut inputs, true, false).into_iter().map(Next::Logits).collect()
    }
}
