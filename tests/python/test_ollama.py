"""The official `ollama` package against a real `headroom serve --gpu sim`: Headroom as a
drop-in for clients built for Ollama."""

import re
import time

import ollama
import pytest

from conftest import httpx

MESSAGES = [{"role": "user", "content": "And God said"}]
OPTIONS = {"num_predict": 16, "seed": 5, "temperature": 0.8}


@pytest.fixture
def client(sim_server):
    c = ollama.Client(host=sim_server.url, timeout=120)
    yield c
    # A test that injected a fault leaves the GPU as it found it.
    httpx.post(sim_server.url + "/admin/sim/fault", json={"fault": "clear"}, timeout=10)


def test_list_show_ps_and_version(client, sim_server):
    models = client.list().models
    assert [m.model for m in models] == ["kjv-demo:latest"]
    assert models[0].size > 0
    assert models[0].details.parameter_size.endswith("M")
    shown = client.show("kjv-demo")
    assert shown.modelinfo["general.architecture"] == "llama"
    assert shown.details.family == "llama"
    running = client.ps().models
    assert running[0].model == "kjv-demo:latest"
    assert httpx.get(sim_server.url + "/api/version", timeout=10).json()["version"]


def test_chat_and_its_stream_give_the_same_text(client):
    plain = client.chat(model="kjv-demo", messages=MESSAGES, options=OPTIONS)
    assert plain.message.role == "assistant"
    assert plain.done and plain.done_reason in ("stop", "length")
    assert 0 < plain.eval_count <= 16
    assert plain.eval_duration > 0 and plain.prompt_eval_duration > 0 and plain.total_duration >= plain.eval_duration
    pieces = list(client.chat(model="kjv-demo:latest", messages=MESSAGES, options=OPTIONS, stream=True))
    assert all(not p.done for p in pieces[:-1]) and pieces[-1].done
    assert "".join(p.message.content for p in pieces) == plain.message.content
    assert pieces[-1].eval_count == plain.eval_count


def test_generate_plain_and_streamed(client):
    out = client.generate(model="kjv-demo", prompt="In the beginning", options={"num_predict": 8, "seed": 1})
    assert out.done and out.response
    streamed = "".join(p.response for p in client.generate(model="kjv-demo", prompt="In the beginning", options={"num_predict": 8, "seed": 1}, stream=True))
    assert streamed == out.response


def test_errors_come_back_as_response_errors(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="llama3.2", messages=MESSAGES)
    assert e.value.status_code == 404
    assert "kjv-demo" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="kjv-demo", messages=MESSAGES, format="json")
    assert e.value.status_code == 400
    assert "format" in e.value.error


def failovers(url):
    """The server's count of GPU-to-CPU failovers (`/metrics`)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r'headroom_failovers_total\{from="sim",to="cpu"\} (\d+)', text)
    return int(m.group(1)) if m else 0


def test_a_stream_that_fails_over_mid_answer_finishes(client, sim_server):
    healthy = list(client.chat(model="kjv-demo", messages=MESSAGES, options=OPTIONS, stream=True))
    before = failovers(sim_server.url)
    r = httpx.post(sim_server.url + "/admin/sim/fault", json={"fault": "oom_after_tokens", "tokens": 4}, timeout=10)
    assert r.status_code == 200, r.text
    pieces = list(client.chat(model="kjv-demo", messages=MESSAGES, options=OPTIONS, stream=True))
    assert pieces[-1].done
    assert failovers(sim_server.url) == before + 1, "the stream moved from the sim GPU to the CPU"
    assert "".join(p.message.content for p in pieces) == "".join(p.message.content for p in healthy)


def test_embed_gives_one_vector_per_input(client):
    out = client.embed(model="kjv-demo", input=["In the beginning", "Blessed are the meek"])
    assert len(out.embeddings) == 2 and len(out.embeddings[0]) == len(out.embeddings[1]) > 16
    assert abs(sum(x * x for x in out.embeddings[0]) - 1.0) < 1e-4
    assert out.embeddings[0] != out.embeddings[1]
    again = client.embed(model="kjv-demo:latest", input="In the beginning")
    assert max(abs(a - b) for a, b in zip(again.embeddings[0], out.embeddings[0])) < 1e-3
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="kjv-demo", input="And it came to pass " * 2000, truncate=False)
    assert e.value.status_code == 400 and "embeds at most" in e.value.error


def served_on_sim(url):
    """Requests the sim GPU completed (`/metrics`)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(r'headroom_requests_total\{device="sim",outcome="completed"\} (\d+)', text)
    return int(m.group(1)) if m else 0


def test_keep_alive_unloads_the_gpu_copy_and_the_next_chat_loads_it(client, sim_server):
    # Ollama's unload call: an empty generate with keep_alive 0.
    unloaded = client.generate(model="kjv-demo", keep_alive=0)
    assert unloaded.done and unloaded.done_reason == "unload"
    for _ in range(100):
        status = httpx.get(sim_server.url + "/v1/status", timeout=10).json()
        if status["gpu_residency"]["state"] == "unloaded":
            break
        time.sleep(0.1)
    assert status["gpu_residency"]["state"] == "unloaded", status
    assert status["degraded"] is False
    assert client.ps().models[0].size_vram == 0
    # The next chat loads the model on the GPU, says how long that took, and its keep_alive
    # is the one in force.
    on_gpu = served_on_sim(sim_server.url)
    reply = client.chat(model="kjv-demo", messages=MESSAGES, options=OPTIONS, keep_alive="5m")
    assert reply.load_duration > 0
    assert served_on_sim(sim_server.url) == on_gpu + 1, "it waited for the load on the GPU, not the CPU"
    running = client.ps().models[0]
    assert running.size_vram > 0
    assert running.expires_at.year >= 2026
    # Back to the server's default for the tests after this one.
    assert client.generate(model="kjv-demo", keep_alive=-1).done_reason == "load"
