#!/usr/bin/env bash
# Installs what Headroom needs on Debian 12 and builds the `headroom` binary (target/debug).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need_apt=()
for pkg in build-essential pkg-config libssl-dev libopenblas-dev curl ca-certificates; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# The end-to-end tests make a Python virtual environment.
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}"
fi
if ! command -v cargo >/dev/null 2>&1; then
  [ -x "$HOME/.cargo/bin/cargo" ] || curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
  export PATH="$HOME/.cargo/bin:$PATH"
fi
# The web UI (served at / by `headroom serve`) needs Node.js 20.19 or newer; without it the API
# still works and the page at / says how to build the UI.
if command -v node >/dev/null 2>&1 && node -e 'const [a,b]=process.versions.node.split(".").map(Number); process.exit(a>20||(a===20&&b>=19)?0:1)'; then
  [ -d ui/node_modules ] || npm --prefix ui ci --no-audit --no-fund
  [ -n "${HEADROOM_SKIP_BUILD:-}" ] || npm --prefix ui run build
else
  echo "install: Node.js >= 20.19 not found: skipping the web UI (the API works without it)" >&2
fi
# The test script builds through `cargo test` instead, so CI compiles everything once.
if [ -z "${HEADROOM_SKIP_BUILD:-}" ]; then
  cargo build -p headroom-cli --bin headroom
fi
