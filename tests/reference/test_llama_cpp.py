"""Headroom against llama.cpp (llama-cpp-python) on the same GGUF files: token ids, teacher-forced
top-1 agreement and perplexity. The files: the default model (SmolLM2-135M-Instruct, Q4_1) and a
random-weight Llama of ~100M parameters written here with `gguf`'s writer and quantized by
llama.cpp to Q8_0 and Q4_K_M.

`HEADROOM_TEST_DEFECT` switches a known defect back on in Headroom for the negative controls at
the end: each must make its criterion fail."""

import json
import os

import llama_cpp
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from conftest import headroom

PROMPTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, the Louvre, and its cafes. Many tourists visit every year to see",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\nfor i in range(10):\n    print(fibonacci(i))\n",
    "<|im_start|>user\nWhat are three good reasons to learn a second language?<|im_end|>\n<|im_start|>assistant\nLearning a second language",
    "In 1969, Neil Armstrong and Buzz Aldrin landed on the Moon. The Apollo 11 mission launched on July 16 and returned on July 24, after",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose and oxygen. The light reactions",
    "Once upon a time, in a small village at the edge of a dark forest, there lived a girl who loved to read. Every evening she would",
    "SELECT name, COUNT(*) AS orders FROM customers JOIN orders ON customers.id = orders.customer_id GROUP BY name ORDER BY orders DESC LIMIT 10;",
    "Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, so water boils at a lower temperature, which",
]
POSITIONS = 64
# Public domain: the opening of Jane Austen's Pride and Prejudice (1813).
PERPLEXITY_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him "
    "one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it "
    "is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made no "
    "answer. \"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, and I "
    "have no objection to hearing it.\" This was invitation enough."
)


def varied_strings():
    """At least 200 strings: prose, unicode, digits, code, whitespace runs, special tokens."""
    base = [
        "Hello, world!", "hello world", " leading space", "trailing space ", "  two leading", "tabs\tand\ttabs",
        "new\nlines\n\nand\n\n\nmore", "\n", " ", "   ", "\t\t", "", "a", "I'm sure they'll've done it, we'd say.",
        "don't DON'T Don'T", "12345", "3.14159", "1,000,000", "2026-12-05T01:02:03Z", "0x1F 0b1010 1e-9",
        "Ünïcödé façade naïve café", "日本語のテキスト", "中文测试文本", "한국어 텍스트", "Ελληνικά κείμενα",
        "русский текст", "עברית", "العربية", "emoji 🎉🚀👍🏽 done", "👨‍👩‍👧‍👦", "math ∑∫√∞ ≤ ≥ ≠",
        "def f(x):\n    return x ** 2  # square", "fn main() { println!(\"{}\", 1 + 2); }", "<div class=\"a\">&amp;</div>",
        "if (a && b || !c) { x += 1; }", "SELECT * FROM t WHERE id = 42;", "path/to/file.txt C:\\Windows\\System32",
        "https://example.com/a?b=c&d=e#f", "user@example.com", "$100.00 €50 £20 ¥1000", "snake_case camelCase PascalCase",
        "ALL CAPS SENTENCE HERE", "mIxEd CaSe", "...!!!???", "—– hyphens - and dashes", "«quotes» „quotes“ 'single'",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
        "<|endoftext|>", "text<|im_end|>text", "<|im_start|><|im_end|>", "<not a special token>",
        "     indented code\n        more", "a  b   c    d", "\r\nwindows\r\nlines", "zero\u200bwidth", "combining é é",
    ]
    words = ["the", "quick", "brown", "fox", "42", "Ω", "naïve", "(x)", "  ", "\n", "🙂", "don't", "2024", "<|im_end|>", "==", "tab\t"]
    generated = []
    for i in range(160):
        rng = np.random.default_rng(i)
        n = int(rng.integers(1, 12))
        generated.append("".join(words[j] + (" " if rng.random() < 0.6 else "") for j in rng.integers(0, len(words), n)))
    strings = base + generated
    assert len(strings) >= 200
    return strings


def llama(path):
    return llama_cpp.Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=2, logits_all=True, verbose=False)


def llama_scores(llm, tokens):
    """llama.cpp's argmax per position and the NLL of each next token."""
    llm.reset()
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    argmax = logits.argmax(axis=1)
    top = logits.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    nll = log_z[:-1] - logits[np.arange(len(tokens) - 1), tokens[1:]]
    return argmax, nll


def headroom_scores(model, sequences, env=None):
    stdin = "".join(json.dumps(s) + "\n" for s in sequences)
    proc = headroom("model", "score", model, stdin=stdin, env=env)
    return [json.loads(line) for line in proc.stdout.splitlines()]


def headroom_tokens(model, strings, env=None):
    stdin = "".join(json.dumps(s) + "\n" for s in strings)
    return [json.loads(line) for line in headroom("model", "tokenize", model, stdin=stdin, env=env).stdout.splitlines()]


def tokenizer_mismatches(model, llm, env=None):
    strings = varied_strings()
    ours = headroom_tokens(model, strings, env)
    theirs = [llm.tokenize(s.encode(), add_bos=True, special=True) for s in strings]
    return [(s, a, b) for s, a, b in zip(strings, ours, theirs) if a != b], len(strings)


def sampled_tokens(llm, n=192, seed=0):
    """A sequence drawn from the model's own distribution by llama.cpp (temperature 1): for a
    random-weight model, natural text has no meaning, so its perplexity is measured on this."""
    rng = np.random.default_rng(seed)
    tokens = llm.tokenize(b"The", add_bos=True, special=False)
    llm.reset()
    llm.eval(tokens)
    while len(tokens) < n:
        logits = np.array(llm.scores[len(tokens) - 1], dtype=np.float64)
        p = np.exp(logits - logits.max())
        tokens.append(int(rng.choice(len(p), p=p / p.sum())))
        llm.eval(tokens[-1:])
    return tokens


def agreement(model, llm, env=None, sampled_text=False):
    """Teacher-forced top-1 agreement over PROMPTS × POSITIONS, and both perplexities (on the
    public-domain text, or on a sequence sampled from the model)."""
    sequences = []
    for prompt in PROMPTS:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        while len(tokens) < POSITIONS:
            tokens += llm.tokenize((" " + prompt).encode(), add_bos=False, special=True)
        sequences.append(tokens[:POSITIONS])
    if sampled_text:
        text_tokens = sampled_tokens(llm)
    else:
        text_tokens = llm.tokenize(PERPLEXITY_TEXT.encode(), add_bos=True, special=False)
    ours = headroom_scores(model, sequences + [text_tokens], env)
    same = total = 0
    for tokens, score in zip(sequences, ours):
        theirs, _ = llama_scores(llm, tokens)
        same += int((np.array(score["argmax"]) == theirs).sum())
        total += len(tokens)
    _, their_nll = llama_scores(llm, text_tokens)
    return same / total, float(np.exp(np.mean(ours[-1]["nll"]))), float(np.exp(their_nll.mean())), len(text_tokens)


# Scales of the random model: embeddings large enough and layer outputs small enough that each
# position has one clearly best next token (see write_random_llama).
EMBED_STD, OUT_STD = 0.18, 0.01


def write_random_llama(path, source):
    """A ~100M-parameter Llama with random weights and the default model's tokenizer, in F16, with
    q/k rows in llama.cpp's order (as its converter writes them)."""
    reader = GGUFReader(source)
    rng = np.random.default_rng(100)
    vocab, hidden, ffn, layers, heads, kv_heads = 49152, 768, 2048, 10, 12, 4
    head_dim = hidden // heads
    w = GGUFWriter(path, "llama")
    w.add_name("random-llama-100m")
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
    w.add_add_bos_token(False)

    def normal(shape, std):
        return rng.normal(0, std, shape).astype(np.float16)

    # Random layers over a structured head: the output row of each token's fixed successor is that
    # token's embedding, so every position has one clearly best next token and top-1 compares the
    # engines rather than rounding noise between the near-equal logits of an unstructured random
    # model (both engines quantize activations to 8 bits in their matmuls, each its own way).
    embedding = normal((vocab, hidden), EMBED_STD)
    successor = (np.arange(vocab) * 7919 + 1) % vocab
    output = np.empty_like(embedding)
    output[successor] = embedding
    w.add_tensor("token_embd.weight", embedding)
    w.add_tensor("output.weight", output)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        p = f"blk.{i}"
        w.add_tensor(f"{p}.attn_norm.weight", (1 + rng.normal(0, 0.1, hidden)).astype(np.float32))
        w.add_tensor(f"{p}.attn_q.weight", normal((heads * head_dim, hidden), 0.05))
        w.add_tensor(f"{p}.attn_k.weight", normal((kv_heads * head_dim, hidden), 0.05))
        w.add_tensor(f"{p}.attn_v.weight", normal((kv_heads * head_dim, hidden), 0.03))
        w.add_tensor(f"{p}.attn_output.weight", normal((hidden, heads * head_dim), OUT_STD))
        w.add_tensor(f"{p}.ffn_norm.weight", (1 + rng.normal(0, 0.1, hidden)).astype(np.float32))
        w.add_tensor(f"{p}.ffn_gate.weight", normal((ffn, hidden), 0.03))
        w.add_tensor(f"{p}.ffn_up.weight", normal((ffn, hidden), 0.03))
        w.add_tensor(f"{p}.ffn_down.weight", normal((hidden, ffn), OUT_STD))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quantize(source, target, ftype):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), params) == 0


@pytest.fixture(scope="module")
def random_models(tmp_path_factory, default_model):
    d = tmp_path_factory.mktemp("random-llama")
    f16 = d / "random-llama-100m.F16.gguf"
    write_random_llama(f16, default_model)
    out = {}
    for name, ftype in [("Q8_0", llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0), ("Q4_K_M", llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M)]:
        out[name] = d / f"random-llama-100m.{name}.gguf"
        quantize(f16, out[name], ftype)
    f16.unlink()
    return out


def models(default_model, random_models):
    return {"default (SmolLM2-135M-Instruct Q4_1)": default_model, **{f"random 100M {k}": v for k, v in random_models.items()}}


def test_token_ids_equal_llama_cpp(default_model, random_models):
    for label, path in models(default_model, random_models).items():
        llm = llama(path)
        mismatches, total = tokenizer_mismatches(path, llm)
        assert not mismatches, f"{label}: {len(mismatches)} of {total} strings tokenize differently, e.g. {mismatches[:3]}"


@pytest.mark.parametrize("which", ["default", "Q8_0", "Q4_K_M"])
def test_agreement_and_perplexity(which, default_model, random_models):
    path = default_model if which == "default" else random_models[which]
    top1, ppl_ours, ppl_theirs, n = agreement(path, llama(path), sampled_text=which != "default")
    print(f"\n{path.name}: top-1 agreement {top1:.2%} over {len(PROMPTS)}x{POSITIONS}; perplexity on {n} tokens: headroom {ppl_ours:.4f}, llama.cpp {ppl_theirs:.4f}")
    assert top1 >= 0.98, f"{path.name}: teacher-forced top-1 agreement {top1:.2%} < 98%"
    assert abs(ppl_ours / ppl_theirs - 1) <= 0.01, f"{path.name}: perplexity {ppl_ours:.4f} vs llama.cpp {ppl_theirs:.4f} (more than 1% apart)"


# Negative controls: each known defect switched back on must break its criterion.

def defect(name):
    return {**os.environ, "HEADROOM_TEST_DEFECT": name}


def test_control_gpt2_pre_tokenizer_breaks_token_ids(default_model):
    mismatches, _ = tokenizer_mismatches(default_model, llama(default_model), env=defect("gpt2-pre-tokenizer"))
    assert mismatches, "with SmolLM's digit split switched off, token ids still matched llama.cpp: the check cannot fail"


def test_control_kept_qk_permutation_breaks_agreement(random_models):
    path = random_models["Q8_0"]
    top1, ppl_ours, ppl_theirs, _ = agreement(path, llama(path), env=defect("keep-qk-permutation"), sampled_text=True)
    assert top1 < 0.98 or abs(ppl_ours / ppl_theirs - 1) > 0.01, f"with q/k rows left permuted, agreement was {top1:.2%}: the check cannot fail"


def byte_level_to_text():
    """GPT-2's byte-to-character table, inverted: a byte-level token back to its bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def write_sentencepiece_llama(path, source):
    """A one-layer Llama whose tokenizer is SentencePiece-style (`tokenizer.ggml.model = llama`,
    as Llama 2, TinyLlama and Mistral ship): <unk>, <s>, </s>, the 256 byte tokens, then the
    default model's pieces as text with `▁` for spaces, scored by merge rank. Only llama.cpp's
    tokenizer is exercised (it is loaded vocabulary-only)."""
    reader = GGUFReader(source)
    field = reader.fields["tokenizer.ggml.tokens"]
    table = byte_level_to_text()
    pieces, seen = [], set()
    for i in field.data:
        token = bytes(field.parts[i]).decode()
        if token.startswith("<|") or not all(c in table for c in token):
            continue
        try:
            text = bytes(table[c] for c in token).decode("utf-8")
        except UnicodeDecodeError:
            continue
        piece = text.replace(" ", "▁")
        if piece and piece not in seen and not (piece.startswith("<0x") and piece.endswith(">")):
            seen.add(piece)
            pieces.append(piece)
    # Like a trained SentencePiece vocabulary, it holds every character its pieces are made of
    # (scored below every longer piece).
    chars = sorted({c for piece in pieces for c in piece} - seen)
    pieces += chars
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-float(i) for i in range(len(pieces))]
    vocab, hidden = len(tokens), 64
    w = GGUFWriter(path, "llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(3)
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "blk.0.attn_norm.weight": (hidden,),
              "blk.0.attn_q.weight": (hidden, hidden), "blk.0.attn_k.weight": (hidden, hidden), "blk.0.attn_v.weight": (hidden, hidden),
              "blk.0.attn_output.weight": (hidden, hidden), "blk.0.ffn_norm.weight": (hidden,), "blk.0.ffn_gate.weight": (128, hidden),
              "blk.0.ffn_up.weight": (128, hidden), "blk.0.ffn_down.weight": (hidden, 128)}
    for name, shape in shapes.items():
        w.add_tensor(name, rng.normal(0, 0.02, shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_sentencepiece_token_ids_equal_llama_cpp(tmp_path, default_model):
    path = tmp_path / "sentencepiece-llama.gguf"
    write_sentencepiece_llama(path, default_model)
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    mismatches, total = tokenizer_mismatches(path, llm)
    assert not mismatches, f"SentencePiece: {len(mismatches)} of {total} strings tokenize differently, e.g. {mismatches[:3]}"
    # The negative control: without SentencePiece's leading space the ids must differ.
    mismatches, _ = tokenizer_mismatches(path, llm, env=defect("no-space-prefix"))
    assert mismatches, "with the space prefix switched off, token ids still matched llama.cpp: the check cannot fail"


EMBEDDED = [
    "The cat sat on the mat.",
    "A cat is sitting on a rug.",
    "Stock markets fell sharply on Monday.",
    "How do I bake bread at home?",
    "In the beginning God created the heaven and the earth.",
    "fn main() { println!(\"hello\"); }",
]


def embedding_agreement(model, env=None):
    """The cosine between Headroom's embedding of each text (`headroom model embed`, what
    /v1/embeddings serves) and llama.cpp's mean-pooled, normalized embedding on the same file."""
    stdin = "".join(json.dumps(s) + "\n" for s in EMBEDDED)
    ours = [np.array(json.loads(line)) for line in headroom("model", "embed", model, stdin=stdin, env=env).stdout.splitlines()]
    llm = llama_cpp.Llama(model_path=str(model), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_MEAN, n_ctx=512, n_threads=2, verbose=False)
    theirs = [np.array(llm.embed(s, normalize=True)) for s in EMBEDDED]
    return [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)) for a, b in zip(ours, theirs)]


def test_embeddings_equal_llama_cpp(default_model):
    cosines = embedding_agreement(default_model)
    print(f"\n{default_model.name}: cosine with llama.cpp's mean-pooled embeddings: " + ", ".join(f"{c:.5f}" for c in cosines))
    assert min(cosines) >= 0.99, f"embeddings differ from llama.cpp's: cosines {cosines}"


def test_control_pooling_before_the_final_norm_breaks_embeddings(default_model):
    cosines = embedding_agreement(default_model, env=defect("embed-before-norm"))
    assert min(cosines) < 0.99, f"pooled before the final norm, the embeddings still matched llama.cpp ({cosines}): the check cannot fail"
