//! The dot products with AVX2, FMA and F16C (x86-64 since Haswell). Same arithmetic as
//! [`super::dot::scalar`]: integer sums per block with `maddubs`/`madd`, one fused multiply-add
//! of the block's scale per block, a horizontal sum at the end.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::dot::{scale_min_k4, Kernels, Q8x256, Q8x32};

pub const KERNELS: Kernels = Kernels {
    name: "avx2",
    f32_dot: |w, x| unsafe { f32_dot(w, x) },
    f16_dot: |w, x| unsafe { f16_dot(w, x) },
    q4_0: |w, a| unsafe { q4_0(w, a) },
    q4_1: |w, a| unsafe { q4_1(w, a) },
    q8_0: |w, a| unsafe { q8_0(w, a) },
    q4_k: |w, a| unsafe { q4_k(w, a) },
    q5_k: |w, a| unsafe { q5_k(w, a) },
    q6_k: |w, a| unsafe { q6_k(w, a) },
};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_scale(p: *const u8) -> f32 {
    let bits = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
}

/// Signed × signed bytes, summed in pairs then in fours: eight i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_i8(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// Unsigned × signed bytes, summed in pairs then in fours: eight i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// The 32 nibbles of 16 bytes: low nibbles in the first half, high in the second.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let packed = _mm_loadu_si128(p as *const __m128i);
    let both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0f))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_dot(w: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    debug_assert!(w.len() >= n * 4);
    let (wp, xp) = (w.as_ptr() as *const f32, x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(i + 8 * k)), _mm256_loadu_ps(xp.add(i + 8 * k)), *a);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(wp.add(i)), _mm256_loadu_ps(xp.add(i)), acc[0]);
        i += 8;
    }
    let mut sum = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
    while i < n {
        sum += wp.add(i).read_unaligned() * *xp.add(i);
        i += 1;
    }
    sum
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_dot(w: &[u8], x: &[f32]) -> f32 {
    let n = x.len();
    debug_assert!(w.len() >= n * 2);
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 2];
    let mut i = 0;
    while i + 16 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(2 * (i + 8 * k)) as *const __m128i));
            *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(i + 8 * k)), *a);
        }
        i += 16;
    }
    let mut sum = hsum(_mm256_add_ps(acc[0], acc[1]));
    while i < n {
        sum += half::f16::from_le_bytes([*wp.add(2 * i), *wp.add(2 * i + 1)]).to_f32() * *xp.add(i);
        i += 1;
    }
    sum
}

/// The 32-value block types, two blocks per iteration so the two accumulator chains overlap:
/// `block(bytes, activations)` gives a block's eight i32 sums, its scale and its min term.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn sum_blocks32(w: &[u8], a: &[Q8x32], size: usize, block: impl Fn(*const u8, &Q8x32) -> (__m256i, f32, f32)) -> f32 {
    debug_assert!(w.len() >= a.len() * size);
    let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mut min0, mut min1) = (0f32, 0f32);
    let base = w.as_ptr();
    let pairs = a.len() / 2;
    for i in 0..pairs {
        let (s0, d0, m0) = block(base.add(2 * i * size), &a[2 * i]);
        let (s1, d1, m1) = block(base.add((2 * i + 1) * size), &a[2 * i + 1]);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(s0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1), _mm256_cvtepi32_ps(s1), acc1);
        min0 += m0;
        min1 += m1;
    }
    if a.len() % 2 == 1 {
        let last = a.len() - 1;
        let (s0, d0, m0) = block(base.add(last * size), &a[last]);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0), _mm256_cvtepi32_ps(s0), acc0);
        min0 += m0;
    }
    hsum(_mm256_add_ps(acc0, acc1)) + (min0 + min1)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0(w: &[u8], a: &[Q8x32]) -> f32 {
    let offset = _mm256_set1_epi8(8);
    sum_blocks32(w, a, 18, |b, a| {
        let q = _mm256_sub_epi8(nibbles(b.add(2)), offset);
        let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
        (dot_i8(q, y), f16_scale(b) * a.d, 0.0)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1(w: &[u8], a: &[Q8x32]) -> f32 {
    sum_blocks32(w, a, 20, |b, a| {
        let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
        (dot_u8_i8(nibbles(b.add(4)), y), f16_scale(b) * a.d, f16_scale(b.add(2)) * a.s)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0(w: &[u8], a: &[Q8x32]) -> f32 {
    sum_blocks32(w, a, 34, |b, a| {
        let q = _mm256_loadu_si256(b.add(2) as *const __m256i);
        let y = _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i);
        (dot_i8(q, y), f16_scale(b) * a.d, 0.0)
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k(w: &[u8], a: &[Q8x256]) -> f32 {
    k_sum(w, a, 144, |b| (None, b.add(16)))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k(w: &[u8], a: &[Q8x256]) -> f32 {
    k_sum(w, a, 176, |b| (Some(b.add(16)), b.add(48)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_sum(w: &[u8], a: &[Q8x256], block: usize, parts: impl Fn(*const u8) -> (Option<*const u8>, *const u8)) -> f32 {
    debug_assert!(w.len() >= a.len() * block);
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0f32;
    for (i, a) in a.iter().enumerate() {
        let b = w.as_ptr().add(i * block);
        let (qh, qs) = parts(b);
        let (sumi, d, m) = k4_k5_block(b, a, qh, qs);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
        mins += m;
    }
    hsum(acc) - mins
}

/// One Q4_K/Q5_K super-block: the scaled integer sums (eight i32), `d`, and `dmin · Σ min · bsum`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_k5_block(b: *const u8, a: &Q8x256, qh: Option<*const u8>, qs: *const u8) -> (__m256i, f32, f32) {
    let scales = std::slice::from_raw_parts(b.add(4), 12);
    let low = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let high_bits = qh.map(|p| _mm256_loadu_si256(p as *const __m256i));
    let mut sumi = _mm256_setzero_si256();
    let mut mins = 0i32;
    for pair in 0..4 {
        let (s1, m1) = scale_min_k4(2 * pair, scales);
        let (s2, m2) = scale_min_k4(2 * pair + 1, scales);
        let packed = _mm256_loadu_si256(qs.add(pair * 32) as *const __m256i);
        let mut q1 = _mm256_and_si256(packed, low);
        let mut q2 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        if let Some(h) = high_bits {
            let h1 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * pair as i32)), one);
            let h2 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * pair as i32 + 1)), one);
            q1 = _mm256_or_si256(q1, _mm256_slli_epi16(h1, 4));
            q2 = _mm256_or_si256(q2, _mm256_slli_epi16(h2, 4));
        }
        let y1 = _mm256_loadu_si256(a.qs.as_ptr().add(pair * 64) as *const __m256i);
        let y2 = _mm256_loadu_si256(a.qs.as_ptr().add(pair * 64 + 32) as *const __m256i);
        let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, y1), _mm256_set1_epi16(s1 as i16));
        let p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(q2, y2), _mm256_set1_epi16(s2 as i16));
        sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p1, p2));
        let j = 4 * pair;
        mins += m1 as i32 * (a.bsums[j] as i32 + a.bsums[j + 1] as i32);
        mins += m2 as i32 * (a.bsums[j + 2] as i32 + a.bsums[j + 3] as i32);
    }
    (sumi, f16_scale(b) * a.d, f16_scale(b.add(2)) * a.d * mins as f32)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k(w: &[u8], a: &[Q8x256]) -> f32 {
    debug_assert!(w.len() >= a.len() * 210);
    let low = _mm256_set1_epi8(0x0f);
    let three = _mm256_set1_epi8(3);
    let m32 = _mm256_set1_epi8(32);
    let mut acc = _mm256_setzero_ps();
    for (i, a) in a.iter().enumerate() {
        let b = w.as_ptr().add(i * 210);
        let scales = b.add(192) as *const i8;
        let mut sumi = _mm256_setzero_si256();
        for half in 0..2 {
            let ql0 = _mm256_loadu_si256(b.add(half * 64) as *const __m256i);
            let ql1 = _mm256_loadu_si256(b.add(half * 64 + 32) as *const __m256i);
            let qh = _mm256_loadu_si256(b.add(128 + half * 32) as *const __m256i);
            let high = |shift: i32| _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(shift)), three), 4);
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, low), high(0)),
                _mm256_or_si256(_mm256_and_si256(ql1, low), high(2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low), high(4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low), high(6)),
            ];
            for (k, q) in q.into_iter().enumerate() {
                let y = _mm256_loadu_si256(a.qs.as_ptr().add(half * 128 + k * 32) as *const __m256i);
                // (q − 32)·y as q·y − 32·y: maddubs needs its first operand unsigned.
                let p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, y), _mm256_maddubs_epi16(m32, y));
                let s = scales.add(half * 8 + 2 * k);
                let scale = _mm256_set_m128i(_mm_set1_epi16(*s.add(1) as i16), _mm_set1_epi16(*s as i16));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, scale));
            }
        }
        let d = _mm256_set1_ps(f16_scale(b.add(208)) * a.d);
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum(acc)
}
