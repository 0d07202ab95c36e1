#!/usr/bin/env bash
# Builds the CPU engine for aarch64 and runs its kernel check (NEON against the scalar
# reference) under qemu-user, on an x86-64 Debian machine.
#
#   bash scripts/check-aarch64.sh          # installs what it needs (apt, rustup target) first
#
# Only the single-threaded check runs (tests/kernels_on_one_thread.rs): threads do not start
# under qemu-user on our machines, so the test harness (a thread per test) cannot run there.
# Not a CI step: the aarch64 standard library comes from rustup's server, not one of the
# registries CI may download from.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null \
    || [ ! -e /usr/lib/aarch64-linux-gnu/libopenblas.so ]; then
    # burn-ndarray links OpenBLAS, so the arm64 build of it is needed to link the test.
    dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross libopenblas-dev:arm64
fi
rustup target list --installed | grep -qx aarch64-unknown-linux-gnu || rustup target add aarch64-unknown-linux-gnu

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
# OpenBLAS starts its thread pool when it loads; one thread means no pool.
export OPENBLAS_NUM_THREADS=1
cargo test --target aarch64-unknown-linux-gnu -p headroom-model --test kernels_on_one_thread
