"""Shared helpers of the reference tests: the `headroom` binary and the default model."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("HEADROOM_BIN", ROOT / "target" / "debug" / "headroom"))
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def headroom(*args, stdin=None, check=True, env=None):
    """Runs `headroom ARGS`; returns the completed process (stdout and stderr as text)."""
    proc = subprocess.run([str(BINARY), *map(str, args)], input=stdin, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"headroom {' '.join(map(str, args))} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="session")
def default_model():
    if not DEFAULT_MODEL.exists():
        pytest.fail(f"{DEFAULT_MODEL} is missing: run ./scripts/install.sh")
    return DEFAULT_MODEL
