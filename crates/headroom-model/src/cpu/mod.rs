//! The CPU engine: GGUF weights stay in their block layout (memory-mapped where the file holds
//! them in a packed type) and are multiplied by SIMD kernels against activations quantized per
//! block, as llama.cpp does, so a decode step streams 4–8 bits per weight instead of 32.
//!
//! - [`dot`]: activation blocks, the scalar reference dot products, run-time kernel choice;
//! - `avx2`: the x86-64 kernels (AVX2, FMA, F16C);
//! - `avx512`: the AVX-512 and VNNI kernels on AVX2's frame (Ice Lake, Sapphire Rapids, Zen 4);
//! - [`tile`]: the K-quants' prefill products over rows unpacked once per product;
//! - [`interleave`]: Q4_0, Q4_1 and Q8_0 repacked into groups of 16 rows at load, one kernel for
//!   every token count (AVX2, AVX-512 VNNI);
//! - [`interleave_k`]: Q4_K, Q5_K and Q6_K repacked the same way (AVX2, AVX-512 VNNI);
//! - [`matrix`]: packed matrices and their threaded products (decode rows and prefill tiles);
//! - [`team`]: the pool's threads held together for a forward pass (one wake-up, not one per
//!   product);
//! - `attention`: causal attention over the KV cache (query heads of a KV head together, keys
//!   in blocks of 16 positions), and the vector `exp`;
//! - [`engine`]: the decoder on top ([`CpuModel`], [`CpuCache`]: a table of KV blocks);
//! - [`prefix`]: blocks of earlier requests' caches, reused by requests that begin the same way.
//!
//! - `neon`: the aarch64 kernels (the scalar reference's arithmetic, 16 bytes at a time).
//!
//! Other processors run the scalar kernels.

mod attention;
#[doc(hidden)]
pub mod conformance;
pub mod dot;
pub mod encoder;
pub mod engine;
pub mod interleave;
pub mod interleave_k;
pub mod matrix;
pub mod prefix;
pub mod team;
pub mod tile;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

pub use attention::KEY_BLOCK;
pub use attention::KvBlock;
pub use encoder::CpuBert;
pub use engine::{CpuCache, CpuModel, KvPrecision, RopePairs};
pub use prefix::{PrefixCache, PrefixStats};
pub use matrix::{Activations, Bytes, PackedMatrix};

/// Sequential read bandwidth of main memory in bytes/s with the pool's threads: the best of five
/// passes over a 1 GiB buffer (larger than any cache here), each thread summing its own slices
/// with software prefetch, as the kernels read. What a decode step that streams every weight
/// once is bounded by (`headroom model bench`, `headroom plan` and headroom-bench print it).
pub fn measure_read_bandwidth() -> f64 {
    use rayon::prelude::*;
    let words = (1usize << 30) / 8;
    let buffer: Vec<u64> = (0..words as u64).into_par_iter().map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).collect();
    let mut best = 0f64;
    for _ in 0..5 {
        let started = std::time::Instant::now();
        // Eight independent lanes per thread, so the loads vectorize and overlap like a kernel's.
        let sum: u64 = buffer
            .par_chunks(1 << 16)
            .map(|c| {
                let mut lanes = [0u64; 8];
                for group in c.chunks_exact(8) {
                    // As the kernels do: ask for the line 4 KiB ahead (the hardware prefetcher
                    // stops at page boundaries), so this measures what a kernel can stream.
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                        _mm_prefetch::<_MM_HINT_T0>(group.as_ptr().wrapping_add(512) as *const i8);
                    }
                    for (l, v) in lanes.iter_mut().zip(group) {
                        *l = l.wrapping_add(*v);
                    }
                }
                lanes.iter().fold(0u64, |a, &b| a.wrapping_add(b))
            })
            .reduce(|| 0, u64::wrapping_add);
        let seconds = started.elapsed().as_secs_f64();
        std::hint::black_box(sum);
        best = best.max((words * 8) as f64 / seconds);
    }
    best
}
