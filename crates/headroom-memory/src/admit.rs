//! The admission decision: where a request may run, given its predicted [`Footprint`], the GPU
//! [`Budget`] (predicted and observed, the smaller wins) and the host-RAM budget of the CPU path.
//! Every decision carries a reason a person can read.

use serde::{Deserialize, Serialize};

use crate::config::MemoryConfig;
use crate::footprint::{human_bytes, Calibration, Footprint, ModelShape, RequestShape};

/// What one device can give a new request right now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    pub total_bytes: u64,
    pub reserve_bytes: u64,
    /// Weights of the loaded model(s).
    pub weights_bytes: u64,
    /// Reservations of admitted requests.
    pub held_bytes: u64,
    /// Free memory as the driver (NVML) or the OS reports it, other programs included.
    pub observed_free_bytes: Option<u64>,
}

impl Budget {
    /// The most any one request could ever get on this device: total − reserve − weights.
    pub fn capacity_bytes(&self) -> u64 {
        self.total_bytes
            .saturating_sub(self.reserve_bytes)
            .saturating_sub(self.weights_bytes)
    }

    /// What a request may take now: the predicted budget less reservations held, or observed
    /// free memory less the reserve, whichever is smaller.
    pub fn available_bytes(&self) -> u64 {
        let predicted = self.capacity_bytes().saturating_sub(self.held_bytes);
        match self.observed_free_bytes {
            Some(free) => predicted.min(free.saturating_sub(self.reserve_bytes)),
            None => predicted,
        }
    }

    /// What a request could get once every admitted request has finished: waiting in the queue
    /// frees reservations, never memory another program holds.
    pub fn available_after_release_bytes(&self) -> u64 {
        let capacity = self.capacity_bytes();
        match self.observed_free_bytes {
            Some(free) => capacity.min(free.saturating_sub(self.reserve_bytes) + self.held_bytes),
            None => capacity,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Admission {
    Gpu { reason: String },
    Queue { eta_ms: u64, reason: String },
    Shrink { max_tokens: u64, reason: String },
    Cpu { reason: String },
    Refuse { reason: String, retry_after_s: Option<u64> },
}

impl Admission {
    pub fn reason(&self) -> &str {
        match self {
            Admission::Gpu { reason }
            | Admission::Queue { reason, .. }
            | Admission::Shrink { reason, .. }
            | Admission::Cpu { reason }
            | Admission::Refuse { reason, .. } => reason,
        }
    }
    pub fn is_refused(&self) -> bool {
        matches!(self, Admission::Refuse { .. })
    }
}

/// A decision made with the `host` budget as it is; when that refuses and `droppable` bytes
/// counted in it are a cache its holder can drop at once (the CPU worker's prefix cache of KV
/// blocks), the decision as if they were free, with `true`: drop them. A cache gives way
/// before a request is refused.
pub fn decide_dropping(host: &Budget, droppable: u64, decide: impl Fn(&Budget) -> Admission) -> (Admission, bool) {
    let admission = decide(host);
    // Test-only: the cache is kept and the request refused.
    if !admission.is_refused() || droppable == 0 || headroom_model::test_defect("prefix-cache-before-requests") {
        return (admission, false);
    }
    let freed = Budget {
        weights_bytes: host.weights_bytes.saturating_sub(droppable),
        observed_free_bytes: host.observed_free_bytes.map(|f| f + droppable),
        ..*host
    };
    match decide(&freed) {
        retry if !retry.is_refused() => (retry, true),
        _ => (admission, false),
    }
}

/// What the caller allows for this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allowances {
    /// The client accepts fewer tokens than asked (never applied silently).
    pub shrink: bool,
    /// The request may be served by the CPU worker.
    pub cpu: bool,
    /// The longest wait the client accepts, in ms (the policy's limit when unset).
    pub max_wait_ms: Option<u64>,
}

impl Default for Allowances {
    fn default() -> Self {
        Self {
            shrink: false,
            cpu: true,
            max_wait_ms: None,
        }
    }
}

/// Turns (model, request, budgets) into an [`Admission`].
#[derive(Debug, Clone)]
pub struct Planner {
    pub shape: ModelShape,
    pub calibration: Calibration,
    pub config: MemoryConfig,
    /// A split model: the GPU holds the KV cache of its last this many layers alone (see
    /// [`crate::split`]); the host path always holds the whole model's.
    pub gpu_layers: Option<u64>,
}

/// Thousands separators for token counts in reasons and summaries: 3000 → "3,000".
pub fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// What every branch of a decision says about the request and the CPU path.
struct DecisionContext {
    /// "needs … (… of KV cache …)", for reasons.
    what: String,
    needs: u64,
    cpu_fits: bool,
    cpu_allowed: bool,
    cpu_available: u64,
    host_reserve: u64,
}

impl DecisionContext {
    fn cpu_note(&self, why: &str) -> String {
        format!(
            "{why}; runs on CPU instead ({} of host RAM free for it after the {} host reserve)",
            human_bytes(self.cpu_available),
            human_bytes(self.host_reserve)
        )
    }

    fn cpu_refusal(&self) -> String {
        if !self.cpu_allowed {
            "CPU fallback is not allowed for this request".to_string()
        } else {
            format!(
                "the CPU path has only {} of host RAM free after its {} reserve",
                human_bytes(self.cpu_available),
                human_bytes(self.host_reserve)
            )
        }
    }
}

impl Planner {
    pub fn new(shape: ModelShape, calibration: Calibration, config: MemoryConfig) -> Self {
        Self {
            shape,
            calibration,
            config,
            gpu_layers: None,
        }
    }

    /// The same planner for a model split with its last `gpu_layers` layers on the GPU.
    pub fn split(self, gpu_layers: u64) -> Self {
        Self { gpu_layers: Some(gpu_layers), ..self }
    }

    /// The model as the device this planner is for holds it (of a split, the GPU's layers).
    fn device_shape(&self) -> ModelShape {
        match self.gpu_layers {
            Some(n) => crate::split::gpu_part_shape(&self.shape, n),
            None => self.shape.clone(),
        }
    }

    /// The request on the device this planner is for (of a split, the GPU's layers' share).
    pub fn footprint(&self, request: RequestShape) -> Footprint {
        Footprint::overcommitted(&self.device_shape(), request, &self.calibration, self.config.fragmentation_margin_percent, self.config.kv_overcommit)
    }

    /// Bytes of one KV block (every layer) on the device this planner is for: what a request
    /// takes for each block it writes past its reservation under overcommit.
    pub fn kv_block_bytes(&self) -> u64 {
        let shape = self.device_shape();
        shape.kv_bytes_per_token() * shape.kv_block_tokens.max(1)
    }

    /// The request in host RAM on the CPU worker, whose KV cache has the configured
    /// `cpu_kv_cache` precision.
    pub fn host_footprint(&self, request: RequestShape) -> Footprint {
        let shape = self.shape.clone().with_cpu_cache(self.config.cpu_kv_cache);
        Footprint::estimate(&shape, request, &self.calibration, self.config.fragmentation_margin_percent)
    }

    /// A split request's share of host RAM: the KV cache of the layers the CPU runs in the GPU
    /// worker (f32, as the split's CPU part holds it). None unless the model runs split.
    pub fn split_host_footprint(&self, request: RequestShape) -> Option<Footprint> {
        let gpu_layers = self.gpu_layers?;
        let shape = ModelShape { layers: self.shape.layers.saturating_sub(gpu_layers), ..self.shape.clone() }.with_cpu_cache(headroom_model::KvPrecision::F32);
        Some(Footprint::estimate(&shape, request, &self.calibration, self.config.fragmentation_margin_percent))
    }

    /// The largest max_tokens whose footprint fits in `available` bytes, if any.
    pub fn max_tokens_fitting(&self, request: RequestShape, available: u64) -> Option<u64> {
        let (mut lo, mut hi) = (0u64, request.max_tokens);
        while lo < hi {
            let mid = (lo + hi).div_ceil(2);
            let fp = self.footprint(RequestShape { max_tokens: mid, ..request });
            if fp.request_bytes() <= available {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        (lo > 0).then_some(lo)
    }

    /// The KV cache a footprint reserves, in blocks: "7 blocks of 16 tokens for 100 tokens", and
    /// under overcommit "3 of the 7 blocks ... reserved (overcommit 2×)".
    fn kv_blocks_phrase(&self, fp: &Footprint) -> String {
        let block = self.shape.kv_block_tokens.max(1);
        let all = fp.tokens.div_ceil(block);
        let held = fp.kv_tokens.div_ceil(block);
        if held < all {
            format!(
                "{held} of the {all} blocks of {block} tokens that {} tokens fill, the rest taken as written (overcommit {}×)",
                thousands(fp.tokens),
                self.config.kv_overcommit
            )
        } else {
            format!("{all} blocks of {block} tokens for {} tokens", thousands(fp.tokens))
        }
    }

    fn context(&self, request: RequestShape, allow: Allowances, host: &Budget) -> DecisionContext {
        let fp = self.footprint(request);
        let needs = fp.request_bytes();
        let cpu_needs = self.host_footprint(request).request_bytes();
        let cpu_allowed = allow.cpu && self.config.allow_cpu_redirect;
        let cpu_available = host.available_bytes();
        let what = if self.shape.encoder {
            format!(
                "needs {} ({} workspace to encode {} tokens in one pass, no KV cache, {} margin)",
                human_bytes(needs),
                human_bytes(fp.workspace_bytes),
                thousands(fp.tokens),
                human_bytes(fp.margin_bytes)
            )
        } else {
            format!(
                "needs {} ({} of KV cache: {}, {} workspace, {} margin)",
                human_bytes(needs),
                human_bytes(fp.kv_bytes),
                self.kv_blocks_phrase(&fp),
                human_bytes(fp.workspace_bytes),
                human_bytes(fp.margin_bytes)
            )
        };
        DecisionContext {
            what,
            needs,
            cpu_fits: cpu_allowed && cpu_needs <= cpu_available,
            cpu_allowed,
            cpu_available,
            host_reserve: host.reserve_bytes,
        }
    }

    /// Decides for a request the GPU cannot take for a reason outside memory (`why`: no healthy
    /// GPU, the GPU paused): the CPU worker if allowed and host RAM holds it, else a refusal.
    pub fn decide_without_gpu(&self, why: &str, request: RequestShape, allow: Allowances, host: &Budget) -> Admission {
        let ctx = self.context(request, allow, host);
        if ctx.cpu_fits {
            return Admission::Cpu { reason: ctx.cpu_note(&format!("{why}; the request {}", ctx.what)) };
        }
        Admission::Refuse {
            reason: format!("{why}, and {}; the request {}", ctx.cpu_refusal(), ctx.what),
            retry_after_s: Some(10),
        }
    }

    /// Decides for one request. `gpu` is `None` when no healthy GPU is there; `queue_eta_ms`
    /// says how long until `bytes` would be free on the GPU (from the router's rates), if known.
    pub fn decide(
        &self,
        request: RequestShape,
        allow: Allowances,
        gpu: Option<&Budget>,
        host: &Budget,
        queue_eta_ms: impl Fn(u64) -> Option<u64>,
    ) -> Admission {
        let Some(gpu) = gpu else {
            return self.decide_without_gpu("no healthy GPU", request, allow, host);
        };
        let ctx = self.context(request, allow, host);
        let (what, needs, cpu_fits) = (&ctx.what, ctx.needs, ctx.cpu_fits);
        let cpu_note = |why: &str| ctx.cpu_note(why);
        let cpu_refusal = || ctx.cpu_refusal();

        let available = gpu.available_bytes();
        let capacity = gpu.capacity_bytes();
        let gpu_state = format!(
            "{} free on the GPU after the {} reserve",
            human_bytes(available),
            human_bytes(gpu.reserve_bytes)
        );
        if needs <= available {
            return Admission::Gpu {
                reason: format!("{what}; {gpu_state}"),
            };
        }

        let max_wait = allow.max_wait_ms.unwrap_or(self.config.max_queue_wait_ms);
        // Queue only when the requests ahead will free enough: memory a competing program holds
        // does not come back by waiting.
        let eta = if needs <= gpu.available_after_release_bytes() { queue_eta_ms(needs) } else { None };
        if let Some(eta) = eta.filter(|&e| e <= max_wait) {
            return Admission::Queue {
                eta_ms: eta,
                reason: format!("{what}; {gpu_state}; expected to fit in about {eta} ms"),
            };
        }
        if allow.shrink {
            if let Some(m) = self
                .max_tokens_fitting(request, available)
                .filter(|&m| m >= self.config.min_shrunk_tokens.min(request.max_tokens))
            {
                return Admission::Shrink {
                    max_tokens: m,
                    reason: format!(
                        "{what}; {gpu_state}; max_tokens lowered from {} to {m} to fit now",
                        thousands(request.max_tokens)
                    ),
                };
            }
        }
        if cpu_fits {
            let why = if needs > capacity {
                format!(
                    "the request {what}, more than the GPU can ever hold ({} after weights and reserve)",
                    human_bytes(capacity)
                )
            } else {
                format!("the request {what}; {gpu_state}")
            };
            return Admission::Cpu { reason: cpu_note(&why) };
        }
        if needs <= capacity {
            return Admission::Refuse {
                reason: format!("the request {what}; {gpu_state}, and {}", cpu_refusal()),
                retry_after_s: Some(eta.map(|e| e.div_ceil(1000)).unwrap_or(5).max(1)),
            };
        }
        Admission::Refuse {
            reason: format!(
                "the request {what}, more than the GPU can ever hold ({} after weights and the {} reserve), and {}; lower max_tokens or shorten the prompt",
                human_bytes(capacity),
                human_bytes(gpu.reserve_bytes),
                cpu_refusal()
            ),
            retry_after_s: None,
        }
    }
}
