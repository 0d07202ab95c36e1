#!/usr/bin/env python3
"""Time to first token when a prompt begins like an earlier one: a real `headroom serve` (CPU
worker, the default model) with its prefix cache, the same server without it, and llama.cpp
(llama-cpp-python, which keeps the tokens it evaluated last and reuses their common beginning),
on the same GGUF file and threads, side by side in one run.

    .venv/bin/python scripts/bench-prefix.py [--threads N] [--chats 3] [FILE]

Each of --chats conversations shares one system prompt of about 500 tokens and has two turns:
the first asks a question, the second sends the first turn and its answer back with a new
question. Measured per engine, median over the chats (the first chat's first turn, which
nothing can reuse, is left out): the first turn of a new chat (its system prompt seen before)
and the second turn of a chat. Streams 16 greedy tokens each; the time to the first streamed
token is taken at the client. Prints one table and writes JSON (target/bench-prefix.json).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx2 as httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import DEFAULT_MODEL, ROOT, Serve  # noqa: E402

RULES = [
    "Answer in plain words a person new to Linux can follow.",
    "Name the exact command, file or setting that helps, and say what it does before using it.",
    "Never invent options, flags or files that do not exist; say so when you are unsure.",
    "Prefer tools that come with Debian 12 over ones that need installing.",
    "When a command needs root, say so and show it with sudo.",
    "Warn before anything that deletes data, restarts services or changes the network.",
    "Keep each answer under five sentences unless the user asks for detail.",
    "If a question is about hardware, ask which model the user has before guessing.",
]
SYSTEM = "You are the assistant of a home server that runs local AI models. " + " ".join(
    f"Rule {i + 1}: {rule}" for i, rule in enumerate(RULES * 3))
QUESTIONS = [
    ("How do I see which programs use the most memory?", "And how do I stop one of them?"),
    ("How do I check how much disk space is left?", "How do I find the largest folders?"),
    ("How do I see whether the GPU is in use?", "How do I see its temperature?"),
    ("How do I restart the web server?", "How do I see why it failed to start?"),
]
MAX_TOKENS = 16


def conversations(n):
    """The two questions of each of n chats."""
    return [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]


def first_turn(q1):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q1}]


def second_turn(q1, a1, q2):
    return first_turn(q1) + [{"role": "assistant", "content": a1}, {"role": "user", "content": q2}]


def headroom_turn(serve, messages):
    """(seconds to the first streamed token, the reply, prompt tokens, cached prompt tokens)."""
    body = {"model": "default", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, text, usage = None, "", {}
    with httpx.stream("POST", serve.url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content"):
                    first = first or time.perf_counter() - started
                    text += choice["delta"]["content"]
            usage = chunk.get("usage") or usage
    return first, text, usage.get("prompt_tokens"), usage.get("prompt_tokens_details", {}).get("cached_tokens")


def llama_turn(llm, messages):
    started = time.perf_counter()
    first, text = None, ""
    for chunk in llm.create_chat_completion(messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True):
        content = chunk["choices"][0]["delta"].get("content")
        if content:
            first = first or time.perf_counter() - started
            text += content
    return first, text, None, None


def run_chats(turn, chats):
    """Per chat: (first turn, second turn) results."""
    results = []
    for q1, q2 in chats:
        one = turn(first_turn(q1))
        two = turn(second_turn(q1, one[1], q2))
        results.append((one, two))
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "target" / "bench-prefix.json")
    args = parser.parse_args()
    import llama_cpp

    chats = conversations(args.chats + 1)
    engines = {}
    for name, mib in (("headroom", "256"), ("headroom, no prefix cache", "0")):
        serve = Serve(args.file, args.threads, "--gpu", "none", env={"HEADROOM_CPU_PREFIX_CACHE_MIB": mib})
        try:
            engines[name] = run_chats(lambda m: headroom_turn(serve, m), chats)
        finally:
            serve.stop()
    llm = llama_cpp.Llama(model_path=str(args.file), n_ctx=2048, n_batch=512, n_threads=args.threads, verbose=False)
    engines["llama.cpp"] = run_chats(lambda m: llama_turn(llm, m), chats)

    figures = {"model": args.file.name, "threads": args.threads, "chats": args.chats, "engines": {}}
    print(f"{args.file.name}, {args.threads} threads, {args.chats} chats after a first one, median time to first token in ms")
    print(f"{'':28}{'new chat':>12}{'second turn':>14}   prompt tokens (cached)")
    for name, results in engines.items():
        new_chat = float(np.median([r[0][0] for r in results[1:]])) * 1e3
        second = float(np.median([r[1][0] for r in results[1:]])) * 1e3
        last = results[-1]
        tokens = f"{last[0][2]} ({last[0][3]}), {last[1][2]} ({last[1][3]})" if last[0][2] is not None else ""
        print(f"{name:28}{new_chat:12.1f}{second:14.1f}   {tokens}")
        figures["engines"][name] = {"new_chat_ttft_ms": new_chat, "second_turn_ttft_ms": second,
                                    "replies": [[r[0][1], r[1][1]] for r in results],
                                    "usage": [[r[0][2:], r[1][2:]] for r in results]}
    same = [r[0][1] for r in engines["headroom"]] == [r[0][1] for r in engines["headroom, no prefix cache"]] and \
        [r[1][1] for r in engines["headroom"]] == [r[1][1] for r in engines["headroom, no prefix cache"]]
    print(f"replies with and without the prefix cache are {'the same' if same else 'DIFFERENT'}")
    figures["same_replies_with_and_without_cache"] = same
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
