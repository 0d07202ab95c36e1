"""Two chat models whose CPU paths run the same model share one CPU worker: one process, one
queue in front of it, its weights in host RAM once. Fault at full load: model A's GPU slots
full with requests queued behind them, model B's requests on the shared CPU worker (B finds no
room beside busy A), then A's GPU worker gets kill -9 and A's requests fail over into the same
CPU queue. Nothing accepted is lost. The negative control puts a queue per model in front of
the shared worker (HEADROOM_TEST_DEFECT=cpu-lane-per-model): A's failovers then meet the
worker busy with B's request, and are lost."""

import json
import os
import shutil
import signal
import threading
import time

from conftest import ROOT, Server, httpx

# 24 MiB of sim VRAM and no reserve: one copy of the 15 MiB fixture and its requests fit, two
# do not. Both entries serve the same folder, so their CPU paths run the same model.
CONFIG = """
[memory]
vram_reserve_mib = 0

[[models]]
source = "kjv-demo"
name = "chat-a"

[[models]]
source = "kjv-demo"
name = "chat-b"
"""


def serve(env=None):
    return Server("--model", "default", "--gpu", "sim", "--sim-vram-mib", "24", config=CONFIG, env=env).start()


def models(server):
    return {m["id"]: m for m in server.status()["models"]}


def lane(model, device):
    return next(q for q in model["queues"] if q["device"] == device)


def chat(server, model, i, max_tokens, stream):
    """One chat request; gives (status code, why it failed or None, the device that ended it)."""
    body = {"model": model, "messages": [{"role": "user", "content": f"And God said {i}"}], "max_tokens": max_tokens, "stream": stream}
    if not stream:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
        if r.status_code != 200:
            return r.status_code, r.text[:200], None
        return 200, None, r.headers["x-headroom-device"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()[:200], None
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    errors = [line for line in lines[:-1] if "error" in json.loads(line[6:])]
    if errors or not lines or lines[-1] != "data: [DONE]":
        return 200, f"the stream ended in an error: {(errors or lines[-1:])[0][:200]}", None
    return 200, None, "streamed"


def through_a_gpu_kill(server):
    """A's 4 GPU slots full (each step slowed 100×) and 4 queued, B's 3 requests on the shared
    one-slot CPU worker (one running, two queued), then kill -9 of A's GPU worker. Gives what
    was lost after acceptance, and the devices that ended A's non-streaming requests."""
    assert httpx.patch(server.url + "/v1/settings", json={"cpu_max_concurrency": 1}, timeout=120).status_code == 200
    assert httpx.post(server.url + "/admin/sim/fault", json={"fault": "slowdown", "factor": 100}, timeout=30).status_code == 200
    results = {}

    def send(model, i, max_tokens):
        results[(model, i)] = chat(server, model, i, max_tokens, stream=i % 2 == 0)

    threads = [threading.Thread(target=send, args=("chat-a", i, 48)) for i in range(8)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while not (lane(models(server)["chat-a"], "gpu")["running"] == 4 and lane(models(server)["chat-a"], "gpu")["waiting"] >= 4):
        assert time.time() < deadline, f"A's GPU slots never filled: {models(server)['chat-a']['queues']}"
        time.sleep(0.02)
    more = [threading.Thread(target=send, args=("chat-b", i, 24)) for i in range(3)]
    for t in more:
        t.start()
    while not lane(models(server)["chat-b"], "cpu")["running"] == 1:
        assert time.time() < deadline, f"B's requests never reached the CPU worker: {models(server)['chat-b']['queues']}"
        time.sleep(0.02)
    now = models(server)
    assert lane(now["chat-a"], "gpu")["running"] == 4, "A's GPU slots are still full at the kill"
    os.kill(now["chat-a"]["gpu_pid"], signal.SIGKILL)
    for t in threads + more:
        t.join(timeout=300)
    assert len(results) == 11, f"requests that never ended: {11 - len(results)}"
    lost = {key: why for key, (code, why, _) in results.items() if code != 200 or why}
    return lost, [device for (model, i), (_, _, device) in results.items() if model == "chat-a" and i % 2 == 1]


def test_two_models_share_one_cpu_worker_through_a_gpu_kill_at_full_load():
    server = serve()
    try:
        now = models(server)
        assert now["chat-a"]["cpu_pid"] == now["chat-b"]["cpu_pid"], "one CPU worker for both"
        cards = {c["id"]: c["headroom"] for c in httpx.get(server.url + "/v1/models", timeout=10).json()["data"]}
        assert cards["chat-a"]["cpu_worker_shared_with"] == ["chat-b"] and cards["chat-b"]["cpu_worker_shared_with"] == ["chat-a"], cards
        lost, a_devices = through_a_gpu_kill(server)
        assert not lost, f"lost after acceptance: {lost}"
        assert "cpu" in a_devices, f"none of A's requests failed over: {a_devices}"
        # The settings change replaced the shared worker once, for both.
        now = models(server)
        assert now["chat-a"]["cpu_pid"] == now["chat-b"]["cpu_pid"]
    finally:
        server.stop()


def test_negative_control_a_queue_per_model_in_front_of_the_shared_worker_loses_requests():
    server = serve(env={"HEADROOM_TEST_DEFECT": "cpu-lane-per-model"})
    try:
        lost, _ = through_a_gpu_kill(server)
        assert lost, "the defect lost nothing"
        print(lost)
    finally:
        server.stop()


def test_a_shared_cpu_worker_keeps_its_model_for_every_model(tmp_path):
    """One model cannot change the CPU model under the other: a clear 400, nothing changed."""
    other = tmp_path / "kjv-copy"
    shutil.copytree(ROOT / "models" / "kjv-demo", other)
    server = serve()
    try:
        before = models(server)["chat-b"]["cpu_pid"]
        r = httpx.patch(server.url + "/v1/settings", params={"model": "chat-b"}, json={"fallback_model": str(other)}, timeout=120)
        assert r.status_code == 400 and "share it" in r.json()["error"]["message"] and "[[models]]" in r.json()["error"]["message"], r.text
        assert models(server)["chat-b"]["cpu_pid"] == before
        assert httpx.get(server.url + "/v1/settings", params={"model": "chat-b"}, timeout=10).json()["settings"]["fallback_model"] is None
    finally:
        server.stop()
