#!/usr/bin/env bash
# Every test suite of the project, each in its own named step. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n=== %s ===\n' "$*"; }

# CI builds once from cold: incremental compilation would only add time and gigabytes of disk.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"

step "install"
HEADROOM_SKIP_BUILD=1 ./scripts/install.sh
# The end-to-end suites drive a real server with the official openai package and schemathesis.
[ -x .venv/bin/python ] || python3 -m venv .venv
# llama.cpp is built for AVX2/FMA/F16C, not -march=native: some VMs report AMX that a process may
# not use, and a native build dies there with SIGILL on its first matmul.
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
  .venv/bin/pip install -q --disable-pip-version-check -r tests/python/requirements.txt -r tests/reference/requirements.txt

# The browser end-to-end test drives Debian's Chromium (never a downloaded browser); the desktop
# app needs WebKitGTK and the tray library, and its end-to-end test Xvfb, D-Bus and WebKitWebDriver.
desktop_packages="chromium libwebkit2gtk-4.1-dev libgtk-3-dev libayatana-appindicator3-dev librsvg2-dev libxdo-dev libssl-dev pkg-config webkit2gtk-driver xvfb xauth dbus"
if ! dpkg -s $desktop_packages >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $desktop_packages
fi
# tauri-driver (crates.io) bridges WebDriver to the app's WebKitWebDriver.
export PATH="$HOME/.cargo/bin:$PATH"
command -v tauri-driver >/dev/null 2>&1 || cargo install tauri-driver --version 2.1.0 --locked

step "web UI: unit tests (vitest) and build"
npm --prefix ui test
npm --prefix ui run build

# One cargo invocation builds every crate but the candle bench, the desktop app and its binary
# included (it embeds ui/dist, built above; `npm run tauri:build` makes the same binary), so no
# crate is compiled twice; `headroom-workspace-hack` unifies the dependencies' features across
# the workspace (so `cargo test` alone and the desktop app agree on them).
step "rust: unit and integration tests of every crate, the desktop app's included (no CUDA needed; the desktop tests check its committed IPC bindings and its binary)"
cargo test --workspace --exclude headroom-bench

# `cargo test` built target/debug/headroom and target/debug/headroom-desktop (integration tests run
# them); the suites below use them.
step "python: the official openai and ollama packages against headroom serve (chat, stream, stop, seed, idempotency, cancel, capacity, degraded, kill -9; Ollama chat, generate, list, show, ps, errors, a stream failing over mid-answer)"
.venv/bin/python -m pytest -q tests/python

step "ollama npm client: the official ollama package against headroom serve (streamed chat, list, a 404, streams losing the GPU worker at full load; negative control: streams that end at a failover)"
npm --prefix ui run ollama-client

step "reference: GGUF against the gguf package and llama.cpp (dequantization of every type, token ids, teacher-forced top-1 agreement, perplexity; negative controls)"
.venv/bin/python -m pytest -q -s tests/reference

step "schemathesis: generated requests against /openapi.json (no 5xx, no panic)"
./scripts/schemathesis.sh

step "pressure: headroom pressure --profile ci on the sim GPU (OOMs and kill -9 at full load, cancels, shrinking VRAM, several models taking turns on one GPU, agent; the exit code enforces the pass criteria)"
./target/debug/headroom pressure --profile ci --gpu sim --model kjv-demo --out target/pressure-ci

step "pressure negative control: with idempotency switched off the agent must see duplicate side effects and the run must fail"
if ./target/debug/headroom pressure --profile ci --gpu sim --model kjv-demo --control idempotency-off --out target/pressure-control 2>&1 | tee target/pressure-control.log; then
  echo "the negative control passed: the duplicate criterion cannot fail"
  exit 1
fi
grep -q "pressure run failed: zero duplicate side effects" target/pressure-control.log

step "pressure negative control: with admission blind to the other models sharing the GPU, what they hold must pass its budget and the run must fail"
if ./target/debug/headroom pressure --profile ci --gpu sim --model kjv-demo --control gpu-share-ignored --out target/pressure-control-models 2>&1 | tee target/pressure-control-models.log; then
  echo "the negative control passed: the several-models criterion cannot fail"
  exit 1
fi
grep -q "pressure run failed: several models: the models and the competing program on the GPU passed" target/pressure-control-models.log

step "bench: decode tokens/s as the sim GPU's share of the model's layers varies (headroom model split-bench; reported, never a pass criterion)"
./target/debug/headroom model split-bench kjv-demo --runs 2 | tee target/split-bench.jsonl


step "web UI end-to-end: Debian's Chromium (playwright-core) against headroom serve --gpu sim; screenshots in docs/screenshots"
npm --prefix ui run e2e

step "desktop end-to-end: the app's real window under Xvfb through tauri-driver and WebKitWebDriver (chat, GPU paused and resumed from Settings, injected OOMs, degraded notice); screenshot in docs/screenshots"
NO_AT_BRIDGE=1 WEBKIT_DISABLE_COMPOSITING_MODE=1 xvfb-run -a dbus-run-session -- node ui/tests/desktop.mjs
