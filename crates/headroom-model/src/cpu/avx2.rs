//! The dot products with AVX2, FMA and F16C (x86-64 since Haswell). Same arithmetic as
//! [`super::dot::scalar`]: integer sums per block with `maddubs`/`madd`, one fused multiply-add
//! of the block's scale per block, a horizontal sum at the end.
//!
//! Each call computes up to four rows against one activation row: the activation block is
//! loaded once for all of them, the four accumulator chains overlap, and the per-row costs (call,
//! horizontal sum) are shared — rows of small models are only a few blocks long.

#![allow(unsafe_op_in_unsafe_fn)]

use std::arch::x86_64::*;

use super::dot::{scales_mins_k4, Kernels, Q8x256, Q8x32};

pub const KERNELS: Kernels = Kernels {
    name: "avx2",
    f32_rows: |w, rb, x, out| unsafe { by_rows(out.len(), |n| float(n, w, rb, [x], out, Float::F32)) },
    f16_rows: |w, rb, x, out| unsafe { by_rows(out.len(), |n| float(n, w, rb, [x], out, Float::F16)) },
    bf16_rows: |w, rb, x, out| unsafe { by_rows(out.len(), |n| float(n, w, rb, [x], out, Float::BF16)) },
    f32_pairs: |w, rb, x, out| unsafe { by_rows(out.len() / 2, |n| float(n, w, rb, x, out, Float::F32)) },
    f16_pairs: |w, rb, x, out| unsafe { by_rows(out.len() / 2, |n| float(n, w, rb, x, out, Float::F16)) },
    bf16_pairs: |w, rb, x, out| unsafe { by_rows(out.len() / 2, |n| float(n, w, rb, x, out, Float::BF16)) },
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
    k_tile: Some(super::tile::avx2::kernel),
    tile32: Some(super::tile::avx2_32::kernel32),
    float_tile: Some((super::tile::avx2_float::unpack, super::tile::avx2_float::kernel)),
    interleaved32: Some(super::interleave::avx2::kernel),
    interleaved256: Some(super::interleave_k::avx2::kernel),
};

/// Runs `kernel` with the row count as a compile-time constant (1 to 4).
#[inline(always)]
pub(super) fn by_rows(rows: usize, kernel: impl FnOnce(Rows)) {
    assert!((1..=4).contains(&rows), "1 to 4 rows per call, not {rows}");
    kernel(match rows {
        1 => Rows::One,
        2 => Rows::Two,
        3 => Rows::Three,
        _ => Rows::Four,
    })
}

#[derive(Clone, Copy)]
pub(super) enum Rows {
    One,
    Two,
    Three,
    Four,
}

/// Dispatches a generic kernel body on [`Rows`] (and passes on a token count `T`).
macro_rules! rows {
    ($n:expr, $f:ident::<$t:ident>($($arg:expr),*)) => {
        match $n {
            Rows::One => $f::<1, $t>($($arg),*),
            Rows::Two => $f::<2, $t>($($arg),*),
            Rows::Three => $f::<3, $t>($($arg),*),
            Rows::Four => $f::<4, $t>($($arg),*),
        }
    };
    ($n:expr, $f:ident($($arg:expr),*)) => {
        match $n {
            Rows::One => $f::<1>($($arg),*),
            Rows::Two => $f::<2>($($arg),*),
            Rows::Three => $f::<3>($($arg),*),
            Rows::Four => $f::<4>($($arg),*),
        }
    };
}
pub(super) use rows;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_scale(p: *const u8) -> f32 {
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

/// How unquantized weights are stored.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Float {
    F32,
    F16,
    BF16,
}

impl Float {
    fn bytes(self) -> usize {
        if self == Float::F32 {
            4
        } else {
            2
        }
    }
}

unsafe fn float<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, x: [&[f32]; T], out: &mut [f32], ty: Float) {
    check_tokens(w, row_bytes, &x, ty.bytes(), out);
    rows!(n, float_rows::<T>(w.as_ptr(), row_bytes, x, out.as_mut_ptr(), ty))
}

/// `N` f32 or f16 rows times `T` tokens into `out[t · N + r]`, eight columns at a time: each
/// weight vector is loaded (and widened from f16) once for all `T` tokens, and every (row, token)
/// sum takes the same steps whatever `N` and `T` are.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn float_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, x: [&[f32]; T], out: *mut f32, ty: Float) {
    let n = x[0].len();
    let elem = ty.bytes();
    let load = |r: usize, i: usize| -> __m256 {
        let p = w.add(r * row_bytes + elem * i);
        match ty {
            Float::F32 => _mm256_loadu_ps(p as *const f32),
            Float::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            Float::BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)))),
        }
    };
    let mut acc = [[_mm256_setzero_ps(); T]; N];
    let mut i = 0;
    while i + 8 <= n {
        if (i * elem) % 64 == 0 {
            prefetch_next_rows::<N>(w, row_bytes, i * elem);
        }
        let xs: [__m256; T] = std::array::from_fn(|t| _mm256_loadu_ps(x[t].as_ptr().add(i)));
        for (r, a) in acc.iter_mut().enumerate() {
            let v = load(r, i);
            for t in 0..T {
                a[t] = _mm256_fmadd_ps(v, xs[t], a[t]);
            }
        }
        i += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        for t in 0..T {
            let mut sum = hsum(a[t]);
            for j in i..n {
                let p = w.add(r * row_bytes + elem * j);
                let v = match ty {
                    Float::F32 => (p as *const f32).read_unaligned(),
                    Float::F16 => half::f16::from_le_bytes([*p, *p.add(1)]).to_f32(),
                    Float::BF16 => half::bf16::from_le_bytes([*p, *p.add(1)]).to_f32(),
                };
                sum += v * *x[t].as_ptr().add(j);
            }
            *out.add(t * N + r) = sum;
        }
    }
}

/// Asks for the bytes at `offset` of the next call's rows (the `N` rows after these) while these
/// are computed: rows are read front to back, but the hardware prefetcher stops at every 4 KiB
/// page, and a decode step starts a new page every few rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn prefetch_next_rows<const N: usize>(w: *const u8, row_bytes: usize, offset: usize) {
    for r in 0..N {
        // `wrapping_add`: the address may lie past the matrix; a prefetch never faults.
        _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add((N + r) * row_bytes + offset) as *const i8);
    }
}

/// `N` rows × `T` tokens of a 32-value block type into `out[t · N + r]`: `unpack(block)` gives
/// the block's 32 weights as bytes, its scale and its min (0 without one), once for all `T`
/// tokens; `dot` multiplies them with a token's 32 activations into eight i32 sums. Every (row,
/// token) sum takes the same steps whatever `N` and `T` are.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows32<const N: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    a: [&[Q8x32]; T],
    size: usize,
    out: *mut f32,
    unpack: impl Fn(*const u8) -> (__m256i, f32, f32),
    dot: impl Fn(__m256i, __m256i) -> __m256i,
) {
    let mut acc = [[_mm256_setzero_ps(); T]; N];
    let mut mins = [[0f32; T]; N];
    for i in 0..a[0].len() {
        let ab: [&Q8x32; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
        let y: [__m256i; T] = std::array::from_fn(|t| _mm256_loadu_si256(ab[t].qs.as_ptr() as *const __m256i));
        prefetch_next_rows::<N>(w, row_bytes, i * size);
        for r in 0..N {
            let (q, d, m) = unpack(w.add(r * row_bytes + i * size));
            for t in 0..T {
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d * ab[t].d), _mm256_cvtepi32_ps(dot(q, y[t])), acc[r][t]);
                mins[r][t] += m * ab[t].s;
            }
        }
    }
    for r in 0..N {
        for t in 0..T {
            *out.add(t * N + r) = hsum(acc[r][t]) + mins[r][t];
        }
    }
}

/// Checks that `T` tokens' activations of equal length and `out` (`T` × rows) fit the weights.
pub(super) fn check_tokens<A, const T: usize>(w: &[u8], row_bytes: usize, a: &[&[A]; T], block_bytes: usize, out: &[f32]) {
    assert!(a.iter().all(|t| t.len() == a[0].len()), "tokens of different lengths");
    let rows = out.len() / T;
    assert!(w.len() >= (rows - 1) * row_bytes + a[0].len() * block_bytes, "rows shorter than the activations");
}

/// A Q4_0 block for [`rows32`]: its 32 weights as signed bytes (nibbles − 8), its scale, no min.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack_q4_0(b: *const u8) -> (__m256i, f32, f32) {
    (_mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8)), f16_scale(b), 0.0)
}

/// A Q4_1 block for [`rows32`]: its 32 nibbles as unsigned bytes, its scale and its min.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack_q4_1(b: *const u8) -> (__m256i, f32, f32) {
    (nibbles(b.add(4)), f16_scale(b), f16_scale(b.add(2)))
}

/// A Q8_0 block for [`rows32`]: its 32 signed bytes, its scale, no min.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unpack_q8_0(b: *const u8) -> (__m256i, f32, f32) {
    (_mm256_loadu_si256(b.add(2) as *const __m256i), f16_scale(b), 0.0)
}

unsafe fn q4_0<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x32]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 18, out);
    rows!(n, q4_0_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x32]; T], out: *mut f32) {
    rows32::<N, T>(w, row_bytes, a, 18, out, |b| unpack_q4_0(b), |q, y| dot_i8(q, y))
}

unsafe fn q4_1<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x32]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 20, out);
    rows!(n, q4_1_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x32]; T], out: *mut f32) {
    rows32::<N, T>(w, row_bytes, a, 20, out, |b| unpack_q4_1(b), |q, y| dot_u8_i8(q, y))
}

unsafe fn q8_0<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x32]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 34, out);
    rows!(n, q8_0_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x32]; T], out: *mut f32) {
    rows32::<N, T>(w, row_bytes, a, 34, out, |b| unpack_q8_0(b), |q, y| dot_i8(q, y))
}

/// `N` rows × `T` tokens of a K-quant type into `out[t · N + r]`: `block(weights, the tokens'
/// activation blocks)` unpacks a super-block once for all `T` tokens and gives each token's
/// eight i32 sums, the block's scale `d`, and each token's min term. Every (row, token) sum takes
/// the same steps whatever `N` and `T` are.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows256<const N: usize, const T: usize>(
    w: *const u8,
    row_bytes: usize,
    a: [&[Q8x256]; T],
    size: usize,
    out: *mut f32,
    block: impl Fn(*const u8, [&Q8x256; T]) -> ([__m256i; T], f32, [f32; T]),
) {
    let mut acc = [[_mm256_setzero_ps(); T]; N];
    let mut mins = [[0f32; T]; N];
    for i in 0..a[0].len() {
        let ab: [&Q8x256; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
        for line in (0..size).step_by(64) {
            prefetch_next_rows::<N>(w, row_bytes, i * size + line);
        }
        for r in 0..N {
            let (s, d, m) = block(w.add(r * row_bytes + i * size), ab);
            for t in 0..T {
                acc[r][t] = _mm256_fmadd_ps(_mm256_set1_ps(d * ab[t].d), _mm256_cvtepi32_ps(s[t]), acc[r][t]);
                mins[r][t] += m[t];
            }
        }
    }
    for r in 0..N {
        for t in 0..T {
            *out.add(t * N + r) = hsum(acc[r][t]) - mins[r][t];
        }
    }
}

/// Activations `k` (0..8, 32 each) of a K-quant activation block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn y32(a: &Q8x256, k: usize) -> __m256i {
    _mm256_loadu_si256((a.qs.as_ptr() as *const __m256i).add(k))
}

/// One Q4_K/Q5_K super-block (`qh`: Q5_K's fifth bits) against `T` tokens: each token's
/// scaled integer sums, `d`, and each token's `dmin · d_act · Σ min · bsum`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_k5_block<const T: usize>(b: *const u8, a: [&Q8x256; T], qh: Option<*const u8>, qs: *const u8) -> ([__m256i; T], f32, [f32; T]) {
    let (scales, mins) = scales_mins_k4(std::slice::from_raw_parts(b.add(4), 12));
    let low = _mm256_set1_epi8(0x0f);
    let one = _mm256_set1_epi8(1);
    let high_bits = qh.map(|p| _mm256_loadu_si256(p as *const __m256i));
    let mut sumi = [_mm256_setzero_si256(); T];
    for pair in 0..4 {
        let packed = _mm256_loadu_si256(qs.add(pair * 32) as *const __m256i);
        let mut q1 = _mm256_and_si256(packed, low);
        let mut q2 = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
        if let Some(h) = high_bits {
            let h1 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * pair as i32)), one);
            let h2 = _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * pair as i32 + 1)), one);
            q1 = _mm256_or_si256(q1, _mm256_slli_epi16(h1, 4));
            q2 = _mm256_or_si256(q2, _mm256_slli_epi16(h2, 4));
        }
        let (s1, s2) = (_mm256_set1_epi16(scales[2 * pair] as i16), _mm256_set1_epi16(scales[2 * pair + 1] as i16));
        for t in 0..T {
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(q1, y32(a[t], 2 * pair)), s1);
            let p2 = _mm256_madd_epi16(_mm256_maddubs_epi16(q2, y32(a[t], 2 * pair + 1)), s2);
            sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p1, p2));
        }
    }
    (sumi, f16_scale(b), k4_min_terms(b, a, &mins))
}

/// Each token's `dmin · d_act · Σ min_j · (bsum_2j + bsum_2j+1)` of a Q4_K/Q5_K super-block
/// `b` whose eight mins are `mins`: the sixteen sums of 16 added in pairs, times the mins.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k4_min_terms<const T: usize>(b: *const u8, a: [&Q8x256; T], mins: &[u8; 8]) -> [f32; T] {
    let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr() as *const __m128i));
    let dmin = f16_scale(b.add(2));
    std::array::from_fn(|t| {
        let bsums = a[t].bsums.as_ptr() as *const __m128i;
        let pairs = _mm_hadd_epi16(_mm_loadu_si128(bsums), _mm_loadu_si128(bsums.add(1)));
        let m = _mm_madd_epi16(mins, pairs);
        let m = _mm_add_epi32(m, _mm_unpackhi_epi64(m, m));
        let m = _mm_add_epi32(m, _mm_shuffle_epi32::<1>(m));
        dmin * a[t].d * _mm_cvtsi128_si32(m) as f32
    })
}

unsafe fn q4_k<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x256]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 144, out);
    rows!(n, q4_k_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x256]; T], out: *mut f32) {
    rows256::<N, T>(w, row_bytes, a, 144, out, |b, a| k4_k5_block(b, a, None, b.add(16)))
}

unsafe fn q5_k<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x256]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 176, out);
    rows!(n, q5_k_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x256]; T], out: *mut f32) {
    rows256::<N, T>(w, row_bytes, a, 176, out, |b, a| k4_k5_block(b, a, Some(b.add(16)), b.add(48)))
}

unsafe fn q6_k<const T: usize>(n: Rows, w: &[u8], row_bytes: usize, a: [&[Q8x256]; T], out: &mut [f32]) {
    check_tokens(w, row_bytes, &a, 210, out);
    rows!(n, q6_k_rows::<T>(w.as_ptr(), row_bytes, a, out.as_mut_ptr()))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_rows<const N: usize, const T: usize>(w: *const u8, row_bytes: usize, a: [&[Q8x256]; T], out: *mut f32) {
    rows256::<N, T>(w, row_bytes, a, 210, out, |b, a| {
        let low = _mm256_set1_epi8(0x0f);
        let three = _mm256_set1_epi8(3);
        let m32 = _mm256_set1_epi8(32);
        let scales = b.add(192) as *const i8;
        let mut sumi = [_mm256_setzero_si256(); T];
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
                let s = scales.add(half * 8 + 2 * k);
                let scale = _mm256_set_m128i(_mm_set1_epi16(*s.add(1) as i16), _mm_set1_epi16(*s as i16));
                for t in 0..T {
                    let y = y32(a[t], half * 4 + k);
                    // (q − 32)·y as q·y − 32·y: maddubs needs its first operand unsigned.
                    let p = _mm256_sub_epi16(_mm256_maddubs_epi16(q, y), _mm256_maddubs_epi16(m32, y));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, scale));
                }
            }
        }
        (sumi, f16_scale(b.add(208)), [0.0; T])
    })
}
