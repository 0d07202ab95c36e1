"""`kill -9` of the whole service: every accepted, unfinished request is re-run or marked failed
(resumable) on the next start; none vanish, and their clients collect them."""

import threading
import time
import uuid

from conftest import Server, httpx, pids_alive

BODY = {"model": "default", "messages": [{"role": "user", "content": "And it came to pass"}], "max_tokens": 300, "seed": 9, "ignore_eos": True}


def wait_for(predicate, timeout=60, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_kill_9_then_restart_recovers_every_accepted_request():
    server = Server("--gpu", "none").start()
    # One CPU slot (the default runs 4 together), so the second request waits in the queue; the
    # setting is saved in the data directory, so the restarted service has it too.
    httpx.patch(server.url + "/v1/settings", json={"cpu_max_concurrency": 1}, timeout=120).raise_for_status()
    wait_for(lambda: len([w for w in server.status()["workers"] if w["pid"]]) == 1, what="the old CPU worker to exit")
    worker_pids = [w["pid"] for w in server.status()["workers"] if w["pid"]]
    key = str(uuid.uuid4())

    # A stream that has sent tokens (no longer replayable from the start), then a plain request
    # queued behind it on the CPU worker (replayable: nothing of it was delivered).
    stream_id = {}
    streamed = threading.Event()

    def streaming():
        try:
            with httpx.stream("POST", server.url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=120) as r:
                stream_id["id"] = r.headers["x-request-id"]
                for line in r.iter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        streamed.set()
        except httpx.HTTPError:
            pass  # the service dies under it

    def plain():
        try:
            httpx.post(server.url + "/v1/chat/completions", json=BODY, headers={"Idempotency-Key": key}, timeout=120)
        except httpx.HTTPError:
            pass

    threading.Thread(target=streaming, daemon=True).start()
    assert streamed.wait(60), "the stream sent no token"
    threading.Thread(target=plain, daemon=True).start()
    wait_for(lambda: any(q["waiting"] > 0 for q in server.status()["queues"]), what="the plain request to be queued")
    server.kill9()
    # Its workers notice their parent is gone and exit; nothing is left holding memory.
    wait_for(lambda: not pids_alive(worker_pids), timeout=30, what="orphaned workers to exit")

    restarted = Server("--gpu", "none", data_dir=server.data_dir).start()
    try:
        # The same Idempotency-Key collects the plain request: re-run after the restart.
        r = httpx.post(restarted.url + "/v1/chat/completions", json=BODY, headers={"Idempotency-Key": key}, timeout=180)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 300
        record = httpx.get(f"{restarted.url}/v1/requests/{body['headroom']['request_id']}", timeout=10).json()
        assert record["state"] == "completed"
        states = [t["state"] for t in record["transitions"]]
        assert states.count("queued") == 2, states  # before the crash, and again after it
        assert states.count("running") == 1, states  # it had not started: it ran once
        # The stream had delivered tokens: it is not re-run from the start (the client would see
        # text twice) but marked failed, resumable, with the tokens it had sent.
        record = httpx.get(f"{restarted.url}/v1/requests/{stream_id['id']}", timeout=10).json()
        assert record["state"] == "failed", record
        assert "resume" in record["error"], record
        assert record["delivered_tokens"] >= 1, record
    finally:
        restarted.stop()


def test_sigterm_is_a_graceful_shutdown():
    server = Server("--gpu", "none").start()
    worker_pids = [w["pid"] for w in server.status()["workers"] if w["pid"]]
    server.stop()
    assert server.proc.returncode == 0
    wait_for(lambda: not pids_alive(worker_pids), timeout=30, what="workers to exit")
