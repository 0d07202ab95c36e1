//! Prefill products of the packed types: eight weight rows unpacked once into a layout whose
//! vector lanes are the rows, then multiplied against every token of the prefill. The K-quants
//! (Q4_K, Q5_K, Q6_K) unpack into [`KBlock8`]; the 32-value types (Q4_0, Q4_1, Q8_0) into
//! [`QBlock8`], whose per-block float scale otherwise costs a row kernel as much as its integer
//! work.
//!
//! The row kernels of [`super::dot`] unpack a super-block (nibbles, fifth or sixth bits, the
//! packed 6-bit scales) for every pair of tokens and sum each row across vector lanes at the end;
//! at 128 tokens that unpacking is repeated 64 times and dominates a prefill. Here a task unpacks
//! its rows once ([`unpack`], portable, 4 values per 32-bit operation) into [`KBlock8`]s — the
//! quants of 8 rows × 4 columns per 32 bytes, each sub-block's scale ready for a multiply — and
//! the kernel then needs per 4 columns and token one broadcast of 4 activations and one
//! unsigned×signed byte multiply for all 8 rows, with 4 tokens sharing each weight load.
//!
//! Every lane takes exactly the scalar reference's steps: exact integer sums per super-block,
//! then the reference's float combination (`d_act · (d · Σ − dmin · Σmin)` for Q4_K/Q5_K,
//! `d · d_act · Σ` for Q6_K), added block after block. So a prefill's products equal the scalar
//! reference's bit for bit, whichever token count or row position a value has.

use super::dot::{f16_at, scales_mins_k4, Q8x256, Q8x32};
use crate::quants::GgmlType;

/// Rows per [`KBlock8`]: the lanes of one 256-bit vector of i32.
pub const ROWS: usize = 8;
/// Tokens one kernel call multiplies (each weight load is used for all of them).
pub const TOKENS: usize = 4;

/// One super-block (256 columns) of 8 rows, unpacked.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct KBlock8 {
    /// `q[g][4r + i]`: the quant (0..=63) of row `r`, column `4g + i`.
    pub q: [[u8; 32]; 64],
    /// `scales[j][r]`: row `r`'s integer scale of columns `16j..16j + 16`, as two equal i16
    /// halves (one `madd` applies it to pairs of products).
    pub scales: [[i32; ROWS]; 16],
    /// `mins[p][r]`: row `r`'s integer mins of columns `32p..32p + 16` (low i16) and
    /// `32p + 16..32p + 32` (high i16), multiplied with the activations' sums of 16.
    pub mins: [[i32; ROWS]; 8],
    pub d: [f32; ROWS],
    pub dmin: [f32; ROWS],
}

impl Default for KBlock8 {
    fn default() -> Self {
        Self { q: [[0; 32]; 64], scales: [[0; ROWS]; 16], mins: [[0; ROWS]; 8], d: [0.0; ROWS], dmin: [0.0; ROWS] }
    }
}

/// How a type's mins combine with its sums (the scalar reference's order, so results agree bit
/// for bit).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Combine {
    /// Q4_K, Q5_K: `d_act · (d · Σ − dmin · Σmin)`.
    ScaleAndMin,
    /// Q6_K: the −32 offset is subtracted in integers, then `d · d_act · Σ`.
    Offset,
}

/// Whether [`unpack`] takes `ty`, and how its sums combine.
pub fn combine(ty: GgmlType) -> Option<Combine> {
    match ty {
        GgmlType::Q4K | GgmlType::Q5K => Some(Combine::ScaleAndMin),
        GgmlType::Q6K => Some(Combine::Offset),
        _ => None,
    }
}

#[inline(always)]
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

/// Two copies of an i16 in one i32 lane.
#[inline(always)]
fn twice(v: i32) -> i32 {
    let h = v as i16 as u16 as u32;
    (h | (h << 16)) as i32
}

/// Two i16 in one i32 lane: `low`, then `high`.
#[inline(always)]
fn pair(low: i32, high: i32) -> i32 {
    ((low as i16 as u16 as u32) | ((high as i16 as u16 as u32) << 16)) as i32
}

/// Unpacks rows `w` (`rows` ≤ 8 of them, `row_bytes` apart, each `out.len()` super-blocks of
/// `ty`) into `out`; lanes past `rows` are zero.
pub fn unpack(ty: GgmlType, w: &[u8], row_bytes: usize, rows: usize, out: &mut [KBlock8]) {
    assert!((1..=ROWS).contains(&rows));
    let size = ty.block_bytes();
    assert!(w.len() >= (rows - 1) * row_bytes + out.len() * size);
    // The negative control of the tile check: Q6_K's −32 offset left out.
    let no_offset = crate::test_defect("tile-q6k-offset");
    for (i, blk) in out.iter_mut().enumerate() {
        if rows < ROWS {
            *blk = KBlock8::default();
        }
        for r in 0..rows {
            let b = &w[r * row_bytes + i * size..r * row_bytes + (i + 1) * size];
            let mut put = |column: usize, quads: u32| blk.q[column / 4][4 * r..4 * r + 4].copy_from_slice(&quads.to_le_bytes());
            match ty {
                GgmlType::Q4K | GgmlType::Q5K => {
                    let (qh, qs) = if ty == GgmlType::Q5K { (Some(&b[16..48]), &b[48..176]) } else { (None, &b[16..144]) };
                    for chunk in 0..4 {
                        for l in (0..32).step_by(4) {
                            let x = u32_at(qs, chunk * 32 + l);
                            let (mut low, mut high) = (x & 0x0f0f_0f0f, (x >> 4) & 0x0f0f_0f0f);
                            if let Some(qh) = qh {
                                let h = u32_at(qh, l);
                                low |= ((h >> (2 * chunk)) & 0x0101_0101) << 4;
                                high |= ((h >> (2 * chunk + 1)) & 0x0101_0101) << 4;
                            }
                            put(chunk * 64 + l, low);
                            put(chunk * 64 + 32 + l, high);
                        }
                    }
                    let (scales, mins) = scales_mins_k4(&b[4..16]);
                    for j in 0..16 {
                        blk.scales[j][r] = twice(scales[j / 2] as i32);
                    }
                    for p in 0..8 {
                        blk.mins[p][r] = twice(mins[p] as i32);
                    }
                    blk.d[r] = f16_at(b, 0);
                    blk.dmin[r] = f16_at(b, 2);
                }
                GgmlType::Q6K => {
                    let (ql, qh, sc) = (&b[0..128], &b[128..192], &b[192..208]);
                    for half in 0..2 {
                        for l in (0..32).step_by(4) {
                            let (x0, x1, h) = (u32_at(ql, half * 64 + l), u32_at(ql, half * 64 + 32 + l), u32_at(qh, half * 32 + l));
                            let high = |shift: u32| ((h >> shift) & 0x0303_0303) << 4;
                            put(half * 128 + l, (x0 & 0x0f0f_0f0f) | high(0));
                            put(half * 128 + 32 + l, (x1 & 0x0f0f_0f0f) | high(2));
                            put(half * 128 + 64 + l, ((x0 >> 4) & 0x0f0f_0f0f) | high(4));
                            put(half * 128 + 96 + l, ((x1 >> 4) & 0x0f0f_0f0f) | high(6));
                        }
                    }
                    for j in 0..16 {
                        blk.scales[j][r] = twice(sc[j] as i8 as i32);
                    }
                    // q − 32 as q, less 32 · scale · (sum of the 16 activations).
                    for p in 0..8 {
                        blk.mins[p][r] = if no_offset { 0 } else { pair(32 * sc[2 * p] as i8 as i32, 32 * sc[2 * p + 1] as i8 as i32) };
                    }
                    let d = f16_at(b, 208);
                    blk.d[r] = d;
                    blk.dmin[r] = d;
                }
                _ => panic!("{ty} is not a K-quant"),
            }
        }
    }
}

/// `out[t][r]` = row `r` of `blocks` times token `t` (`a[t]`, one activation block per
/// super-block), for 1 to [`TOKENS`] tokens.
pub type TileKernel = fn(blocks: &[KBlock8], a: &[&[Q8x256]], combine: Combine, out: &mut [[f32; ROWS]; TOKENS]);

/// The scalar form of the kernel (the reference's arithmetic on the unpacked layout): the tests'
/// check of [`unpack`] on its own. Sets without a SIMD tile keep the row kernels.
pub fn scalar(blocks: &[KBlock8], a: &[&[Q8x256]], combine: Combine, out: &mut [[f32; ROWS]; TOKENS]) {
    for (t, a) in a.iter().enumerate() {
        for r in 0..ROWS {
            let mut sum = 0f32;
            for (blk, a) in blocks.iter().zip(a.iter()) {
                let (mut isum, mut msum) = (0i32, 0i32);
                for j in 0..16 {
                    let scale = blk.scales[j][r] as i16 as i32;
                    let mut part = 0i32;
                    for c in 16 * j..16 * j + 16 {
                        part += blk.q[c / 4][4 * r + c % 4] as i32 * a.qs[c] as i32;
                    }
                    isum += scale * part;
                }
                for p in 0..8 {
                    let m = blk.mins[p][r];
                    msum += (m as i16 as i32) * a.bsums[2 * p] as i32 + (m >> 16) * a.bsums[2 * p + 1] as i32;
                }
                sum += match combine {
                    Combine::ScaleAndMin => a.d * (blk.d[r] * isum as f32 - blk.dmin[r] * msum as f32),
                    Combine::Offset => blk.d[r] * a.d * (isum - msum) as f32,
                };
            }
            out[t][r] = sum;
        }
    }
}

/// One 32-column block of 8 rows of Q4_0, Q4_1 or Q8_0, unpacked to unsigned bytes.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub struct QBlock8 {
    /// `q[g][4r + i]`: row `r`'s quant of column `4g + i` plus the type's offset, so unsigned
    /// (Q4_0, Q4_1: the nibble; Q8_0: the signed byte + 128).
    pub q: [[u8; 32]; 8],
    pub d: [f32; ROWS],
    /// Q4_1's minimum (zero otherwise).
    pub m: [f32; ROWS],
}

impl Default for QBlock8 {
    fn default() -> Self {
        Self { q: [[0; 32]; 8], d: [0.0; ROWS], m: [0.0; ROWS] }
    }
}

/// How a 32-value type's sums combine, in the scalar reference's order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Combine32 {
    /// Q4_0 (8), Q8_0 (128): the unsigned quants' offset times the activations' sum is
    /// subtracted in integers, then `d · d_act · Σ`.
    Offset(i32),
    /// Q4_1: `d · d_act · Σ`, plus `m · s_act` summed apart and added last.
    Min,
}

/// Whether [`unpack32`] takes `ty`, and how its sums combine.
pub fn combine32(ty: GgmlType) -> Option<Combine32> {
    match ty {
        GgmlType::Q4_0 => Some(Combine32::Offset(8)),
        GgmlType::Q8_0 => Some(Combine32::Offset(128)),
        GgmlType::Q4_1 => Some(Combine32::Min),
        _ => None,
    }
}

/// Unpacks rows `w` (`rows` ≤ 8 of them, `row_bytes` apart, each `out.len()` blocks of `ty`)
/// into `out`; lanes past `rows` are zero.
pub fn unpack32(ty: GgmlType, w: &[u8], row_bytes: usize, rows: usize, out: &mut [QBlock8]) {
    assert!((1..=ROWS).contains(&rows));
    let size = ty.block_bytes();
    assert!(w.len() >= (rows - 1) * row_bytes + out.len() * size);
    // The negative control of the tile check: Q4_0's nibbles taken as signed −8..7 by the
    // unpacking as well as by the offset.
    let twice_offset = crate::test_defect("tile-q4-0-offset");
    for (i, blk) in out.iter_mut().enumerate() {
        if rows < ROWS {
            *blk = QBlock8::default();
        }
        for r in 0..rows {
            let b = &w[r * row_bytes + i * size..r * row_bytes + (i + 1) * size];
            let mut put = |column: usize, quads: u32| blk.q[column / 4][4 * r..4 * r + 4].copy_from_slice(&quads.to_le_bytes());
            blk.d[r] = f16_at(b, 0);
            match ty {
                GgmlType::Q4_0 | GgmlType::Q4_1 => {
                    let qs = if ty == GgmlType::Q4_0 { &b[2..18] } else { &b[4..20] };
                    let shift = if twice_offset && ty == GgmlType::Q4_0 { 0x0808_0808 } else { 0 };
                    for l in (0..16).step_by(4) {
                        let x = u32_at(qs, l);
                        put(l, (x & 0x0f0f_0f0f) ^ shift);
                        put(16 + l, ((x >> 4) & 0x0f0f_0f0f) ^ shift);
                    }
                    blk.m[r] = if ty == GgmlType::Q4_1 { f16_at(b, 2) } else { 0.0 };
                }
                GgmlType::Q8_0 => {
                    for l in (0..32).step_by(4) {
                        put(l, u32_at(b, 2 + l) ^ 0x8080_8080);
                    }
                    blk.m[r] = 0.0;
                }
                _ => panic!("{ty} is not a 32-value block type"),
            }
        }
    }
}

/// `out[t][r]` = row `r` of `blocks` times token `t` (`a[t]`, one activation block per block),
/// for 1 to [`TOKENS`] tokens.
pub type Tile32Kernel = fn(blocks: &[QBlock8], a: &[&[Q8x32]], combine: Combine32, out: &mut [[f32; ROWS]; TOKENS]);

/// The scalar form of the 32-value kernel.
pub fn scalar32(blocks: &[QBlock8], a: &[&[Q8x32]], combine: Combine32, out: &mut [[f32; ROWS]; TOKENS]) {
    for (t, a) in a.iter().enumerate() {
        for r in 0..ROWS {
            let (mut sum, mut mins) = (0f32, 0f32);
            for (blk, a) in blocks.iter().zip(a.iter()) {
                let isum: i32 = (0..32).map(|c| blk.q[c / 4][4 * r + c % 4] as i32 * a.qs[c] as i32).sum();
                sum += match combine {
                    Combine32::Offset(offset) => blk.d[r] * a.d * (isum - offset * a.sum) as f32,
                    Combine32::Min => {
                        mins += blk.m[r] * a.s;
                        blk.d[r] * a.d * isum as f32
                    }
                };
            }
            out[t][r] = sum + mins;
        }
    }
}

/// The 32-value kernel with AVX-512 VNNI (`vpdpbusd` on 256-bit vectors): one instruction per 4
/// columns of 8 rows and a token.
#[cfg(target_arch = "x86_64")]
pub(super) mod vnni {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::*;

    pub fn kernel32(blocks: &[QBlock8], a: &[&[Q8x32]], combine: Combine32, out: &mut [[f32; ROWS]; TOKENS]) {
        for a in a {
            assert!(a.len() >= blocks.len());
        }
        // SAFETY: this kernel is only in the set of processors with AVX-512 VL and VNNI; every
        // token has an activation block per block (checked above).
        unsafe {
            match a.len() {
                1 => tokens::<1>(blocks, a, combine, out),
                2 => tokens::<2>(blocks, a, combine, out),
                3 => tokens::<3>(blocks, a, combine, out),
                4 => tokens::<4>(blocks, a, combine, out),
                n => panic!("1 to {TOKENS} tokens per call, not {n}"),
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
    unsafe fn tokens<const T: usize>(blocks: &[QBlock8], a: &[&[Q8x32]], combine: Combine32, out: &mut [[f32; ROWS]; TOKENS]) {
        let mut sum = [_mm256_setzero_ps(); T];
        // Q4_1's minimums' terms, summed apart (see `dot::scalar::q4_1`).
        let mut mins = [_mm256_setzero_ps(); T];
        for (i, blk) in blocks.iter().enumerate() {
            let ab: [&Q8x32; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            let q = blk.q.as_ptr() as *const __m256i;
            let mut isum = [_mm256_setzero_si256(); T];
            for g in 0..8 {
                let w = _mm256_load_si256(q.add(g));
                for t in 0..T {
                    let y = _mm256_set1_epi32(std::ptr::read_unaligned(ab[t].qs.as_ptr().add(4 * g) as *const i32));
                    isum[t] = _mm256_dpbusd_epi32(isum[t], w, y);
                }
            }
            let d = _mm256_load_ps(blk.d.as_ptr());
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            for t in 0..T {
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(ab[t].d));
                let part = match combine {
                    Combine32::Offset(offset) => _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], _mm256_set1_epi32(offset * ab[t].sum)))),
                    Combine32::Min => {
                        mins[t] = _mm256_add_ps(mins[t], _mm256_mul_ps(_mm256_load_ps(blk.m.as_ptr()), _mm256_set1_ps(ab[t].s)));
                        _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum[t]))
                    }
                };
                sum[t] = _mm256_add_ps(sum[t], part);
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(out[t].as_mut_ptr(), _mm256_add_ps(sum[t], mins[t]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::*;

    pub fn kernel(blocks: &[KBlock8], a: &[&[Q8x256]], combine: Combine, out: &mut [[f32; ROWS]; TOKENS]) {
        for a in a {
            assert!(a.len() >= blocks.len());
        }
        // SAFETY: this kernel is only in the sets of processors with AVX2, FMA and F16C; every
        // token has an activation block per super-block (checked above).
        unsafe {
            match a.len() {
                1 => tokens::<1>(blocks, a, combine, out),
                2 => tokens::<2>(blocks, a, combine, out),
                3 => tokens::<3>(blocks, a, combine, out),
                4 => tokens::<4>(blocks, a, combine, out),
                n => panic!("1 to {TOKENS} tokens per call, not {n}"),
            }
        }
    }

    #[inline(always)]
    unsafe fn four_bytes(p: *const i8, at: usize) -> __m256i {
        _mm256_set1_epi32(std::ptr::read_unaligned(p.add(at) as *const i32))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tokens<const T: usize>(blocks: &[KBlock8], a: &[&[Q8x256]], combine: Combine, out: &mut [[f32; ROWS]; TOKENS]) {
        let mut sum = [_mm256_setzero_ps(); T];
        for (i, blk) in blocks.iter().enumerate() {
            let ab: [&Q8x256; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            let q = blk.q.as_ptr() as *const __m256i;
            let mut isum = [_mm256_setzero_si256(); T];
            for j in 0..16 {
                let scale = _mm256_load_si256(blk.scales[j].as_ptr() as *const __m256i);
                let w = [0, 1, 2, 3].map(|g| _mm256_load_si256(q.add(4 * j + g)));
                for t in 0..T {
                    let y = ab[t].qs.as_ptr();
                    // Two products of at most 2·63·127 each fit an i16 together.
                    let p01 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[0], four_bytes(y, 16 * j)),
                        _mm256_maddubs_epi16(w[1], four_bytes(y, 16 * j + 4)),
                    );
                    let p23 = _mm256_add_epi16(
                        _mm256_maddubs_epi16(w[2], four_bytes(y, 16 * j + 8)),
                        _mm256_maddubs_epi16(w[3], four_bytes(y, 16 * j + 12)),
                    );
                    let s = _mm256_add_epi32(_mm256_madd_epi16(p01, scale), _mm256_madd_epi16(p23, scale));
                    isum[t] = _mm256_add_epi32(isum[t], s);
                }
            }
            let mut msum = [_mm256_setzero_si256(); T];
            for p in 0..8 {
                let mins = _mm256_load_si256(blk.mins[p].as_ptr() as *const __m256i);
                for t in 0..T {
                    let bsums = _mm256_set1_epi32(std::ptr::read_unaligned(ab[t].bsums.as_ptr().add(2 * p) as *const i32));
                    msum[t] = _mm256_add_epi32(msum[t], _mm256_madd_epi16(mins, bsums));
                }
            }
            let d = _mm256_load_ps(blk.d.as_ptr());
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            match combine {
                Combine::ScaleAndMin => {
                    let dmin = _mm256_load_ps(blk.dmin.as_ptr());
                    for t in 0..T {
                        let inner = _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(isum[t])), _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(msum[t])));
                        sum[t] = _mm256_add_ps(sum[t], _mm256_mul_ps(_mm256_set1_ps(ab[t].d), inner));
                    }
                }
                Combine::Offset => {
                    for t in 0..T {
                        let scale = _mm256_mul_ps(d, _mm256_set1_ps(ab[t].d));
                        sum[t] = _mm256_add_ps(sum[t], _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], msum[t]))));
                    }
                }
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(out[t].as_mut_ptr(), sum[t]);
        }
    }
}

/// The 32-value kernel with AVX2 alone: the nibble types' unsigned quants with `maddubs`
/// (eight blocks' pairs fit an i16 before one `madd`); Q8_0's bytes back to signed, multiplied
/// as |w| × (a with w's sign), which needs no offset.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2_32 {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::*;

    pub fn kernel32(blocks: &[QBlock8], a: &[&[Q8x32]], combine: Combine32, out: &mut [[f32; ROWS]; TOKENS]) {
        for a in a {
            assert!(a.len() >= blocks.len());
        }
        // SAFETY: this kernel is only in the sets of processors with AVX2, FMA and F16C; every
        // token has an activation block per block (checked above).
        unsafe {
            match a.len() {
                1 => tokens::<1>(blocks, a, combine, out),
                2 => tokens::<2>(blocks, a, combine, out),
                3 => tokens::<3>(blocks, a, combine, out),
                4 => tokens::<4>(blocks, a, combine, out),
                n => panic!("1 to {TOKENS} tokens per call, not {n}"),
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tokens<const T: usize>(blocks: &[QBlock8], a: &[&[Q8x32]], combine: Combine32, out: &mut [[f32; ROWS]; TOKENS]) {
        let ones = _mm256_set1_epi16(1);
        let signed = combine == Combine32::Offset(128);
        let mut sum = [_mm256_setzero_ps(); T];
        // Q4_1's minimums' terms, summed apart (see `dot::scalar::q4_1`).
        let mut mins = [_mm256_setzero_ps(); T];
        for (i, blk) in blocks.iter().enumerate() {
            let ab: [&Q8x32; T] = std::array::from_fn(|t| a[t].get_unchecked(i));
            let q = blk.q.as_ptr() as *const __m256i;
            let y = |t: usize, g: usize| _mm256_set1_epi32(std::ptr::read_unaligned(ab[t].qs.as_ptr().add(4 * g) as *const i32));
            let mut isum = [_mm256_setzero_si256(); T];
            if signed {
                for g in 0..8 {
                    let w = _mm256_xor_si256(_mm256_load_si256(q.add(g)), _mm256_set1_epi8(-128));
                    let magnitude = _mm256_sign_epi8(w, w);
                    for t in 0..T {
                        let p = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(y(t, g), w));
                        isum[t] = _mm256_add_epi32(isum[t], _mm256_madd_epi16(p, ones));
                    }
                }
            } else {
                let mut pairs = [_mm256_setzero_si256(); T];
                for g in 0..8 {
                    let w = _mm256_load_si256(q.add(g));
                    for t in 0..T {
                        pairs[t] = _mm256_add_epi16(pairs[t], _mm256_maddubs_epi16(w, y(t, g)));
                    }
                }
                for t in 0..T {
                    isum[t] = _mm256_madd_epi16(pairs[t], ones);
                }
            }
            let d = _mm256_load_ps(blk.d.as_ptr());
            // The scalar reference's float steps, lane by lane (no fused multiply-adds).
            for t in 0..T {
                let scale = _mm256_mul_ps(d, _mm256_set1_ps(ab[t].d));
                let part = match combine {
                    Combine32::Offset(_) if signed => _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum[t])),
                    Combine32::Offset(offset) => _mm256_mul_ps(scale, _mm256_cvtepi32_ps(_mm256_sub_epi32(isum[t], _mm256_set1_epi32(offset * ab[t].sum)))),
                    Combine32::Min => {
                        mins[t] = _mm256_add_ps(mins[t], _mm256_mul_ps(_mm256_load_ps(blk.m.as_ptr()), _mm256_set1_ps(ab[t].s)));
                        _mm256_mul_ps(scale, _mm256_cvtepi32_ps(isum[t]))
                    }
                };
                sum[t] = _mm256_add_ps(sum[t], part);
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(out[t].as_mut_ptr(), _mm256_add_ps(sum[t], mins[t]));
        }
    }
}

/// Rows per float tile: two 256-bit vectors (AVX2) or one 512-bit vector of f32.
pub const FLOAT_ROWS: usize = 16;

/// One column of 16 unquantized rows, widened to f32 (F32, F16 and BF16 weights share it).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
pub struct FColumn16(pub [f32; FLOAT_ROWS]);

/// Unpacks `rows` (≤ 16) F32, F16 or BF16 rows `w` (`row_bytes` apart, `out.len()` columns)
/// into columns of 16; lanes past `rows` are zero.
pub type FloatUnpack = fn(ty: GgmlType, w: &[u8], row_bytes: usize, rows: usize, out: &mut [FColumn16]);

/// `out[t][r]` = row `r` of the columns times token `t` (`x[t]`, f32), 1 to [`TOKENS`] tokens.
/// Unlike the packed types' tiles, the float sums are added in another order than the row
/// kernels' (column after column per lane instead of eight lanes per row), so they agree with
/// the reference within rounding only.
pub type FloatTileKernel = fn(columns: &[FColumn16], x: &[&[f32]], out: &mut [[f32; FLOAT_ROWS]; TOKENS]);

/// The unquantized tile with AVX2 and FMA: rows widened with F16C (or a shift for BF16) once,
/// then per column and token one broadcast and two fused multiply-adds (16 rows).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2_float {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::*;

    pub fn unpack(ty: GgmlType, w: &[u8], row_bytes: usize, rows: usize, out: &mut [FColumn16]) {
        assert!(matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16), "{ty} is not an unquantized type");
        assert!((1..=FLOAT_ROWS).contains(&rows));
        assert!(w.len() >= (rows - 1) * row_bytes + out.len() * ty.block_bytes());
        // SAFETY: this unpacking is only in the sets of processors with AVX2 and F16C; every row
        // holds `out.len()` values (checked above).
        unsafe { widen(ty, w, row_bytes, rows, out) }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen(ty: GgmlType, w: &[u8], row_bytes: usize, rows: usize, out: &mut [FColumn16]) {
        // The negative control of the float tile check: BF16 widened one bit short.
        let short = crate::test_defect("tile-bf16-widen");
        let cols = out.len();
        if rows < FLOAT_ROWS {
            out.fill(FColumn16::default());
        }
        for r in 0..rows {
            let row = w.as_ptr().add(r * row_bytes);
            let mut k = 0;
            while k < cols {
                let n = (cols - k).min(8);
                let mut v = [0f32; 8];
                if n == 8 {
                    let values = match ty {
                        GgmlType::F32 => _mm256_loadu_ps(row.add(4 * k) as *const f32),
                        GgmlType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(row.add(2 * k) as *const __m128i)),
                        _ => {
                            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(row.add(2 * k) as *const __m128i));
                            _mm256_castsi256_ps(if short { _mm256_slli_epi32::<15>(wide) } else { _mm256_slli_epi32::<16>(wide) })
                        }
                    };
                    _mm256_storeu_ps(v.as_mut_ptr(), values);
                } else {
                    for (j, v) in v[..n].iter_mut().enumerate() {
                        let p = row.add(ty.block_bytes() * (k + j));
                        *v = match ty {
                            GgmlType::F32 => (p as *const f32).read_unaligned(),
                            GgmlType::F16 => half::f16::from_le_bytes([*p, *p.add(1)]).to_f32(),
                            _ => half::bf16::from_le_bytes([*p, *p.add(1)]).to_f32(),
                        };
                    }
                }
                for (j, v) in v[..n].iter().enumerate() {
                    out.get_unchecked_mut(k + j).0[r] = *v;
                }
                k += n;
            }
        }
    }

    pub fn kernel(columns: &[FColumn16], x: &[&[f32]], out: &mut [[f32; FLOAT_ROWS]; TOKENS]) {
        for x in x {
            assert!(x.len() >= columns.len());
        }
        // SAFETY: this kernel is only in the sets of processors with AVX2 and FMA; every token
        // has a value per column (checked above).
        unsafe {
            match x.len() {
                1 => tokens::<1>(columns, x, out),
                2 => tokens::<2>(columns, x, out),
                3 => tokens::<3>(columns, x, out),
                4 => tokens::<4>(columns, x, out),
                n => panic!("1 to {TOKENS} tokens per call, not {n}"),
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tokens<const T: usize>(columns: &[FColumn16], x: &[&[f32]], out: &mut [[f32; FLOAT_ROWS]; TOKENS]) {
        let mut low = [_mm256_setzero_ps(); T];
        let mut high = [_mm256_setzero_ps(); T];
        let c = columns.as_ptr() as *const f32;
        for k in 0..columns.len() {
            let (w0, w1) = (_mm256_load_ps(c.add(16 * k)), _mm256_load_ps(c.add(16 * k + 8)));
            for t in 0..T {
                let b = _mm256_broadcast_ss(&*x.get_unchecked(t).as_ptr().add(k));
                low[t] = _mm256_fmadd_ps(w0, b, low[t]);
                high[t] = _mm256_fmadd_ps(w1, b, high[t]);
            }
        }
        for t in 0..T {
            _mm256_storeu_ps(out[t].as_mut_ptr(), low[t]);
            _mm256_storeu_ps(out[t].as_mut_ptr().add(8), high[t]);
        }
    }
}

/// The unquantized tile's kernel with AVX-512: one 512-bit fused multiply-add per column, 16
/// rows and token, even and odd columns in separate chains (eight in flight for 4 tokens).
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512_float {
    #![allow(unsafe_op_in_unsafe_fn)]
    use std::arch::x86_64::*;

    use super::*;

    pub fn kernel(columns: &[FColumn16], x: &[&[f32]], out: &mut [[f32; FLOAT_ROWS]; TOKENS]) {
        for x in x {
            assert!(x.len() >= columns.len());
        }
        // SAFETY: this kernel is only in the set of processors with AVX-512 F; every token has a
        // value per column (checked above).
        unsafe {
            match x.len() {
                1 => tokens::<1>(columns, x, out),
                2 => tokens::<2>(columns, x, out),
                3 => tokens::<3>(columns, x, out),
                4 => tokens::<4>(columns, x, out),
                n => panic!("1 to {TOKENS} tokens per call, not {n}"),
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f")]
    unsafe fn tokens<const T: usize>(columns: &[FColumn16], x: &[&[f32]], out: &mut [[f32; FLOAT_ROWS]; TOKENS]) {
        let mut even = [_mm512_setzero_ps(); T];
        let mut odd = [_mm512_setzero_ps(); T];
        let n = columns.len();
        let c = columns.as_ptr() as *const f32;
        let mut k = 0;
        while k + 2 <= n {
            let (w0, w1) = (_mm512_load_ps(c.add(16 * k)), _mm512_load_ps(c.add(16 * k + 16)));
            for t in 0..T {
                let xt = x.get_unchecked(t).as_ptr();
                even[t] = _mm512_fmadd_ps(w0, _mm512_set1_ps(*xt.add(k)), even[t]);
                odd[t] = _mm512_fmadd_ps(w1, _mm512_set1_ps(*xt.add(k + 1)), odd[t]);
            }
            k += 2;
        }
        if k < n {
            let w0 = _mm512_load_ps(c.add(16 * k));
            for t in 0..T {
                even[t] = _mm512_fmadd_ps(w0, _mm512_set1_ps(*x.get_unchecked(t).as_ptr().add(k)), even[t]);
            }
        }
        for t in 0..T {
            _mm512_storeu_ps(out[t].as_mut_ptr(), _mm512_add_ps(even[t], odd[t]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::conformance::{activations, blocks, Blocks, TYPES};
    use crate::cpu::dot::{quantize_q8x256, quantize_q8x32, Kernels};
    use rand::SeedableRng;

    /// A tile kernel: unpacked blocks `B` times 1 to 4 tokens' activation blocks `A`.
    type Kernel<B, A, C> = fn(&[B], &[&[A]], C, &mut [[f32; ROWS]; TOKENS]);

    /// Rows of every type `combine_of` takes, unpacked by `unpack` and multiplied by each of
    /// `kernels`, equal the scalar row reference (`reference`) bit for bit: random, zero and
    /// saturated blocks; 1, 3 and 8 rows; 1 to 4 tokens.
    #[allow(clippy::too_many_arguments)]
    fn tiles_equal_reference<B: Default + Clone, A: Default + Clone, C: Copy>(
        seed: u64,
        n_blocks: usize,
        combine_of: fn(GgmlType) -> Option<C>,
        kernels: &[(&str, Kernel<B, A, C>)],
        unpack: fn(GgmlType, &[u8], usize, usize, &mut [B]),
        quantize: fn(&[f32], &mut [A]),
        reference: fn(GgmlType) -> fn(&[u8], usize, &[A], &mut [f32]),
    ) {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        for &(ty, scale_at) in TYPES {
            let Some(combine) = combine_of(ty) else { continue };
            for kind in [Blocks::Random, Blocks::Zero, Blocks::Max] {
                let (cols, row_bytes) = (n_blocks * ty.block_elements(), n_blocks * ty.block_bytes());
                let w = blocks(ty, scale_at, ROWS * n_blocks, kind, &mut rng);
                let a: Vec<Vec<A>> = (0..TOKENS)
                    .map(|_| {
                        let mut a = vec![A::default(); n_blocks];
                        quantize(&activations(cols, &mut rng), &mut a);
                        a
                    })
                    .collect();
                for rows in [1, 3, 8] {
                    let mut tile = vec![B::default(); n_blocks];
                    unpack(ty, &w, row_bytes, rows, &mut tile);
                    for tokens in 1..=TOKENS {
                        let refs: Vec<&[A]> = a[..tokens].iter().map(|a| a.as_slice()).collect();
                        for (name, kernel) in kernels {
                            let mut out = [[f32::NAN; ROWS]; TOKENS];
                            kernel(&tile, &refs, combine, &mut out);
                            for t in 0..tokens {
                                for r in 0..ROWS {
                                    let want = if r < rows {
                                        let mut o = [0f32];
                                        reference(ty)(&w[r * row_bytes..(r + 1) * row_bytes], row_bytes, &a[t], &mut o);
                                        o[0]
                                    } else {
                                        0.0
                                    };
                                    // `==`: the same float (+0 and −0 alike, as the reference's sum starts at either).
                                    assert!(out[t][r] == want, "{name} {ty} row {r} of {rows}, token {t} of {tokens}: {} vs {want}", out[t][r]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The K-quants' tiles, through the scalar tile kernel and every SIMD one this processor has.
    #[test]
    fn tiles_equal_the_scalar_reference_exactly() {
        let mut kernels: Vec<(&str, TileKernel)> = vec![("scalar", scalar)];
        kernels.extend(Kernels::available().iter().filter_map(|k| k.k_tile.map(|f| (k.name, f))));
        tiles_equal_reference(5, 3, combine, &kernels, unpack, quantize_q8x256, |ty| Kernels::SCALAR.q8x256_kernels(ty).0);
    }

    /// The same for the 32-value types and their kernels.
    #[test]
    fn tiles32_equal_the_scalar_reference_exactly() {
        let mut kernels: Vec<(&str, Tile32Kernel)> = vec![("scalar", scalar32)];
        kernels.extend(Kernels::available().iter().filter_map(|k| k.tile32.map(|f| (k.name, f))));
        tiles_equal_reference(6, 5, combine32, &kernels, unpack32, quantize_q8x32, |ty| Kernels::SCALAR.q8x32_kernels(ty).0);
    }

    /// The check above fails when Q4_0's nibbles are unpacked as if already signed
    /// (`HEADROOM_TEST_DEFECT=tile-q4-0-offset`, in a child process).
    #[test]
    fn the_negative_control_of_the_tile32_check_fails() {
        let stdout = crate::failing_with_defect("cpu::tile::tests::tiles32_equal_the_scalar_reference_exactly", "tile-q4-0-offset");
        assert!(stdout.contains("Q4_0"), "it failed on something else: {stdout}");
    }

    /// The check above fails when Q6_K's −32 offset is left out of the unpacked rows
    /// (`HEADROOM_TEST_DEFECT=tile-q6k-offset`, in a child process).
    #[test]
    fn the_negative_control_of_the_tile_check_fails() {
        let stdout = crate::failing_with_defect("cpu::tile::tests::tiles_equal_the_scalar_reference_exactly", "tile-q6k-offset");
        assert!(stdout.contains("Q6_K"), "it failed on something else: {stdout}");
    }

    /// Unquantized rows (F32, F16, BF16; lengths with a remainder of 8) through every float
    /// tile this processor has agree with the scalar reference within rounding, for 1 to 8 rows
    /// and 1 to 4 tokens.
    #[test]
    fn float_tiles_equal_the_scalar_reference() {
        use crate::cpu::conformance::{close, dot_with};
        use half::{bf16, f16};
        use rand::Rng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
        for k in Kernels::available() {
            let Some((unpack, kernel)) = k.float_tile else { continue };
            for cols in [8, 13, 576] {
                let x: Vec<Vec<f32>> = (0..TOKENS).map(|_| (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect()).collect();
                let values: Vec<f32> = (0..FLOAT_ROWS * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
                let rows_of = |ty: GgmlType| -> Vec<u8> {
                    match ty {
                        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
                        GgmlType::F16 => values.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
                        _ => values.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
                    }
                };
                for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16] {
                    let w = rows_of(ty);
                    let row_bytes = w.len() / FLOAT_ROWS;
                    for rows in [1, 5, 16] {
                        let mut columns = vec![FColumn16::default(); cols];
                        unpack(ty, &w, row_bytes, rows, &mut columns);
                        for tokens in 1..=TOKENS {
                            let refs: Vec<&[f32]> = x[..tokens].iter().map(|x| x.as_slice()).collect();
                            let mut out = [[f32::NAN; FLOAT_ROWS]; TOKENS];
                                kernel(&columns, &refs, &mut out);
                            for t in 0..tokens {
                                for r in 0..FLOAT_ROWS {
                                    let want = if r < rows { dot_with(&Kernels::SCALAR, ty, &w[r * row_bytes..(r + 1) * row_bytes], &x[t]) } else { 0.0 };
                                    assert!(close(out[t][r], want, cols as f32), "{} {ty} {cols} columns, row {r} of {rows}, token {t}: {} vs {want}", k.name, out[t][r]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The check above fails when BF16 rows are widened one bit short
    /// (`HEADROOM_TEST_DEFECT=tile-bf16-widen`, in a child process).
    #[test]
    fn the_negative_control_of_the_float_tile_check_fails() {
        let stdout = crate::failing_with_defect("cpu::tile::tests::float_tiles_equal_the_scalar_reference", "tile-bf16-widen");
        assert!(stdout.contains("BF16"), "it failed on something else: {stdout}");
    }
}
