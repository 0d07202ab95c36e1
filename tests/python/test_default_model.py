"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) served as the README's first command
serves it, through the official `openai` package: the chat answers a plain question sensibly and
/v1/models says what the model is."""

import time

import httpx
import openai
import pytest

from conftest import ROOT, Server

DEFAULT_FILE = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def default_server():
    if not DEFAULT_FILE.exists():
        pytest.fail(f"{DEFAULT_FILE} is missing: run ./scripts/install.sh")
    server = Server("--model", "default", "--gpu", "sim").start(timeout=300)
    yield server
    server.stop()


def test_the_default_model_knows_the_capital_of_france(default_server):
    client = openai.OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    models = client.models.list().data
    served = models[0].model_extra["headroom"]
    assert models[0].id == "SmolLM2-135M-Instruct.Q4_1"
    assert (served["served"], served["format"], served["quantization"], served["architecture"]) == (True, "gguf", "Q4_1", "llama")
    assert 130e6 < served["parameters"] < 140e6
    chat = client.chat.completions.create(
        # The bare question gets "L'Étoile, la Marseillaise, …" from this Q4_1 file in llama.cpp
        # too (8-bit activations, greedy): ask for the city by name, which both answer.
        model="default",
        messages=[{"role": "user", "content": "What is the capital of France? Answer with the city name."}],
        max_tokens=40,
        temperature=0,
    )
    answer = chat.choices[0].message.content
    assert "Paris" in answer, answer
    assert chat.choices[0].finish_reason == "stop", "the template's end-of-turn token ends the answer"


SYSTEM = (
    "You are a patient assistant for a home server. Answer in one short sentence, name the "
    "command or setting that helps, and never invent options that do not exist."
)


def chat_turns(client, first_answer=None):
    """The first turn, or the second (the first turn's messages and answer, then a new question)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How do I see which programs use the most memory?"}]
    if first_answer is not None:
        messages += [{"role": "assistant", "content": first_answer}, {"role": "user", "content": "And how do I stop one of them?"}]
    return client.chat.completions.create(model="default", messages=messages, max_tokens=24, temperature=0)


def test_a_chat_second_turn_reuses_the_first_turns_cache_and_answers_the_same():
    """On the CPU worker, a chat's second turn starts from the KV blocks of its first (the
    system prompt, the question, the answer): `usage.prompt_tokens_details.cached_tokens` says
    how many prompt tokens were not computed again, status and metrics count the hits, and the
    answer is the one a server without a prefix cache gives (its control: nothing cached)."""
    if not DEFAULT_FILE.exists():
        pytest.fail(f"{DEFAULT_FILE} is missing: run ./scripts/install.sh")
    answers = {}
    for cache_mib in (256, 0):
        server = Server("--model", "default", "--gpu", "none", config=f"[memory]\ncpu_prefix_cache_mib = {cache_mib}\n").start(timeout=300)
        try:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            first = chat_turns(client)
            second = chat_turns(client, first.choices[0].message.content)
            again = chat_turns(client, first.choices[0].message.content)
            cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, second, again)]
            answers[cache_mib] = (first.choices[0].message.content, second.choices[0].message.content, again.choices[0].message.content)
            # The worker reports its cache with its memory, once a second. With nothing
            # running, the KV blocks alive are the prefix cache's: none leaked.
            deadline = time.monotonic() + 10
            while True:
                memory = server.status()["memory"]
                prefix = memory["cpu_prefix_cache"]
                settled = prefix["reused_tokens"] >= sum(cached) and memory["cpu_kv_resident_bytes"] == prefix["bytes"]
                if settled or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            assert memory["cpu_kv_resident_bytes"] == prefix["bytes"], (memory["cpu_kv_resident_bytes"], prefix)
            assert memory["host_reserved_bytes"] == 0, memory
            metrics = httpx.get(server.url + "/metrics", timeout=10).text
            # With no cache asked for, or on a CPU whose prefill is not the same bits in any
            # chunks (the CPU worker keeps prefixes only on AVX-512 VNNI: a reused prefix could
            # change a later token elsewhere), nothing is kept or reused.
            if cache_mib == 0 or prefix["capacity_blocks"] == 0:
                assert cached == [0, 0, 0], cached
                assert prefix["blocks"] == 0 and prefix["reused_tokens"] == 0, prefix
                continue
            # The first turn's prompt (system prompt and question) is more than 2 blocks of 16;
            # the second turn asked again holds the whole second prompt but its last token.
            assert cached[0] == 0 and cached[1] >= 32 and cached[2] > cached[1], cached
            assert cached[2] >= second.usage.prompt_tokens - 16, (cached, second.usage.prompt_tokens)
            assert prefix["reused_tokens"] >= cached[1] + cached[2] and 0 < prefix["hit_rate"] <= 1, prefix
            assert 0 < prefix["bytes"] <= 256 * 2**20, prefix
            reused = [line for line in metrics.splitlines() if line.startswith("headroom_prefix_cache_reused_tokens")]
            assert reused and float(reused[0].split()[-1]) >= cached[1] + cached[2], reused
        finally:
            server.stop()
    assert answers[256] == answers[0], f"with the prefix cache: {answers[256]}; without: {answers[0]}"
    assert answers[256][1] == answers[256][2]
