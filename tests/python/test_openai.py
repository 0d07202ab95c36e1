"""The official `openai` package against a real `headroom serve --gpu sim`."""

import threading
import time
import uuid

import openai
import pytest

from conftest import httpx

MESSAGES = [{"role": "user", "content": "And God said"}]


@pytest.fixture
def client(sim_server):
    c = openai.OpenAI(base_url=sim_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    # A test that injected a fault leaves the GPU as it found it.
    httpx.post(sim_server.url + "/admin/sim/fault", json={"fault": "clear"}, timeout=10)


def test_models_lists_the_served_model(client):
    assert client.models.list().data[0].id == "kjv-demo"


def test_chat_answers_with_headroom_headers(client):
    raw = client.chat.completions.with_raw_response.create(model="default", messages=MESSAGES, max_tokens=16, seed=1)
    chat = raw.parse()
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens <= 16
    assert raw.headers["x-request-id"] == chat.model_extra["headroom"]["request_id"]
    assert raw.headers["x-headroom-device"] in ("sim", "cpu")
    assert raw.headers["x-headroom-degraded"] in ("true", "false")


def test_stream_matches_the_plain_answer_and_reports_usage(client):
    kwargs = dict(model="default", messages=MESSAGES, max_tokens=24, seed=5, temperature=0.9)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"])


def test_stop_strings_end_the_answer_before_them(client):
    kwargs = dict(model="default", messages=MESSAGES, max_tokens=40, seed=2, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    words = full.split()
    assert len(words) > 3, full
    stop = " " + words[2]
    cut = client.chat.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.message.content
    assert full.startswith(cut.message.content)


def test_the_same_seed_gives_the_same_text(client):
    kwargs = dict(model="default", messages=MESSAGES, max_tokens=24, temperature=1.0)
    a = client.chat.completions.create(seed=11, **kwargs).choices[0].message.content
    b = client.chat.completions.create(seed=11, **kwargs).choices[0].message.content
    others = {client.chat.completions.create(seed=s, **kwargs).choices[0].message.content for s in (12, 13, 14)}
    assert a == b
    assert others != {a}, "other seeds should sample differently"


def test_an_idempotent_retry_returns_the_stored_answer(client):
    key = {"Idempotency-Key": str(uuid.uuid4())}
    kwargs = dict(model="default", messages=MESSAGES, max_tokens=12, seed=3)
    first = client.chat.completions.create(extra_headers=key, **kwargs)
    again = client.chat.completions.create(extra_headers=key, **kwargs)
    assert again.id == first.id
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.model_extra["headroom"]["from_journal"] is True
    with pytest.raises(openai.ConflictError):
        client.chat.completions.create(extra_headers=key, **{**kwargs, "max_tokens": 13})


def test_a_cancelled_stream_ends_with_an_error(client, sim_server):
    stream = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=400, stream=True, seed=1, extra_body={"ignore_eos": True})
    first = next(iter(stream))
    request_id = first.model_extra["headroom"]["request_id"]
    r = httpx.post(f"{sim_server.url}/v1/requests/{request_id}/cancel", timeout=10).json()
    assert r["cancelled"] is True
    with pytest.raises(openai.APIError, match="cancelled"):
        for _ in stream:
            pass
    state = httpx.get(f"{sim_server.url}/v1/requests/{request_id}", timeout=10).json()["state"]
    assert state == "cancelled"


def test_a_full_queue_is_a_503_with_retry_after(client, sim_server):
    # Both queues hold 2; far more concurrent long requests than the service can hold.
    results = []

    def one():
        try:
            raw = client.chat.completions.with_raw_response.create(model="default", messages=MESSAGES, max_tokens=200)
            results.append(raw.status_code)
        except openai.APIStatusError as e:
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    refused = [r for r in results if not isinstance(r, int)]
    assert refused, results
    e = refused[0]
    assert e.status_code == 503
    assert int(e.response.headers["retry-after"]) >= 1
    assert e.body["type"] == "capacity_error", e.body
    assert any(r == 200 for r in results), "what was accepted was served"


def test_after_a_sim_oom_the_answer_says_degraded(client, sim_server):
    httpx.post(sim_server.url + "/admin/sim/fault", json={"fault": "oom_next_allocation"}, timeout=10).raise_for_status()
    raw = client.chat.completions.with_raw_response.create(model="default", messages=MESSAGES, max_tokens=8, seed=4)
    chat = raw.parse()
    assert raw.headers["x-headroom-device"] == "cpu"
    assert raw.headers["x-headroom-degraded"] == "true"
    assert raw.headers["x-headroom-degraded-reason"]
    assert chat.model_extra["headroom"]["failovers"][0]["from"] == "sim"
    assert chat.choices[0].message.content


def test_bad_input_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError, match="messages is empty"):
        client.chat.completions.create(model="default", messages=[])
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=10**9)
    with pytest.raises(openai.BadRequestError, match="n = 3"):
        client.chat.completions.create(model="default", messages=MESSAGES, n=3)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)


def test_embeddings_through_the_official_client(client, sim_server):
    texts = ["In the beginning God created the heaven and the earth.", "Blessed are the meek", "And the LORD spake unto Moses"]
    # The client asks for base64 by default and decodes it.
    raw = client.embeddings.with_raw_response.create(model="default", input=texts)
    result = raw.parse()
    assert [d.index for d in result.data] == [0, 1, 2]
    vectors = [d.embedding for d in result.data]
    assert len({len(v) for v in vectors}) == 1 and len(vectors[0]) > 16
    for v in vectors:
        assert abs(sum(x * x for x in v) - 1.0) < 1e-4, "length 1"
    assert result.usage.prompt_tokens > 6
    assert raw.headers["x-headroom-device"] == "sim"
    floats = client.embeddings.create(model="default", input=texts[0], encoding_format="float").data[0].embedding
    assert max(abs(a - b) for a, b in zip(floats, vectors[0])) < 1e-6, "float and base64 carry one vector"
    # The GPU runs out of memory at the first input's allocation: that input moves to the CPU
    # worker, and the answer says so.
    httpx.post(sim_server.url + "/admin/sim/fault", json={"fault": "oom_next_allocation"}, timeout=10).raise_for_status()
    raw = client.embeddings.with_raw_response.create(model="default", input=texts[:1])
    moved = raw.parse()
    assert raw.headers["x-headroom-device"] == "cpu"
    assert raw.headers["x-headroom-degraded"] == "true"
    assert moved.data[0].model_extra["headroom"]["failovers"][0]["from"] == "sim"
    # The sim GPU's engine (burn) and the CPU engine agree to rounding.
    assert max(abs(a - b) for a, b in zip(moved.data[0].embedding, vectors[0])) < 1e-3
    with pytest.raises(openai.BadRequestError, match="empty"):
        client.embeddings.create(model="default", input="")
    with pytest.raises(openai.BadRequestError, match="token ids"):
        client.embeddings.create(model="default", input=[[1, 2, 3]])
