#!/usr/bin/env bash
# Fuzzes every documented endpoint of a real `headroom serve` (CPU only, the kjv-demo fixture) with
# schemathesis: any 5xx or a dead server fails. /v1/events is an endless stream: left out.
set -euo pipefail
cd "$(dirname "$0")/.."
data="$(mktemp -d)"
log="$data/serve.log"
./target/debug/headroom serve --gpu none --model kjv-demo --port 0 --data-dir "$data" >"$data/out" 2>"$log" &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
url=""
for _ in $(seq 1 600); do
  url="$(grep -o 'http://[0-9.:]*' "$data/out" | head -1 || true)"
  [ -n "$url" ] && break
  kill -0 $pid 2>/dev/null || { cat "$log"; echo "headroom serve exited before listening"; exit 1; }
  sleep 0.2
done
[ -n "$url" ] || { cat "$log"; echo "headroom serve did not start"; exit 1; }
.venv/bin/schemathesis run "$url/openapi.json" \
  --checks not_a_server_error \
  --exclude-path /v1/events \
  --max-examples "${SCHEMATHESIS_EXAMPLES:-40}" \
  --request-timeout 120 \
  --generation-deterministic \
  --suppress-health-check all
kill -0 $pid || { cat "$log"; echo "headroom serve died during the run"; exit 1; }
