"""A real `headroom serve` for the benchmark scripts: the release binary (else the debug one),
its own data directory, the given threads, extra flags and environment."""

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def headroom_binary():
    for profile in ("release", "debug"):
        path = ROOT / "target" / profile / "headroom"
        if path.exists():
            return path
    sys.exit("no target/*/headroom: build it first (cargo build --release --bin headroom)")


class Serve:
    def __init__(self, model, threads, *flags, env=None):
        self.dir = tempfile.mkdtemp(prefix="headroom-bench-")
        env = {**os.environ, "HEADROOM_LOG": "warn", "RAYON_NUM_THREADS": str(threads), **(env or {})}
        self.proc = subprocess.Popen([str(headroom_binary()), "serve", "--port", "0", "--data-dir", self.dir, "--model", str(model), *flags],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        deadline = time.time() + 300
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(rb"at (http://[^ ]+)", line)
            if m:
                self.url = m.group(1).decode()
                return
        self.proc.kill()
        sys.exit("headroom serve did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)
