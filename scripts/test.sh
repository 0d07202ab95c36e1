#!/usr/bin/env bash
# Every test suite of the project, each in its own named step. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n=== %s ===\n' "$*"; }

step "install"
HEADROOM_SKIP_BUILD=1 ./scripts/install.sh

step "rust: unit and integration tests (default members, no CUDA needed)"
cargo test
