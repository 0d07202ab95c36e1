"""Faults at full load on a real GPU: `headroom serve --gpu cuda` (run by scripts/gpu-check.sh on
a machine with an NVIDIA GPU and PyTorch), fresh kernel cache.

Phases, each with more requests in flight than the GPU worker's slots (the rest queued behind
them), half streaming:
  cold:    a burst on a cold kernel cache; no health check may kill the busy worker.
  kill:    kill -9 of the GPU worker once its slots are full and requests wait behind them.
  compete: a second program (PyTorch, this one) takes nearly all free VRAM while a burst runs.
A request is lost if it was accepted and did not complete. Records every request's device,
failovers, latency and first-token time, and the service events.
Usage: gpu_load_check.py BASE_URL OUT_JSON
"""
import json
import os
import signal
import sys
import threading
import time
import urllib.error
import urllib.request

import torch

from gpu_client import Service, fill_vram

BASE, OUT = sys.argv[1], sys.argv[2]
IN_FLIGHT = 12
service = Service(BASE)
events = service.events
wait_gpu_ready = service.wait_gpu_ready
report = {"phases": {}}


def get(path):
    return service.get(path)


def chat(i, max_tokens, stream):
    body = json.dumps({
        "model": "default",
        "messages": [{"role": "user", "content": f"And God said unto Moses, {i}"}],
        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
    }).encode()
    request = urllib.request.Request(f"{BASE}/v1/chat/completions", body, {"content-type": "application/json"})
    started = time.time()
    row = {"i": i, "stream": stream, "status": 0, "completed": False}
    try:
        with urllib.request.urlopen(request, timeout=600) as r:
            row["status"] = r.status
            if not stream:
                answer = json.loads(r.read())
                h = answer["headroom"]
                row.update(device=h["device"], failovers=len(h["failovers"]), tokens=answer["usage"]["completion_tokens"],
                           completed=answer["choices"][0]["finish_reason"] is not None)
            else:
                notices = []
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if "error" in chunk:
                        row["error"] = chunk["error"].get("message")
                        continue
                    h = chunk.get("headroom") or {}
                    if h.get("notice"):
                        notices.append(h["notice"])
                    choice = (chunk.get("choices") or [{}])[0]
                    if choice.get("delta", {}).get("content") and "first_token_s" not in row:
                        row["first_token_s"] = time.time() - started
                    if "failovers" in h:
                        row.update(device=h["device"], failovers=len(h["failovers"]))
                    if choice.get("finish_reason"):
                        row["completed"] = "error" not in row
                row["notices"] = notices
    except urllib.error.HTTPError as e:
        row.update(status=e.code, error=e.read().decode()[:300])
    except Exception as e:
        row["error"] = f"transport: {e}"
    row["s"] = time.time() - started
    return row


def gpu_queue():
    return next((q for q in get("/v1/status")["queues"] if q["device"] == "gpu"), {})


def burst(name, max_tokens, fault=None):
    """IN_FLIGHT requests at once; `fault` fires once the GPU's slots are full with requests queued."""
    rows = [None] * IN_FLIGHT
    threads = [threading.Thread(target=lambda i=i: rows.__setitem__(i, chat(i, max_tokens, i % 2 == 0))) for i in range(IN_FLIGHT)]
    started = time.time()
    for t in threads:
        t.start()
    phase = {"requests": IN_FLIGHT, "max_tokens": max_tokens}
    if fault:
        deadline = time.time() + 120
        q = {}
        while time.time() < deadline:
            q = gpu_queue()
            if q.get("running", 0) >= 1 and q.get("waiting", 0) >= 1:
                break
            time.sleep(0.02)
        phase["at_fault"] = {"gpu_running": q.get("running"), "gpu_waiting": q.get("waiting"), "after_s": time.time() - started}
        phase["fault"] = fault()
    for t in threads:
        t.join()
    accepted = [r for r in rows if r["status"] == 200 or r["status"] >= 500 or r.get("error", "").startswith("transport")]
    phase.update(
        wall_s=time.time() - started,
        completed=sum(r["completed"] for r in rows),
        lost=sum(1 for r in accepted if not r["completed"]),
        refused=sum(1 for r in rows if 400 <= r["status"] < 500),
        by_device={d: sum(1 for r in rows if r.get("device") == d) for d in sorted({r.get("device") or "-" for r in rows})},
        failed_over=sum(1 for r in rows if r.get("failovers")),
        first_token_s_max=max([r["first_token_s"] for r in rows if "first_token_s" in r] or [None]),
        rows=rows,
    )
    report["phases"][name] = phase
    print(name, json.dumps({k: v for k, v in phase.items() if k != "rows"}), flush=True)
    save()


def kill_gpu_worker():
    s = get("/v1/status")
    pid = next(w["pid"] for w in s["workers"] if w["kind"] == "gpu")
    os.kill(pid, signal.SIGKILL)
    return {"killed_pid": pid}


def save():
    report["events"] = events
    report["health_check_failures"] = [e for e in events if e.get("event") == "health_check_failed"]
    json.dump(report, open(OUT, "w"), indent=1)


service.watch_events()
torch.cuda.init()
report["gpu_ready_at_start"] = wait_gpu_ready(300)
burst("cold", 200)
report["gpu_ready_after_cold"] = wait_gpu_ready(120)
burst("kill", 200, kill_gpu_worker)
report["gpu_ready_after_kill"] = wait_gpu_ready(120)
held = []


def compete():
    held.extend(fill_vram(leave_mib=0))
    return {"competitor_gib": sum(b.numel() for b in held) / 2**30}


burst("compete", 200, compete)
held.clear()
torch.cuda.empty_cache()
report["gpu_ready_after_compete"] = wait_gpu_ready(120)
burst("after", 64)
report["summary"] = {name: {k: p[k] for k in ("completed", "lost", "refused", "by_device", "failed_over", "wall_s", "first_token_s_max")} for name, p in report["phases"].items()}
report["summary"]["health_check_failures"] = len(report["health_check_failures"])
print(json.dumps(report["summary"], indent=1))
save()
