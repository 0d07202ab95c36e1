"""What the GPU check scripts share: a `headroom serve` client (status, the event stream, waiting
for the GPU worker) and a PyTorch competitor for VRAM."""
import json
import threading
import time
import urllib.request

import torch


class Service:
    def __init__(self, base):
        self.base = base
        # Service events other than the per-second memory and queue samples, as they arrive.
        self.events = []

    def get(self, path):
        with urllib.request.urlopen(f"{self.base}{path}", timeout=10) as r:
            return json.loads(r.read())

    def status(self):
        return self.get("/v1/status")

    def watch_events(self):
        """Collects the event stream on a background thread until the server goes away."""
        def watch():
            try:
                with urllib.request.urlopen(f"{self.base}/v1/events", timeout=900) as stream:
                    for raw in stream:
                        line = raw.decode().strip()
                        if line.startswith("data:"):
                            event = json.loads(line[5:])
                            if event.get("event") not in ("memory", "queue"):
                                self.events.append({"t": time.time(), **event})
            except Exception as e:  # the server going away ends the watch
                self.events.append({"t": time.time(), "event": "watch_ended", "error": str(e)})
        threading.Thread(target=watch, daemon=True).start()

    def wait_gpu_ready(self, limit_s=60):
        """Waits until the GPU worker is ready with a closed breaker."""
        deadline = time.time() + limit_s
        while time.time() < deadline:
            s = self.status()
            gpu = next((w for w in s["workers"] if w["kind"] == "gpu"), {})
            if gpu.get("state") == "ready" and s["breaker"] == "closed":
                return True
            time.sleep(0.25)
        return False


def fill_vram(leave_mib):
    """Takes free VRAM in shrinking blocks until about `leave_mib` is left; returns the blocks."""
    blocks = []
    for block_mib in (8192, 1024, 128, 16, 2):
        while True:
            free, _ = torch.cuda.mem_get_info()
            if free // 2**20 < leave_mib + block_mib:
                break
            try:
                blocks.append(torch.empty(block_mib * 2**20, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                break
    return blocks
