//! The dot products with AVX-512 (F, BW, VL) and VNNI, on the AVX2 set's frame (rows and tokens
//! per call, prefetch, scale multiply-adds), so every sum is the same integer as the scalar
//! reference's and the AVX2 set's:
//!
//! - the 32-value types multiply bytes with one `vpdpbusd` instead of `maddubs` + `madd`;
//! - the K-quants unpack and multiply 64 weights per instruction instead of 32: two sub-blocks
//!   side by side in one 512-bit register, against 64 contiguous activations, each sub-block's
//!   scale spread over its half with one permute; Q6_K's `−32` offset becomes one multiply of
//!   its sixteen scales with the activations' sums of 16, not a second `maddubs` per sub-block.
//!
//! Unquantized rows stream memory at the same rate with 256-bit vectors, so they keep the AVX2
//! kernels.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::avx2::{self, by_rows, check_tokens, f16_scale, k4_min_terms, rows, rows256, rows32, unpack_q4_0, unpack_q4_1, unpack_q8_0, Rows};
use super::dot::{scales_mins_k4, Kernels, Q8x256, Q8x32};

pub const KERNELS: Kernels = Kernels {
    name: "avx512-vnni",
    f32_rows: avx2::KERNELS.f32_rows,
    f16_rows: avx2::KERNELS.f16_rows,
    bf16_rows: avx2::KERNELS.bf16_rows,
    f32_pairs: avx2::KERNELS.f32_pairs,
    f16_pairs: avx2::KERNELS.f16_pairs,
    bf16_pairs: avx2::KERNELS.bf16_pairs,
    q4_0: |w, rb, a, out| unsafe { by_rows(out.len(), |n| q4_0(n, w, rb, [a], out)) },
    q4_1: |w, rb, a, out| unsafe { by_rows(out.len(), |n| q4_1(n, w, rb, [a], out)) },
    q8_0: |w, rb, a, out| unsafe { by_rows(out.len(), |n| q8_0(n, w, rb, [a], out)) },
    q4_0_pairs: |w, rb, a, out| unsafe { by_rows(out.len() / 2, |n| q4_0(n, w, rb, a, out)) },
    q4_1_pairs: |w, rb, a, out| unsafe { by_rows(out.len() / 2, |n| q4_1(n, w, rb, a, out)) },
    q8_0_pairs: |w, rb, a, out| unsafe { by_rows(out.len() / 2, |n| q8_0(n, w, rb, a, out)) },
    q4_k: |w, rb, a, out| unsafe { by_rows(out.len(), |n| q4_k(n, w, rb, [a], out)) },
    q5_k: |w, rb, a, out| unsafe { by_rows(out.len(), |n| q5_k(n, w, rb, [a], out)) },
    q6_k: |w, rb, a, out| unsafe { by_rows(out.len(), |n| q6_k(n, w, rb, [a], out)) },
    q4_k_pairs: |w, rb, a, out| unsafe { by_rows(out.len() / 2, |n| q4_k(n, w, rb, a, out)) },
    q5_k_pairs: |w, rb, a, out| unsafe { by_rows(out.len() / 2, |n| q5_k(n, w, rb, a, out)) },
    q6_k_pairs: |w, rb, a, out| unsafe { by_rows(out.len() / 2, |n| q6_k(n, w, rb, a, out)) },
    k_tile: avx2::KERNELS.k_tile,
    tile32: Some(super::tile::vnni::kernel32),
    float_tile: Some((super::tile::avx2_float::unpack, super::tile::avx512_float::kernel)),
    interleaved32: Some(super::interleave::vnni::kernel),
    interleaved256: Some(super::interleave_k::vnni::kernel),
};

/// Whether this processor runs [`KERNELS`].
pub fn supported() -> bool {
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Signed × signed bytes summed in fours: eight i32 (`vpdpbusd` takes its first operand
/// unsigned, so the sign moves to the second).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// Unsigned × signed bytes summed in fours: eight i32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), x, y)
}

unsafe fn q4_0<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x32]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 18, out);
    rows!(n, q4_0_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_0_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x32]; T], out: *mut f32) {
    rows32::<N, T>(w, row_bytes, a, 18, out, |b| unpack_q4_0(b), |q, y| dot_i8(q, y))
}

unsafe fn q4_1<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x32]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 20, out);
    rows!(n, q4_1_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_1_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x32]; T], out: *mut f32) {
    rows32::<N, T>(w, row_bytes, a, 20, out, |b| unpack_q4_1(b), |q, y| dot_u8_i8(q, y))
}

unsafe fn q8_0<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x32]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 34, out);
    rows!(n, q8_0_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q8_0_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x32]; T], out: *mut f32) {
    rows32::<N, T>(w, row_bytes, a, 34, out, |b| unpack_q8_0(b), |q, y| dot_i8(q, y))
}

/// The upper half of a 512-bit register, as a mask of its 32 16-bit lanes.
const UPPER_HALF: __mmask32 = 0xffff_0000;

/// Activations `64k .. 64k + 64` of a K-quant activation block (sub-blocks `2k` and `2k + 1`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn y64(a: &Q8x256, k: usize) -> __m512i {
    _mm512_loadu_si512(a.qs.as_ptr().add(64 * k) as *const __m512i)
}

/// The 32 bytes at `p` in both halves of a 512-bit register.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn both_halves(p: *const u8) -> __m512i {
    _mm512_broadcast_i64x4(_mm256_loadu_si256(p as *const __m256i))
}

/// Sixteen-bit lanes of `scales` (16 of them, the first 16 lanes of the register) spread so that
/// lane `i` holds scale `first + i / 2^LOG2_PER`: each scale over the products of its sub-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn spread<const LOG2_PER: u32>(scales: __m512i, first: i16) -> __m512i {
    let lanes = _mm512_set_epi16(
        31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0,
    );
    let index = _mm512_add_epi16(_mm512_set1_epi16(first), _mm512_srli_epi16::<LOG2_PER>(lanes));
    _mm512_permutexvar_epi16(index, scales)
}

/// The sum of a 512-bit register's halves: eight i32, as the frame's accumulators take them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn fold(v: __m512i) -> __m256i {
    _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
}

/// One Q4_K/Q5_K super-block `b` (`qh`: Q5_K's fifth bits, `qs`: its packed nibbles) against
/// the `T` tokens' activation blocks `a`, as [`avx2`]'s `k4_k5_block`: sub-blocks `2·pair` (low
/// nibbles) and `2·pair + 1` (high nibbles) of each 32 packed bytes side by side. A macro, so
/// that it is inlined into each kernel: as a function LLVM kept it out of line (a call, and its
/// results through memory, per row and block).
macro_rules! k4_k5_block {
    ($b:expr, $a:expr, $qh:expr, $qs:expr) => {{
        let (b, a, qh, qs): (*const u8, [&Q8x256; T], Option<*const u8>, *const u8) = ($b, $a, $qh, $qs);
        let (scales, mins) = scales_mins_k4(std::slice::from_raw_parts(b.add(4), 12));
        let scales = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64(scales.as_ptr() as *const __m128i)));
        let low = _mm512_set1_epi8(0x0f);
        let one = _mm512_set1_epi8(1);
        let high_bits = qh.map(|p| both_halves(p));
        let mut sumi = [_mm512_setzero_si512(); T];
        for pair in 0..4 {
            let packed = both_halves(qs.add(pair * 32));
            let mut q = _mm512_and_si512(_mm512_mask_srli_epi16::<4>(packed, UPPER_HALF, packed), low);
            if let Some(h) = high_bits {
                // Bit 2·pair of each byte for the first sub-block, bit 2·pair + 1 for the second.
                let h = _mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * pair as i32));
                let h = _mm512_and_si512(_mm512_mask_srli_epi16::<1>(h, UPPER_HALF, h), one);
                q = _mm512_or_si512(q, _mm512_slli_epi16::<4>(h));
            }
            let scale = spread::<4>(scales, 2 * pair as i16);
            for t in 0..T {
                let p = _mm512_madd_epi16(_mm512_maddubs_epi16(q, y64(a[t], pair)), scale);
                sumi[t] = _mm512_add_epi32(sumi[t], p);
            }
        }
        (sumi.map(|s| fold(s)), f16_scale(b), k4_min_terms(b, a, &mins))
    }};
}

unsafe fn q4_k<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x256]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 144, out);
    rows!(n, q4_k_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q4_k_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x256]; T], out: *mut f32) {
    rows256::<N, T>(w, row_bytes, a, 144, out, |b, a| k4_k5_block!(b, a, None, b.add(16)))
}

unsafe fn q5_k<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x256]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 176, out);
    rows!(n, q5_k_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q5_k_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x256]; T], out: *mut f32) {
    rows256::<N, T>(w, row_bytes, a, 176, out, |b, a| k4_k5_block!(b, a, Some(b.add(16)), b.add(48)))
}

unsafe fn q6_k<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x256]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 210, out);
    rows!(n, q6_k_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

/// Q6_K: in each half of the super-block, the low nibbles of its 64 `ql` bytes with two-bit
/// pairs of `qh` are sub-blocks 0 and 1 side by side, the high nibbles sub-blocks 2 and 3; each
/// scale covers 16 weights. The quants are stored `+32`: the offset's share, `32 · Σ scale ·
/// (sum of its 16 activations)`, is subtracted once per block.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn q6_k_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x256]; T], out: *mut f32) {
    rows256::<N, T>(w, row_bytes, a, 210, out, |b, a| {
        let low = _mm512_set1_epi8(0x0f);
        let three = _mm512_set1_epi8(3);
        let scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
        let scales = _mm512_castsi256_si512(scales16);
        let mut sumi = [_mm512_setzero_si512(); T];
        for half in 0..2 {
            let ql = _mm512_loadu_si512(b.add(half * 64) as *const __m512i);
            let qh = both_halves(b.add(128 + half * 32));
            // Bits 0–1 of qh (first half of the register) and 2–3 (second) over the low nibbles,
            // bits 4–5 and 6–7 over the high nibbles.
            let h01 = _mm512_and_si512(_mm512_mask_srli_epi16::<2>(qh, UPPER_HALF, qh), three);
            let h23 = _mm512_srli_epi16::<4>(qh);
            let h23 = _mm512_and_si512(_mm512_mask_srli_epi16::<2>(h23, UPPER_HALF, h23), three);
            let q01 = _mm512_or_si512(_mm512_and_si512(ql, low), _mm512_slli_epi16::<4>(h01));
            let q23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), low), _mm512_slli_epi16::<4>(h23));
            let s01 = spread::<3>(scales, (half * 8) as i16);
            let s23 = spread::<3>(scales, (half * 8 + 4) as i16);
            for t in 0..T {
                let p01 = _mm512_madd_epi16(_mm512_maddubs_epi16(q01, y64(a[t], 2 * half)), s01);
                let p23 = _mm512_madd_epi16(_mm512_maddubs_epi16(q23, y64(a[t], 2 * half + 1)), s23);
                sumi[t] = _mm512_add_epi32(sumi[t], _mm512_add_epi32(p01, p23));
            }
        }
        let sums = std::array::from_fn(|t| {
            let offset = _mm256_madd_epi16(scales16, _mm256_loadu_si256(a[t].bsums.as_ptr() as *const __m256i));
            _mm256_sub_epi32(fold(sumi[t]), _mm256_slli_epi32::<5>(offset))
        });
        (sums, f16_scale(b.add(208)), [0.0; T])
    })
}
