"""Starts real `headroom serve` processes for the end-to-end tests."""

import json
import os
import re
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx2 as httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
BINARY = Path(os.environ.get("HEADROOM_BIN", ROOT / "target" / "debug" / "headroom"))


class Server:
    """One `headroom serve` process with its own data directory."""

    def __init__(self, *args, data_dir=None, config=None, env=None):
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="headroom-e2e-"))
        self.args = list(args)
        self.config = config
        self.env = env or {}
        self.proc = None
        self.url = None

    def start(self, timeout=120):
        # The suites serve the fast 4M-parameter fixture unless a test names a model.
        model = [] if "--model" in self.args else ["--model", "kjv-demo"]
        cmd = [str(BINARY), "serve", "--port", "0", "--data-dir", str(self.data_dir), *model, *self.args]
        if self.config:
            path = self.data_dir / "headroom.toml"
            path.write_text(self.config)
            cmd += ["--config", str(path)]
        env = {**os.environ, "HEADROOM_LOG": "warn", **self.env}
        self.log = open(self.data_dir / "serve.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, env=env)
        deadline = time.time() + timeout
        line = b""
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            m = re.search(rb"at (http://[^ ]+)", line)
            if m:
                self.url = m.group(1).decode()
                return self
        raise RuntimeError(f"headroom serve did not start: {line!r}; log: {(self.data_dir / 'serve.log').read_text()[-2000:]}")

    def http(self, timeout=60):
        return httpx.Client(base_url=self.url, timeout=timeout)

    def status(self):
        return httpx.get(self.url + "/v1/status", timeout=10).json()

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# Small queues so a capacity error is easy to provoke.
SIM_CONFIG = """
[queues]
gpu_queue_capacity = 2
cpu_queue_capacity = 2
"""


@pytest.fixture(scope="session")
def sim_server():
    server = Server("--gpu", "sim", config=SIM_CONFIG).start()
    yield server
    server.stop()


def pids_alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive
