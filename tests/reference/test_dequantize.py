"""Headroom's GGUF dequantization against the `gguf` package's numpy reference, for every tensor
type Headroom reads, on tensors this test writes with `gguf`'s writer."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFWriter
from gguf.quants import GGML_QUANT_SIZES, dequantize, quantize

from conftest import headroom

# Types `gguf.quants` can quantize from floats; the K-quants it only dequantizes, so their blocks
# are random bytes with finite f16 scales.
QUANTIZABLE = [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
RANDOM_BLOCKS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
# Byte offsets of each K-quant block's f16 scales (ggml's block structs).
F16_FIELDS = {T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
ROWS, COLS = 6, 512


def raw_tensor(qtype, rng):
    block, size = GGML_QUANT_SIZES[qtype]
    if qtype in QUANTIZABLE:
        data = rng.normal(0, 1.5, (ROWS, COLS)).astype(np.float32)
        data[0, :64] = 0.0  # an all-zero block (scale 0)
        return quantize(data, qtype)
    blocks = rng.integers(0, 256, (ROWS * COLS // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.05, 0.05, len(blocks)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", QUANTIZABLE + RANDOM_BLOCKS, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype, tmp_path):
    rng = np.random.default_rng(int(qtype) + 7)
    raw = raw_tensor(qtype, rng)
    path = tmp_path / f"{qtype.name}.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("t", raw, raw_shape=raw.shape if raw.dtype == np.uint8 else None, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    out = tmp_path / "t.f32"
    headroom("model", "tensor", path, "t", "--out", out)
    ours = np.fromfile(out, dtype="<f4").reshape(ROWS, COLS)
    reference = dequantize(raw, qtype).astype(np.float32).reshape(ROWS, COLS)
    assert np.isfinite(reference).all()
    scale = float(np.abs(reference).max()) or 1.0
    worst = float(np.abs(ours - reference).max())
    # Same formulas in f32; only the order of a product may differ.
    assert worst <= 1e-6 * scale, f"{qtype.name}: worst difference {worst} (values up to {scale})"


def test_control_q5_high_bits_defect_is_caught(tmp_path, monkeypatch):
    """The negative control: with Q5's high bits read from the wrong half, the comparison fails."""
    monkeypatch.setenv("HEADROOM_TEST_DEFECT", "q5-high-bits")
    for qtype in (T.Q5_0, T.Q5_1):
        with pytest.raises(AssertionError, match="worst difference"):
            test_dequantize_matches_gguf(qtype, tmp_path)
