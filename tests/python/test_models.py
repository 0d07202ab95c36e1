"""Several models in one `headroom serve` on one sim GPU: a chat model and an embedding model
(a copy of the 4M fixture, named in the config, with 3 of its 4 layers on the GPU), on a GPU that
holds one of them at a time. Each
request names its model; the other one is evicted to make room and loads again when asked for;
a request of the wrong kind for a model, or for a model not served, gets a clear 4xx."""

import json
import re
import shutil
import threading
import time

import pytest

from conftest import ROOT, Server, httpx

# 24 MiB of sim VRAM and no reserve: one 15 MiB model and its requests fit, two models do not.
CONFIG = """
[memory]
vram_reserve_mib = 0
split_min_context_tokens = 64

[[models]]
source = "{embedder}"
name = "kjv-embed"
role = "embedding"
gpu_layers = 3
"""


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    # The folder's name is not the model's: requests use the `name` of its [[models]] entry.
    embedder = tmp_path_factory.mktemp("models") / "embedder-files"
    shutil.copytree(ROOT / "models" / "kjv-demo", embedder)
    server = Server("--gpu", "sim", "--sim-vram-mib", "24", config=CONFIG.format(embedder=embedder)).start()
    yield server
    server.stop()


def chat(url, model):
    return httpx.post(url + "/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "And God said"}], "max_tokens": 8}, timeout=120)


def embed(url, model):
    return httpx.post(url + "/v1/embeddings", json={"model": model, "input": "In the beginning"}, timeout=120)


def where(server):
    """Each served model's state now: gpu or cpu (only its CPU worker holds it)."""
    return {m["id"]: m["state"] for m in server.status()["models"]}


def test_models_are_listed_with_their_role_and_where_they_are(two_models):
    cards = httpx.get(two_models.url + "/v1/models", timeout=10).json()["data"]
    assert [c["id"] for c in cards[:2]] == ["kjv-demo", "kjv-embed"]
    assert [c["headroom"]["role"] for c in cards[:2]] == ["chat", "embedding"]
    assert cards[0]["headroom"]["state"] == "gpu", "the first model loads at start"
    tags = [m["name"] for m in httpx.get(two_models.url + "/api/tags", timeout=10).json()["models"]]
    assert tags == ["kjv-demo:latest", "kjv-embed:latest"]


def watch_events(url, until_event, seen, subscribed):
    """Reads /v1/events into `seen` until an event named `until_event` arrives (or the server
    closes the stream, which the test's assertion then reports)."""
    try:
        with httpx.stream("GET", url + "/v1/events", timeout=60) as stream:
            name = None
            for line in stream.iter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("data:") and name:
                    seen.append((name, json.loads(line[5:])))
                    # The stream opens with a status: from here on nothing is missed.
                    subscribed.set()
                    if name == until_event:
                        return
    except httpx.HTTPError:
        pass


def metric(url, name, **labels):
    text = httpx.get(url + "/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{want}\}} (\d+)$", text, re.M)
    return int(m.group(1)) if m else None


def test_each_model_takes_the_gpu_in_turn_by_evicting_the_idle_other(two_models):
    seen, subscribed = [], threading.Event()
    watcher = threading.Thread(target=watch_events, args=(two_models.url, "gpu_model_unloaded", seen, subscribed), daemon=True)
    watcher.start()
    assert subscribed.wait(timeout=30)
    r = embed(two_models.url, "kjv-embed")
    assert r.status_code == 200, r.text
    assert r.headers["x-headroom-device"] == "sim", "the chat model made way"
    assert r.headers.get("x-headroom-split") == "3/4", "the embedding model's own gpu_layers"
    assert r.json()["data"][0]["headroom"]["degraded"] is False
    # Its `gpu_layers`: split, 3 of 4 layers on the GPU.
    assert where(two_models) == {"kjv-demo": "cpu", "kjv-embed": "split"}
    watcher.join(timeout=30)
    evicted = [e for name, e in seen if name == "gpu_model_unloaded"]
    assert evicted and evicted[0]["model"] == "kjv-demo" and "evicted to make room for kjv-embed" in evicted[0]["reason"], seen[-5:]
    assert metric(two_models.url, "headroom_model_loaded_on_gpu", model="kjv-embed", role="embedding") == 1
    assert metric(two_models.url, "headroom_model_loaded_on_gpu", model="kjv-demo", role="chat") == 0
    assert metric(two_models.url, "headroom_model_gpu_unloads_total", model="kjv-demo") == 1
    r = chat(two_models.url, "kjv-demo")
    assert r.status_code == 200, r.text
    assert r.headers["x-headroom-device"] == "sim"
    assert r.json()["headroom"]["degraded"] is False
    assert where(two_models) == {"kjv-demo": "gpu", "kjv-embed": "cpu"}
    ollama = httpx.post(two_models.url + "/api/embed", json={"model": "kjv-embed:latest", "input": ["a", "b"]}, timeout=120)
    assert ollama.status_code == 200, ollama.text
    assert len(ollama.json()["embeddings"]) == 2
    # A request's id finds its model's journal.
    rid = r.headers["x-request-id"]
    assert httpx.get(two_models.url + f"/v1/requests/{rid}", timeout=10).json()["state"] == "completed"


def test_wrong_kind_or_unknown_model_is_a_clear_error(two_models):
    r = chat(two_models.url, "kjv-embed")
    assert r.status_code == 400 and "is an embedding model" in r.json()["error"]["message"], r.text
    r = embed(two_models.url, "kjv-demo")
    assert r.status_code == 400 and 'embeddings are served by "kjv-embed"' in r.json()["error"]["message"], r.text
    for name in ["llama3", "../models/kjv-demo", "/etc/passwd"]:
        r = chat(two_models.url, name)
        assert r.status_code == 404, r.text
        assert '"kjv-demo", "kjv-embed"' in r.json()["error"]["message"], r.text
    r = httpx.post(two_models.url + "/api/chat", json={"model": "kjv-embed", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400 and "embedding model" in r.json()["error"], r.text


def test_pausing_the_gpu_in_settings_pauses_it_for_every_model(two_models):
    r = httpx.patch(two_models.url + "/v1/settings", json={"gpu_paused": True}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        for name, call in [("kjv-embed", embed), ("kjv-demo", chat)]:
            r = call(two_models.url, name)
            assert r.status_code == 200, r.text
            assert r.headers["x-headroom-device"] == "cpu", f"{name} still ran on the paused GPU"
    finally:
        assert httpx.patch(two_models.url + "/v1/settings", json={"gpu_paused": False}, timeout=60).status_code == 200


def test_a_competing_program_bites_every_model_on_the_shared_gpu(two_models):
    """A sim fault of the device's surroundings without a `model` goes to every model, and to
    the workers launched later: the competitor is on the GPU, not in one model's worker."""
    mib = 1024 * 1024
    # A GPU worker starting again (the GPU resumed in the test before) takes requests only when
    # ready: each model is loaded with its worker up, or unloaded.
    deadline = time.time() + 30
    while not all(m["gpu_pid"] or m["gpu_residency"]["state"] == "unloaded" for m in two_models.status()["models"]):
        assert time.time() < deadline, two_models.status()["models"]
        time.sleep(0.1)
    r = httpx.post(two_models.url + "/admin/sim/fault", json={"fault": "compete", "mib": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["models"] == ["kjv-demo", "kjv-embed"], r.text
    try:
        for name, call in [("kjv-embed", embed), ("kjv-demo", chat)]:
            r = call(two_models.url, name)
            assert r.status_code == 200 and r.headers["x-headroom-device"] == "sim", r.text
            # The worker that loaded the model for this request holds the competitor too.
            deadline = time.time() + 10
            while True:
                s = two_models.status()
                entry = next(m for m in s["models"] if m["id"] == name)
                if entry["state"] in ("gpu", "split") and s["memory"]["gpu_other_bytes"] == 2 * mib:
                    break
                assert time.time() < deadline, (name, s["memory"], entry)
                time.sleep(0.1)
            assert entry["gpu_weights_bytes"] > 0 and entry["degraded"] is False, entry
    finally:
        assert httpx.post(two_models.url + "/admin/sim/fault", json={"fault": "compete", "mib": 0}, timeout=30).status_code == 200


def test_metrics_label_every_sample_with_its_model(two_models):
    """With several models, /metrics holds each model's dispatcher metrics with a `model`
    label, each family once: the official Prometheus client's OpenMetrics parser reads it
    (it refuses a family split in two or given twice)."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    assert chat(two_models.url, "kjv-demo").status_code == 200
    assert embed(two_models.url, "kjv-embed").status_code == 200
    families = list(text_string_to_metric_families(httpx.get(two_models.url + "/metrics", timeout=10).text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), names
    requests = next(f for f in families if f.name == "headroom_requests")
    assert {s.labels["model"] for s in requests.samples} == {"kjv-demo", "kjv-embed"}, requests.samples
    unlabelled = [(f.name, s) for f in families for s in f.samples if "model" not in s.labels]
    assert not unlabelled, unlabelled[:3]


def test_each_model_has_its_own_fallback_and_layers_in_settings(two_models):
    """`?model=` names whose fallback model and layer count a settings call reads or changes;
    the other settings are the service's, and changing them keeps each model's own."""
    url = two_models.url + "/v1/settings"
    first = httpx.get(url, timeout=10).json()
    assert first["model"] == "kjv-demo"
    embed_settings = httpx.get(url, params={"model": "kjv-embed"}, timeout=10).json()
    assert embed_settings["model"] == "kjv-embed" and embed_settings["file"].endswith("settings-kjv-embed.json"), embed_settings
    r = httpx.patch(url, params={"model": "kjv-embed"}, json={"gpu_layers": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["restart_required"] == ["gpu_layers"] and r.json()["settings"]["gpu_layers"] == 2, r.text
    assert httpx.get(url, timeout=10).json()["settings"]["gpu_layers"] == first["settings"]["gpu_layers"], "the first model's is its own"
    fallback = str(ROOT / "models" / "kjv-demo")
    r = httpx.patch(url, params={"model": "kjv-embed"}, json={"fallback_model": fallback}, timeout=120)
    assert r.status_code == 200 and r.json()["settings"]["fallback_model"] == fallback, r.text
    try:
        # A service-wide change (sent for the first model) restarts every CPU worker: each
        # keeps its own fallback model.
        context = first["settings"]["cpu_max_context_tokens"]
        r = httpx.patch(url, json={"cpu_max_context_tokens": context + 64}, timeout=120)
        assert r.status_code == 200 and r.json()["settings"]["fallback_model"] == first["settings"]["fallback_model"], r.text
        embed_settings = httpx.get(url, params={"model": "kjv-embed"}, timeout=10).json()["settings"]
        assert embed_settings["fallback_model"] == fallback and embed_settings["cpu_max_context_tokens"] == context + 64, embed_settings
        r = httpx.get(url, params={"model": "nope"}, timeout=10)
        assert r.status_code == 404 and '"kjv-demo", "kjv-embed"' in r.json()["error"]["message"], r.text
    finally:
        r = httpx.patch(url, params={"model": "kjv-embed"}, json={"fallback_model": None, "gpu_layers": None}, timeout=120)
        assert r.status_code == 200, r.text
        assert httpx.patch(url, json={"cpu_max_context_tokens": first["settings"]["cpu_max_context_tokens"]}, timeout=120).status_code == 200


def test_every_route_names_a_model_alike(two_models):
    """Ollama's `name:tag` and `default` name a model on the OpenAI routes too: one check of a
    request's model for every route."""
    for model in ["kjv-demo:latest", "default"]:
        assert chat(two_models.url, model).status_code == 200, model
        r = httpx.post(two_models.url + "/v1/completions", json={"model": model, "prompt": "And God said", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "kjv-demo"
    assert embed(two_models.url, "kjv-embed:latest").status_code == 200
    r = httpx.post(two_models.url + "/v1/completions", json={"model": "llama3:latest", "prompt": "a", "max_tokens": 4}, timeout=30)
    assert r.status_code == 404 and '"kjv-demo", "kjv-embed"' in r.json()["error"]["message"], r.text
