//! Q4_0, Q4_1 and Q8_0 weights repacked at load into groups of 16 rows whose vector lanes are the
//! rows (llama.cpp's CPU "repack" does the same for its x86 kernels), so that one product kernel
//! serves every token count — a lone decode step, a batch of sequences' steps, a prefill — with
//! the same arithmetic for each token. Kernels: AVX-512 VNNI (below) and AVX2 (`avx2`).
//!
//! The row kernels of [`super::dot`] spend per 32-weight block and token a float scale, a
//! conversion and a fused multiply-add on one row, and sum across lanes at the end; unpacking is
//! repeated for every pair of tokens. Here one 512-bit `vpdpbusd` multiplies 4 columns of all 16
//! rows with 4 activations, one float step per block scales 16 rows at once, and each weight
//! load serves up to 4 tokens. A decode step streams weights at the memory's rate, and a batch
//! of sequences reads the weights once for all of them; what a batch adds per sequence (the
//! products and float steps of its activations) is half of what 256-bit vectors over 8 rows
//! cost (measured here: `vpdpbusd` on 512 bits runs at 86% of the 256-bit rate per
//! instruction, so 1.7× the products per cycle).
//!
//! Every lane takes the scalar reference's steps (exact integer sums per block, then
//! `d · d_act · (Σ − offset · Σ_act)` or `d · d_act · Σ` added block after block, Q4_1's
//! `m · s_act` summed apart and added last), so
//! a product equals [`super::dot`]'s scalar reference bit for bit whatever the token count, and a
//! sequence's logits in a batch equal its lone step's.
//!
//! A record holds one block (32 columns) of a group's 16 rows, the same bytes as the 16 blocks it
//! replaces: the 16 f16 scales, Q4_1's 16 f16 minimums, then the quants — for the 4-bit types 4
//! × 64 bytes, where bytes `4r..4r + 4` of the `h`-th 64 are row `r`'s packed bytes `4h..4h + 4`
//! (low nibbles: columns `4h..4h + 4`, high nibbles: `16 + 4h..`); for Q8_0 8 × 64 bytes, row
//! `r`'s columns `4g..4g + 4` at `64g + 4r`, stored `+ 128` (unsigned, as `vpdpbusd` takes its
//! first operand). A group's records follow each other, groups follow each other. Only matrices
//! of whole groups are repacked (every model's are; a remainder would make the engine hold more
//! bytes than the file, which admission counts).

use super::dot::{f16_at, Q8x32};
use super::tile::{combine32, Combine32, TOKENS};

/// Rows per group: the lanes of one 512-bit vector of f32 sums.
pub const GROUP: usize = 16;
use crate::quants::GgmlType;

/// Bytes of one record of `ty` (8 rows × one block), `None` for types not repacked.
pub fn record_bytes(ty: GgmlType) -> Option<usize> {
    combine32(ty).map(|_| GROUP * ty.block_bytes())
}

/// Where a record's quants start: after the scales (and Q4_1's minimums).
fn quants_at(ty: GgmlType) -> usize {
    if ty == GgmlType::Q4_1 {
        4 * GROUP
    } else {
        2 * GROUP
    }
}

/// Calls `each(at in the block, at in the record, flip)` for every byte of lane `lane`'s `ty`
/// block: the record holds it `^ flip` (Q8_0's quants are stored + 128, which is flipping the
/// top bit, both ways). Repacking and reading a row back both go by it.
fn moved_bytes(ty: GgmlType, lane: usize, mut each: impl FnMut(usize, usize, u8)) {
    let q = quants_at(ty);
    (0..2).for_each(|i| each(i, 2 * lane + i, 0));
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let packed = if ty == GgmlType::Q4_1 {
                (0..2).for_each(|i| each(2 + i, 2 * GROUP + 2 * lane + i, 0));
                4
            } else {
                2
            };
            for h in 0..4 {
                (0..4).for_each(|j| each(packed + 4 * h + j, q + 4 * GROUP * h + 4 * lane + j, 0));
            }
        }
        _ => {
            for g in 0..8 {
                (0..4).for_each(|j| each(2 + 4 * g + j, q + 4 * GROUP * g + 4 * lane + j, 0x80));
            }
        }
    }
}

/// Repacks rows `w` (whole groups of 16, `row_bytes` bytes each, whole blocks of `ty`) into
/// records, in `out` (as long as `w`).
pub fn interleave(ty: GgmlType, w: &[u8], row_bytes: usize, out: &mut [u8]) {
    let rec = record_bytes(ty).expect("a 32-value type");
    let size = ty.block_bytes();
    let blocks = row_bytes / size;
    assert!(w.len() % (GROUP * row_bytes) == 0 && out.len() == w.len(), "whole groups of {GROUP} rows");
    for (r, row) in w.chunks_exact(row_bytes).enumerate() {
        let (group, lane) = (r / GROUP, r % GROUP);
        for (i, b) in row.chunks_exact(size).enumerate() {
            let o = &mut out[(group * blocks + i) * rec..][..rec];
            moved_bytes(ty, lane, |at, to, flip| o[to] = b[at] ^ flip);
        }
    }
}

/// Row `r`'s blocks in the file's layout again, from the records (an embedding lookup).
pub fn row(ty: GgmlType, records: &[u8], row_bytes: usize, r: usize) -> Vec<u8> {
    let rec = record_bytes(ty).expect("a 32-value type");
    let size = ty.block_bytes();
    let blocks = row_bytes / size;
    let (group, lane) = (r / GROUP, r % GROUP);
    let mut out = vec![0u8; row_bytes];
    for (i, b) in out.chunks_exact_mut(size).enumerate() {
        let o = &records[(group * blocks + i) * rec..][..rec];
        moved_bytes(ty, lane, |at, from, flip| b[at] = o[from] ^ flip);
    }
    out
}

/// A kernel of repacked weights, here and in [`super::interleave_k`]: `out[t][r]` = row `r` of a
/// group (its records, one per block) times token `t` (`a[t]`, one activation block `A` per
/// block), for 1 to [`TOKENS`] tokens.
pub type RepackedKernel<A> = fn(ty: GgmlType, records: &[u8], a: &[&[A]], out: &mut [[f32; GROUP]; TOKENS]);

/// The kernel of repacked Q4_0, Q4_1 and Q8_0 weights.
pub type InterleavedKernel = RepackedKernel<Q8x32>;

/// The quant of lane `r`, column `c` of a record, unsigned (see the module's layout).
fn quant(ty: GgmlType, o: &[u8], r: usize, c: usize) -> i32 {
    let q = quants_at(ty);
    match ty {
        GgmlType::Q4_0 | GgmlType::Q4_1 => {
            let byte = o[q + 4 * GROUP * (c % 16 / 4) + 4 * r + c % 4];
            (if c < 16 { byte & 0x0f } else { byte >> 4 }) as i32
        }
        _ => o[q + 4 * GROUP * (c / 4) + 4 * r + c % 4] as i32,
    }
}

/// The scalar form of the kernel: the tests' check of the layout, and the kernel where no SIMD
/// form exists. With `reordered`, the blocks are added last to first (another rounding): the
/// negative control of batch invariance, for products of a batch's steps.
pub fn scalar(ty: GgmlType, records: &[u8], a: &[&[Q8x32]], out: &mut [[f32; GROUP]; TOKENS], reordered: bool) {
    let rec = record_bytes(ty).expect("a 32-value type");
    let combine = combine32(ty).expect("a 32-value type");
    for (t, a) in a.iter().enumerate() {
        for r in 0..GROUP {
            let (mut sum, mut mins) = (0f32, 0f32);
            let mut blocks: Vec<(&[u8], &Q8x32)> = records.chunks_exact(rec).zip(a.iter()).collect();
            if reordered {
                blocks.reverse();
            }
            for (o, a) in blocks {
                let isum: i32 = (0..32).map(|c| quant(ty, o, r, c) * a.qs[c] as i32).sum();
                let d = f16_at(o, 2 * r);
                sum += match combine {
                    Combine32::Offset(offset) => d * a.d * (isum - offset * a.sum) as f32,
                    Combine32::Min => {
                        mins += f16_at(o, 2 * GROUP + 2 * r) * a.s;
                        d * a.d * isum as f32
                    }
                };
            }
            out[t][r] = sum + mins;
        }
    }
}

/// A repacked kernel's call checked, here and in [`super::interleave_k`]: whole records of
/// `rec` bytes, 1 to [`TOKENS`] tokens, each with an activation block per record. Gives the
/// records' count.
#[cfg(target_arch = "x86_64")]
pub(super) fn checked_blocks<A>(rec: usize, records: &[u8], a: &[&[A]]) -> usize {
    let blocks = records.len() / rec;
    assert_eq!(records.len(), blocks * rec);
    assert!((1..=TOKENS).contains(&a.len()), "1 to {TOKENS} tokens per call, not {}", a.len());
    for a in a {
        assert!(a.len() >= blocks);
    }
    blocks
}

/// A SIMD kernel's call checked ([`checked_blocks`]). Gives the records' count and the type's `(record bytes, where its quants start, its quants' offset)`.
#[cfg(target_arch = "x86_64")]
fn checked_layout(ty: GgmlType, records: &[u8], a: &[&[Q8x32]]) -> (usize, (usize, usize, i32)) {
    let rec = record_bytes(ty).expect("a 32-value type");
    let blocks = checked_blocks(rec, records, a);
    let offset = match combine32(ty) {
        Some(Combine32::Offset(offset)) => offset,
        _ => 0,
    };
    (blocks, (rec, quants_at(ty), offset))
}

/// Calls `$kernel::<T, KIND>(args)` with the token count `T` (1 to 4) and the type's `KIND` (0
/// Q4_0, 1 Q4_1, 2 Q8_0) as constants.
#[cfg(target_arch = "x86_64")]
macro_rules! monomorphized {
    ($kernel:ident, $ty:expr, $tokens:expr, ($($arg:expr),*)) => {
        match ($tokens, $ty) {
            (1, GgmlType::Q4_0) => $kernel::<1, 0>($($arg),*),
            (1, GgmlType::Q4_1) => $kernel::<1, 1>($($arg),*),
            (1, _) => $kernel::<1, 2>($($arg),*),
            (2, GgmlType::Q4_0) => $kernel::<2, 0>($($arg),*),
            (2, GgmlType::Q4_1) => $kernel::<2, 1>($($arg),*),
            (2, _) => $kernel::<2, 2>($($arg),*),
            (3, GgmlType::Q4_0) => $kernel::<3, 0>($($arg),*),
            (3, GgmlType::Q4_1) => $kernel::<3, 1>($($arg),*),
            (3, _) => $kernel::<3, 2>($($arg),*),
            (_, GgmlType::Q4_0) => $kernel::<4, 0>($($arg),*),
            (_, GgmlType::Q4_1) => $kernel::<4, 1>($($arg),*),
            (_, _) => $kernel::<4, 2>($($arg),*),
        }
    };
}

/// Asks for the record `AHEAD` bytes past `record` (`rec` bytes long), every cache line of it.
/// The hardware prefetcher stops at each 4 KiB page and a product's rows are a few short runs
/// of records per thread. (Measured here, SmolLM2 Q4_1, 2 threads: one sequence decodes ~20%
/// faster with it, four sequences ~2× faster.) `wrapping_add`: past the matrix's end a
/// prefetch does nothing.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_ahead(record: *const u8, rec: usize) {
    const AHEAD: usize = 8192;
    for line in (0..rec).step_by(64) {
        // SAFETY: a prefetch reads nothing and faults on no address.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(record.wrapping_add(AHEAD + line) as *const i8) };
    }
}

/// The kernel with AVX-512 VNNI (`vpdpbusd` on 512-bit vectors, a lane per row of the group).
#[cfg(target_arch = "x86_64")]
pub(super) mod vnni {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::*;

    pub fn kernel(ty: GgmlType, records: &[u8], a: &[&[Q8x32]], out: &mut [[f32; GROUP]; TOKENS]) {
        let (blocks, layout) = checked_layout(ty, records, a);
        // SAFETY: this kernel is only in the set of processors with AVX-512 VL and VNNI; every
        // token has an activation block per record (checked).
        unsafe { monomorphized!(tokens, ty, a.len(), (records.as_ptr(), blocks, layout, a, out)) }
    }

    /// Activations `at..at + 4` of a block in every 32-bit lane.
    #[inline(always)]
    unsafe fn four(a: &Q8x32, at: usize) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(a.qs.as_ptr().add(at) as *const i32))
    }

    /// `KIND`: 0 Q4_0, 1 Q4_1, 2 Q8_0; `(rec, q, offset)`: the type's record bytes, where its
    /// quants start, its quants' offset.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn tokens<const T: usize, const KIND: u8>(
        records: *const u8,
        blocks: usize,
        (rec, q, offset): (usize, usize, i32),
        a: &[&[Q8x32]],
        out: &mut [[f32; GROUP]; TOKENS],
    ) {
        let low = _mm512_set1_epi8(0x0f);
        let mut sum = [_mm512_setzero_ps(); T];
        // Q4_1's minimums' terms, summed apart (see `dot::scalar::q4_1`).
        let mut mins = [_mm512_setzero_ps(); T];
        for i in 0..blocks {
            let o = records.add(i * rec);
            prefetch_ahead(o, rec);
            let ab: [&Q8x32; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            // The quants' offset times the activations' sum starts the integer sum (Q4_1 has
            // none): the same integer as subtracting it after, one vector step less per token.
            let mut isum: [__m512i; T] = std::array::from_fn(|t| _mm512_set1_epi32(-offset * ab[t].sum));
            if KIND == 2 {
                for g in 0..8 {
                    let w = _mm512_loadu_si512(o.add(q + 4 * GROUP * g) as *const __m512i);
                    for t in 0..T {
                        isum[t] = _mm512_dpbusd_epi32(isum[t], w, four(ab[t], 4 * g));
                    }
                }
            } else {
                for h in 0..4 {
                    let v = _mm512_loadu_si512(o.add(q + 4 * GROUP * h) as *const __m512i);
                    let (lo, hi) = (_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16::<4>(v), low));
                    for t in 0..T {
                        isum[t] = _mm512_dpbusd_epi32(isum[t], lo, four(ab[t], 4 * h));
                        isum[t] = _mm512_dpbusd_epi32(isum[t], hi, four(ab[t], 16 + 4 * h));
                    }
                }
            }
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(o as *const __m256i));
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            for t in 0..T {
                let scale = _mm512_mul_ps(d, _mm512_set1_ps(ab[t].d));
                let part = if KIND == 1 {
                    let m = _mm512_cvtph_ps(_mm256_loadu_si256(o.add(2 * GROUP) as *const __m256i));
                    mins[t] = _mm512_add_ps(mins[t], _mm512_mul_ps(m, _mm512_set1_ps(ab[t].s)));
                    _mm512_mul_ps(scale, _mm512_cvtepi32_ps(isum[t]))
                } else {
                    _mm512_mul_ps(scale, _mm512_cvtepi32_ps(isum[t]))
                };
                sum[t] = _mm512_add_ps(sum[t], part);
            }
        }
        for t in 0..T {
            _mm512_storeu_ps(out[t].as_mut_ptr(), _mm512_add_ps(sum[t], mins[t]));
        }
    }
}

/// The kernel with AVX2 (x86-64 since Haswell): each group's 16 rows as two halves of 8 lanes.
/// Without `vpdpbusd`, `maddubs` multiplies byte pairs into 16-bit sums and `madd` adds those
/// into 32-bit ones: exact, as no 16-bit sum can overflow (a 4-bit quant's 8 pair sums reach
/// 8 · 2 · 15 · 127 = 30480; a Q8_0 weight goes in as its magnitude with its sign moved to the
/// activation, 2 · 128 · 127 = 32512 per pair, widened at once). The integer per block and row
/// is the scalar reference's, and so are the float steps.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::*;

    pub fn kernel(ty: GgmlType, records: &[u8], a: &[&[Q8x32]], out: &mut [[f32; GROUP]; TOKENS]) {
        let (blocks, layout) = checked_layout(ty, records, a);
        for half in 0..2 {
            // SAFETY: this kernel is only in the sets of processors with AVX2, FMA and F16C;
            // every token has an activation block per record (checked).
            unsafe { monomorphized!(tokens, ty, a.len(), (records.as_ptr(), blocks, layout, half, a, &mut *out)) }
        }
    }

    /// Activations `at..at + 4` of a block in every 32-bit lane.
    #[inline(always)]
    unsafe fn four(a: &Q8x32, at: usize) -> __m256i {
        _mm256_set1_epi32(std::ptr::read_unaligned(a.qs.as_ptr().add(at) as *const i32))
    }

    /// Rows `8 · half..8 · half + 8` of the group. `KIND`: 0 Q4_0, 1 Q4_1, 2 Q8_0; `(rec, q,
    /// offset)`: the type's record bytes, where its quants start, its quants' offset.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tokens<const T: usize, const KIND: u8>(
        records: *const u8,
        blocks: usize,
        (rec, q, offset): (usize, usize, i32),
        half: usize,
        a: &[&[Q8x32]],
        out: &mut [[f32; GROUP]; TOKENS],
    ) {
        let low = _mm256_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        let mut sum = [_mm256_setzero_ps(); T];
        // Q4_1's minimums' terms, summed apart (see `dot::scalar::q4_1`).
        let mut mins = [_mm256_setzero_ps(); T];
        for i in 0..blocks {
            let o = records.add(i * rec);
            if half == 0 {
                // The second half finds the record in cache.
                prefetch_ahead(o, rec);
            }
            let ab: [&Q8x32; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            let mut isum = [_mm256_setzero_si256(); T];
            if KIND == 2 {
                for g in 0..8 {
                    // Stored + 128 for `vpdpbusd`; flipped back to signed here.
                    let w = _mm256_xor_si256(_mm256_loadu_si256(o.add(q + 4 * GROUP * g + 32 * half) as *const __m256i), flip);
                    let magnitude = _mm256_sign_epi8(w, w);
                    for t in 0..T {
                        let pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(four(ab[t], 4 * g), w));
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(pairs, ones));
                    }
                }
            } else {
                let mut nibbles = [_mm256_setzero_si256(); 8];
                for h in 0..4 {
                    let v = _mm256_loadu_si256(o.add(q + 4 * GROUP * h + 32 * half) as *const __m256i);
                    nibbles[2 * h] = _mm256_and_si256(v, low);
                    nibbles[2 * h + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                }
                for t in 0..T {
                    let mut pairs = _mm256_setzero_si256();
                    for h in 0..4 {
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(nibbles[2 * h], four(ab[t], 4 * h)));
                        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(nibbles[2 * h + 1], four(ab[t], 16 + 4 * h)));
                    }
                    // The quants' offset times the activations' sum (Q4_1 has none).
                    isum[t] = _mm256_sub_epi32(_mm256_madd_epi16(pairs, ones), _mm256_set1_epi32(offset * ab[t].sum));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(o.add(16 * half) as *const __m128i));
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            for t in 0..T {
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(ab[t].d));
                if KIND == 1 {
                    let m = _mm256_cvtph_ps(_mm_loadu_si128(o.add(2 * GROUP + 16 * half) as *const __m128i));
                    mins[t] = _mm256_add_ps(mins[t], _mm256_mul_ps(m, _mm256_set1_ps(ab[t].s)));
                }
                sum[t] = _mm256_add_ps(sum[t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum[t])));
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(out[t].as_mut_ptr().add(8 * half), _mm256_add_ps(sum[t], mins[t]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::conformance::{activations, blocks, repacked_equal_the_reference, Blocks, TYPES};
    use crate::cpu::dot::{quantize_q8x32, Kernels};
    use rand::SeedableRng;

    /// Random `rows × cols` weights of `ty`: their bytes as the file stores them, and repacked.
    fn weights(ty: GgmlType, scale_at: &[usize], rows: usize, cols: usize, rng: &mut rand_chacha::ChaCha8Rng) -> (Vec<u8>, Vec<u8>) {
        let w = blocks(ty, scale_at, rows * cols / 32, Blocks::Random, rng);
        let mut records = vec![0u8; w.len()];
        interleave(ty, &w, cols / 32 * ty.block_bytes(), &mut records);
        (w, records)
    }

    /// Rows come back out of the records as the file stored them.
    #[test]
    fn rows_come_back_from_the_records() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        for &(ty, scale_at) in TYPES.iter().filter(|(ty, _)| record_bytes(*ty).is_some()) {
            let (rows, cols) = (2 * GROUP, 96);
            let row_bytes = cols / 32 * ty.block_bytes();
            let (w, records) = weights(ty, scale_at, rows, cols, &mut rng);
            assert_eq!(records.len(), 2 * 3 * record_bytes(ty).unwrap());
            for r in 0..rows {
                assert_eq!(row(ty, &records, row_bytes, r), &w[r * row_bytes..(r + 1) * row_bytes], "{ty} row {r}");
            }
        }
    }

    /// The scalar kernel on the records and this processor's kernel equal the scalar row
    /// reference bit for bit, for 1 to 4 tokens; the reordered control does not.
    #[test]
    fn kernels_equal_the_row_reference_exactly() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        for &(ty, scale_at) in TYPES.iter().filter(|(ty, _)| record_bytes(*ty).is_some()) {
            let (rows, cols) = (GROUP, 320);
            let row_bytes = cols / 32 * ty.block_bytes();
            let (w, records) = weights(ty, scale_at, rows, cols, &mut rng);
            let q: Vec<Vec<Q8x32>> = (0..TOKENS)
                .map(|_| {
                    let mut q = vec![Q8x32::default(); cols / 32];
                    quantize_q8x32(&activations(cols, &mut rng), &mut q);
                    q
                })
                .collect();
            let mut kernels: Vec<(&str, InterleavedKernel)> = vec![("scalar", |ty, rec, a, out| scalar(ty, rec, a, out, false))];
            // Every set this processor runs (an AVX-512 one runs the AVX2 kernel too).
            kernels.extend(Kernels::available().iter().filter_map(|k| k.interleaved32.map(|kernel| (k.name, kernel))));
            let reference = Kernels::SCALAR.q8x32_kernels(ty).0;
            let reordered = |ty, rec: &[u8], a: &[&[Q8x32]], out: &mut [[f32; GROUP]; TOKENS]| scalar(ty, rec, a, out, true);
            let reordered_differs = repacked_equal_the_reference(ty, &w, row_bytes, &records, &q, reference, &kernels, reordered);
            assert!(reordered_differs, "{ty}: the reordered control changes nothing");
        }
    }
}

