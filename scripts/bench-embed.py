#!/usr/bin/env python3
"""Embeddings: a real `headroom serve` (CPU worker, the default model) against llama.cpp
(llama-cpp-python, mean pooling, normalized) on the same GGUF file and threads, side by side in
one run. FILE may be a BERT folder (models/all-MiniLM-L6-v2): Headroom serves the folder and
llama.cpp embeds the same weights written as an f32 GGUF (scripts/bert_to_gguf.py).

    .venv/bin/python scripts/bench-embed.py [--threads N] [--texts 64] [--runs 3] [FILE]

Measures, median of --runs after a warm-up: one text's latency (`/v1/embeddings` with one
input, over HTTP, against `Llama.embed` of one text), and the throughput of a list of --texts
texts in one request (`/v1/embeddings` with a list, against `Llama.embed` of the list, which
llama.cpp packs into shared batches of 512 tokens). Also the cosine between the two engines'
vectors for every text. (With a 4096-token context and batch, llama-cpp-python 0.3.36 gave one
of 64 texts a vector at cosine 0.954 from its own one-at-a-time vector: 512 keeps the check
honest.) Prints one table and writes the figures as JSON (target/bench-embed.json).
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
from bert_to_gguf import convert  # noqa: E402

WORDS = ("the light shall be upon the earth and the waters of the deep were divided while "
         "markets rose and fell as the engineers measured memory bandwidth and bread was baked").split()


def texts(n):
    """n sentences of 20 to 60 words, fixed by their index."""
    rng = np.random.default_rng(0)
    return [" ".join(WORDS[j] for j in rng.integers(0, len(WORDS), int(rng.integers(20, 61)))) for _ in range(n)]


def embed(serve, inputs):
    r = httpx.post(serve.url + "/v1/embeddings", json={"model": "default", "input": inputs, "encoding_format": "float"}, timeout=600)
    r.raise_for_status()
    return [np.array(d["embedding"]) for d in r.json()["data"]], r.json()["usage"]["prompt_tokens"]


def timed(f, runs):
    f()  # warm-up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--texts", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "target" / "bench-embed.json")
    args = parser.parse_args()
    import llama_cpp

    batch = texts(args.texts)
    llama_file = args.file
    if args.file.is_dir():
        llama_file = ROOT / "target" / f"bench-embed-{args.file.name}.gguf"
        convert(args.file, llama_file)
    serve = Serve(args.file, args.threads)
    try:
        ours, tokens = embed(serve, batch)
        one_ours = timed(lambda: embed(serve, batch[:1]), args.runs)
        list_ours = timed(lambda: embed(serve, batch), args.runs)
    finally:
        serve.stop()
    llm = llama_cpp.Llama(model_path=str(llama_file), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN,
                          n_ctx=512, n_batch=512, n_threads=args.threads, verbose=False)
    theirs = [np.array(v) for v in llm.embed(batch, normalize=True)]
    one_theirs = timed(lambda: llm.embed(batch[:1], normalize=True), args.runs)
    list_theirs = timed(lambda: llm.embed(batch, normalize=True), args.runs)
    cosines = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(ours, theirs)]
    figures = {
        "model": args.file.name, "threads": args.threads, "texts": args.texts, "tokens": tokens,
        "one_text_ms": {"headroom": one_ours * 1e3, "llama_cpp": one_theirs * 1e3},
        "list_texts_per_s": {"headroom": args.texts / list_ours, "llama_cpp": args.texts / list_theirs},
        "list_tokens_per_s": {"headroom": tokens / list_ours, "llama_cpp": tokens / list_theirs},
        "cosine_min": min(cosines), "cosine_mean": float(np.mean(cosines)),
    }
    print(f"{args.file.name}, {args.threads} threads, {args.texts} texts ({tokens} tokens), median of {args.runs}")
    print(f"{'':24}{'headroom':>12}{'llama.cpp':>12}")
    print(f"{'one text, ms':24}{one_ours * 1e3:12.1f}{one_theirs * 1e3:12.1f}")
    print(f"{'list, texts/s':24}{args.texts / list_ours:12.1f}{args.texts / list_theirs:12.1f}")
    print(f"{'list, tokens/s':24}{tokens / list_ours:12.0f}{tokens / list_theirs:12.0f}")
    print(f"cosine between the engines' vectors: min {min(cosines):.5f}, mean {np.mean(cosines):.5f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
