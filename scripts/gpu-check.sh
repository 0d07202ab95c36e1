#!/usr/bin/env bash
# The CUDA checks, as one script for a lent NVIDIA machine (no network, no Rust there): run from
# the repository root with the binaries built here and packed by `scripts/gpu-check.sh pack`.
#   pack:  strips and compresses target/debug/headroom and headroom-bench (built with
#          `cargo build -p headroom-cli -p headroom-bench --features headroom-bench/cuda`) and the
#          shared libraries they need that a CUDA image may lack (OpenBLAS) into .device/.
#          headroom-bench is optional (`load` does not need it).
#   run [all|second]: generate (cuda vs cpu, greedy 64 tokens) and the engine bench with --cuda
#          (skipped by `second`), `serve --gpu cuda` against a real VRAM competitor, then a fresh
#          process reading the kernel cache the server filled.
#   run load: faults at full load (scripts/gpu_load_check.py): a burst on a cold kernel cache,
#          kill -9 of the GPU worker and a real competing allocation, each with the GPU's slots
#          full and requests queued behind them.
#   run bench: issue 20's CUDA figures only: the 4M default on CUDA against the CPU engines, then
#          (headroom-bench --cuda --only-cuda) the 4M, random ~100M and ~1.24B models at 1, 2, 4
#          and 8 sequences, each beside its bandwidth bound.
#   run split: issue 21's CUDA figures: `headroom model split-bench --device cuda` on the demo
#          model with 0, 1, 2 (half) and 4 (all) of its layers on the GPU: decode tokens/s, the
#          VRAM in use (NVML) and each device's bytes beside the plan's prediction.
#          Everything lands in $OUT (log.txt, bench.json, serve.json).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-run}" = pack ]; then
    rm -rf .device && mkdir -p .device/lib .git/info
    for b in headroom headroom-bench; do
        [ -f target/debug/$b ] || { echo "pack: no target/debug/$b, skipped"; continue; }
        strip -o .device/$b target/debug/$b && xz -T2 -6 .device/$b
    done
    for l in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0; do
        cp -L /lib/x86_64-linux-gnu/$l .device/lib/
    done
    tar -C .device -cJf .device/lib.tar.xz lib && rm -r .device/lib
    grep -qsx '/.device/' .git/info/exclude || echo '/.device/' >> .git/info/exclude
    du -sh .device
    exit 0
fi

OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT" /tmp/hr
exec > >(tee "$OUT/log.txt") 2>&1
step() { echo; echo "=== $* ($(date +%T))"; }

step setup
# Python rather than xz/tar: a CUDA image always has python3.
python3 - <<'PY'
import lzma, shutil, tarfile
import os
for b in ("headroom", "headroom-bench"):
    if not os.path.exists(f".device/{b}.xz"):
        continue
    with lzma.open(f".device/{b}.xz") as src, open(f"/tmp/hr/{b}", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.chmod(f"/tmp/hr/{b}", 0o755)
tarfile.open(".device/lib.tar.xz").extractall("/tmp/hr")
PY
export PATH=/tmp/hr:$PATH
nvrtc=$(ldconfig -p | awk '/libnvrtc\.so/{print $NF; exit}')
[ -z "$nvrtc" ] && nvrtc=$(find /usr/local /opt -name 'libnvrtc.so*' 2>/dev/null | head -1)
export LD_LIBRARY_PATH=/tmp/hr/lib:$(dirname "${nvrtc:-/usr/local/cuda/lib64/x}"):/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
command -v nvcc >/dev/null && export CUDA_PATH=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
echo "nvrtc: $nvrtc; CUDA_PATH=${CUDA_PATH:-unset}"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
export HEADROOM_DEFAULT_MODEL=$PWD/models/kjv-demo
prompt="And God said, Let there be light: and there was light."

if [ "${2:-all}" = bench ]; then
step "bench: the 4M default on cuda against the cpu engines"
timeout 120 headroom-bench --runs 2 --cuda --skip-100m --json "$OUT/bench-default.json"
step "bench: headroom on cuda only, 4M, ~100M and ~1.24B models, 1-8 sequences, bandwidth bounds"
timeout 420 headroom-bench --runs 2 --cuda --only-cuda --random-1b --json "$OUT/bench-cuda.json"
step done
exit 0
fi

if [ "${2:-all}" = split ]; then
step "split: the demo model with 0, 1, 2 and 4 of its 4 layers on cuda:0"
timeout 300 headroom model split-bench kjv-demo --device cuda --gpu-layers 0,1,2,4 --runs 3 | tee "$OUT/split-bench.jsonl"
step done
exit 0
fi

if [ "${2:-all}" = load ]; then
step "faults at full load: serve --gpu cuda, cold kernel cache"
mkdir -p /tmp/hr/load
export HEADROOM_CACHE_DIR=/tmp/hr/load/cache
printf '[memory]\nmax_queue_wait_ms = 5000\n\n[supervision]\nhealth_interval_ms = 500\n' > /tmp/hr/load/headroom.toml
HEADROOM_LOG=warn,headroom_worker=info,headroom_router=info headroom serve --port 18081 --gpu cuda --config /tmp/hr/load/headroom.toml --data-dir /tmp/hr/load/data > /tmp/hr/load/out.log 2>&1 &
server=$!
for i in $(seq 300); do curl -sf localhost:18081/healthz >/dev/null && break; sleep 0.5; done
timeout 420 python3 scripts/gpu_load_check.py http://127.0.0.1:18081 "$OUT/load.json"
kill $server; wait $server
sed 's/\x1b\[[0-9;]*m//g' /tmp/hr/load/out.log | grep -E "warmed|breaker|health|worker process|device fault|failover|model loaded|ERROR" | tail -40
cp /tmp/hr/load/out.log "$OUT/serve-load.log" 2>/dev/null
step done
exit 0
fi

if [ "${2:-all}" = all ]; then
step "generate: cuda vs cpu, greedy, 64 tokens"
timeout 150 headroom generate --device cuda --prompt "$prompt" --max-tokens 64 --ignore-eos --stats > /tmp/hr/cuda.txt
timeout 40 headroom generate --device cpu --prompt "$prompt" --max-tokens 64 --ignore-eos --stats > /tmp/hr/cpu.txt
echo "cuda: $(cat /tmp/hr/cuda.txt)"; echo "cpu:  $(cat /tmp/hr/cpu.txt)"
cmp -s /tmp/hr/cuda.txt /tmp/hr/cpu.txt && echo "greedy text: identical" || echo "greedy text: DIFFERENT"

step "bench: headroom cpu vs candle cpu, and headroom cuda"
timeout 170 headroom-bench --runs 3 --cuda --json "$OUT/bench.json"

fi
step "serve --gpu cuda with a real VRAM competitor"
mkdir -p /tmp/hr/serve
printf '[memory]\nmax_queue_wait_ms = 2000\n\n[supervision]\nhealth_interval_ms = 500\n' > /tmp/hr/serve/headroom.toml
HEADROOM_LOG=warn,headroom_worker=info headroom serve --port 18080 --gpu cuda --config /tmp/hr/serve/headroom.toml --data-dir /tmp/hr/serve/data > /tmp/hr/serve/out.log 2>&1 &
server=$!
for i in $(seq 120); do curl -sf localhost:18080/healthz >/dev/null && break; sleep 0.5; done
timeout 200 python3 scripts/gpu_serve_check.py http://127.0.0.1:18080 "$OUT/serve.json"
kill $server; wait $server
grep -E "warmed|breaker|worker process|device fault|model loaded" /tmp/hr/serve/out.log | sed 's/\x1b\[[0-9;]*m//g' | tail -30
step "kernel cache: a fresh process after the server filled it"
time timeout 60 headroom generate --device cuda --prompt "$prompt" --max-tokens 8 --stats >/dev/null
step done
