"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) served as the README's first command
serves it, through the official `openai` package: the chat answers a plain question sensibly and
/v1/models says what the model is."""

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
