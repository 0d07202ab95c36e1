//! The dot products with NEON (every aarch64 processor has it). Each block's integer sum is
//! computed 16 bytes at a time (`smull` + pairwise widening adds) and scaled exactly as
//! [`super::dot::scalar`] scales it, so these kernels give the scalar reference's results;
//! several rows or tokens per call run one row and one token at a time.
//!
//! Not yet here: the `sdot` instruction (ARMv8.2 dotprod; its intrinsic is not stable Rust),
//! sharing activation loads across rows, and widening F16 with `fcvtl` (the `f16` type its
//! intrinsics take is not stable Rust either: F16 rows are widened by the `half` crate in
//! chunks).

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::aarch64::*;

use half::slice::HalfFloatSliceExt;

use super::dot::{each_row, each_row_pair, f16_at, scales_mins_k4, Kernels, Q8x256, Q8x32};

pub const KERNELS: Kernels = Kernels {
    name: "neon",
    f32_rows: each_row!(f32_dot, 4),
    f16_rows: each_row!(f16_dot, 2),
    bf16_rows: each_row!(bf16_dot, 2),
    f32_pairs: each_row_pair!(f32_dot, 4),
    f16_pairs: each_row_pair!(f16_dot, 2),
    bf16_pairs: each_row_pair!(bf16_dot, 2),
    q4_0: each_row!(q4_0, 18),
    q4_1: each_row!(q4_1, 20),
    q8_0: each_row!(q8_0, 34),
    q4_0_pairs: each_row_pair!(q4_0, 18),
    q4_1_pairs: each_row_pair!(q4_1, 20),
    q8_0_pairs: each_row_pair!(q8_0, 34),
    q4_k: each_row!(q4_k, 144),
    q5_k: each_row!(q5_k, 176),
    q6_k: each_row!(q6_k, 210),
    q4_k_pairs: each_row_pair!(q4_k, 144),
    q5_k_pairs: each_row_pair!(q5_k, 176),
    q6_k_pairs: each_row_pair!(q6_k, 210),
    k_tile: None,
    tile32: None,
    float_tile: None,
    interleaved32: None,
    interleaved256: None,
};

/// Σ x·y of 16 signed bytes, in four i32 lanes (products fit i16: |x·y| ≤ 128²).
#[inline(always)]
unsafe fn dot16(x: int8x16_t, y: int8x16_t) -> int32x4_t {
    let low = vmull_s8(vget_low_s8(x), vget_low_s8(y));
    let high = vmull_high_s8(x, y);
    vpaddq_s32(vpaddlq_s16(low), vpaddlq_s16(high))
}

/// Sixteen activations starting at `at`.
#[inline(always)]
unsafe fn y16(qs: &[i8], at: usize) -> int8x16_t {
    debug_assert!(at + 16 <= qs.len());
    vld1q_s8(qs.as_ptr().add(at))
}

/// Sixteen weight bytes starting at `at`.
#[inline(always)]
unsafe fn w16(b: &[u8], at: usize) -> uint8x16_t {
    assert!(at + 16 <= b.len());
    vld1q_u8(b.as_ptr().add(at))
}

fn f32_dot(w: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    assert!(w.len() >= 4 * n);
    // SAFETY: loads stay within `w` (4·n bytes) and `x` (n values).
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let v = vreinterpretq_f32_u8(vld1q_u8(w.as_ptr().add(4 * (i + 4 * k))));
                *a = vfmaq_f32(*a, v, vld1q_f32(x.as_ptr().add(i + 4 * k)));
            }
            i += 16;
        }
        let mut sum = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
        for j in i..n {
            sum += f32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]]) * x[j];
        }
        sum
    }
}

fn f16_dot(w: &[u8], x: &[f32]) -> f32 {
    const CHUNK: usize = 64;
    let mut wide = [0f32; CHUNK];
    let mut halves = [half::f16::ZERO; CHUNK];
    let mut sum = 0f32;
    for (w, x) in w[..2 * x.len()].chunks(2 * CHUNK).zip(x.chunks(CHUNK)) {
        let n = x.len();
        for (h, b) in halves.iter_mut().zip(w.chunks_exact(2)) {
            *h = half::f16::from_le_bytes([b[0], b[1]]);
        }
        halves[..n].convert_to_f32_slice(&mut wide[..n]);
        sum += f32_dot(f32_bytes(&wide[..n]), x);
    }
    sum
}

/// The bytes of f32 values, as the f32 kernel reads its weights.
fn f32_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and u8 no alignment requirement.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, 4 * v.len()) }
}

fn bf16_dot(w: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    assert!(w.len() >= 2 * n);
    // SAFETY: loads stay within `w` (2·n bytes) and `x` (n values).
    unsafe {
        let mut acc = [vdupq_n_f32(0.0); 2];
        let mut i = 0;
        while i + 8 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                // bf16 is the top half of an f32: widening is a 16-bit shift.
                let v = vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(w.as_ptr().add(2 * (i + 4 * k)) as *const u16)));
                *a = vfmaq_f32(*a, v, vld1q_f32(x.as_ptr().add(i + 4 * k)));
            }
            i += 8;
        }
        let mut sum = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
        for j in i..n {
            sum += half::bf16::from_le_bytes([w[2 * j], w[2 * j + 1]]).to_f32() * x[j];
        }
        sum
    }
}

fn q4_0(w: &[u8], a: &[Q8x32]) -> f32 {
    let mut sum = 0f32;
    for (b, a) in w.chunks_exact(18).zip(a) {
        // SAFETY: 16 quant bytes at 2..18 of the block, 32 activations.
        let isum = unsafe {
            let packed = w16(b, 2);
            let eight = vdupq_n_s8(8);
            let low = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0f))), eight);
            let high = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(packed)), eight);
            vaddvq_s32(vaddq_s32(dot16(low, y16(&a.qs, 0)), dot16(high, y16(&a.qs, 16))))
        };
        sum += f16_at(b, 0) * a.d * isum as f32;
    }
    sum
}

fn q4_1(w: &[u8], a: &[Q8x32]) -> f32 {
    let (mut sum, mut mins) = (0f32, 0f32);
    for (b, a) in w.chunks_exact(20).zip(a) {
        // SAFETY: 16 quant bytes at 4..20 of the block, 32 activations.
        let isum = unsafe {
            let packed = w16(b, 4);
            let low = vreinterpretq_s8_u8(vandq_u8(packed, vdupq_n_u8(0x0f)));
            let high = vreinterpretq_s8_u8(vshrq_n_u8::<4>(packed));
            vaddvq_s32(vaddq_s32(dot16(low, y16(&a.qs, 0)), dot16(high, y16(&a.qs, 16))))
        };
        sum += f16_at(b, 0) * a.d * isum as f32;
        mins += f16_at(b, 2) * a.s;
    }
    sum + mins
}

fn q8_0(w: &[u8], a: &[Q8x32]) -> f32 {
    let mut sum = 0f32;
    for (b, a) in w.chunks_exact(34).zip(a) {
        // SAFETY: 32 quant bytes at 2..34 of the block, 32 activations.
        let isum = unsafe {
            let (q0, q1) = (vreinterpretq_s8_u8(w16(b, 2)), vreinterpretq_s8_u8(w16(b, 18)));
            vaddvq_s32(vaddq_s32(dot16(q0, y16(&a.qs, 0)), dot16(q1, y16(&a.qs, 16))))
        };
        sum += f16_at(b, 0) * a.d * isum as f32;
    }
    sum
}

/// Q4_K and Q5_K share everything but the fifth bit (`qh`, Q5_K only), as in the reference.
fn k4_k5(b: &[u8], a: &Q8x256, qh: Option<&[u8]>, qs: &[u8]) -> f32 {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, mins) = scales_mins_k4(&b[4..16]);
    let mut isum = 0i32;
    for pair in 0..4 {
        for half in 0..2 {
            let j = 2 * pair + half;
            // SAFETY: 32 quant bytes at 32·pair of `qs` (128 bytes), 32 `qh` bytes, and 32
            // activations at 32·j of 256.
            let part = unsafe {
                let mut sums = vdupq_n_s32(0);
                for k in 0..2 {
                    let packed = w16(qs, pair * 32 + 16 * k);
                    let mut q = if half == 0 { vandq_u8(packed, vdupq_n_u8(0x0f)) } else { vshrq_n_u8::<4>(packed) };
                    if let Some(qh) = qh {
                        // Bit j of each qh byte, moved to bit 4.
                        let bits = vandq_u8(vshlq_u8(w16(qh, 16 * k), vdupq_n_s8(-(j as i8))), vdupq_n_u8(1));
                        q = vorrq_u8(q, vshlq_n_u8::<4>(bits));
                    }
                    sums = vaddq_s32(sums, dot16(vreinterpretq_s8_u8(q), y16(&a.qs, j * 32 + 16 * k)));
                }
                vaddvq_s32(sums)
            };
            isum += scales[j] as i32 * part;
        }
    }
    let mins: i32 = (0..8).map(|j| mins[j] as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32)).sum();
    a.d * (d * isum as f32 - dmin * mins as f32)
}

fn q4_k(w: &[u8], a: &[Q8x256]) -> f32 {
    w.chunks_exact(144).zip(a).map(|(b, a)| k4_k5(b, a, None, &b[16..144])).sum()
}

fn q5_k(w: &[u8], a: &[Q8x256]) -> f32 {
    w.chunks_exact(176).zip(a).map(|(b, a)| k4_k5(b, a, Some(&b[16..48]), &b[48..176])).sum()
}

fn q6_k(w: &[u8], a: &[Q8x256]) -> f32 {
    let mut sum = 0f32;
    for (b, a) in w.chunks_exact(210).zip(a) {
        let scales = &b[192..208];
        let mut isum = 0i32;
        for half in 0..2 {
            let (ql, qh) = (&b[half * 64..half * 64 + 64], &b[128 + half * 32..128 + half * 32 + 32]);
            for is in 0..2 {
                let l = 16 * is;
                // SAFETY: 16 bytes at l and l + 32 of 64 `ql` bytes, at l of 32 `qh` bytes, and
                // activations at most at 128·half + 96 + 16 of 256.
                unsafe {
                    let (low, high, h) = (w16(ql, l), w16(ql, l + 32), w16(qh, l));
                    let (mask, three, m32) = (vdupq_n_u8(0x0f), vdupq_n_u8(3), vdupq_n_s8(32));
                    let quant = |nibbles: uint8x16_t, bits: uint8x16_t| {
                        vsubq_s8(vreinterpretq_s8_u8(vorrq_u8(nibbles, vshlq_n_u8::<4>(vandq_u8(bits, three)))), m32)
                    };
                    let q = [
                        quant(vandq_u8(low, mask), h),
                        quant(vandq_u8(high, mask), vshrq_n_u8::<2>(h)),
                        quant(vshrq_n_u8::<4>(low), vshrq_n_u8::<4>(h)),
                        quant(vshrq_n_u8::<4>(high), vshrq_n_u8::<6>(h)),
                    ];
                    for (k, q) in q.into_iter().enumerate() {
                        let part = vaddvq_s32(dot16(q, y16(&a.qs, half * 128 + 32 * k + l)));
                        isum += scales[half * 8 + is + 2 * k] as i8 as i32 * part;
                    }
                }
            }
        }
        sum += f16_at(b, 208) * a.d * isum as f32;
    }
    sum
}
