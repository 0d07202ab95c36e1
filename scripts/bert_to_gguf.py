"""Writes a sentence-transformers BERT folder (all-MiniLM-L6-v2) as an f32 GGUF that llama.cpp
embeds with, through the `gguf` package: the same weights, for a side-by-side benchmark.

    .venv/bin/python scripts/bert_to_gguf.py FOLDER OUT.gguf

llama.cpp's BERT vocabulary is WordPiece in "phantom space" form (a word's first piece carries
U+2581, a continuation loses its "##"), as its own converter writes it. The pooler is left out;
embeddings do not use it."""

import json
import struct
import sys
from pathlib import Path

import gguf
import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        data = f.read()
    for name, info in header.items():
        if name == "__metadata__" or info["dtype"] != "F32":
            continue
        start, end = info["data_offsets"]
        yield name, np.frombuffer(data[start:end], dtype="<f4").reshape(info["shape"])


def convert(folder: Path, out: Path):
    config = json.loads((folder / "config.json").read_text())
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(out), "bert")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(layers)
    writer.add_head_count(config["num_attention_heads"])
    writer.add_layer_norm_eps(config["layer_norm_eps"])
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = sorted(tokenizer["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tokenizer["added_tokens"]}

    def phantom(token):
        if token in special:
            return token
        return token[2:] if token.startswith("##") else "\u2581" + token

    writer.add_tokenizer_model("bert")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([phantom(t) for t, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t, _ in vocab])
    writer.add_token_type_count(config.get("type_vocab_size", 2))
    ids = dict(vocab)
    writer.add_bos_token_id(ids["[CLS]"])
    writer.add_sep_token_id(ids["[SEP]"])
    writer.add_unk_token_id(ids["[UNK]"])
    writer.add_pad_token_id(ids["[PAD]"])
    writer.add_mask_token_id(ids["[MASK]"])
    writer.add_add_bos_token(True)
    writer.add_add_sep_token(True)
    writer.add_add_eos_token(False)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, layers)
    for name, values in read_safetensors(folder / "model.safetensors"):
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            continue  # the pooler
        writer.add_tensor(mapped, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
