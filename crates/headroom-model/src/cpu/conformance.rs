//! The check that a kernel set computes what the scalar reference computes: random, all-zero
//! and saturated blocks of every packed type, 1 to 4 rows and one or two tokens per call, float
//! rows with and without a remainder. The unit tests run it on every set this processor has;
//! `tests/kernels_on_one_thread.rs` runs it without threads, which is how the aarch64 (NEON)
//! kernels are checked under qemu-user on an x86-64 machine (`scripts/check-aarch64.sh`).

use half::f16;
use rand::{Rng, SeedableRng};

use super::dot::*;
use super::interleave::{RepackedKernel, GROUP};
use super::tile::TOKENS;
use crate::quants::GgmlType;

/// Packed types and where their f16 scales sit in a block.
pub const TYPES: &[(GgmlType, &[usize])] = &[
    (GgmlType::Q4_0, &[0]),
    (GgmlType::Q4_1, &[0, 2]),
    (GgmlType::Q8_0, &[0]),
    (GgmlType::Q4K, &[0, 2]),
    (GgmlType::Q5K, &[0, 2]),
    (GgmlType::Q6K, &[208]),
];

#[derive(Clone, Copy)]
pub enum Blocks {
    Random,
    Zero,
    /// Every quant and sub-scale at its largest, the f16 scales large.
    Max,
}

/// `blocks` blocks of `ty`: random bytes with finite f16 scales (random bytes there could be
/// NaN), all zero, or saturated.
pub fn blocks(ty: GgmlType, scales: &[usize], n: usize, kind: Blocks, rng: &mut impl Rng) -> Vec<u8> {
    let size = ty.block_bytes();
    let mut out = vec![0u8; n * size];
    for block in out.chunks_exact_mut(size) {
        match kind {
            Blocks::Zero => {}
            Blocks::Random => {
                rng.fill(block);
                for &at in scales {
                    let v = f16::from_f32(rng.random_range(-0.05f32..0.05));
                    block[at..at + 2].copy_from_slice(&v.to_le_bytes());
                }
            }
            Blocks::Max => {
                block.fill(0xff);
                if ty == GgmlType::Q8_0 {
                    block[2..].fill(0x7f);
                }
                if ty == GgmlType::Q6K {
                    block[192..208].fill(0x7f);
                }
                for &at in scales {
                    block[at..at + 2].copy_from_slice(&f16::from_f32(100.0).to_le_bytes());
                }
            }
        }
    }
    out
}

pub fn activations(n: usize, rng: &mut impl Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    // A block of zeros and a block with one large value: the activation scale's edges.
    x[..32].fill(0.0);
    if n > 64 {
        x[40] = 1e4;
    }
    x
}

pub fn dot_with(k: &Kernels, ty: GgmlType, w: &[u8], x: &[f32]) -> f32 {
    let mut out = [0f32];
    rows_with(k, ty, w, w.len(), x, &mut out);
    out[0]
}

/// `out.len() / 2` rows of `row_bytes` each, times two tokens.
pub fn pairs_with(k: &Kernels, ty: GgmlType, w: &[u8], row_bytes: usize, x: [&[f32]; 2], out: &mut [f32]) {
    match activation_kind(ty).unwrap() {
        ActivationKind::Q8x32 => {
            let a = x.map(|x| {
                let mut a = vec![Q8x32::default(); x.len() / 32];
                quantize_q8x32(x, &mut a);
                a
            });
            k.q8x32_kernels(ty).1(w, row_bytes, [&a[0], &a[1]], out)
        }
        ActivationKind::Q8x256 => {
            let a = x.map(|x| {
                let mut a = vec![Q8x256::default(); x.len() / 256];
                quantize_q8x256(x, &mut a);
                a
            });
            k.q8x256_kernels(ty).1(w, row_bytes, [&a[0], &a[1]], out)
        }
        ActivationKind::F32 => k.float_kernels(ty).1(w, row_bytes, x, out),
    }
}

/// `out.len()` rows of `row_bytes` each, times `x`.
pub fn rows_with(k: &Kernels, ty: GgmlType, w: &[u8], row_bytes: usize, x: &[f32], out: &mut [f32]) {
    match activation_kind(ty).unwrap() {
        ActivationKind::F32 => k.float_kernels(ty).0(w, row_bytes, x, out),
        ActivationKind::Q8x32 => {
            let mut a = vec![Q8x32::default(); x.len() / 32];
            quantize_q8x32(x, &mut a);
            k.q8x32_kernels(ty).0(w, row_bytes, &a, out)
        }
        ActivationKind::Q8x256 => {
            let mut a = vec![Q8x256::default(); x.len() / 256];
            quantize_q8x256(x, &mut a);
            k.q8x256_kernels(ty).0(w, row_bytes, &a, out)
        }
    }
}

/// The activations as the kernels see them (quantized and back), so the product of
/// dequantized weights with them is exactly what the integer kernels compute.
pub fn seen_activations(ty: GgmlType, x: &[f32]) -> Vec<f32> {
    match activation_kind(ty).unwrap() {
        ActivationKind::F32 => x.to_vec(),
        ActivationKind::Q8x32 => {
            let mut a = vec![Q8x32::default(); x.len() / 32];
            quantize_q8x32(x, &mut a);
            a.iter().flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d)).collect()
        }
        ActivationKind::Q8x256 => {
            let mut a = vec![Q8x256::default(); x.len() / 256];
            quantize_q8x256(x, &mut a);
            a.iter().flat_map(|b| b.qs.iter().map(move |&q| q as f32 * b.d)).collect()
        }
    }
}

pub fn close(a: f32, b: f32, magnitude: f32) -> bool {
    (a - b).abs() <= 1e-4 * magnitude.max(1e-3)
}

/// Panics, naming the type and the case, where a kernel of `simd` does not give what the scalar
/// reference gives (within float rounding), or where several rows or tokens per call do not give
/// exactly what one row and one token per call give.
pub fn equals_scalar(simd: Kernels) {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
    for &(ty, scales) in TYPES {
        for kind in [Blocks::Random, Blocks::Zero, Blocks::Max] {
            for n_blocks in [1, 2, 5] {
                let cols = n_blocks * ty.block_elements();
                let w = blocks(ty, scales, n_blocks, kind, &mut rng);
                let x = activations(cols, &mut rng);
                let wd = crate::quants::dequantize(ty, &w, cols).unwrap();
                let xs = seen_activations(ty, &x);
                let magnitude: f32 = wd.iter().zip(&xs).map(|(a, b)| (a * b).abs()).sum();
                let (want, got) = (dot_with(&Kernels::SCALAR, ty, &w, &x), dot_with(&simd, ty, &w, &x));
                assert!(close(got, want, magnitude), "{} {ty} {n_blocks} blocks: {got} vs scalar {want}", simd.name);
            }
        }
    }
    // Two to four rows per call give each row what one row per call gives.
    for &(ty, scales) in TYPES {
        let cols = 3 * ty.block_elements();
        let row_bytes = 3 * ty.block_bytes();
        let w = blocks(ty, scales, 4 * 3, Blocks::Random, &mut rng);
        let x = activations(cols, &mut rng);
        for rows in 2..=4 {
            let mut together = vec![0f32; rows];
            rows_with(&simd, ty, &w, row_bytes, &x, &mut together);
            for (r, got) in together.iter().enumerate() {
                let alone = dot_with(&Kernels::SCALAR, ty, &w[r * row_bytes..(r + 1) * row_bytes], &x);
                assert!(close(*got, alone, 4.0 * alone.abs().max(1.0)), "{ty} row {r} of {rows}: {got} vs {alone}");
            }
        }
    }
    // Two tokens and 1 to 4 rows per call give each (row, token) exactly what one row and one
    // token per call give.
    for &(ty, scales) in TYPES {
        let (cols, row_bytes) = (3 * ty.block_elements(), 3 * ty.block_bytes());
        let w = blocks(ty, scales, 4 * 3, Blocks::Random, &mut rng);
        let x = [activations(cols, &mut rng), activations(cols, &mut rng)];
        for k in [&Kernels::SCALAR, &simd] {
            pairs_equal_singles(k, ty, &w, row_bytes, &x);
        }
    }
    for cols in [1, 7, 8, 31, 33, 100, 576] {
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let w32: Vec<u8> = (0..cols).flat_map(|_| rng.random_range(-1.0f32..1.0).to_le_bytes()).collect();
        let w16: Vec<u8> = (0..cols).flat_map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes()).collect();
        let wb16: Vec<u8> = (0..cols).flat_map(|_| half::bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes()).collect();
        for (ty, w) in [(GgmlType::F32, &w32), (GgmlType::F16, &w16), (GgmlType::BF16, &wb16)] {
            let (want, got) = (dot_with(&Kernels::SCALAR, ty, w, &x), dot_with(&simd, ty, w, &x));
            assert!(close(got, want, cols as f32), "{ty} {cols} values: {got} vs {want}");
        }
    }
    // Float rows: 1 to 4 rows and two tokens per call give what one row and one token give
    // (bit for bit within a kernel set), lengths with and without a remainder.
    for cols in [8, 13, 576] {
        let x: [Vec<f32>; 2] = std::array::from_fn(|_| (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect());
        let w32: Vec<u8> = (0..4 * cols).flat_map(|_| rng.random_range(-1.0f32..1.0).to_le_bytes()).collect();
        let w16: Vec<u8> = (0..4 * cols).flat_map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes()).collect();
        let wb16: Vec<u8> = (0..4 * cols).flat_map(|_| half::bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes()).collect();
        for (ty, w) in [(GgmlType::F32, &w32), (GgmlType::F16, &w16), (GgmlType::BF16, &wb16)] {
            for k in [&Kernels::SCALAR, &simd] {
                pairs_equal_singles(k, ty, w, w.len() / 4, &x);
            }
        }
    }
}

/// 1 to 4 rows of `w` times both tokens `x` per call give each (row, token) exactly what one
/// row and one token per call give.
pub fn pairs_equal_singles(k: &Kernels, ty: GgmlType, w: &[u8], row_bytes: usize, x: &[Vec<f32>; 2]) {
    for rows in 1..=4 {
        let mut both = vec![0f32; 2 * rows];
        pairs_with(k, ty, w, row_bytes, [&x[0], &x[1]], &mut both);
        for (t, x) in x.iter().enumerate() {
            let alone: Vec<f32> = (0..rows).map(|r| dot_with(k, ty, &w[r * row_bytes..(r + 1) * row_bytes], x)).collect();
            let cols = x.len();
            assert_eq!(&both[t * rows..(t + 1) * rows], &alone[..], "{} {ty} {cols} columns: token {t} of a pair, {rows} rows", k.name);
        }
    }
}

/// Each of `kernels` on `records` (16 rows of `w`, repacked) times the first 1 to 4 tokens of `q`
/// equals the row reference `reference` on `w` bit for bit; gives whether `reordered` (the
/// records' scalar kernel adding blocks last to first) differed from the first kernel anywhere.
#[allow(clippy::type_complexity)]
pub fn repacked_equal_the_reference<A>(
    ty: GgmlType,
    w: &[u8],
    row_bytes: usize,
    records: &[u8],
    q: &[Vec<A>],
    reference: fn(&[u8], usize, &[A], &mut [f32]),
    kernels: &[(&str, RepackedKernel<A>)],
    reordered: RepackedKernel<A>,
) -> bool {
    let mut differs = false;
    for tokens in 1..=q.len().min(TOKENS) {
        let a: Vec<&[A]> = q[..tokens].iter().map(Vec::as_slice).collect();
        let mut first = None;
        for (name, kernel) in kernels {
            let mut out = [[0f32; GROUP]; TOKENS];
            kernel(ty, records, &a, &mut out);
            for (t, a) in a.iter().enumerate() {
                let mut want = [0f32; GROUP];
                reference(w, row_bytes, a, &mut want);
                assert_eq!(out[t], want, "{ty} {name}: token {t} of {tokens}");
            }
            first.get_or_insert(out);
        }
        let mut other = [[0f32; GROUP]; TOKENS];
        reordered(ty, records, &a, &mut other);
        differs |= Some(other) != first;
    }
    differs
}
