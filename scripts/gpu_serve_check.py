"""`headroom serve --gpu cuda` against a real competitor for VRAM (run by scripts/gpu-check.sh on a
machine with an NVIDIA GPU and PyTorch).

Phases: requests on a healthy GPU; a second program (this one, through PyTorch) takes nearly all
free VRAM and requests are sent while it holds it, some right after it grabs the memory (before
Headroom's next memory sample, where a real CUDA allocation failure can happen); the competitor
lets go and the GPU must serve again. Records every response's device, degraded flag and reason,
failovers, the service events, and checks that no accepted request was lost.
Usage: gpu_serve_check.py BASE_URL OUT_JSON
"""
import json
import sys
import time
import urllib.error
import urllib.request

import torch

from gpu_client import Service, fill_vram

BASE, OUT = sys.argv[1], sys.argv[2]
service = Service(BASE)
events = service.events
status, wait_gpu_ready = service.status, service.wait_gpu_ready
results = []


def chat(phase, prompt="And God said", max_tokens=48):
    body = json.dumps({
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }).encode()
    request = urllib.request.Request(f"{BASE}/v1/chat/completions", body, {"content-type": "application/json"})
    started = time.time()
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
        h = answer["headroom"]
        row = {
            "phase": phase, "status": 200, "ms": (time.time() - started) * 1000, "device": h["device"],
            "degraded": h["degraded"], "degraded_reason": h["degraded_reason"], "failovers": h["failovers"],
            "admission": h.get("admission"), "request_id": h["request_id"],
            "text": answer["choices"][0]["message"]["content"],
        }
    except urllib.error.HTTPError as e:
        row = {"phase": phase, "status": e.code, "ms": (time.time() - started) * 1000, "error": e.read().decode()[:400]}
    results.append(row)
    print(json.dumps({k: row.get(k) for k in ("phase", "status", "device", "degraded", "degraded_reason", "failovers", "error")}), flush=True)
    return row


def save(report):
    report["results"] = results
    report["events"] = events
    json.dump(report, open(OUT, "w"), indent=1)


service.watch_events()
torch.cuda.init()
started = time.time()
report = {"gpu_ready_at_start": wait_gpu_ready(120), "gpu_ready_after_s": time.time() - started}

for i in range(4):
    chat("healthy")

# A competitor holds almost everything: admission must see it (NVML) and redirect, marked degraded.
competitor = fill_vram(leave_mib=64)
report["competitor_held_gib"] = sum(b.numel() for b in competitor) / 2**30
time.sleep(2.5)  # past the worker's next memory sample
report["status_while_full"] = status()["memory"]
for i in range(3):
    chat("vram_full", max_tokens=64)
del competitor
torch.cuda.empty_cache()
report["gpu_restored_after_full"] = wait_gpu_ready(60)
time.sleep(1.5)
chat("after_release")
save(report)

# Races: grab the memory and ask at once, before Headroom's next sample; a long request needs new
# allocator pages, so the CUDA allocation itself can fail (a real OOM), which must fail over.
for attempt in range(3):
    competitor = fill_vram(leave_mib=0)
    chat("race", prompt="And God said " * 60, max_tokens=600)
    del competitor
    torch.cuda.empty_cache()
    released = time.time()
    restored = wait_gpu_ready(45)
    report.setdefault("gpu_restored_after_race", []).append({"restored": restored, "after_s": time.time() - released})
    save(report)
    time.sleep(1.0)

chat("final")
time.sleep(1.0)
ok = [r for r in results if r["status"] == 200]
report["summary"] = {
    "requests": len(results),
    "ok": len(ok),
    "by_device": {d: sum(1 for r in ok if r["device"] == d) for d in sorted({r["device"] for r in ok})},
    "degraded": sum(1 for r in ok if r["degraded"]),
    "degraded_without_reason": sum(1 for r in ok if r["degraded"] and not r["degraded_reason"]),
    "with_failover": sum(1 for r in ok if r["failovers"]),
    "final_on_gpu": results[-1].get("device") not in (None, "cpu"),
    "event_kinds": sorted({e.get("event", "?") for e in events}),
}
print(json.dumps(report["summary"], indent=1))
save(report)
