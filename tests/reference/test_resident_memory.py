"""The CPU engine keeps the default model's packed weights packed, and the memory model predicts
what loading it and serving a request adds to the process's resident memory (VmRSS peak, mapped
weight pages included) within 5%: weights as the engine holds them, KV cache at the configured
precision, calibrated workspace. That prediction is what admission's host-RAM budget uses.

`headroom model bench` measures both; the negative control switches on a defect that expands the
packed weights to f32 at load (what an engine without packed kernels does), and the check fails.
"""

import json
import os

from conftest import headroom

TOLERANCE_PERCENT = 5.0


def resident(model, kv="f32", defect=None):
    env = {**os.environ, "HEADROOM_TEST_DEFECT": defect} if defect else None
    out = headroom("model", "bench", model, "--threads", "2", "--runs", "1", "--prompt-tokens", "128", "--decode-tokens", "32",
                   "--kv", kv, "--no-bandwidth", env=env)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["resident_bytes"] is not None, "this kernel does not report VmHWM or refuses clear_refs"
    return report


def test_resident_memory_is_predicted_within_5_percent(default_model):
    for kv in ("f32", "f16"):
        r = resident(default_model, kv)
        print(f"kv {kv}: resident {r['resident_bytes'] / 2**20:.1f} MiB, predicted {r['predicted_resident_bytes'] / 2**20:.1f} MiB "
              f"({r['resident_error_percent']:+.1f}%), weights {r['weight_bytes'] / 2**20:.1f} MiB")
        # The committed calibration (models/…gguf.headroom-calibration.json) is what admission
        # uses for the default model; a stale one would fall back to the analytic default.
        assert r["calibration"].startswith("measured"), r["calibration"]
        # The engine holds the file's packed tensors (norms as f32), not f32 copies.
        assert r["weight_bytes"] <= os.path.getsize(default_model), r
        assert abs(r["resident_error_percent"]) <= TOLERANCE_PERCENT, r


def test_control_unpacked_weights_break_the_prediction(default_model):
    r = resident(default_model, defect="unpack-weights")
    print(f"unpack-weights: resident {r['resident_bytes'] / 2**20:.1f} MiB, predicted {r['predicted_resident_bytes'] / 2**20:.1f} MiB "
          f"({r['resident_error_percent']:+.1f}%)")
    assert abs(r["resident_error_percent"]) > TOLERANCE_PERCENT, r
