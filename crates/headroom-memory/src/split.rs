//! The planned CPU/GPU layer split: when a model's weights do not all fit in VRAM less the
//! reserve, the GPU holds as many of its last transformer layers as fit (with the KV cache those
//! layers need for a minimum context at the GPU's concurrency, the workspace and the margin),
//! and the CPU runs the rest. The output head goes to the GPU only with every layer. Unlike a
//! silent offload, the plan is computed before the model loads, says what it placed where and
//! why, and predicts what the split costs in speed.

use serde::{Deserialize, Serialize};

use crate::footprint::{human_bytes, Calibration, ModelShape};

/// How many transformer layers the GPU holds: as many as fit, or a fixed count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuLayers {
    #[default]
    Auto,
    Count(u32),
}

impl Serialize for GpuLayers {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            GpuLayers::Auto => s.serialize_str("auto"),
            GpuLayers::Count(n) => s.serialize_u32(*n),
        }
    }
}

impl<'de> Deserialize<'de> for GpuLayers {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Count(u32),
            Word(String),
        }
        match Raw::deserialize(d)? {
            Raw::Count(n) => Ok(GpuLayers::Count(n)),
            Raw::Word(w) if w == "auto" => Ok(GpuLayers::Auto),
            Raw::Word(w) => Err(serde::de::Error::custom(format!("gpu_layers must be \"auto\" or a layer count, not {w:?}"))),
        }
    }
}

impl std::str::FromStr for GpuLayers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(GpuLayers::Auto),
            n => n.parse().map(GpuLayers::Count).map_err(|_| format!("gpu_layers must be \"auto\" or a layer count, not {s:?}")),
        }
    }
}

/// What the plan needs to know beyond the model's shapes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SplitInputs {
    /// VRAM a model may use: free VRAM (other programs' use taken out) less the reserve.
    pub gpu_usable_bytes: u64,
    /// Every request on the GPU layers is guaranteed at least this context.
    pub min_context_tokens: u64,
    /// Requests the GPU worker runs at once, each with that context.
    pub requests: u64,
    /// The prefill chunk the workspace is sized for.
    pub prefill_chunk: u64,
    pub margin_percent: f64,
    /// Bandwidths for the speed estimate, bytes/s (host: measured; GPU: the driver's).
    pub host_bandwidth: Option<f64>,
    pub gpu_bandwidth: Option<f64>,
}

/// Where a model's parts live, and what each device holds for them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SplitPlan {
    pub layers: u32,
    /// The last `gpu_layers` layers run on the GPU, the first `layers − gpu_layers` on the CPU.
    pub gpu_layers: u32,
    pub head_on_gpu: bool,
    pub gpu_weights_bytes: u64,
    /// KV cache of the GPU layers for `context_tokens` × `requests`.
    pub gpu_kv_bytes: u64,
    pub gpu_workspace_bytes: u64,
    pub gpu_margin_bytes: u64,
    /// The CPU part's weights as the CPU engine holds them (the file's packed tensors).
    pub cpu_weights_bytes: u64,
    /// KV cache of the CPU layers for the same context and requests.
    pub cpu_kv_bytes: u64,
    pub context_tokens: u64,
    pub requests: u64,
    /// VRAM the plan could give the model (free less the reserve), and the most layers that fit
    /// in it: what a fixed `gpu_layers` may ask for.
    pub gpu_usable_bytes: u64,
    pub most_gpu_layers: u32,
    /// Decode tokens/s of one sequence if each part streams its weights at its device's
    /// bandwidth: an upper bound (none without both bandwidths).
    pub predicted_decode_tok_s: Option<f64>,
    pub reason: String,
}

impl SplitPlan {
    pub fn gpu_bytes(&self) -> u64 {
        self.gpu_weights_bytes + self.gpu_kv_bytes + self.gpu_workspace_bytes + self.gpu_margin_bytes
    }

    /// "all on the GPU", "split: 22 of 32 layers on the GPU", "all on the CPU".
    pub fn placement(&self) -> String {
        match (self.gpu_layers, self.head_on_gpu) {
            (n, true) if n == self.layers => "all on the GPU".into(),
            (0, _) => "all on the CPU".into(),
            (n, _) => format!("split: {n} of {} layers on the GPU", self.layers),
        }
    }
}

/// The model's parts in bytes, per device.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerBytes {
    /// One transformer layer's weights on the GPU (16-bit matrices, f32 norms).
    pub gpu_layer: u64,
    /// The output head and final norm on the GPU (for a tied head, a GPU copy of the embedding).
    pub gpu_head: u64,
    /// One layer's weights as the CPU engine holds them.
    pub cpu_layer: u64,
    /// KV cache per token per layer on the GPU (f32) and on the CPU (its chosen precision).
    pub gpu_kv_per_token: u64,
    pub cpu_kv_per_token: u64,
}

impl LayerBytes {
    /// From the model's shape on each device: `gpu` as CUDA holds it (matrices at their type,
    /// norms f32), `cpu` as the CPU engine does (a layer's share of the packed file is its share
    /// of the parameters).
    pub fn of(gpu: &ModelShape, cpu: &ModelShape) -> Self {
        let (h, layers) = (gpu.hidden, gpu.layers.max(1));
        let (q, kv) = (gpu.heads * gpu.head_dim, gpu.kv_heads * gpu.head_dim);
        let layer_matrices = 2 * h * q + 2 * h * kv + 3 * h * gpu.intermediate;
        let norms = (2 * gpu.layers + 1) * h;
        let matrix_bytes = gpu.weights_bytes().saturating_sub(norms * 4) as f64 / gpu.parameters.saturating_sub(norms).max(1) as f64;
        let cpu_bytes_per_param = cpu.weights_bytes() as f64 / cpu.parameters.max(1) as f64;
        Self {
            gpu_layer: (layer_matrices as f64 * matrix_bytes) as u64 + 2 * h * 4,
            gpu_head: (gpu.vocab as f64 * h as f64 * matrix_bytes) as u64 + h * 4,
            cpu_layer: ((layer_matrices + 2 * h) as f64 * cpu_bytes_per_param) as u64,
            gpu_kv_per_token: gpu.kv_bytes_per_token() / layers,
            cpu_kv_per_token: cpu.kv_bytes_per_token() / layers,
        }
    }
}

/// How a GPU device holds `bundle`: CUDA with 16-bit matrices and norms in f32, the sim GPU
/// (any other label) with f32 weights, as its ledger charges them. The KV cache is f32 on both.
pub fn gpu_shape(bundle: &headroom_model::ModelBundle, device_label: &str) -> ModelShape {
    if device_label.starts_with("cuda") {
        ModelShape::for_backend(bundle, "cuda", headroom_model::KvPrecision::F32)
    } else {
        ModelShape::from_config(&bundle.config)
    }
}

/// `shape` as its last `gpu_layers` layers alone: a split's part on the GPU, whose KV cache per
/// token is those layers' (what admission charges the GPU for a request there).
pub fn gpu_part_shape(shape: &ModelShape, gpu_layers: u64) -> ModelShape {
    ModelShape { layers: gpu_layers.min(shape.layers), ..shape.clone() }
}

/// The split of `bundle` on the GPU device `device_label` ("cuda:0", "sim") with
/// `gpu_usable_bytes` to give it: the one plan `headroom plan` prints and `headroom serve` loads.
/// It guarantees `requests` requests of `config.split_min_context_tokens` (at most the model's
/// context) on the GPU's layers; further requests are admitted as memory allows, like any.
pub fn plan_model_split(
    bundle: &headroom_model::ModelBundle,
    device_label: &str,
    config: &crate::MemoryConfig,
    gpu_usable_bytes: u64,
    requests: u64,
    prefill_chunk: u64,
    bandwidths: Bandwidths,
) -> Result<SplitPlan, String> {
    let (planner, _) = crate::planner_for(bundle, crate::calibration::backend_key(device_label), config.clone());
    let gpu = gpu_shape(bundle, device_label);
    let cpu = ModelShape::for_backend(bundle, "cpu", config.cpu_kv_cache);
    let inputs = SplitInputs {
        gpu_usable_bytes,
        min_context_tokens: config.split_min_context_tokens.min(gpu.context),
        requests: requests.max(1),
        prefill_chunk,
        margin_percent: config.fragmentation_margin_percent,
        host_bandwidth: bandwidths.host,
        gpu_bandwidth: bandwidths.gpu,
    };
    let plan = plan_split(&gpu, &cpu, &planner.calibration, inputs, config.gpu_layers)?;
    if !bundle.config.is_encoder() || plan.gpu_layers == 0 || plan.gpu_layers == plan.layers {
        return Ok(plan);
    }
    // An encoder runs whole on one device (headroom_model::bert): no split.
    if let GpuLayers::Count(n) = config.gpu_layers {
        return Err(format!("gpu_layers = {n} would split {}, an encoder, which runs whole on one device; leave gpu_layers out or set it to {}", bundle.name(), plan.layers));
    }
    let mut on_cpu = plan_split(&gpu, &cpu, &planner.calibration, inputs, GpuLayers::Count(0))?;
    on_cpu.reason = format!("all on the CPU: {} is an encoder, which runs whole, and only {} of its {} layers fit on the GPU now", bundle.name(), plan.gpu_layers, plan.layers);
    Ok(on_cpu)
}

/// Read bandwidths in bytes/s for a split's speed estimate, where known.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Bandwidths {
    pub host: Option<f64>,
    pub gpu: Option<f64>,
}

/// Chooses the split for `wanted` layers on the GPU: the most that fit (`Auto`) or the count
/// asked for, which is an error naming what fits when it does not.
pub fn plan_split(
    gpu: &ModelShape,
    cpu: &ModelShape,
    calibration: &Calibration,
    inputs: SplitInputs,
    wanted: GpuLayers,
) -> Result<SplitPlan, String> {
    let bytes = LayerBytes::of(gpu, cpu);
    let layers = gpu.layers as u32;
    let tokens = inputs.min_context_tokens * inputs.requests;
    let chunk = inputs.prefill_chunk.clamp(1, inputs.min_context_tokens.max(1));
    // The workspace of the widest step the GPU layers run: a batch step holds one request's
    // prefill chunk and one decode row of each other request, each attending over its context
    // (the estimates admission makes for whole requests).
    let context = inputs.min_context_tokens;
    let workspace = calibration.workspace_bytes(gpu, chunk, context) + calibration.workspace_bytes(gpu, 1, context) * (inputs.requests - 1);
    let plan = |n: u32| -> SplitPlan {
        let head_on_gpu = n == layers;
        let gpu_kv = bytes.gpu_kv_per_token * n as u64 * tokens;
        let gpu_workspace = if n > 0 { workspace } else { 0 };
        let cpu_layers = (layers - n) as u64;
        let gpu_weights = bytes.gpu_layer * n as u64 + if head_on_gpu { bytes.gpu_head } else { 0 };
        let cpu_weights = if head_on_gpu { 0 } else { cpu.weights_bytes().saturating_sub(bytes.cpu_layer * n as u64) };
        let predicted = match (inputs.host_bandwidth, inputs.gpu_bandwidth) {
            (Some(host), Some(device)) => Some(1.0 / (cpu_weights as f64 / host + gpu_weights as f64 / device)),
            (Some(host), None) if n == 0 => Some(host / cpu_weights as f64),
            _ => None,
        };
        // Test-only: the GPU layers' KV cache is left out (the defect of an offload that fits
        // the weights and runs out of memory at the first long request).
        let gpu_kv = if headroom_model::test_defect("split-ignores-kv") { 0 } else { gpu_kv };
        SplitPlan {
            layers,
            gpu_layers: n,
            head_on_gpu,
            gpu_weights_bytes: gpu_weights,
            gpu_kv_bytes: gpu_kv,
            gpu_workspace_bytes: gpu_workspace,
            gpu_margin_bytes: ((gpu_kv + gpu_workspace) as f64 * inputs.margin_percent / 100.0) as u64,
            cpu_weights_bytes: cpu_weights,
            cpu_kv_bytes: bytes.cpu_kv_per_token * cpu_layers * tokens,
            context_tokens: inputs.min_context_tokens,
            requests: inputs.requests,
            gpu_usable_bytes: inputs.gpu_usable_bytes,
            most_gpu_layers: 0,
            predicted_decode_tok_s: predicted,
            reason: String::new(),
        }
    };
    let fits = |p: &SplitPlan| p.gpu_bytes() <= inputs.gpu_usable_bytes;
    let most = (0..=layers).rev().map(plan).find(|p| fits(p)).expect("no layers on the GPU always fits");
    let plan = |n: u32| SplitPlan { most_gpu_layers: most.gpu_layers, ..plan(n) };
    let most = plan(most.gpu_layers);
    let need = |p: &SplitPlan| {
        format!(
            "{} of weights, {} of KV cache for {} requests × {} tokens, {} of workspace and margin",
            human_bytes(p.gpu_weights_bytes),
            human_bytes(p.gpu_kv_bytes),
            p.requests,
            p.context_tokens,
            human_bytes(p.gpu_workspace_bytes + p.gpu_margin_bytes)
        )
    };
    let usable = human_bytes(inputs.gpu_usable_bytes);
    match wanted {
        GpuLayers::Count(n) if n > layers => Err(format!("gpu_layers = {n}, but the model has {layers} layers; at most {} fit in the {usable} the GPU can give it", most.gpu_layers)),
        GpuLayers::Count(n) => {
            let mut p = plan(n);
            if !fits(&p) {
                return Err(format!(
                    "gpu_layers = {n} needs {} on the GPU ({}), but only {usable} is usable after the reserve; at most {} layers fit (gpu_layers = \"auto\" picks that)",
                    human_bytes(p.gpu_bytes()),
                    need(&p),
                    most.gpu_layers
                ));
            }
            p.reason = format!("{} as configured (gpu_layers = {n}): {} on the GPU ({}) of {usable} usable", p.placement(), human_bytes(p.gpu_bytes()), need(&p));
            Ok(p)
        }
        GpuLayers::Auto => {
            let mut p = most;
            p.reason = match p.gpu_layers {
                0 => format!("all on the CPU: not even one layer fits in the {usable} the GPU can give it with {} tokens of context for {} requests", p.context_tokens, p.requests),
                n if n == layers => format!("all on the GPU: {} ({}) fits in {usable}", human_bytes(p.gpu_bytes()), need(&p)),
                n => format!(
                    "split: the last {n} of {layers} layers fit in the {usable} the GPU can give them ({}); the first {} and the output head run on the CPU",
                    need(&p),
                    layers - n
                ),
            };
            Ok(p)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::footprint::MIB;
    use headroom_model::KvPrecision;

    /// Llama 3.2 1B's shape: f16 matrices on the GPU, Q8_0 (34 bytes per 32 weights) on the CPU.
    fn shapes() -> (ModelShape, ModelShape) {
        let config = headroom_model::fixture::config_1b();
        let mut gpu = ModelShape::from_config(&config);
        let norms = config.norm_parameter_count() as u64;
        gpu.packed_weights_bytes = (gpu.parameters - norms) * 2 + norms * 4;
        let cpu = ModelShape::from_config(&config).on_cpu(gpu.parameters * 34 / 32, KvPrecision::F32);
        (gpu, cpu)
    }

    fn inputs(usable: u64) -> SplitInputs {
        SplitInputs {
            gpu_usable_bytes: usable,
            min_context_tokens: 4096,
            requests: 2,
            prefill_chunk: 256,
            margin_percent: 10.0,
            host_bandwidth: Some(20e9),
            gpu_bandwidth: Some(1000e9),
        }
    }

    /// What `n` GPU layers need, worked out here from the shape rather than by the plan.
    fn needed(n: u64, head: bool) -> u64 {
        let (gpu, _) = shapes();
        let c = headroom_model::fixture::config_1b();
        let (h, q, kv) = (c.hidden_size as u64, (c.num_attention_heads * c.head_dim()) as u64, (c.kv_heads() * c.head_dim()) as u64);
        let layer = (2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size as u64) * 2 + 2 * h * 4;
        let head_bytes = if head { c.vocab_size as u64 * h * 2 + h * 4 } else { 0 };
        let kv_bytes = n * 2 * kv * 4 * 4096 * 2;
        let c = Calibration::default();
        let workspace = if n > 0 { c.workspace_bytes(&gpu, 256, 4096) + c.workspace_bytes(&gpu, 1, 4096) } else { 0 };
        n * layer + head_bytes + kv_bytes + workspace + ((kv_bytes + workspace) as f64 * 0.1) as u64
    }

    #[test]
    fn the_gpu_takes_every_layer_that_fits_with_its_kv_cache() {
        let (gpu, cpu) = shapes();
        let all = needed(16, true);
        let plan = plan_split(&gpu, &cpu, &Calibration::default(), inputs(all), GpuLayers::Auto).unwrap();
        assert_eq!((plan.gpu_layers, plan.head_on_gpu, plan.cpu_weights_bytes), (16, true, 0), "{}", plan.reason);
        assert!(plan.reason.starts_with("all on the GPU"), "{}", plan.reason);

        // Room for 9 layers (and their KV cache) but not 10.
        let usable = (needed(9, false) + needed(10, false)) / 2;
        let plan = plan_split(&gpu, &cpu, &Calibration::default(), inputs(usable), GpuLayers::Auto).unwrap();
        assert_eq!((plan.gpu_layers, plan.head_on_gpu), (9, false), "{}", plan.reason);
        assert!(plan.gpu_bytes() <= usable && plan.gpu_kv_bytes > 0);
        assert!(plan.reason.contains("the last 9 of 16 layers") && plan.placement() == "split: 9 of 16 layers on the GPU", "{}", plan.reason);
        // Each device holds its own part: the CPU the embedding, head and first 7 layers.
        assert!(plan.cpu_weights_bytes < cpu.weights_bytes() && plan.cpu_weights_bytes > cpu.weights_bytes() / 3);
        assert_eq!(plan.cpu_kv_bytes, 7 * cpu.kv_bytes_per_token() / 16 * 4096 * 2);
        // Faster than all on the CPU, slower than all on the GPU.
        let cpu_only = plan_split(&gpu, &cpu, &Calibration::default(), inputs(MIB), GpuLayers::Auto).unwrap();
        let gpu_only = plan_split(&gpu, &cpu, &Calibration::default(), inputs(all), GpuLayers::Auto).unwrap();
        let speed = |p: &SplitPlan| p.predicted_decode_tok_s.unwrap();
        assert!(speed(&cpu_only) < speed(&plan) && speed(&plan) < speed(&gpu_only));
        assert_eq!((cpu_only.gpu_layers, cpu_only.gpu_bytes()), (0, 0), "{}", cpu_only.reason);
        assert!(cpu_only.reason.starts_with("all on the CPU"), "{}", cpu_only.reason);
    }

    /// The negative control: a plan that leaves the GPU layers' KV cache out places more layers
    /// than fit.
    #[test]
    fn a_plan_without_the_kv_cache_fails_the_check() {
        if std::env::var_os("HEADROOM_TEST_DEFECT").is_some() {
            return;
        }
        headroom_model::failing_with_defect("split::tests::the_gpu_takes_every_layer_that_fits_with_its_kv_cache", "split-ignores-kv");
    }

    #[test]
    fn a_layer_count_that_does_not_fit_says_what_does() {
        let (gpu, cpu) = shapes();
        let usable = (needed(9, false) + needed(10, false)) / 2;
        let err = plan_split(&gpu, &cpu, &Calibration::default(), inputs(usable), GpuLayers::Count(12)).unwrap_err();
        assert!(err.contains("gpu_layers = 12 needs") && err.contains("at most 9 layers fit"), "{err}");
        let err = plan_split(&gpu, &cpu, &Calibration::default(), inputs(usable), GpuLayers::Count(40)).unwrap_err();
        assert!(err.contains("has 16 layers") && err.contains("at most 9"), "{err}");
        let plan = plan_split(&gpu, &cpu, &Calibration::default(), inputs(usable), GpuLayers::Count(4)).unwrap();
        assert_eq!(plan.gpu_layers, 4);
        assert!(plan.reason.contains("as configured"), "{}", plan.reason);
    }

    #[test]
    fn gpu_layers_reads_auto_or_a_count() {
        #[derive(Deserialize)]
        struct S {
            gpu_layers: GpuLayers,
        }
        let read = |t: &str| toml::from_str::<S>(t).map(|s| s.gpu_layers).map_err(|e| e.to_string());
        assert_eq!(read("gpu_layers = \"auto\""), Ok(GpuLayers::Auto));
        assert_eq!(read("gpu_layers = 12"), Ok(GpuLayers::Count(12)));
        assert!(read("gpu_layers = \"most\"").unwrap_err().contains("\"auto\" or a layer count"));
        assert_eq!("7".parse(), Ok(GpuLayers::Count(7)));
        assert!("x".parse::<GpuLayers>().is_err());
    }

    /// A split's requests: the GPU is charged the KV cache of its layers, the host that of the
    /// CPU's (f32), and a whole model's planner charges the host nothing extra.
    #[test]
    fn a_split_charges_each_device_the_kv_cache_of_its_own_layers() {
        let (gpu, _) = shapes();
        let planner = crate::Planner::new(gpu, Calibration::default(), crate::MemoryConfig::default());
        let request = crate::RequestShape { prompt_tokens: 1000, max_tokens: 24, prefill_chunk: 256 };
        let whole = planner.footprint(request);
        let split = planner.clone().split(4);
        let on_gpu = split.footprint(request);
        let on_host = split.split_host_footprint(request).expect("a split holds layers in host RAM");
        // Llama 3.2 1B: 16 layers, 4 on the GPU.
        assert_eq!(on_gpu.kv_bytes * 16, whole.kv_bytes * 4);
        assert_eq!(on_host.kv_bytes * 16, whole.kv_bytes * 12);
        assert_eq!(on_gpu.workspace_bytes, whole.workspace_bytes, "a step's workspace is one layer's, whatever the count");
        assert!(planner.split_host_footprint(request).is_none());
    }
}
