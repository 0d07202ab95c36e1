//! Q4_K, Q5_K and Q6_K weights repacked at load into groups of 16 rows whose vector lanes are the rows,
//! as [`super::interleave`] does for the 32-value types: one kernel for every token count, each
//! weight load serving up to 4 tokens, and a decode step that does no per-row work.
//!
//! The row kernels of [`super::dot`] unpack each row's 6-bit scales and mins, broadcast them and
//! sum across lanes per super-block and row; at one token that scalar work, not the memory, set
//! the pace (Q4_K_M decode at 0.63× llama.cpp's, measured on a ~1B model). Here the scales of
//! 16 rows unpack together, once per super-block for every token, and a batch of sequences reads
//! the weights once (the row kernels read them once per pair).
//!
//! Every lane takes the scalar reference's steps (exact integer sums per super-block, then
//! `d_act · (d · Σ − dmin · Σmin)` for Q4_K and Q5_K, `d · d_act · Σ` for Q6_K, added block
//! after block),
//! so a product equals [`super::dot`]'s scalar reference bit for bit whatever the token count:
//! prefills are chunk-invariant and a sequence's logits in a batch equal its lone step's.
//!
//! A record holds one super-block (256 columns) of a group's 16 rows, the same bytes as the 16
//! blocks it replaces.
//! - Q4_K (2304 bytes): the 16 f16 `d`, the 16 f16 `dmin`, the 12 packed scale bytes as 12 × 16
//!   (byte `k` of row `r` at `16k + r`), then 32 × 64 bytes of quants: bytes `4r..4r + 4` of the
//!   `(8p + h)`-th 64 are row `r`'s bytes `32p + 4h..32p + 4h + 4` (low nibbles: sub-block `2p`,
//!   columns `4h..4h + 4`; high nibbles: sub-block `2p + 1`).
//! - Q5_K (2816 bytes): Q4_K's, with each row's 32 bytes of fifth bits as 8 × 64 between the
//!   scales and the quants (bytes `4r..4r + 4` of the `h`-th 64 are row `r`'s `qh[4h..4h + 4]`,
//!   whose bit `j` belongs to sub-block `j`).
//! - Q6_K (3360 bytes): the 16 f16 `d`, the 16 signed scales as 16 × 16 (sub-block `s` of row `r`
//!   at `16s + r`), then 16 runs of three 64-byte vectors, read front to back: low nibbles `k`,
//!   low nibbles `k + 16`, high bit pairs `k`. Writing `g` for the 4 columns `4g..4g + 4`, row
//!   `r`'s quants' low 4 bits sit at `4r` of low nibbles `g mod 32` (low nibbles for `g` < 32,
//!   high for the rest), their top 2 bits at `4r` of high bit pairs `g mod 16`, shifted by
//!   `2 · ⌊g / 16⌋`. So one 64-byte load of high bits serves 4 quant vectors. (Three vectors
//!   apart, low nibbles `k + 16` and the high bits made two more streams for the hardware
//!   prefetcher: Q6_K's products ran at ~60% of Q4_K's bytes per second.)

use super::dot::{f16_at, scales_mins_k4, Q8x256};
use super::interleave::{RepackedKernel, GROUP};
use super::tile::TOKENS;
use crate::quants::GgmlType;

/// Q4_K, Q5_K: where the mins' f16 scales, the packed scales and Q5_K's fifth bits start in a
/// record.
const K4_DMIN: usize = 2 * GROUP;
const K4_SCALES: usize = 4 * GROUP;
const K5_HIGH: usize = K4_SCALES + 12 * GROUP;

/// Q4_K, Q5_K: where the quants start in a record.
const fn k45_quants(fifth: bool) -> usize {
    if fifth {
        K5_HIGH + 8 * 64
    } else {
        K5_HIGH
    }
}
/// Q6_K: where the scales and the quants start in a record.
const K6_SCALES: usize = 2 * GROUP;
const K6_QUANTS: usize = K6_SCALES + 16 * GROUP;

/// Q6_K: where low nibbles `n` (0..32) start in a record.
const fn k6_low(n: usize) -> usize {
    K6_QUANTS + 192 * (n % 16) + 64 * (n / 16)
}

/// Q6_K: where high bit pairs `k` (0..16) start in a record.
const fn k6_high(k: usize) -> usize {
    K6_QUANTS + 192 * k + 128
}

/// Bytes of one record of `ty` (16 rows × one super-block), `None` for types not repacked.
pub fn record_bytes(ty: GgmlType) -> Option<usize> {
    matches!(ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K).then(|| GROUP * ty.block_bytes())
}

/// A Q6_K block's 256 quants (0..=63, before the −32 offset), in column order.
fn q6_quants(b: &[u8]) -> [u8; 256] {
    let (ql, qh) = (&b[0..128], &b[128..192]);
    let mut q = [0u8; 256];
    for half in 0..2 {
        for l in 0..32 {
            let (lo0, lo1, h) = (ql[half * 64 + l], ql[half * 64 + 32 + l], qh[half * 32 + l]);
            let at = half * 128 + l;
            q[at] = (lo0 & 0x0f) | ((h & 3) << 4);
            q[at + 32] = (lo1 & 0x0f) | (((h >> 2) & 3) << 4);
            q[at + 64] = (lo0 >> 4) | (((h >> 4) & 3) << 4);
            q[at + 96] = (lo1 >> 4) | (((h >> 6) & 3) << 4);
        }
    }
    q
}

/// [`q6_quants`] undone: the block's `ql` and `qh` bytes.
fn q6_pack(q: &[u8; 256], ql: &mut [u8], qh: &mut [u8]) {
    for half in 0..2 {
        for l in 0..32 {
            let at = half * 128 + l;
            ql[half * 64 + l] = (q[at] & 0x0f) | (q[at + 64] & 0x0f) << 4;
            ql[half * 64 + 32 + l] = (q[at + 32] & 0x0f) | (q[at + 96] & 0x0f) << 4;
            qh[half * 32 + l] = (q[at] >> 4) | (q[at + 32] >> 4) << 2 | (q[at + 64] >> 4) << 4 | (q[at + 96] >> 4) << 6;
        }
    }
}

/// Where column `c`'s quant of lane `r` sits in a Q6_K record: `(low byte, its shift, high
/// byte, its shift)`.
fn q6_at(r: usize, c: usize) -> (usize, u32, usize, u32) {
    let (g, i) = (c / 4, c % 4);
    (k6_low(g % 32) + 4 * r + i, 4 * (g / 32) as u32, k6_high(g % 16) + 4 * r + i, 2 * (g / 16) as u32)
}

/// Where column `c` of lane `r` sits in a Q4_K or Q5_K record: `(byte, its shift)`.
fn q45_at(fifth: bool, r: usize, c: usize) -> (usize, u32) {
    let (j, l) = (c / 32, c % 32);
    (k45_quants(fifth) + 64 * (8 * (j / 2) + l / 4) + 4 * r + l % 4, 4 * (j % 2) as u32)
}

/// Where byte `l` of lane `r`'s fifth bits sits in a Q5_K record.
fn q5_high_at(r: usize, l: usize) -> usize {
    K5_HIGH + 64 * (l / 4) + 4 * r + l % 4
}

/// Calls `each(at in the block, at in the record)` for every byte of lane `lane`'s `ty` block
/// that its record holds unchanged: all of a Q4_K or Q5_K block; Q6_K's `d` and scales (its
/// quants are regrouped bit by bit, [`q6_at`]). Repacking and reading a row back both go by it.
fn moved_bytes(ty: GgmlType, lane: usize, mut each: impl FnMut(usize, usize)) {
    if ty == GgmlType::Q6K {
        (0..2).for_each(|i| each(208 + i, 2 * lane + i));
        (0..16).for_each(|s| each(192 + s, K6_SCALES + 16 * s + lane));
        return;
    }
    let fifth = ty == GgmlType::Q5K;
    for i in 0..2 {
        each(i, 2 * lane + i);
        each(2 + i, K4_DMIN + 2 * lane + i);
    }
    (0..12).for_each(|k| each(4 + k, K4_SCALES + 16 * k + lane));
    let qs = if fifth {
        (0..32).for_each(|l| each(16 + l, q5_high_at(lane, l)));
        48
    } else {
        16
    };
    // Each quant byte holds columns c (low nibble) and c + 32 of one pair of sub-blocks.
    (0..128).for_each(|at| each(qs + at, q45_at(fifth, lane, 64 * (at / 32) + at % 32).0));
}

/// Repacks rows `w` (whole groups of 16, `row_bytes` bytes each, whole super-blocks of `ty`)
/// into records, in `out` (as long as `w`).
pub fn interleave(ty: GgmlType, w: &[u8], row_bytes: usize, out: &mut [u8]) {
    let rec = record_bytes(ty).expect("a repacked K-quant");
    let size = ty.block_bytes();
    let blocks = row_bytes / size;
    assert!(w.len() % (GROUP * row_bytes) == 0 && out.len() == w.len(), "whole groups of {GROUP} rows");
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (group, lane) = (r / GROUP, r % GROUP);
        for (i, b) in row.chunks_exact(size).enumerate() {
            let o = &mut out[(group * blocks + i) * rec..][..rec];
            moved_bytes(ty, lane, |at, to| o[to] = b[at]);
            if ty == GgmlType::Q6K {
                let q = q6_quants(b);
                for c in 0..256 {
                    let (low, _, high, _) = q6_at(lane, c);
                    o[low] = 0;
                    o[high] = 0;
                }
                for (c, &q) in q.iter().enumerate() {
                    let (low, low_shift, high, high_shift) = q6_at(lane, c);
                    o[low] |= (q & 0x0f) << low_shift;
                    o[high] |= (q >> 4) << high_shift;
                }
            }
        }
    }
}

/// Row `r`'s blocks in the file's layout again, from the records (an embedding lookup).
pub fn row(ty: GgmlType, records: &[u8], row_bytes: usize, r: usize) -> Vec<u8> {
    let rec = record_bytes(ty).expect("a repacked K-quant");
    let size = ty.block_bytes();
    let blocks = row_bytes / size;
    let (group, lane) = (r / GROUP, r % GROUP);
    let mut out = vec![0u8; row_bytes];
    for (i, b) in out.chunks_exact_mut(size).enumerate() {
        let o = &records[(group * blocks + i) * rec..][..rec];
        moved_bytes(ty, lane, |at, from| b[at] = o[from]);
        if ty == GgmlType::Q6K {
            let q: [u8; 256] = std::array::from_fn(|c| q6_quant(o, lane, c));
            let (ql, rest) = b.split_at_mut(128);
            q6_pack(&q, ql, &mut rest[..64]);
        }
    }
    out
}

/// Lane `r`'s Q6_K quant of column `c` (0..=63, before the offset).
fn q6_quant(o: &[u8], r: usize, c: usize) -> u8 {
    let (low, low_shift, high, high_shift) = q6_at(r, c);
    ((o[low] >> low_shift) & 0x0f) | (((o[high] >> high_shift) & 3) << 4)
}

/// The kernel of repacked Q4_K, Q5_K and Q6_K weights (a block is a super-block).
pub type Kernel = RepackedKernel<Q8x256>;

/// The scalar form of the kernel: the tests' check of the layout. With `reordered`, the blocks
/// are added last to first (another rounding): the negative control of batch invariance.
pub fn scalar(ty: GgmlType, records: &[u8], a: &[&[Q8x256]], out: &mut [[f32; GROUP]; TOKENS], reordered: bool) {
    let rec = record_bytes(ty).expect("a repacked K-quant");
    for (t, a) in a.iter().enumerate() {
        for r in 0..GROUP {
            let mut blocks: Vec<(&[u8], &Q8x256)> = records.chunks_exact(rec).zip(a.iter()).collect();
            if reordered {
                blocks.reverse();
            }
            let mut sum = 0f32;
            for (o, a) in blocks {
                sum += if ty != GgmlType::Q6K {
                    let fifth = ty == GgmlType::Q5K;
                    let packed: [u8; 12] = std::array::from_fn(|k| o[K4_SCALES + 16 * k + r]);
                    let (scales, mins) = scales_mins_k4(&packed);
                    let (mut isum, mut msum) = (0i32, 0i32);
                    for j in 0..8 {
                        let part: i32 = (32 * j..32 * j + 32)
                            .map(|c| {
                                let (at, shift) = q45_at(fifth, r, c);
                                let high = if fifth { ((o[q5_high_at(r, c % 32)] >> j) & 1) << 4 } else { 0 };
                                (((o[at] >> shift) & 0x0f) | high) as i32 * a.qs[c] as i32
                            })
                            .sum();
                        isum += scales[j] as i32 * part;
                        msum += mins[j] as i32 * (a.bsums[2 * j] as i32 + a.bsums[2 * j + 1] as i32);
                    }
                    a.d * (f16_at(o, 2 * r) * isum as f32 - f16_at(o, K4_DMIN + 2 * r) * msum as f32)
                } else {
                    let mut isum = 0i32;
                    for s in 0..16 {
                        let part: i32 = (16 * s..16 * s + 16).map(|c| (q6_quant(o, r, c) as i32 - 32) * a.qs[c] as i32).sum();
                        isum += o[K6_SCALES + 16 * s + r] as i8 as i32 * part;
                    }
                    f16_at(o, 2 * r) * a.d * isum as f32
                };
            }
            out[t][r] = sum;
        }
    }
}

/// A SIMD kernel's call checked ([`super::interleave::checked_blocks`]). Gives the records'
/// count.
#[cfg(target_arch = "x86_64")]
fn checked_blocks(ty: GgmlType, records: &[u8], a: &[&[Q8x256]]) -> usize {
    super::interleave::checked_blocks(record_bytes(ty).expect("a repacked K-quant"), records, a)
}

/// The rows' 6-bit scales and mins of a Q4_K or Q5_K record, a byte per row, from its 12
/// transposed scale bytes `s` (one vector per byte, a byte per row): `scales_mins_k4` for 16
/// rows at once. SSE2, which every x86-64 processor has.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(unsafe_op_in_unsafe_fn)]
unsafe fn scales_mins_k4_lanes(s: &[std::arch::x86_64::__m128i; 12]) -> ([std::arch::x86_64::__m128i; 8], [std::arch::x86_64::__m128i; 8]) {
    use std::arch::x86_64::*;
    let (low6, low4, top2) = (_mm_set1_epi8(0x3f), _mm_set1_epi8(0x0f), _mm_set1_epi8(0x30));
    // Bits 6 and 7 of byte k as bits 4 and 5.
    let high = |k: usize| _mm_and_si128(_mm_srli_epi16::<2>(s[k]), top2);
    let scales = std::array::from_fn(|j| if j < 4 { _mm_and_si128(s[j], low6) } else { _mm_or_si128(_mm_and_si128(s[j + 4], low4), high(j - 4)) });
    let mins = std::array::from_fn(|j| {
        if j < 4 {
            _mm_and_si128(s[j + 4], low6)
        } else {
            _mm_or_si128(_mm_and_si128(_mm_srli_epi16::<4>(s[j + 4]), low4), high(j))
        }
    });
    (scales, mins)
}

/// Calls `q4_k::<T, FIFTH>(args)` for Q4_K and Q5_K, `q6_k::<T>(args)` for Q6_K, with the token
/// count `T` (1 to 4) as a constant.
#[cfg(target_arch = "x86_64")]
macro_rules! monomorphized {
    ($ty:expr, $tokens:expr, ($($arg:expr),*)) => {
        match ($tokens, $ty) {
            (1, GgmlType::Q4K) => q4_k::<1, false>($($arg),*),
            (2, GgmlType::Q4K) => q4_k::<2, false>($($arg),*),
            (3, GgmlType::Q4K) => q4_k::<3, false>($($arg),*),
            (_, GgmlType::Q4K) => q4_k::<4, false>($($arg),*),
            (1, GgmlType::Q5K) => q4_k::<1, true>($($arg),*),
            (2, GgmlType::Q5K) => q4_k::<2, true>($($arg),*),
            (3, GgmlType::Q5K) => q4_k::<3, true>($($arg),*),
            (_, GgmlType::Q5K) => q4_k::<4, true>($($arg),*),
            (1, _) => q6_k::<1>($($arg),*),
            (2, _) => q6_k::<2>($($arg),*),
            (3, _) => q6_k::<3>($($arg),*),
            (_, _) => q6_k::<4>($($arg),*),
        }
    };
}

/// The kernel with AVX-512 VNNI (`vpdpbusd` on 512-bit vectors, a lane per row of the group).
/// A sub-block's integer sum is one `vpdpbusd` chain, then one multiply by the 16 rows' scales.
#[cfg(target_arch = "x86_64")]
pub(super) mod vnni {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::interleave::prefetch_ahead;
    use super::*;

    pub fn kernel(ty: GgmlType, records: &[u8], a: &[&[Q8x256]], out: &mut [[f32; GROUP]; TOKENS]) {
        let blocks = checked_blocks(ty, records, a);
        // SAFETY: this kernel is only in the set of processors with AVX-512 VL, BW and VNNI;
        // every token has an activation block per record (checked).
        unsafe { monomorphized!(ty, a.len(), (records.as_ptr(), blocks, a, out)) }
    }

    /// Activations `at..at + 4` of a block in every 32-bit lane.
    #[inline(always)]
    unsafe fn four(a: &Q8x256, at: usize) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(a.qs.as_ptr().add(at) as *const i32))
    }

    /// 16 bytes, one per row, at `p`.
    #[inline(always)]
    unsafe fn lanes(p: *const u8) -> __m128i {
        _mm_loadu_si128(p as *const __m128i)
    }

    /// Q4_K, or Q5_K with `FIFTH`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q4_k<const T: usize, const FIFTH: bool>(records: *const u8, blocks: usize, a: &[&[Q8x256]], out: &mut [[f32; GROUP]; TOKENS]) {
        let rec = GROUP * if FIFTH { 176 } else { 144 };
        let low = _mm512_set1_epi8(0x0f);
        let (bit0, bit1) = (_mm512_set1_epi8(1), _mm512_set1_epi8(2));
        let mut sum = [_mm512_setzero_ps(); T];
        for i in 0..blocks {
            let o = records.add(i * rec);
            prefetch_ahead(o, rec);
            let ab: [&Q8x256; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            let (scales, mins) = scales_mins_k4_lanes(&std::array::from_fn(|k| lanes(o.add(K4_SCALES + 16 * k))));
            let scales = scales.map(|b| _mm512_cvtepu8_epi32(b));
            let mut isum = [_mm512_setzero_si512(); T];
            for p in 0..4 {
                let mut part = [[_mm512_setzero_si512(); T]; 2];
                for h in 0..8 {
                    let v = _mm512_loadu_si512(o.add(k45_quants(FIFTH) + 64 * (8 * p + h)) as *const __m512i);
                    let (mut lo, mut hi) = (_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16::<4>(v), low));
                    if FIFTH {
                        // Bits 2p and 2p + 1 of each byte to bit 4 of the sub-blocks' quants.
                        let bits = _mm512_loadu_si512(o.add(K5_HIGH + 64 * h) as *const __m512i);
                        let bits = _mm512_srl_epi16(bits, _mm_cvtsi32_si128(2 * p as i32));
                        lo = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(_mm512_and_si512(bits, bit0)));
                        hi = _mm512_or_si512(hi, _mm512_slli_epi16::<3>(_mm512_and_si512(bits, bit1)));
                    }
                    for t in 0..T {
                        part[0][t] = _mm512_dpbusd_epi32(part[0][t], lo, four(ab[t], 64 * p + 4 * h));
                        part[1][t] = _mm512_dpbusd_epi32(part[1][t], hi, four(ab[t], 64 * p + 32 + 4 * h));
                    }
                }
                for t in 0..T {
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(part[0][t], scales[2 * p]));
                    isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(part[1][t], scales[2 * p + 1]));
                }
            }
            // Each min twice as i16, against the activations' two sums of 16 of its sub-block.
            let mut msum = [_mm512_setzero_si512(); T];
            for (j, m) in mins.into_iter().enumerate() {
                let m = _mm512_cvtepu8_epi32(m);
                let twice = _mm512_or_si512(m, _mm512_slli_epi32::<16>(m));
                for t in 0..T {
                    let bsums = _mm512_set1_epi32(std::ptr::read_unaligned(ab[t].bsums.as_ptr().add(2 * j) as *const i32));
                    msum[t] = _mm512_dpwssd_epi32(msum[t], twice, bsums);
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(o as *const __m256i));
            let dmin = _mm512_cvtph_ps(_mm256_loadu_si256(o.add(K4_DMIN) as *const __m256i));
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            for t in 0..T {
                let inner = _mm512_sub_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(isum[t])), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(msum[t])));
                sum[t] = _mm512_add_ps(sum[t], _mm512_mul_ps(_mm512_set1_ps(ab[t].d), inner));
            }
        }
        for t in 0..T {
            _mm512_storeu_ps(out[t].as_mut_ptr(), sum[t]);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn q6_k<const T: usize>(records: *const u8, blocks: usize, a: &[&[Q8x256]], out: &mut [[f32; GROUP]; TOKENS]) {
        const REC: usize = GROUP * 210;
        let (low, top2) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
        let mut sum = [_mm512_setzero_ps(); T];
        for i in 0..blocks {
            let o = records.add(i * REC);
            prefetch_ahead(o, REC);
            let ab: [&Q8x256; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            let mut isum = [_mm512_setzero_si512(); T];
            // High-bit vectors k in 4b..4b + 4 serve columns 4g.. for g = k + 16n: sub-blocks
            // b + 4n, n = 0..4.
            for b in 0..4 {
                // The −32 offset times the sub-block's activations starts each sum.
                let mut part: [[__m512i; T]; 4] = std::array::from_fn(|n| std::array::from_fn(|t| _mm512_set1_epi32(-32 * ab[t].bsums[b + 4 * n] as i32)));
                for k in 4 * b..4 * b + 4 {
                    let n0 = _mm512_loadu_si512(o.add(k6_low(k)) as *const __m512i);
                    let n1 = _mm512_loadu_si512(o.add(k6_low(k + 16)) as *const __m512i);
                    let h = _mm512_loadu_si512(o.add(k6_high(k)) as *const __m512i);
                    let q = [
                        _mm512_or_si512(_mm512_and_si512(n0, low), _mm512_and_si512(_mm512_slli_epi16::<4>(h), top2)),
                        _mm512_or_si512(_mm512_and_si512(n1, low), _mm512_and_si512(_mm512_slli_epi16::<2>(h), top2)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(n0), low), _mm512_and_si512(h, top2)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(n1), low), _mm512_and_si512(_mm512_srli_epi16::<2>(h), top2)),
                    ];
                    for n in 0..4 {
                        for t in 0..T {
                            part[n][t] = _mm512_dpbusd_epi32(part[n][t], q[n], four(ab[t], 4 * (k + 16 * n)));
                        }
                    }
                }
                for n in 0..4 {
                    let scale = _mm512_cvtepi8_epi32(lanes(o.add(K6_SCALES + 16 * (b + 4 * n))));
                    for t in 0..T {
                        isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(part[n][t], scale));
                    }
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(o as *const __m256i));
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            for t in 0..T {
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(ab[t].d));
                sum[t] = _mm512_add_ps(sum[t], _mm512_mul_ps(scale, _mm512_cvtepi32_ps(isum[t])));
            }
        }
        for t in 0..T {
            _mm512_storeu_ps(out[t].as_mut_ptr(), sum[t]);
        }
    }
}

/// The kernel with AVX2 (x86-64 since Haswell): each group's 16 rows as two halves of 8 lanes.
/// Without `vpdpbusd`, `maddubs` multiplies byte pairs into 16-bit sums that a `madd` by the
/// sub-block's scale (twice, as i16) widens: exact, as no 16-bit sum can overflow (a Q4_K
/// sub-block's 8 pair sums reach 8 · 2 · 15 · 127 = 30480, Q5_K's are summed 4 at a time,
/// 4 · 2 · 31 · 127 = 31496; Q6_K's quants, up to 63, are summed
/// two pairs at a time, 2 · 2 · 63 · 127 = 32004). The integers per super-block and row are the
/// scalar reference's, and so are the float steps.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::super::interleave::prefetch_ahead;
    use super::*;

    pub fn kernel(ty: GgmlType, records: &[u8], a: &[&[Q8x256]], out: &mut [[f32; GROUP]; TOKENS]) {
        let blocks = checked_blocks(ty, records, a);
        for half in 0..2 {
            // SAFETY: this kernel is only in the sets of processors with AVX2, FMA and F16C;
            // every token has an activation block per record (checked).
            unsafe { monomorphized!(ty, a.len(), (records.as_ptr(), blocks, half, a, &mut *out)) }
        }
    }

    /// Activations `at..at + 4` of a block in every 32-bit lane.
    #[inline(always)]
    unsafe fn four(a: &Q8x256, at: usize) -> __m256i {
        _mm256_set1_epi32(std::ptr::read_unaligned(a.qs.as_ptr().add(at) as *const i32))
    }

    /// The activations' sums of 16 at `2j` and `2j + 1`, as two i16 in every lane.
    #[inline(always)]
    unsafe fn sums_pair(a: &Q8x256, j: usize) -> __m256i {
        _mm256_set1_epi32(std::ptr::read_unaligned(a.bsums.as_ptr().add(2 * j) as *const i32))
    }

    /// 8 bytes, one per row of the half, at `p`.
    #[inline(always)]
    unsafe fn lanes(p: *const u8) -> __m128i {
        _mm_loadl_epi64(p as *const __m128i)
    }

    /// Each lane's low i16 in both of its halves (`v` in 0..32768).
    #[inline(always)]
    unsafe fn twice(v: __m256i) -> __m256i {
        _mm256_or_si256(v, _mm256_slli_epi32::<16>(v))
    }

    /// Rows `8 · half..8 · half + 8` of the group: Q4_K, or Q5_K with `FIFTH`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k<const T: usize, const FIFTH: bool>(records: *const u8, blocks: usize, half: usize, a: &[&[Q8x256]], out: &mut [[f32; GROUP]; TOKENS]) {
        let rec = GROUP * if FIFTH { 176 } else { 144 };
        // Quants of 4 bits: 8 pair sums fit an i16 (30480); of 5 bits, 4 (4 · 2 · 31 · 127 = 31496).
        let flush = if FIFTH { 4 } else { 8 };
        let low = _mm256_set1_epi8(0x0f);
        let (bit0, bit1) = (_mm256_set1_epi8(1), _mm256_set1_epi8(2));
        let mut sum = [_mm256_setzero_ps(); T];
        for i in 0..blocks {
            let o = records.add(i * rec);
            if half == 0 {
                // The second half finds the record in cache.
                prefetch_ahead(o, rec);
            }
            let ab: [&Q8x256; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            let (scales, mins) = scales_mins_k4_lanes(&std::array::from_fn(|k| lanes(o.add(K4_SCALES + 16 * k + 8 * half))));
            let mut isum = [_mm256_setzero_si256(); T];
            for p in 0..4 {
                let (even, odd) = (twice(_mm256_cvtepu8_epi32(scales[2 * p])), twice(_mm256_cvtepu8_epi32(scales[2 * p + 1])));
                let mut pairs = [[_mm256_setzero_si256(); T]; 2];
                for h in 0..8 {
                    let v = _mm256_loadu_si256(o.add(k45_quants(FIFTH) + 64 * (8 * p + h) + 32 * half) as *const __m256i);
                    let (mut lo, mut hi) = (_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16::<4>(v), low));
                    if FIFTH {
                        // Bits 2p and 2p + 1 of each byte to bit 4 of the sub-blocks' quants.
                        let bits = _mm256_loadu_si256(o.add(K5_HIGH + 64 * h + 32 * half) as *const __m256i);
                        let bits = _mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * p as i32));
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(bits, bit0)));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16::<3>(_mm256_and_si256(bits, bit1)));
                    }
                    for t in 0..T {
                        pairs[0][t] = _mm256_add_epi16(pairs[0][t], _mm256_maddubs_epi16(lo, four(ab[t], 64 * p + 4 * h)));
                        pairs[1][t] = _mm256_add_epi16(pairs[1][t], _mm256_maddubs_epi16(hi, four(ab[t], 64 * p + 32 + 4 * h)));
                    }
                    if h % flush == flush - 1 {
                        for t in 0..T {
                            isum[t] = _mm256_add_epi32(isum[t], _mm256_add_epi32(_mm256_madd_epi16(pairs[0][t], even), _mm256_madd_epi16(pairs[1][t], odd)));
                        }
                        pairs = [[_mm256_setzero_si256(); T]; 2];
                    }
                }
            }
            let mut msum = [_mm256_setzero_si256(); T];
            for (j, m) in mins.into_iter().enumerate() {
                let m = twice(_mm256_cvtepu8_epi32(m));
                for t in 0..T {
                    msum[t] = _mm256_add_epi32(msum[t], _mm256_madd_epi16(m, sums_pair(ab[t], j)));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(o.add(16 * half) as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(o.add(K4_DMIN + 16 * half) as *const __m128i));
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            for t in 0..T {
                let inner = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(isum[t])), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum[t])));
                sum[t] = _mm256_add_ps(sum[t], _mm256_mul_ps(_mm256_set1_ps(ab[t].d), inner));
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * half), sum[t]);
        }
    }

    /// Rows `8 · half..8 · half + 8` of the group.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k<const T: usize>(records: *const u8, blocks: usize, half: usize, a: &[&[Q8x256]], out: &mut [[f32; GROUP]; TOKENS]) {
        const REC: usize = GROUP * 210;
        let (low, top2) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
        let mut sum = [_mm256_setzero_ps(); T];
        for i in 0..blocks {
            let o = records.add(i * REC);
            if half == 0 {
                prefetch_ahead(o, REC);
            }
            let ab: [&Q8x256; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            let scale = |s: usize| _mm256_cvtepi8_epi32(lanes(o.add(K6_SCALES + 16 * s + 8 * half)));
            let mut isum = [_mm256_setzero_si256(); T];
            // High-bit vectors k, k + 1 serve 8 columns of sub-blocks k / 4 + 4n, n = 0..4.
            for k in (0..16).step_by(2) {
                let mut pairs = [[_mm256_setzero_si256(); T]; 4];
                for k in k..k + 2 {
                    let n0 = _mm256_loadu_si256(o.add(k6_low(k) + 32 * half) as *const __m256i);
                    let n1 = _mm256_loadu_si256(o.add(k6_low(k + 16) + 32 * half) as *const __m256i);
                    let h = _mm256_loadu_si256(o.add(k6_high(k) + 32 * half) as *const __m256i);
                    let q = [
                        _mm256_or_si256(_mm256_and_si256(n0, low), _mm256_and_si256(_mm256_slli_epi16::<4>(h), top2)),
                        _mm256_or_si256(_mm256_and_si256(n1, low), _mm256_and_si256(_mm256_slli_epi16::<2>(h), top2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(n0), low), _mm256_and_si256(h, top2)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(n1), low), _mm256_and_si256(_mm256_srli_epi16::<2>(h), top2)),
                    ];
                    for n in 0..4 {
                        for t in 0..T {
                            pairs[n][t] = _mm256_add_epi16(pairs[n][t], _mm256_maddubs_epi16(q[n], four(ab[t], 4 * (k + 16 * n))));
                        }
                    }
                }
                for n in 0..4 {
                    let sc = twice(_mm256_and_si256(scale(k / 4 + 4 * n), _mm256_set1_epi32(0xffff)));
                    for t in 0..T {
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(pairs[n][t], sc));
                    }
                }
            }
            // Less 32 · scale · (the sub-block's activations' sum): the quants' −32.
            for p in 0..8 {
                let sc = _mm256_blend_epi16::<0xaa>(scale(2 * p), _mm256_slli_epi32::<16>(scale(2 * p + 1)));
                for t in 0..T {
                    isum[t] = _mm256_sub_epi32(isum[t], _mm256_slli_epi32::<5>(_mm256_madd_epi16(sc, sums_pair(ab[t], p))));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(o.add(16 * half) as *const __m128i));
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            for t in 0..T {
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(ab[t].d));
                sum[t] = _mm256_add_ps(sum[t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum[t])));
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * half), sum[t]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::conformance::{activations, blocks, repacked_equal_the_reference, Blocks, TYPES};
    use crate::cpu::dot::{quantize_q8x256, Kernels};
    use rand::SeedableRng;

    /// Random `rows × cols` weights of `ty`: their bytes as the file stores them, and repacked.
    fn weights(ty: GgmlType, scale_at: &[usize], rows: usize, cols: usize, kind: Blocks, rng: &mut rand_chacha::ChaCha8Rng) -> (Vec<u8>, Vec<u8>) {
        let w = blocks(ty, scale_at, rows * cols / 256, kind, rng);
        let mut records = vec![0u8; w.len()];
        interleave(ty, &w, cols / 256 * ty.block_bytes(), &mut records);
        (w, records)
    }

    fn repacked_types() -> impl Iterator<Item = &'static (GgmlType, &'static [usize])> {
        TYPES.iter().filter(|(ty, _)| record_bytes(*ty).is_some())
    }

    /// Rows come back out of the records as the file stored them.
    #[test]
    fn rows_come_back_from_the_records() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(13);
        for &(ty, scale_at) in repacked_types() {
            let (rows, cols) = (2 * GROUP, 3 * 256);
            let row_bytes = cols / 256 * ty.block_bytes();
            let (w, records) = weights(ty, scale_at, rows, cols, Blocks::Random, &mut rng);
            assert_eq!(records.len(), 2 * 3 * record_bytes(ty).unwrap());
            for r in 0..rows {
                assert_eq!(row(ty, &records, row_bytes, r), &w[r * row_bytes..(r + 1) * row_bytes], "{ty} row {r}");
            }
        }
    }

    /// The scalar kernel on the records and this processor's kernels equal the scalar row
    /// reference bit for bit, for 1 to 4 tokens, on random, all-zero and saturated blocks (and
    /// saturated activations); the reordered control does not.
    #[test]
    fn kernels_equal_the_row_reference_exactly() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(14);
        for &(ty, scale_at) in repacked_types() {
            let mut reordered_differs = false;
            for kind in [Blocks::Random, Blocks::Zero, Blocks::Max] {
                let (rows, cols) = (GROUP, 5 * 256);
                let row_bytes = cols / 256 * ty.block_bytes();
                let (w, records) = weights(ty, scale_at, rows, cols, kind, &mut rng);
                // The last token's activations all at their largest: with saturated blocks, the
                // 16-bit sums of the AVX2 kernel at their bounds.
                let q: Vec<Vec<Q8x256>> = (0..TOKENS)
                    .map(|t| {
                        let x = if t == TOKENS - 1 { vec![1.0; cols] } else { activations(cols, &mut rng) };
                        let mut q = vec![Q8x256::default(); cols / 256];
                        quantize_q8x256(&x, &mut q);
                        q
                    })
                    .collect();
                let mut kernels: Vec<(&str, Kernel)> = vec![("scalar", |ty, rec, a, out| scalar(ty, rec, a, out, false))];
                kernels.extend(Kernels::available().iter().filter_map(|k| k.interleaved256.map(|kernel| (k.name, kernel))));
                let reference = Kernels::SCALAR.q8x256_kernels(ty).0;
                let reordered = |ty, rec: &[u8], a: &[&[Q8x256]], out: &mut [[f32; GROUP]; TOKENS]| scalar(ty, rec, a, out, true);
                reordered_differs |= repacked_equal_the_reference(ty, &w, row_bytes, &records, &q, reference, &kernels, reordered);
            }
            assert!(reordered_differs, "{ty}: the reordered control changes nothing");
        }
    }
}
