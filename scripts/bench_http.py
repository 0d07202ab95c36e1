#!/usr/bin/env python3
"""HTTP + router overhead, side by side in one run on this machine:

1. decode ms/token of the engine called directly (`headroom generate --stats`, in process), and
   of the same request streamed through `headroom serve` (HTTP -> router -> worker process ->
   engine -> back), measured between the first and the last streamed token;
2. requests per second with max_tokens = 1 under 64 concurrent clients (wrk when installed,
   else a Python client pool; the client shares the machine's cores with the server).

Usage: .venv/bin/python scripts/bench_http.py [--tokens 128] [--runs 3] [--seconds 15]
"""

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from conftest import BINARY, Server, httpx  # noqa: E402

PROMPT = "And God said"


def engine_ms_per_token(tokens):
    out = subprocess.run(
        [str(BINARY), "generate", "--model", "default", "--device", "cpu", "--chat", "--prompt", PROMPT,
         "--max-tokens", str(tokens), "--ignore-eos", "--stats", "--seed", "1", "--temperature", "0.8"],
        capture_output=True, text=True, check=True)
    rate = float(re.search(r"decode ([0-9.]+) tok/s", out.stderr).group(1))
    return 1000.0 / rate


def http_ms_per_token(url, tokens):
    """Client-observed ms/token between the first and last streamed token, and the decode
    ms/token the worker's engine measured for the same request (the finishing chunk says)."""
    body = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "seed": 1, "temperature": 0.8, "stream": True, "ignore_eos": True}
    stamps, engine_decode_ms = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            if '"content":"' in line and '"role"' not in line:
                stamps.append(time.perf_counter())
            elif '"decode_ms"' in line:
                engine_decode_ms = json.loads(line[6:])["headroom"]["decode_ms"]
    steps = len(stamps) - 1
    return (stamps[-1] - stamps[0]) * 1000.0 / steps, engine_decode_ms / steps


def rps_wrk(url, seconds, clients):
    body = json.dumps({"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1})
    script = Path(tempfile.mkdtemp()) / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\nwrk.body = %s\n' % json.dumps(body))
    out = subprocess.run(["wrk", "-t2", f"-c{clients}", f"-d{seconds}s", "--latency", "-s", str(script), url + "/v1/chat/completions"],
                         capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([0-9.]+)", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    p99 = re.search(r"99%\s+(\S+)", out)
    return rps, int(non2xx.group(1)) if non2xx else 0, p99.group(1) if p99 else "?", "wrk"


def rps_python(url, seconds, clients):
    body = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 1}
    done, failed = [0], [0]
    stop = time.time() + seconds

    def client():
        with httpx.Client(base_url=url, timeout=60) as c:
            while time.time() < stop:
                r = c.post("/v1/chat/completions", json=body)
                if r.status_code == 200:
                    done[0] += 1
                else:
                    failed[0] += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0] / (time.time() - start), failed[0], "?", "python"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=15)
    ap.add_argument("--clients", type=int, default=64)
    args = ap.parse_args()
    # Queues deep enough for every client: the figure is throughput, not refusals.
    server = Server("--gpu", "none", config="[queues]\ncpu_queue_capacity = 256\n").start()
    try:
        engine, http, same = [], [], []
        for _ in range(args.runs):
            engine.append(engine_ms_per_token(args.tokens))
            client_ms, worker_ms = http_ms_per_token(server.url, args.tokens)
            http.append(client_ms)
            same.append((client_ms, worker_ms))
        e, h = statistics.median(engine), statistics.median(http)
        overhead = statistics.median([c - w for c, w in same])
        worker = statistics.median([w for _, w in same])
        print(f"decode, default model, {args.tokens} tokens (ignore_eos), {args.runs} runs, medians:")
        print(f"  per request: client-observed through HTTP + router {statistics.median([c for c, _ in same]):.3f} ms/token vs its worker's engine {worker:.3f} ms/token")
        print(f"  router + HTTP overhead   {overhead:+.3f} ms/token = {100 * overhead / worker:+.2f}% of decode time (target <= 2%)")
        print(f"  engine in process (headroom generate, separate runs, noisier): {e:.3f} ms/token (runs {', '.join(f'{x:.2f}' for x in engine)}); through serve {h:.3f}")
        rps, non2xx, p99, tool = (rps_wrk if shutil.which("wrk") else rps_python)(server.url, args.seconds, args.clients)
        print(f"max_tokens = 1, {args.clients} concurrent clients, {args.seconds} s ({tool}): {rps:.1f} requests/s, {non2xx} non-2xx, p99 {p99}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
