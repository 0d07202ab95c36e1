#!/usr/bin/env python3
"""Headroom's CPU engine against llama.cpp (llama-cpp-python) on the same GGUF files, same
threads, same prompt length and decode steps, side by side in one run.

    .venv/bin/python scripts/bench-engine.py [--threads N] [--runs 3] [--no-1b] [--unquantized]
        [--concurrency 1,2,4,8] [FILE ...]

Without FILE: the default model (SmolLM2-135M-Instruct Q4_1) and a random-weight ~1B Llama in
Q4_K_M and Q8_0, written with `gguf` and quantized with llama.cpp's quantizer, cached in
~/.cache/headroom/bench (outside the repository). Headroom's side is `headroom model bench`, which
also measures this machine's read bandwidth; decode is reported as a share of the bound
(weight bytes per token ÷ bandwidth), and the resident memory the model added against what
admission predicts for it (weights + KV cache + workspace). With --concurrency, also the aggregate
decode tokens/s of N sequences decoded together: Headroom's batch (`--concurrency` of `headroom
model bench`) against llama.cpp's own batched decode (one `llama_decode` of N tokens, one per
sequence, each sequence with its own KV cells), both timed from every sequence's first token
on. Prints one table and writes the figures as JSON (target/bench-engine.json).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("HEADROOM_BENCH_CACHE", Path.home() / ".cache" / "headroom" / "bench"))
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def headroom_binary():
    for profile in ("release", "debug"):
        path = ROOT / "target" / profile / "headroom"
        if path.exists():
            return path
    sys.exit("no target/*/headroom: build it first (cargo build --bin headroom)")


def prompt_ids(vocab, n):
    """The prompt `headroom model bench` uses: fixed ids away from the special tokens."""
    start = min(1000, vocab // 2)
    return [start + (i * 7919) % (vocab // 2) for i in range(n)]


def mib(n):
    return "?" if n is None else f"{n / 2**20:.0f} MiB"


def percent(p):
    return "?" if p is None else f"{p:+.1f}%"


def run_llama_cpp(path, threads, prompt_tokens, decode_tokens, runs):
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=prompt_tokens + decode_tokens + 16,
        n_batch=prompt_tokens,
        n_ubatch=prompt_tokens,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    vocab = llm.n_vocab()
    prompt = prompt_ids(vocab, prompt_tokens)
    prefill, decode = [], []
    for run in range(runs + 1):
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        prefilled = time.perf_counter()
        for _ in range(decode_tokens):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))
            llm.eval([int(np.argmax(logits))])
        done = time.perf_counter()
        if run > 0:  # the first run warms up
            prefill.append(prompt_tokens / (prefilled - started))
            decode.append(decode_tokens / (done - prefilled))
    return {"prefill_tok_s": float(np.median(prefill)), "decode_tok_s": float(np.median(decode))}


def run_llama_cpp_concurrent(path, threads, prompt_tokens, decode_tokens, runs, counts):
    """Aggregate decode tok/s of `n` greedy sequences per step, for each `n` in `counts`: each
    prefills the prompt (rotated by its index, as Headroom's bench does), then every step decodes
    one token of every sequence in one batch."""
    import llama_cpp

    model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    prompt = prompt_ids(vocab, prompt_tokens)
    out = {}
    for n in counts:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n * (prompt_tokens + decode_tokens + 16)
        params.n_batch = params.n_ubatch = max(prompt_tokens, n)
        params.n_seq_max = n
        params.n_threads = params.n_threads_batch = threads
        ctx = llama_cpp.llama_init_from_model(model, params)
        batch = llama_cpp.llama_batch_init(max(prompt_tokens, n), 0, n)

        def decode(entries):
            """entries: (token, position, sequence); logits for every entry."""
            batch.n_tokens = len(entries)
            for i, (token, pos, seq) in enumerate(entries):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, True
                batch.seq_id[i][0] = seq
            assert llama_cpp.llama_decode(ctx, batch) == 0
            return [int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(vocab,)))) for i in range(len(entries))]

        rates = []
        for run in range(runs + 1):
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
            nexts = []
            for s in range(n):
                rotated = prompt[s % len(prompt):] + prompt[:s % len(prompt)]
                nexts.append(decode([(t, p, s) for p, t in enumerate(rotated)])[-1])
            started = time.perf_counter()
            for step in range(decode_tokens - 1):
                nexts = decode([(nexts[s], prompt_tokens + step, s) for s in range(n)])
            if run > 0:  # the first run warms up
                rates.append(n * (decode_tokens - 1) / (time.perf_counter() - started))
        out[n] = float(np.median(rates))
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return out


def run_headroom(path, threads, prompt_tokens, decode_tokens, runs, counts=None):
    out = subprocess.run(
        [str(headroom_binary()), "model", "bench", str(path), "--threads", str(threads), "--prompt-tokens", str(prompt_tokens),
         "--decode-tokens", str(decode_tokens), "--runs", str(runs)] + (["--concurrency", ",".join(map(str, counts))] if counts else []),
        capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        sys.exit(f"headroom model bench {path} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_random_llama_1b(path, source):
    """A ~1B-parameter Llama (hidden 2048, 16 layers, ffn 5632, 32 heads, 4 KV heads, untied
    49k vocabulary) with random F16 weights and the default model's tokenizer."""
    from gguf import GGUFReader, GGUFWriter

    reader = GGUFReader(source)
    rng = np.random.default_rng(1)
    vocab, hidden, ffn, layers, heads, kv_heads = 49152, 2048, 5632, 16, 32, 4
    head_dim = hidden // heads
    w = GGUFWriter(str(path), "llama")
    w.add_name("random-llama-1b")
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    field = lambda name: reader.fields[name]
    w.add_token_list([bytes(field("tokenizer.ggml.tokens").parts[i]) for i in field("tokenizer.ggml.tokens").data])
    w.add_token_types([int(field("tokenizer.ggml.token_type").parts[i][0]) for i in field("tokenizer.ggml.token_type").data])
    w.add_token_merges([bytes(field("tokenizer.ggml.merges").parts[i]) for i in field("tokenizer.ggml.merges").data])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def normal(shape, std):
        return (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float16)

    w.add_tensor("token_embd.weight", normal((vocab, hidden), 0.05))
    w.add_tensor("output.weight", normal((vocab, hidden), 0.02))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"{p}.attn_q.weight", normal((heads * head_dim, hidden), 0.02))
        w.add_tensor(f"{p}.attn_k.weight", normal((kv_heads * head_dim, hidden), 0.02))
        w.add_tensor(f"{p}.attn_v.weight", normal((kv_heads * head_dim, hidden), 0.02))
        w.add_tensor(f"{p}.attn_output.weight", normal((hidden, heads * head_dim), 0.02))
        w.add_tensor(f"{p}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", normal((ffn, hidden), 0.02))
        w.add_tensor(f"{p}.ffn_up.weight", normal((ffn, hidden), 0.02))
        w.add_tensor(f"{p}.ffn_down.weight", normal((hidden, ffn), 0.02))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def random_1b_files():
    import llama_cpp

    CACHE.mkdir(parents=True, exist_ok=True)
    f16 = CACHE / "random-llama-1b.F16.gguf"
    files = {"Q4_K_M": CACHE / "random-llama-1b.Q4_K_M.gguf", "Q8_0": CACHE / "random-llama-1b.Q8_0.gguf"}
    if all(p.exists() for p in files.values()):
        return list(files.values())
    if not f16.exists():
        print(f"writing {f16} …", file=sys.stderr)
        write_random_llama_1b(f16, DEFAULT_MODEL)
    for name, target in files.items():
        if target.exists():
            continue
        print(f"quantizing {target.name} with llama.cpp …", file=sys.stderr)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"Q4_K_M": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[name]
        params.nthread = os.cpu_count() or 2
        assert llama_cpp.llama_model_quantize(str(f16).encode(), str(target).encode(), params) == 0
    f16.unlink()  # 2 GB that nothing else reads
    return list(files.values())


def unquantized_files():
    """The default model's weights unquantized, as F32, F16 and BF16 GGUF files (llama.cpp's
    quantizer expands the Q4_1 file; both engines then read the same unquantized weights)."""
    import llama_cpp

    CACHE.mkdir(parents=True, exist_ok=True)
    files = {name: CACHE / f"SmolLM2-135M-Instruct.{name}.gguf" for name in ("F32", "F16", "BF16")}
    for name, target in files.items():
        if target.exists():
            continue
        print(f"expanding the default model to {target.name} with llama.cpp …", file=sys.stderr)
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"F32": llama_cpp.LLAMA_FTYPE_ALL_F32, "F16": llama_cpp.LLAMA_FTYPE_MOSTLY_F16, "BF16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16}[name]
        params.allow_requantize = True
        params.nthread = os.cpu_count() or 2
        assert llama_cpp.llama_model_quantize(str(DEFAULT_MODEL).encode(), str(target).encode(), params) == 0
    return list(files.values())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-1b", action="store_true", help="skip the random ~1B models")
    parser.add_argument("--unquantized", action="store_true", help="also the default model expanded to F32, F16 and BF16")
    parser.add_argument("--concurrency", type=lambda s: [int(n) for n in s.split(",")], default=None,
                        help="also aggregate decode tok/s at these numbers of sequences decoded together, e.g. 1,2,4,8")
    parser.add_argument("--out", type=Path, default=ROOT / "target" / "bench-engine.json")
    args = parser.parse_args()
    files = args.files or [DEFAULT_MODEL] + ([] if args.no_1b else random_1b_files())
    if args.unquantized:
        files += unquantized_files()
    import llama_cpp

    # What each engine multiplies with on this processor: a llama.cpp built for fewer
    # instruction sets than Headroom detects (or more) is not the same comparison.
    llama_features = [f.split("=")[0].strip() for f in llama_cpp.llama_print_system_info().decode().split("|") if f.strip().endswith("= 1")]
    print(f"llama.cpp {llama_cpp.__version__} from {Path(llama_cpp.__file__).parent.parent}: {' '.join(llama_features)}", flush=True)
    rows = []
    for path in files:
        ours = run_headroom(path, args.threads, args.prompt_tokens, args.decode_tokens, args.runs, args.concurrency)
        theirs = run_llama_cpp(path, args.threads, args.prompt_tokens, args.decode_tokens, args.runs)
        if args.concurrency:
            theirs["concurrent"] = run_llama_cpp_concurrent(path, args.threads, args.prompt_tokens, args.decode_tokens, args.runs, args.concurrency)
        row = {
            "file": path.name,
            "threads": args.threads,
            "headroom_kernels": ours.get("kernels"),
            "llama_cpp_features": llama_features,
            "headroom": ours,
            "llama_cpp": theirs,
            "decode_ratio": ours["decode_tok_s"] / theirs["decode_tok_s"],
            "prefill_ratio": ours["prefill_tok_s"] / theirs["prefill_tok_s"],
            "llama_cpp_share_of_bound": theirs["decode_tok_s"] / ours["bandwidth_bound_tok_s"],
        }
        rows.append(row)
        print(
            f"{path.name:42} {args.threads:>2} threads {ours.get('kernels', '?')} | decode {ours['decode_tok_s']:7.1f} vs {theirs['decode_tok_s']:7.1f} tok/s "
            f"({row['decode_ratio']:.2f}×) | prefill {ours['prefill_tok_s']:7.1f} vs {theirs['prefill_tok_s']:7.1f} tok/s "
            f"({row['prefill_ratio']:.2f}×) | bound {ours['bandwidth_bound_tok_s']:.0f} tok/s at {ours['read_bandwidth_gb_s']:.1f} GB/s: "
            f"headroom {ours['share_of_bound']:.0%}, llama.cpp {row['llama_cpp_share_of_bound']:.0%} | "
            f"resident {mib(ours.get('resident_bytes'))} predicted {mib(ours.get('predicted_resident_bytes'))} "
            f"({percent(ours.get('resident_error_percent'))})",
            flush=True,
        )
        for c in ours.get("concurrent", []):
            n, mine, theirs_n = c["sequences"], c["decode_tok_s"], theirs["concurrent"][c["sequences"]]
            print(f"  {n} sequences together: decode {mine:7.1f} vs {theirs_n:7.1f} tok/s ({mine / theirs_n:.2f}×); "
                  f"× one sequence: headroom {mine / ours['concurrent'][0]['decode_tok_s']:.2f}, "
                  f"llama.cpp {theirs_n / theirs['concurrent'][args.concurrency[0]]:.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
