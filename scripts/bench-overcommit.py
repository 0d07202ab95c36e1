#!/usr/bin/env python3
"""KV overcommit on a fixed sim GPU budget, side by side in one run: the chats the GPU runs at
once and the tokens/s they get with every KV block reserved up front (kv_overcommit 1) against
overcommit (kv_overcommit 4), on the default model.

Workload: `--chats` chats at once, each a shared system prompt (~`--system-tokens`) and its own
question, max_tokens `--max-tokens`, read as a stream that the client stops after
`--stop-after` tokens (a chat that ends long before its max_tokens; the client's disconnect
cancels the request), `--turns` turns each. The sim GPU is sized so that with every block
reserved `--fit` such requests fit beside the weights and the reserve (the reservation is
measured on a probe server). Reported per setting: replies begun on the GPU and on the CPU (the
placement header: what admission made of the budget), preemptions, tokens/s over the run, and
the most requests holding a GPU slot at once (/v1/status every 50 ms; a request waiting there
for memory holds one too). The CPU worker serves what the GPU does not take, as in production.
On the sim GPU the "GPU" computes on the same cores as the CPU worker, so tokens/s says how the
two workers shared this machine, not what a GPU would give; the placement is the finding.

Usage: .venv/bin/python scripts/bench-overcommit.py [--chats 8] [--turns 2] [--stop-after 150]
"""

import argparse
import json
import threading
import time

import httpx2 as httpx

from bench_serve import DEFAULT_MODEL, Serve

RESERVE_MIB = 64
QUESTIONS = ["How do I water a cactus?", "What is a good name for a cat?", "How far is the moon?", "Why is the sky blue?",
             "How do I boil an egg?", "What is a prime number?", "How do bees make honey?", "What is rain made of?"]


def system_prompt(tokens):
    sentence = "You are a careful assistant for a home server; answer briefly and plainly. "
    return sentence * max(1, tokens // 16)


def chat(url, system, question, max_tokens, stop_after):
    """One turn, streamed and stopped after `stop_after` tokens: (tokens, device it began on)."""
    body = {"model": "default", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        device = r.headers.get("x-headroom-device", "?")
        for line in r.iter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"role"' not in line:
                tokens += 1
                if tokens >= stop_after:
                    break
    return tokens, device


def status(url):
    return httpx.get(url + "/v1/status", timeout=30).json()


def held_while_one_runs(url, system, max_tokens):
    """GPU bytes one request holds while it runs (its reservation), read from /v1/status."""
    done = threading.Event()
    t = threading.Thread(target=lambda: (chat(url, system, QUESTIONS[0], max_tokens, 40), done.set()))
    t.start()
    held = 0
    while not done.is_set():
        held = max(held, status(url)["memory"]["gpu_held_bytes"] or 0)
        time.sleep(0.02)
    t.join()
    return held


def run(setting, url, args, system):
    results, lock = [], threading.Lock()
    peak = {"gpu_running": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            q = {x["device"]: x for x in status(url)["queues"]}
            peak["gpu_running"] = max(peak["gpu_running"], q.get("gpu", {}).get("running", 0))
            time.sleep(0.05)

    def client(i):
        for _ in range(args.turns):
            got = chat(url, system, QUESTIONS[i % len(QUESTIONS)], args.max_tokens, args.stop_after)
            with lock:
                results.append(got)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    clients = [threading.Thread(target=client, args=(i,)) for i in range(args.chats)]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    kv = status(url)["memory"].get("gpu_kv") or {}
    tokens = sum(t for t, _ in results)
    return {
        "setting": setting,
        "replies": len(results),
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_gpu_running": peak["gpu_running"],
        "begun_on_gpu": sum(1 for _, d in results if d != "cpu"),
        "begun_on_cpu": sum(1 for _, d in results if d == "cpu"),
        "preemptions": kv.get("preemptions"),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chats", type=int, default=8)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--stop-after", type=int, default=150)
    p.add_argument("--fit", type=int, default=2, help="requests the sim GPU holds with every block reserved")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    system = system_prompt(args.system_tokens)
    common = ["--gpu", "sim", "--vram-reserve-mib", str(RESERVE_MIB)]

    probe = Serve(DEFAULT_MODEL, args.threads, *common, "--sim-vram-mib", "8192", env={"HEADROOM_KV_OVERCOMMIT": "1"})
    try:
        weights = status(probe.url)["memory"]["gpu"]["weights_bytes"]
        held = held_while_one_runs(probe.url, system, args.max_tokens)
    finally:
        probe.stop()
    mib = 1 << 20
    # Room for `fit` whole reservations and half of one more.
    vram_mib = (weights + int((args.fit + 0.5) * held)) // mib + RESERVE_MIB
    print(json.dumps({"weights_mib": round(weights / mib, 1), "request_reserves_mib": round(held / mib, 1), "sim_vram_mib": vram_mib,
                      "reserve_mib": RESERVE_MIB, "chats": args.chats, "turns": args.turns, "max_tokens": args.max_tokens,
                      "stop_after": args.stop_after, "threads": args.threads}), flush=True)
    for ratio in ("1", "4"):
        serve = Serve(DEFAULT_MODEL, args.threads, *common, "--sim-vram-mib", str(vram_mib), env={"HEADROOM_KV_OVERCOMMIT": ratio})
        try:
            print(json.dumps(run(f"kv_overcommit {ratio}", serve.url, args, system)), flush=True)
        finally:
            serve.stop()


if __name__ == "__main__":
    main()
