//! Every SIMD kernel set this processor runs equals the scalar reference, checked on the main
//! thread only: the test harness starts a thread per test, and threads do not start under
//! qemu-user on our x86-64 machines, which is where the aarch64 (NEON) kernels are run
//! (`scripts/check-aarch64.sh`). On x86-64 this repeats what the unit tests check.

use headroom_model::cpu::conformance::equals_scalar;
use headroom_model::cpu::dot::Kernels;

fn main() {
    let sets: Vec<Kernels> = Kernels::available().into_iter().filter(|k| k.name != "scalar").collect();
    if sets.is_empty() {
        println!("no SIMD kernels on this processor ({}): nothing to compare", std::env::consts::ARCH);
    }
    for set in sets {
        equals_scalar(set);
        println!("{} ({}): every kernel equals the scalar reference", set.name, std::env::consts::ARCH);
    }
}
