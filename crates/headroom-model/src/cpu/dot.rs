//! Dot products of one packed weight row with one activation row, per ggml block type.
//!
//! Activations are quantized per block to 8 bits, as llama.cpp does, so a 4-bit weight block and
//! its activations multiply in integers and one float multiply per block scales the sum:
//! [`Q8x32`] beside the 32-value types (Q4_0, Q4_1, Q8_0), [`Q8x256`] beside the K-quants
//! (Q4_K, Q5_K, Q6_K). Unquantized weights (F32, F16) take f32 activations.
//!
//! Every kernel has a portable scalar form, the reference the tests hold the SIMD forms to (the
//! integer sums are exact in both; only the float combination order differs). The SIMD form is
//! chosen once at run time from what the processor reports (see [`Kernels::detect`]).

use half::f16;

pub(crate) use crate::quants::scales_mins_k4;
use crate::quants::GgmlType;

/// 32 activations quantized to `d · qs`, with `s = d · Σ qs` for the types with a minimum (Q4_1)
/// and `sum = Σ qs` for the tiles' offsets ([`super::tile`]).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(8))]
pub struct Q8x32 {
    pub d: f32,
    pub s: f32,
    pub sum: i32,
    pub qs: [i8; 32],
}

/// 256 activations quantized to `d · qs`, with the sums of each 16 for the K-quants' minimums.
#[derive(Clone, Copy, Debug)]
#[repr(C, align(8))]
pub struct Q8x256 {
    pub d: f32,
    pub bsums: [i16; 16],
    pub qs: [i8; 256],
}

impl Default for Q8x32 {
    fn default() -> Self {
        Self { d: 0.0, s: 0.0, sum: 0, qs: [0; 32] }
    }
}

impl Default for Q8x256 {
    fn default() -> Self {
        Self { d: 0.0, bsums: [0; 16], qs: [0; 256] }
    }
}

/// Round to nearest, ties to even (what llama.cpp's AVX2 quantizer does with `_mm256_round_ps`).
#[inline(always)]
fn round_i8(v: f32) -> i8 {
    v.round_ties_even().clamp(-127.0, 127.0) as i8
}

/// Quantizes `x` (a multiple of 32 long) into `out`, as llama.cpp's `q8_0`/`q8_1` do: the scale
/// is stored (and multiplied) at f16 precision, and so is `d · Σ qs`, so both engines see the
/// same activations and a greedy generation does not part ways over a rounding difference.
pub fn quantize_q8x32(x: &[f32], out: &mut [Q8x32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2.
        return unsafe { avx2_quantize::q8x32(x, out) };
    }
    quantize_q8x32_body(x, out)
}

/// Quantizes `x` (a multiple of 256 long) into `out`.
pub fn quantize_q8x256(x: &[f32], out: &mut [Q8x256]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the processor has AVX2.
        return unsafe { avx2_quantize::q8x256(x, out) };
    }
    quantize_q8x256_body(x, out)
}

/// The quantizers compiled for AVX2: the same arithmetic (bit for bit), but rounding is one
/// instruction instead of a call into libm per value (5% of a prefill's time) and the loops
/// vectorize.
#[cfg(target_arch = "x86_64")]
mod avx2_quantize {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::*;

    /// The largest magnitude of `n` (a multiple of 8) values at `p`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn amax(p: *const f32, n: usize) -> f32 {
        let sign = _mm256_set1_ps(-0.0);
        let mut m = _mm256_setzero_ps();
        for k in (0..n).step_by(8) {
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p.add(k))));
        }
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)))
    }

    /// 32 values at `p` times `inv`, rounded to nearest even, as i32 in four vectors (the
    /// scalar form's `round_i8`: `|v · inv|` ≤ 127 needs no clamp).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(p: *const f32, inv: f32) -> [__m256i; 4] {
        let inv = _mm256_set1_ps(inv);
        std::array::from_fn(|k| {
            let v = _mm256_mul_ps(_mm256_loadu_ps(p.add(8 * k)), inv);
            _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v))
        })
    }

    /// The 32 quants packed to bytes in order, at `out`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store(q: [__m256i; 4], out: *mut i8) {
        // The packs interleave 128-bit lanes; one permute puts the 32-bit groups back in order.
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(out as *mut __m256i, bytes);
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<1>(s)))
    }

    /// [`quantize_q8x32_body`], eight values per instruction.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q8x32(x: &[f32], out: &mut [Q8x32]) {
        assert_eq!(x.len(), out.len() * 32);
        for (block, q) in x.chunks_exact(32).zip(out.iter_mut()) {
            let amax = amax(block.as_ptr(), 32);
            let d = amax / 127.0;
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            let v = quants(block.as_ptr(), inv);
            store(v, q.qs.as_mut_ptr());
            let sum = hsum(_mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3])));
            q.d = f16::from_f32(d).to_f32();
            q.s = f16::from_f32(d * sum as f32).to_f32();
            q.sum = sum;
        }
    }

    /// [`quantize_q8x256_body`], eight values per instruction.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q8x256(x: &[f32], out: &mut [Q8x256]) {
        assert_eq!(x.len(), out.len() * 256);
        for (block, q) in x.chunks_exact(256).zip(out.iter_mut()) {
            let amax = amax(block.as_ptr(), 256);
            let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
            for k in 0..8 {
                let v = quants(block.as_ptr().add(32 * k), inv);
                store(v, q.qs.as_mut_ptr().add(32 * k));
                q.bsums[2 * k] = hsum(_mm256_add_epi32(v[0], v[1])) as i16;
                q.bsums[2 * k + 1] = hsum(_mm256_add_epi32(v[2], v[3])) as i16;
            }
            q.d = amax / 127.0;
        }
    }
}

#[inline(always)]
fn quantize_q8x32_body(x: &[f32], out: &mut [Q8x32]) {
    debug_assert_eq!(x.len(), out.len() * 32);
    for (block, q) in x.chunks_exact(32).zip(out.iter_mut()) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (o, v) in q.qs.iter_mut().zip(block) {
            *o = round_i8(v * inv);
            sum += *o as i32;
        }
        q.d = f16::from_f32(d).to_f32();
        q.s = f16::from_f32(d * sum as f32).to_f32();
        q.sum = sum;
    }
}

#[inline(always)]
fn quantize_q8x256_body(x: &[f32], out: &mut [Q8x256]) {
    debug_assert_eq!(x.len(), out.len() * 256);
    for (block, q) in x.chunks_exact(256).zip(out.iter_mut()) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        for (o, v) in q.qs.iter_mut().zip(block) {
            *o = round_i8(v * inv);
        }
        for (s, group) in q.bsums.iter_mut().zip(q.qs.chunks_exact(16)) {
            *s = group.iter().map(|&v| v as i16).sum();
        }
        q.d = d;
    }
}

#[inline]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The scalar reference kernels. `w` holds exactly the row's blocks.
pub mod scalar {
    use super::*;

    pub fn f32_dot(w: &[u8], x: &[f32]) -> f32 {
        w.chunks_exact(4).zip(x).map(|(b, x)| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) * x).sum()
    }

    pub fn f16_dot(w: &[u8], x: &[f32]) -> f32 {
        w.chunks_exact(2).zip(x).map(|(b, x)| f16::from_le_bytes([b[0], b[1]]).to_f32() * x).sum()
    }

    pub fn bf16_dot(w: &[u8], x: &[f32]) -> f32 {
        w.chunks_exact(2).zip(x).map(|(b, x)| half::bf16::from_le_bytes([b[0], b[1]]).to_f32() * x).sum()
    }

    pub fn q4_0(w: &[u8], a: &[Q8x32]) -> f32 {
        let mut sum = 0f32;
        for (b, a) in w.chunks_exact(18).zip(a) {
            let qs = &b[2..18];
            let mut isum = 0i32;
            for j in 0..16 {
                isum += ((qs[j] & 0x0f) as i32 - 8) * a.qs[j] as i32;
                isum += ((qs[j] >> 4) as i32 - 8) * a.qs[j + 16] as i32;
            }
            sum += f16_at(b, 0) * a.d * isum as f32;
        }
        sum
    }

    /// The minimums' terms are summed apart and added last, as llama.cpp and the row kernels
    /// do (mixed into the scaled sums they cost precision: teacher-forced agreement with
    /// llama.cpp on the default model 97.7% mixed, 98.6% apart).
    pub fn q4_1(w: &[u8], a: &[Q8x32]) -> f32 {
        let (mut sum, mut mins) = (0f32, 0f32);
        for (b, a) in w.chunks_exact(20).zip(a) {
            let qs = &b[4..20];
            let mut isum = 0i32;
            for j in 0..16 {
                isum += (qs[j] & 0x0f) as i32 * a.qs[j] as i32;
                isum += (qs[j] >> 4) as i32 * a.qs[j + 16] as i32;
            }
            sum += f16_at(b, 0) * a.d * isum as f32;
            mins += f16_at(b, 2) * a.s;
        }
        sum + mins
    }

    pub fn q8_0(w: &[u8], a: &[Q8x32]) -> f32 {
        let mut sum = 0f32;
        for (b, a) in w.chunks_exact(34).zip(a) {
            let isum: i32 = b[2..34].iter().zip(&a.qs).map(|(&q, &y)| q as i8 as i32 * y as i32).sum();
            sum += f16_at(b, 0) * a.d * isum as f32;
        }
        sum
    }

    /// Q4_K and Q5_K share everything but the fifth bit (`qh`, Q5_K only).
    fn k4_k5(b: &[u8], a: &Q8x256, qh: Option<&[u8]>, qs: &[u8]) -> f32 {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let scales = &b[4..16];
        let (mut isum, mut mins) = (0i32, 0i32);
        // The negative control of the kernel tests: scale and min read the wrong way round.
        let swapped = crate::test_defect("k-quant-scale-order");
        let (scs, ms) = scales_mins_k4(scales);
        for pair in 0..4 {
            let q = &qs[pair * 32..pair * 32 + 32];
            for half in 0..2 {
                let j = 2 * pair + half;
                let (sc, m) = (scs[j], ms[j]);
                let (sc, m) = if swapped { (m, sc) } else { (sc, m) };
                let mut part = 0i32;
                for l in 0..32 {
                    let nibble = if half == 0 { q[l] & 0x0f } else { q[l] >> 4 };
                    let high = qh.map_or(0, |qh| ((qh[l] >> j) & 1) << 4);
                    part += (nibble | high) as i32 * a.qs[j * 32 + l] as i32;
                }
                isum += sc as i32 * part;
                mins += m as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
            }
        }
        a.d * (d * isum as f32 - dmin * mins as f32)
    }

    pub fn q4_k(w: &[u8], a: &[Q8x256]) -> f32 {
        w.chunks_exact(144).zip(a).map(|(b, a)| k4_k5(b, a, None, &b[16..144])).sum()
    }

    pub fn q5_k(w: &[u8], a: &[Q8x256]) -> f32 {
        w.chunks_exact(176).zip(a).map(|(b, a)| k4_k5(b, a, Some(&b[16..48]), &b[48..176])).sum()
    }

    pub fn q6_k(w: &[u8], a: &[Q8x256]) -> f32 {
        let mut sum = 0f32;
        for (b, a) in w.chunks_exact(210).zip(a) {
            let (ql_all, qh_all, sc_all) = (&b[0..128], &b[128..192], &b[192..208]);
            let mut isum = 0i32;
            for half in 0..2 {
                let ql = &ql_all[half * 64..half * 64 + 64];
                let qh = &qh_all[half * 32..half * 32 + 32];
                let y = &a.qs[half * 128..half * 128 + 128];
                let sc = &sc_all[half * 8..half * 8 + 8];
                for l in 0..32 {
                    let is = l / 16;
                    let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                    let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                    let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                    let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                    isum += sc[is] as i8 as i32 * q1 * y[l] as i32;
                    isum += sc[is + 2] as i8 as i32 * q2 * y[l + 32] as i32;
                    isum += sc[is + 4] as i8 as i32 * q3 * y[l + 64] as i32;
                    isum += sc[is + 6] as i8 as i32 * q4 * y[l + 96] as i32;
                }
            }
            sum += f16_at(b, 208) * a.d * isum as f32;
        }
        sum
    }
}

/// `rows` weight rows (`row_bytes` apart, at most 4) times one f32 activation row, into `out`.
pub type FloatRows = fn(w: &[u8], row_bytes: usize, x: &[f32], out: &mut [f32]);
/// Rows of f32 or f16 weights times two activation rows (two tokens of a prefill), each weight
/// loaded once for both; each (row, token) sum is computed exactly as [`FloatRows`] computes it.
pub type FloatPairs = fn(w: &[u8], row_bytes: usize, x: [&[f32]; 2], out: &mut [f32]);
/// The same for the 32-value block types.
pub type Q32Rows = fn(w: &[u8], row_bytes: usize, a: &[Q8x32], out: &mut [f32]);
/// The same for the K-quants.
pub type Q256Rows = fn(w: &[u8], row_bytes: usize, a: &[Q8x256], out: &mut [f32]);
/// Rows of a 32-value block type times two activation rows (two tokens of a prefill): `out`
/// holds the first token's rows, then the second's. Each weight block is unpacked once for both,
/// and each (row, token) sum is computed exactly as [`Q32Rows`] computes it.
pub type Q32Pairs = fn(w: &[u8], row_bytes: usize, a: [&[Q8x32]; 2], out: &mut [f32]);
/// The same for the K-quants.
pub type Q256Pairs = fn(w: &[u8], row_bytes: usize, a: [&[Q8x256]; 2], out: &mut [f32]);

/// The dot product functions for one processor; each takes 1 to 4 rows at a time.
#[derive(Clone, Copy)]
pub struct Kernels {
    pub name: &'static str,
    pub f32_rows: FloatRows,
    pub f16_rows: FloatRows,
    pub bf16_rows: FloatRows,
    pub f32_pairs: FloatPairs,
    pub f16_pairs: FloatPairs,
    pub bf16_pairs: FloatPairs,
    pub q4_0: Q32Rows,
    pub q4_1: Q32Rows,
    pub q8_0: Q32Rows,
    pub q4_0_pairs: Q32Pairs,
    pub q4_1_pairs: Q32Pairs,
    pub q8_0_pairs: Q32Pairs,
    pub q4_k: Q256Rows,
    pub q5_k: Q256Rows,
    pub q6_k: Q256Rows,
    pub q4_k_pairs: Q256Pairs,
    pub q5_k_pairs: Q256Pairs,
    pub q6_k_pairs: Q256Pairs,
    /// The K-quants' prefill kernel over unpacked rows ([`super::tile`]), where there is one.
    pub k_tile: Option<super::tile::TileKernel>,
    /// The same for Q4_0, Q4_1 and Q8_0.
    pub tile32: Option<super::tile::Tile32Kernel>,
    /// The same for F32, F16 and BF16 rows: their widening into columns, and the kernel.
    pub float_tile: Option<(super::tile::FloatUnpack, super::tile::FloatTileKernel)>,
    /// The products of Q4_0, Q4_1 and Q8_0 weights repacked into groups of 16 rows
    /// ([`super::interleave`]), for every token count, where there is one: matrices of those
    /// types are then repacked at load.
    pub interleaved32: Option<super::interleave::InterleavedKernel>,
    /// The same for Q4_K, Q5_K and Q6_K ([`super::interleave_k`]).
    pub interleaved256: Option<super::interleave_k::Kernel>,
}

/// A scalar row kernel applied to each of the rows.
macro_rules! each_row {
    ($f:path, $bytes:expr) => {
        |w, row_bytes, a, out| {
            let len = a.len() * $bytes;
            for (r, o) in out.iter_mut().enumerate() {
                *o = $f(&w[r * row_bytes..r * row_bytes + len], a);
            }
        }
    };
}
#[cfg(target_arch = "aarch64")]
pub(super) use each_row;

/// A scalar row kernel applied to each row and each of two tokens.
macro_rules! each_row_pair {
    ($f:path, $bytes:expr) => {
        |w, row_bytes, a, out| {
            let rows = out.len() / 2;
            for (t, a) in a.into_iter().enumerate() {
                let len = a.len() * $bytes;
                for r in 0..rows {
                    out[t * rows + r] = $f(&w[r * row_bytes..r * row_bytes + len], a);
                }
            }
        }
    };
}
#[cfg(target_arch = "aarch64")]
pub(super) use each_row_pair;

impl Kernels {
    pub const SCALAR: Kernels = Kernels {
        name: "scalar",
        f32_rows: each_row!(scalar::f32_dot, 4),
        f16_rows: each_row!(scalar::f16_dot, 2),
        bf16_rows: each_row!(scalar::bf16_dot, 2),
        f32_pairs: each_row_pair!(scalar::f32_dot, 4),
        f16_pairs: each_row_pair!(scalar::f16_dot, 2),
        bf16_pairs: each_row_pair!(scalar::bf16_dot, 2),
        q4_0: each_row!(scalar::q4_0, 18),
        q4_1: each_row!(scalar::q4_1, 20),
        q8_0: each_row!(scalar::q8_0, 34),
        q4_0_pairs: each_row_pair!(scalar::q4_0, 18),
        q4_1_pairs: each_row_pair!(scalar::q4_1, 20),
        q8_0_pairs: each_row_pair!(scalar::q8_0, 34),
        q4_k: each_row!(scalar::q4_k, 144),
        q5_k: each_row!(scalar::q5_k, 176),
        q6_k: each_row!(scalar::q6_k, 210),
        q4_k_pairs: each_row_pair!(scalar::q4_k, 144),
        q5_k_pairs: each_row_pair!(scalar::q5_k, 176),
        q6_k_pairs: each_row_pair!(scalar::q6_k, 210),
        k_tile: None,
        tile32: None,
        float_tile: None,
        interleaved32: None,
        interleaved256: None,
    };

    /// The one-token and two-token kernels of unquantized rows (F32, F16, BF16).
    pub fn float_kernels(&self, ty: GgmlType) -> (FloatRows, FloatPairs) {
        match ty {
            GgmlType::F32 => (self.f32_rows, self.f32_pairs),
            GgmlType::F16 => (self.f16_rows, self.f16_pairs),
            GgmlType::BF16 => (self.bf16_rows, self.bf16_pairs),
            other => unreachable!("{other} is not multiplied with f32 activations"),
        }
    }

    /// The one-token and two-token kernels of a 32-value block type (Q4_0, Q4_1, Q8_0).
    pub fn q8x32_kernels(&self, ty: GgmlType) -> (Q32Rows, Q32Pairs) {
        match ty {
            GgmlType::Q4_0 => (self.q4_0, self.q4_0_pairs),
            GgmlType::Q4_1 => (self.q4_1, self.q4_1_pairs),
            GgmlType::Q8_0 => (self.q8_0, self.q8_0_pairs),
            other => unreachable!("{other} is not multiplied with 32-value activation blocks"),
        }
    }

    /// The one-token and two-token kernels of a K-quant (Q4_K, Q5_K, Q6_K).
    pub fn q8x256_kernels(&self, ty: GgmlType) -> (Q256Rows, Q256Pairs) {
        match ty {
            GgmlType::Q4K => (self.q4_k, self.q4_k_pairs),
            GgmlType::Q5K => (self.q5_k, self.q5_k_pairs),
            GgmlType::Q6K => (self.q6_k, self.q6_k_pairs),
            other => unreachable!("{other} is not multiplied with 256-value activation blocks"),
        }
    }

    /// The fastest set this processor runs. `HEADROOM_CPU_KERNELS` names another one it runs
    /// (`scalar`, the reference; `avx2`, `avx512-vnni`, `neon`), to compare them.
    pub fn detect() -> &'static Kernels {
        static CHOSEN: std::sync::OnceLock<Kernels> = std::sync::OnceLock::new();
        CHOSEN.get_or_init(|| {
            let available = Self::available();
            match std::env::var("HEADROOM_CPU_KERNELS") {
                Ok(name) => match available.iter().find(|k| k.name == name) {
                    Some(k) => *k,
                    None => {
                        let names: Vec<_> = available.iter().map(|k| k.name).collect();
                        eprintln!("HEADROOM_CPU_KERNELS={name} is not a kernel set this processor runs ({}); using {}", names.join(", "), available[0].name);
                        available[0]
                    }
                },
                Err(_) => available[0],
            }
        })
    }

    /// Every set this processor runs, fastest first; the scalar reference last.
    pub fn available() -> Vec<Kernels> {
        let mut sets = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if super::avx512::supported() {
                sets.push(super::avx512::KERNELS);
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                sets.push(super::avx2::KERNELS);
            }
        }
        // Every aarch64 processor has NEON.
        #[cfg(target_arch = "aarch64")]
        sets.push(super::neon::KERNELS);
        sets.push(Kernels::SCALAR);
        sets
    }
}

/// What a weight type multiplies with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationKind {
    F32,
    Q8x32,
    Q8x256,
}

/// Whether the CPU engine keeps `ty` packed, and what its activations are.
pub fn activation_kind(ty: GgmlType) -> Option<ActivationKind> {
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => Some(ActivationKind::F32),
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 => Some(ActivationKind::Q8x32),
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => Some(ActivationKind::Q8x256),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use super::super::conformance::*;
    use rand::SeedableRng;

    /// The scalar kernels compute what the dequantizer (checked against the `gguf` package in
    /// tests/reference) says the weights are, times the quantized activations.
    #[test]
    fn scalar_kernels_equal_dequantized_products() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &(ty, scales) in TYPES {
            for kind in [Blocks::Random, Blocks::Zero, Blocks::Max] {
                for n_blocks in [1, 3] {
                    let cols = n_blocks * ty.block_elements();
                    let w = blocks(ty, scales, n_blocks, kind, &mut rng);
                    let x = activations(cols, &mut rng);
                    let wd = crate::quants::dequantize(ty, &w, cols).unwrap();
                    let xs = seen_activations(ty, &x);
                    let expected: f64 = wd.iter().zip(&xs).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let magnitude: f64 = wd.iter().zip(&xs).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                    let got = dot_with(&Kernels::SCALAR, ty, &w, &x);
                    assert!(close(got, expected as f32, magnitude as f32), "{ty} {n_blocks} blocks: {got} vs {expected}");
                }
            }
        }
    }

    /// The quantizers compiled for AVX2 give the plain build's blocks bit for bit, ties included.
    #[test]
    fn quantizers_are_the_same_with_and_without_avx2() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let mut x = activations(1024, &mut rng);
        // Values that land exactly halfway between two quants.
        x[300..332].iter_mut().enumerate().for_each(|(i, v)| *v = if i == 0 { 127.0 } else { i as f32 + 0.5 });
        let (mut a, mut b) = (vec![Q8x32::default(); 32], vec![Q8x32::default(); 32]);
        quantize_q8x32(&x, &mut a);
        quantize_q8x32_body(&x, &mut b);
        assert!(a.iter().zip(&b).all(|(a, b)| a.qs == b.qs && a.sum == b.sum && a.d.to_bits() == b.d.to_bits() && a.s.to_bits() == b.s.to_bits()));
        let (mut a, mut b) = (vec![Q8x256::default(); 4], vec![Q8x256::default(); 4]);
        quantize_q8x256(&x, &mut a);
        quantize_q8x256_body(&x, &mut b);
        assert!(a.iter().zip(&b).all(|(a, b)| a.qs == b.qs && a.bsums == b.bsums && a.d.to_bits() == b.d.to_bits()));
    }

    /// The comparison above fails when the reference kernel reads a K-quant's scale and min the
    /// wrong way round (`HEADROOM_TEST_DEFECT=k-quant-scale-order`, in a child process).
    #[test]
    fn the_negative_control_of_the_kernel_check_fails() {
        let stdout = crate::failing_with_defect("cpu::dot::tests::scalar_kernels_equal_dequantized_products", "k-quant-scale-order");
        assert!(stdout.contains("Q4_K"), "it failed on something else: {stdout}");
    }

    /// Every SIMD kernel equals the scalar reference on random, all-zero and saturated blocks,
    /// and f32/f16 rows of lengths that leave a remainder.
    #[test]
    fn simd_kernels_equal_the_scalar_reference() {
        let sets: Vec<Kernels> = Kernels::available().into_iter().filter(|k| k.name != "scalar").collect();
        if sets.is_empty() {
            eprintln!("no SIMD kernels on this processor; the scalar kernels are the only ones");
        }
        for simd in sets {
            eprintln!("checking the {} kernels", simd.name);
            equals_scalar(simd);
        }
    }
}
