//! Property tests of the ledger and the admission policy.

use headroom_memory::{
    Admission, Allowances, Budget, Calibration, Ledger, MemoryConfig, ModelShape, Planner,
    RequestShape, GIB, MIB,
};
use proptest::prelude::*;

fn shape() -> ModelShape {
    // Shaped like a 1B Llama in f16.
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

fn planner() -> Planner {
    Planner::new(shape(), Calibration::default(), MemoryConfig::default())
}

#[derive(Debug, Clone)]
enum Op {
    Reserve(u64),
    Release(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            (1u64..400).prop_map(Op::Reserve),
            (0usize..16).prop_map(Op::Release),
        ],
        1..200,
    )
}

proptest! {
    #[test]
    fn ledger_never_admits_beyond_capacity_and_every_reservation_returns(capacity in 1u64..1000, ops in ops()) {
        let ledger = Ledger::new("sim", capacity);
        let mut held = Vec::new();
        for op in ops {
            match op {
                Op::Reserve(bytes) => {
                    let before = ledger.held_bytes();
                    match ledger.try_reserve("req", bytes) {
                        Ok(r) => {
                            prop_assert!(before + bytes <= capacity);
                            held.push(r);
                        }
                        Err(e) => prop_assert!(before + bytes > capacity, "{e}"),
                    }
                }
                Op::Release(i) => {
                    if !held.is_empty() {
                        let i = i % held.len();
                        held.swap_remove(i);
                    }
                }
            }
            prop_assert!(ledger.held_bytes() <= capacity);
            prop_assert_eq!(ledger.held_bytes(), held.iter().map(|r| r.bytes()).sum::<u64>());
        }
        drop(held);
        prop_assert_eq!(ledger.held_bytes(), 0);
        prop_assert!(ledger.reservations().is_empty());
    }

    #[test]
    fn more_free_memory_never_turns_an_admission_into_a_refusal(
        prompt in 1u64..20_000,
        max_tokens in 1u64..20_000,
        total_gib in 4u64..96,
        free_a in 0u64..96 * 1024,
        extra in 0u64..32 * 1024,
        host_free_mib in 0u64..64 * 1024,
        shrink in any::<bool>(),
        cpu in any::<bool>(),
        eta in prop::option::of(0u64..60_000),
    ) {
        let p = planner();
        let request = RequestShape { prompt_tokens: prompt, max_tokens, prefill_chunk: 512 };
        let allow = Allowances { shrink, cpu, max_wait_ms: None };
        let total = total_gib * GIB;
        let gpu = |free_mib: u64| Budget {
            total_bytes: total,
            reserve_bytes: p.config.vram_reserve_bytes(total),
            weights_bytes: p.shape.weights_bytes(),
            held_bytes: 0,
            observed_free_bytes: Some(free_mib * MIB),
        };
        let host = Budget {
            total_bytes: 64 * GIB,
            reserve_bytes: 2 * GIB,
            weights_bytes: 0,
            held_bytes: 0,
            observed_free_bytes: Some(host_free_mib * MIB),
        };
        let less = p.decide(request, allow, Some(&gpu(free_a)), &host, |_| eta);
        let more = p.decide(request, allow, Some(&gpu(free_a + extra)), &host, |_| eta);
        if matches!(less, Admission::Gpu { .. }) {
            prop_assert!(matches!(more, Admission::Gpu { .. }), "{less:?} then {more:?}");
        }
        if !less.is_refused() {
            prop_assert!(!more.is_refused(), "{less:?} then {more:?}");
        }
    }

    #[test]
    fn a_granted_shrink_fits_and_is_never_silent(prompt in 1u64..4000, max_tokens in 1u64..60_000, free_mib in 0u64..8192) {
        let p = planner();
        let request = RequestShape { prompt_tokens: prompt, max_tokens, prefill_chunk: 512 };
        let total = 16 * GIB;
        let gpu = Budget {
            total_bytes: total,
            reserve_bytes: GIB,
            weights_bytes: p.shape.weights_bytes(),
            held_bytes: 0,
            observed_free_bytes: Some(free_mib * MIB),
        };
        let host = Budget { total_bytes: GIB, reserve_bytes: GIB, weights_bytes: 0, held_bytes: 0, observed_free_bytes: Some(0) };
        let allow = Allowances { shrink: true, cpu: false, max_wait_ms: Some(0) };
        if let Admission::Shrink { max_tokens: m, reason } = p.decide(request, allow, Some(&gpu), &host, |_| None) {
            prop_assert!(m < max_tokens);
            let fp = p.footprint(RequestShape { max_tokens: m, ..request });
            prop_assert!(fp.request_bytes() <= gpu.available_bytes());
            prop_assert!(reason.contains("lowered"));
        }
        let no_shrink = Allowances { shrink: false, ..allow };
        let d = p.decide(request, no_shrink, Some(&gpu), &host, |_| None);
        prop_assert!(!matches!(d, Admission::Shrink { .. }), "shrink only where allowed: {d:?}");
    }
}

#[test]
fn reasons_say_what_is_needed_and_what_is_free() {
    let p = planner();
    let request = RequestShape { prompt_tokens: 100, max_tokens: 8092, prefill_chunk: 512 };
    let total = 4 * GIB;
    let gpu = Budget {
        total_bytes: total,
        reserve_bytes: GIB,
        weights_bytes: p.shape.weights_bytes(),
        held_bytes: 0,
        observed_free_bytes: None,
    };
    let host = Budget { total_bytes: 32 * GIB, reserve_bytes: 2 * GIB, weights_bytes: 0, held_bytes: 0, observed_free_bytes: Some(20 * GIB) };
    let d = p.decide(request, Allowances::default(), Some(&gpu), &host, |_| None);
    let reason = d.reason();
    assert!(reason.contains("8,192 tokens"), "{reason}");
    assert!(reason.contains("reserve"), "{reason}");
    assert!(matches!(d, Admission::Gpu { .. }), "{d:?}");

    // Another program takes most of the GPU: observed free memory wins over the prediction.
    let crowded = Budget { observed_free_bytes: Some(GIB + 100 * MIB), ..gpu };
    let d = p.decide(request, Allowances::default(), Some(&crowded), &host, |_| None);
    assert!(matches!(d, Admission::Cpu { .. }), "{d:?}");
    assert!(d.reason().contains("runs on CPU instead"), "{}", d.reason());

    let no_cpu = Allowances { cpu: false, ..Allowances::default() };
    // Our own running requests hold the GPU: they will free it, so the request may wait.
    let busy = Budget { held_bytes: gpu.capacity_bytes(), observed_free_bytes: Some(GIB + 100 * MIB), ..gpu };
    let d = p.decide(request, no_cpu, Some(&busy), &host, |_| Some(2_000));
    assert!(matches!(d, Admission::Queue { eta_ms: 2_000, .. }), "{d:?}");
    let d = p.decide(request, no_cpu, Some(&busy), &host, |_| None);
    assert!(matches!(d, Admission::Refuse { retry_after_s: Some(_), .. }), "{d:?}");
    // Another program holds it: waiting for our queue frees nothing, whatever its rate says.
    let d = p.decide(request, no_cpu, Some(&crowded), &host, |_| Some(2_000));
    assert!(matches!(d, Admission::Refuse { retry_after_s: Some(_), .. }), "{d:?}");
}

#[test]
fn only_reservations_come_back_by_waiting() {
    let b = Budget { total_bytes: 100, reserve_bytes: 10, weights_bytes: 20, held_bytes: 30, observed_free_bytes: Some(45) };
    assert_eq!(b.capacity_bytes(), 70);
    assert_eq!(b.available_bytes(), 35, "observed free less the reserve");
    assert_eq!(b.available_after_release_bytes(), 65, "plus what our requests hold");
    let unobserved = Budget { observed_free_bytes: None, ..b };
    assert_eq!(unobserved.available_after_release_bytes(), 70);
}

/// The CPU worker's KV cache precision decides what a CPU request holds in host RAM: f16 needs
/// half the KV bytes of f32, so host RAM between the two admits the request on the CPU with f16
/// and refuses it with f32 (the control: the same request and budget, the f32 cache).
#[test]
fn host_ram_admission_counts_the_cpu_kv_cache_precision() {
    use headroom_model::KvPrecision;
    let request = RequestShape { prompt_tokens: 1000, max_tokens: 7000, prefill_chunk: 512 };
    let with = |kv: KvPrecision| Planner::new(shape(), Calibration::default(), MemoryConfig { cpu_kv_cache: kv, ..MemoryConfig::default() });
    let (f32_cache, f16_cache) = (with(KvPrecision::F32), with(KvPrecision::F16));
    let (f32_fp, f16_fp) = (f32_cache.host_footprint(request), f16_cache.host_footprint(request));
    assert_eq!(f32_fp.kv_bytes, 2 * f16_fp.kv_bytes);
    assert_eq!(f16_fp.kv_bytes, 2 * 16 * 8 * 64 * 2 * 8000, "K and V × layers × kv heads × head dim × 2 bytes × tokens");
    let between = (f32_fp.request_bytes() + f16_fp.request_bytes()) / 2;
    let host = Budget { total_bytes: between + GIB, reserve_bytes: GIB, weights_bytes: 0, held_bytes: 0, observed_free_bytes: None };
    let why = "no healthy GPU";
    let d = f16_cache.decide_without_gpu(why, request, Allowances::default(), &host);
    assert!(matches!(d, Admission::Cpu { .. }), "f16: {d:?}");
    let d = f32_cache.decide_without_gpu(why, request, Allowances::default(), &host);
    assert!(matches!(d, Admission::Refuse { .. }), "f32: {d:?}");
}

/// The CPU worker's prefix cache gives way before a request is refused: with host RAM that the
/// cache's bytes fill, the request is admitted to the CPU and the cache must be dropped; with
/// room to spare, nothing is dropped; where dropping would not help, the refusal stands.
#[test]
fn a_prefix_cache_is_dropped_before_a_request_is_refused() {
    let request = RequestShape { prompt_tokens: 1000, max_tokens: 1000, prefill_chunk: 512 };
    let planner = planner();
    let needs = planner.host_footprint(request).request_bytes();
    let cache = 2 * needs;
    let decide = |host: &Budget| planner.decide_without_gpu("no healthy GPU", request, Allowances::default(), host);
    // The weights and the cache leave half of what the request needs.
    let host = Budget { total_bytes: GIB + 8 * GIB + cache + needs / 2, reserve_bytes: GIB, weights_bytes: 8 * GIB + cache, held_bytes: 0, observed_free_bytes: Some(cache + needs / 2 + GIB) };
    let (d, drop) = headroom_memory::decide_dropping(&host, cache, decide);
    assert!(matches!(d, Admission::Cpu { .. }) && drop, "a cache that holds the room: {d:?}, drop {drop}");
    let roomy = Budget { total_bytes: host.total_bytes + 2 * needs, observed_free_bytes: host.observed_free_bytes.map(|f| f + 2 * needs), ..host };
    let (d, drop) = headroom_memory::decide_dropping(&roomy, cache, decide);
    assert!(matches!(d, Admission::Cpu { .. }) && !drop, "room to spare: {d:?}, drop {drop}");
    let (d, drop) = headroom_memory::decide_dropping(&host, needs / 4, decide);
    assert!(matches!(d, Admission::Refuse { .. }) && !drop, "a cache too small to help: {d:?}, drop {drop}");
}

/// Its negative control: a cache kept before requests gets the request refused.
#[test]
fn a_prefix_cache_kept_before_requests_refuses_them() {
    headroom_model::assert_control_fails("a_prefix_cache_is_dropped_before_a_request_is_refused", "prefix-cache-before-requests", "a cache that holds the room");
}
