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
