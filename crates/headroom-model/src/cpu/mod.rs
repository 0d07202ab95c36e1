//! The CPU engine: GGUF weights stay in their block layout (memory-mapped where the file holds
//! them in a packed type) and are multiplied by SIMD kernels against activations quantized per
//! block, as llama.cpp does, so a decode step streams 4–8 bits per weight instead of 32.
//!
//! - [`dot`]: activation blocks, the scalar reference dot products, run-time kernel choice;
//! - `avx2`: the x86-64 kernels (AVX2, FMA, F16C);
//! - `avx512`: the AVX-512 and VNNI kernels on AVX2's frame (Ice Lake, Sapphire Rapids, Zen 4);
//! - [`tile`]: the K-quants' prefill products over rows unpacked once per product;
//! - [`interleave`]: Q4_0, Q4_1 and Q8_0 repacked into groups of 8 rows at load, one kernel for
//!   every token count (AVX-512 VNNI);
//! - [`matrix`]: packed matrices and their threaded products (decode rows and prefill tiles);
//! - [`team`]: the pool's threads held together for a forward pass (one wake-up, not one per
//!   product);
//! - [`engine`]: the decoder on top ([`CpuModel`], [`CpuCache`]).
//!
//! - `neon`: the aarch64 kernels (the scalar reference's arithmetic, 16 bytes at a time).
//!
//! Other processors run the scalar kernels.

#[doc(hidden)]
pub mod conformance;
pub mod dot;
pub mod engine;
pub mod interleave;
pub mod matrix;
pub mod team;
pub mod tile;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

pub use engine::{CpuCache, CpuModel, KvPrecision, RopePairs};
pub use matrix::{Activations, Bytes, PackedMatrix};

/// The host's memory read bandwidth in bytes/s, measured: every thread of the pool sums its
/// share of a 512 MiB buffer (far larger than any cache), best of three passes. What a decode
/// step that streams every weight once is bounded by (benchmarks print it beside their rates).
pub fn measure_read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let words = 64usize << 20;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let started = std::time::Instant::now();
        // Eight independent lanes per chunk, so the adds never wait on each other.
        let sum = buffer
            .par_chunks(1 << 16)
            .map(|c| {
                let mut lanes = [0u64; 8];
                for block in c.chunks_exact(8) {
                    for (lane, &x) in lanes.iter_mut().zip(block) {
                        *lane = lane.wrapping_add(x);
                    }
                }
                lanes.iter().fold(0u64, |a, &x| a.wrapping_add(x))
            })
            .reduce(|| 0, u64::wrapping_add);
        let rate = (words * 8) as f64 / started.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        best = best.max(rate);
    }
    best
}
