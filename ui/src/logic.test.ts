import { describe, expect, it } from "vitest";
import { apiEndpoints, applyChunk, cpuKvLine, gpuKvLine, tokenCount, workerLines, countdown, replyTiming, axisRange, degradedSpans, formatMiB, emptyReply, formatDelay, MemoryHistory, modelLine, modelRows, placementLine, settingsForm, settingsPatch, splitSse, statusView } from "./logic";

const gpuWorker = { kind: "gpu", device: "sim", state: "ready", simulated: true };
const cpuWorker = { kind: "cpu", device: "cpu", state: "ready", simulated: false };

describe("status bar", () => {
  it("says healthy, degraded with the reason, or unavailable", () => {
    expect(statusView({ degraded: false, workers: [gpuWorker, cpuWorker] }).label).toBe("GPU healthy (simulated): sim");
    const degraded = statusView({ degraded: true, degraded_reason: "breaker open after 3 OOMs", workers: [gpuWorker, cpuWorker], estimated_delay_ms: 1200 });
    expect(degraded.health).toBe("degraded");
    expect(degraded.reason).toBe("breaker open after 3 OOMs");
    expect(degraded.summary).toMatch(/answered on the CPU/);
    const plain = statusView({ degraded: true, degraded_reason: "GPU unavailable: 3 allocation failures", degraded_summary: "The GPU is out of memory; kjv-demo on the CPU is answering.", workers: [gpuWorker, cpuWorker] });
    expect(plain.summary).toBe("The GPU is out of memory; kjv-demo on the CPU is answering.");
    expect(plain.reason).toBe("GPU unavailable: 3 allocation failures");
    expect(degraded.estimatedDelayMs).toBe(1200);
    expect(statusView({ degraded: true, workers: [{ ...gpuWorker, state: "down" }, cpuWorker] }).health).toBe("unavailable");
    expect(statusView({ degraded: false, workers: [cpuWorker] }).health).toBe("cpu-only");
  });

  it("says paused when the GPU is paused in settings, and degraded wins over it", () => {
    const paused = statusView({ degraded: false, gpu_paused: true, workers: [{ ...gpuWorker, state: "paused", pid: null }, cpuWorker] });
    expect(paused.health).toBe("paused");
    expect(paused.label).toBe("GPU paused (simulated)");
    expect(statusView({ degraded: true, gpu_paused: true, workers: [gpuWorker, cpuWorker] }).health).toBe("degraded");
    expect(statusView({ degraded: false, workers: [{ ...gpuWorker, state: "starting" }, cpuWorker] }).label).toBe("GPU starting (simulated)");
  });

  it("says the model was unloaded after its keep_alive, not that the GPU failed", () => {
    const status = { degraded: false, gpu_residency: { state: "unloaded", keep_alive: "5m" }, workers: [{ ...gpuWorker, state: "unloaded", pid: null }, cpuWorker] };
    const view = statusView(status);
    expect(view.health).toBe("unloaded");
    expect(view.label).toBe("GPU idle (simulated): model unloaded");
    expect(view.reason).toBe("unloaded after 5m idle (keep_alive), VRAM freed; the next request loads it on the GPU");
    expect(view.summary).toBeNull();
  });
});

describe("layer placement", () => {
  const plan = { layers: 4, gpu_layers: 2, head_on_gpu: false, gpu_weights_bytes: 6 * 1048576, cpu_weights_bytes: 10 * 1048576, predicted_decode_tok_s: 812.4, reason: "split: …" };

  it("says a split's layers, each device's weights and the expected speed", () => {
    expect(placementLine({ placement: plan })).toBe(
      "split: the last 2 of 4 layers on the GPU (6 MiB), the first 2 and the output head on the CPU (10 MiB) · expected up to 812 tokens/s",
    );
    expect(placementLine({ placement: { ...plan, gpu_layers: 4, head_on_gpu: true } })).toBe("all 4 layers on the GPU (6 MiB of weights)");
    expect(placementLine({ placement: { ...plan, gpu_layers: 0, reason: "not one layer fits" } })).toBe("all 4 layers on the CPU: not one layer fits");
    expect(placementLine({})).toBeNull();
  });

  it("marks a healthy GPU that runs the model split", () => {
    const split = { ...gpuWorker, split: { gpu_layers: 2, layers: 4 } };
    expect(statusView({ degraded: false, workers: [split, cpuWorker], placement: plan }).label).toBe("GPU healthy (simulated): sim · split, 2 of 4 layers");
  });
});

describe("settings form", () => {
  const current = { vram_reserve_mib: null, gpu_paused: false, fallback_model: null, cpu_max_concurrency: 1, cpu_max_context_tokens: 8192, gpu_device: 0 };

  it("sends only what changed, with empty optional fields as automatic", () => {
    const form = settingsForm(current);
    expect(form.vramReserveMib).toBe("");
    expect(settingsPatch(current, form)).toEqual({ patch: {}, error: null });
    expect(settingsPatch(current, { ...form, vramReserveMib: " 1500 ", gpuPaused: true }).patch).toEqual({ vram_reserve_mib: 1500, gpu_paused: true });
    const reserved = { ...current, vram_reserve_mib: 1500, fallback_model: "/models/small" };
    expect(settingsPatch(reserved, { ...settingsForm(reserved), vramReserveMib: "", fallbackModel: "" }).patch).toEqual({ vram_reserve_mib: null, fallback_model: null });
  });

  it("sends GPU layers as auto, a count, or null for the config file's", () => {
    const form = settingsForm(current);
    expect(form.gpuLayers).toBe("");
    expect(settingsPatch(current, { ...form, gpuLayers: "auto" }).patch).toEqual({ gpu_layers: "auto" });
    expect(settingsPatch(current, { ...form, gpuLayers: " 12 " }).patch).toEqual({ gpu_layers: 12 });
    const twelve = { ...current, gpu_layers: 12 };
    expect(settingsForm(twelve).gpuLayers).toBe("12");
    expect(settingsPatch(twelve, { ...settingsForm(twelve), gpuLayers: "" }).patch).toEqual({ gpu_layers: null });
    expect(settingsPatch(current, { ...form, gpuLayers: "half" }).error).toBe('GPU layers: "half" is not "auto" or a whole number');
  });

  it("names a field that is not a whole number, or missing", () => {
    const form = settingsForm(current);
    expect(settingsPatch(current, { ...form, vramReserveMib: "2 GB" }).error).toBe('VRAM reserve: "2 GB" is not a whole number');
    expect(settingsPatch(current, { ...form, cpuMaxConcurrency: "" }).error).toBe("CPU concurrency is required");
  });
});

describe("chat stream", () => {
  it("builds a reply with its device, and a notice when it moved to the CPU", () => {
    let r = emptyReply();
    r = applyChunk(r, { choices: [{ delta: { role: "assistant", content: "" } }], headroom: { request_id: "req_1", device: "sim", degraded: false } });
    r = applyChunk(r, { choices: [{ delta: { content: "In the" } }] });
    r = applyChunk(r, { choices: [{ delta: { content: " beginning" } }], headroom: { notice: "failover", from: "sim", to: "cpu", degraded: true, message: "the sim worker failed; continuing on cpu after 2 tokens" } });
    r = applyChunk(r, { choices: [{ delta: {}, finish_reason: "length" }], headroom: { device: "cpu", degraded: true, failovers: [{ from: "sim", to: "cpu", reason: "oom" }], queued_ms: 3 } });
    expect(r.text).toBe("In the beginning");
    expect(r.requestId).toBe("req_1");
    expect(r.device).toBe("cpu");
    expect(r.degraded).toBe(true);
    expect(r.notice).toBe("The GPU failed; the CPU continues where it stopped.");
    expect(r.detail).toBe("the sim worker failed; continuing on cpu after 2 tokens");
    expect(r.failovers).toBe(1);
    expect(r.done).toBe(true);
    expect(r.finishReason).toBe("length");
  });

  it("says when a failed-over reply waits for the CPU, and drops the text a fallback model restarts", () => {
    let r = emptyReply();
    r = applyChunk(r, { choices: [{ delta: { content: "In the" } }], headroom: { request_id: "req_2", device: "sim" } });
    r = applyChunk(r, { choices: [], headroom: { notice: "waiting", queue: "cpu", ahead: 2, degraded: true, message: "sim failed: killed; waiting for the cpu worker (2 ahead)" } });
    expect(r.notice).toBe("Waiting for the CPU behind 2 others.");
    expect(r.detail).toBe("sim failed: killed; waiting for the cpu worker (2 ahead)");
    expect(r.text).toBe("In the");
    r = applyChunk(r, { choices: [{ delta: { content: "And" } }], headroom: { notice: "restart", from: "sim", to: "cpu", degraded: true, message: "cpu answers again from the start" } });
    expect(r.text).toBe("And");
    expect(r.device).toBe("cpu");
  });

  it("says why a reply was sent to the CPU by admission", () => {
    const r = applyChunk(emptyReply(), { choices: [], headroom: { request_id: "x", device: "cpu", degraded: true, degraded_reason: "sent to the CPU: needs 7.5 MiB" } });
    expect(r.notice).toBe("sent to the CPU: needs 7.5 MiB");
  });

  it("puts the plain summary first and keeps the figures behind it", () => {
    const summary = "The GPU is out of memory; kjv-demo on the CPU is answering, about 4× slower, up to 2k tokens.";
    let r = applyChunk(emptyReply(), { choices: [], headroom: { request_id: "x", device: "cpu", degraded: true, degraded_reason: "sent to the CPU: needs 7.5 MiB", degraded_summary: summary } });
    expect(r.notice).toBe(summary);
    expect(r.detail).toBe("sent to the CPU: needs 7.5 MiB");
    // A failover mid-stream: the final chunk's summary replaces the notice, which moves behind it.
    r = applyChunk(emptyReply(), { choices: [{ delta: { content: "In" } }], headroom: { notice: "failover", from: "sim", to: "cpu", degraded: true, message: "the sim worker failed; continuing on cpu after 1 tokens" } });
    r = applyChunk(r, { choices: [{ delta: {}, finish_reason: "stop" }], headroom: { device: "cpu", degraded: true, degraded_reason: "sim failed: out of memory", degraded_summary: summary, failovers: [{ from: "sim", to: "cpu", reason: "sim failed: out of memory" }] } });
    expect(r.notice).toBe(summary);
    expect(r.detail).toBe("the sim worker failed; continuing on cpu after 1 tokens; sim failed: out of memory");
  });

  it("ends on an error chunk", () => {
    const r = applyChunk(emptyReply(), { error: { message: "worker failed" } });
    expect(r.error).toBe("worker failed");
    expect(r.done).toBe(true);
  });

  it("splits server-sent events across reads", () => {
    const first = splitSse("event: failover\ndata: {\"a\":1}\n\ndata: [DO");
    expect(first.events).toEqual([{ event: "failover", data: '{"a":1}' }]);
    const second = splitSse(first.rest + "NE]\n\n");
    expect(second.events).toEqual([{ event: "message", data: "[DONE]" }]);
    expect(second.rest).toBe("");
  });
});

describe("memory panel", () => {
  it("keeps a window of samples with the reserve line, and marks failovers", () => {
    const h = new MemoryHistory(60);
    const status = (used: number) => ({ memory: { gpu: { capacity_bytes: 100 * 1048576, used_bytes: used * 1048576, reserved_bytes: 0 }, vram_reserve_bytes: 20 * 1048576, gpu_held_bytes: 5 * 1048576, host: { total_bytes: 1000 * 1048576, available_bytes: 600 * 1048576 } } });
    h.addStatus(status(30), 0);
    h.addStatus(status(40), 30_000);
    h.addStatus(status(50), 90_000);
    expect(h.points.map((p) => p.vramUsed)).toEqual([40, 50]);
    expect(h.points[0].vramLimit).toBe(80);
    expect(h.points[0].vramReserved).toBe(5);
    expect(h.points[0].hostUsed).toBe(400);
    h.addEvent("failover", { at_unix_ms: 91_000, from: "sim", to: "cpu" });
    h.addEvent("queue_changed", { at_unix_ms: 91_000 });
    h.addEvent("placement_changed", { at_unix_ms: 91_500, gpu_layers: 1, layers: 4 });
    h.addEvent("gpu_model_unloaded", { at_unix_ms: 91_600 });
    h.addEvent("gpu_model_loading", { at_unix_ms: 91_700 });
    expect(h.marks).toEqual([
      { t: 91, kind: "failover", label: "failover sim→cpu" },
      { t: 91.5, kind: "placement", label: "layers 1/4 on the GPU" },
      { t: 91.6, kind: "residency", label: "model unloaded (keep_alive)" },
      { t: 91.7, kind: "residency", label: "model loading on the GPU" },
    ]);
    expect(h.columns()[0]).toEqual([90], "a mark moves the window too");
  });

  it("stacks GPU memory by part: weights, requests, other programs", () => {
    const h = new MemoryHistory(60);
    h.addStatus({ memory: { gpu: { capacity_bytes: 100 * 1048576, used_bytes: 50 * 1048576, weights_bytes: 15 * 1048576, reserved_bytes: 0 }, vram_reserve_bytes: 20 * 1048576, gpu_held_bytes: 5 * 1048576 } }, 0);
    expect(h.points[0].vramOther).toBe(30);
    const [, top, middle, bottom, limit] = h.columns();
    expect([top[0], middle[0], bottom[0], limit[0]]).toEqual([50, 20, 15, 80]);
    expect(h.columns()[6]).toEqual([null], "no KV line where the worker does not count its blocks");
  });

  it("stacks one area per model when several share the GPU, other programs on top", () => {
    const h = new MemoryHistory(60);
    const M = 1048576;
    const status = (aBytes: number | null, first = true) => ({
      memory: { gpu: first ? { capacity_bytes: 100 * M, used_bytes: 60 * M, weights_bytes: 15 * M, reserved_bytes: 0 } : null, vram_reserve_bytes: first ? 20 * M : null, gpu_other_bytes: 7 * M },
      models: [
        { id: "a", gpu_weights_bytes: aBytes, gpu_held_bytes: 5 * M },
        { id: "b", gpu_weights_bytes: 0, gpu_held_bytes: 0 },
        { id: "c-embed", gpu_weights_bytes: 12 * M, gpu_held_bytes: 1 * M },
      ],
    });
    h.addStatus(status(15 * M), 0);
    expect(h.modelIds).toEqual(["a", "b", "c-embed"]);
    // The first model unloaded: its reading is gone, the limit stays.
    h.addStatus(status(0, false), 1000);
    const [t, top, all, ab, a, limit, host] = h.columns();
    expect(t).toEqual([0, 1]);
    expect(top).toEqual([40, 25]);
    expect(all).toEqual([33, 18]);
    expect(ab).toEqual([20, 5]);
    expect(a).toEqual([20, 5]);
    expect(limit).toEqual([80, 80]);
    expect(host).toEqual([null, null]);
    h.addEvent("gpu_model_unloaded", { at_unix_ms: 1500, model: "b", reason: "evicted to make room for a" });
    h.addEvent("gpu_model_loading", { at_unix_ms: 1600, model: "a" });
    h.addEvent("placement_changed", { at_unix_ms: 1700, model: "a", gpu_layers: 3, layers: 4 });
    expect(h.marks.map((m) => m.label)).toEqual(["b evicted", "a loading on the GPU", "a: layers 3/4 on the GPU"]);
    // One model again (a restart): the parts' layout comes back.
    h.addStatus({ memory: { gpu: { capacity_bytes: 100 * M, used_bytes: 50 * M, weights_bytes: 15 * M, reserved_bytes: 0 }, vram_reserve_bytes: 20 * M }, models: [{ id: "a" }] }, 2000);
    expect(h.modelIds).toEqual([]);
    expect(h.columns().length).toBe(7);
  });

  it("names the model holding the shared GPU while the page's model is unloaded", () => {
    const status = { model: "a", workers: [{ kind: "gpu", state: "unloaded", device: "sim", simulated: true }], gpu_residency: { keep_alive: "-1" }, models: [{ id: "a", state: "cpu" }, { id: "b", state: "gpu" }] };
    const view = statusView(status);
    expect(view.health).toBe("unloaded");
    expect(view.label).toBe("GPU (simulated): b loaded");
    expect(view.reason).toMatch(/^a is unloaded .*its next request loads it on the GPU$/);
    expect(statusView({ ...status, models: [{ id: "a", state: "cpu" }] }).label).toBe("GPU idle (simulated): model unloaded");
  });

  it("says the service is degraded when any served model is", () => {
    const status = { model: "a", degraded: false, workers: [{ kind: "gpu", state: "ready", device: "sim", simulated: true }], models: [{ id: "a", degraded: false }, { id: "b", degraded: true, degraded_summary: "b's GPU is out of memory; b on the CPU is answering." }] };
    const view = statusView(status);
    expect(view.health).toBe("degraded");
    expect(view.label).toBe("GPU degraded (simulated) for b");
    expect(view.summary).toBe("b's GPU is out of memory; b on the CPU is answering.");
    expect(statusView({ ...status, models: [{ id: "a", degraded: false }, { id: "b", degraded: false }] }).health).toBe("healthy");
  });

  it("draws the KV cache written inside what requests hold (KV overcommit)", () => {
    const h = new MemoryHistory(60);
    const gpu = { capacity_bytes: 100 * 1048576, used_bytes: 50 * 1048576, weights_bytes: 15 * 1048576, reserved_bytes: 8 * 1048576 };
    h.addStatus({ memory: { gpu, gpu_held_bytes: 8 * 1048576, gpu_kv: { resident_bytes: 3 * 1048576 } } }, 0);
    const columns = h.columns();
    expect(columns[2][0]).toBe(23);
    expect(columns[6][0]).toBe(18);
  });
});

describe("delay", () => {
  it("reads like a person would say it", () => {
    expect(formatDelay(null)).toBeNull();
    expect(formatDelay(0)).toBeNull();
    expect(formatDelay(400)).toBe("about 400 ms");
    expect(formatDelay(4200)).toBe("about 4 s");
    expect(formatDelay(180_000)).toBe("about 3 min");
  });
});

describe("modelLine", () => {
  it("names the served model, its format and quantization, parameters and file size", () => {
    const status = { model: "SmolLM2-135M-Instruct.Q4_1", model_info: { format: "gguf", quantization: "Q4_1", parameters: 134515008, file_bytes: 98362432 } };
    expect(modelLine(status)).toBe("SmolLM2-135M-Instruct.Q4_1 · GGUF Q4_1 · 135M parameters · 98 MB");
    expect(statusView({ ...status, workers: [] }).model).toBe(modelLine(status));
    expect(modelLine({ model: "kjv-demo" })).toBe("kjv-demo");
    expect(modelLine({})).toBeNull();
  });
});

describe("API endpoints", () => {
  it("gives OpenAI clients the /v1 base URL and Ollama clients the bare host", () => {
    const [openai, ollama] = apiEndpoints("http://127.0.0.1:11434/");
    expect(openai).toMatchObject({ api: "OpenAI", url: "http://127.0.0.1:11434/v1" });
    expect(ollama).toMatchObject({ api: "Ollama", url: "http://127.0.0.1:11434" });
  });
});

describe("memory chart", () => {
  it("ranges an axis from 0 to a round value, never less than its minimum span", () => {
    expect(axisRange(0.2, 64)).toEqual([0, 100]);
    expect(axisRange(null, 64)).toEqual([0, 100]);
    expect(axisRange(17.3, 16)).toEqual([0, 20]);
    expect(axisRange(1590, 256)).toEqual([0, 2000]);
    expect(axisRange(70000, 256)).toEqual([0, 100000]);
  });

  it("reads values with units", () => {
    expect(formatMiB(null)).toBe("--");
    expect(formatMiB(0.46)).toBe("0.5 MiB");
    expect(formatMiB(1500.2)).toBe("1.5 GiB");
    expect(formatMiB(512)).toBe("512 MiB");
  });

  it("shades the degraded stretches, open ones up to now", () => {
    const mark = (t: number, label: string) => ({ t, label, kind: "degraded" as const });
    const failover = { t: 5, label: "failover sim→cpu", kind: "failover" as const };
    expect(degradedSpans([mark(10, "degraded"), failover, mark(20, "recovered"), mark(30, "degraded")], 40)).toEqual([[10, 20], [30, 40]]);
    expect(degradedSpans([mark(20, "recovered")], 40)).toEqual([[-Infinity, 20]]);
    expect(degradedSpans([], 40)).toEqual([]);
  });
});

describe("waits and speeds", () => {
  it("counts the expected wait down, then says any moment", () => {
    expect(countdown(5000, 1000, 1000)).toBe("about 5 s left");
    expect(countdown(5000, 1000, 4000)).toBe("about 2 s left");
    expect(countdown(5000, 1000, 7000)).toBe("any moment now");
    expect(countdown(null, 0, 0)).toBe(null);
  });

  it("measures the time to the first token and the tokens per second", () => {
    let r = emptyReply(1000);
    r = applyChunk(r, { choices: [{ delta: { role: "assistant", content: "" } }] }, 1100);
    expect(replyTiming(r)).toBe(null);
    r = applyChunk(r, { choices: [{ delta: { content: "In" } }] }, 2200);
    expect(replyTiming(r)).toBe("first token after 1.2 s");
    for (let i = 1; i <= 20; i++) r = applyChunk(r, { choices: [{ delta: { content: " x" } }] }, 2200 + i * 50);
    r = applyChunk(r, { choices: [{ delta: {}, finish_reason: "stop" }] }, 3200);
    expect(replyTiming(r)).toBe("first token after 1.2 s · 20.0 tokens/s");
    // Every chunk in the same millisecond: the worker's measured decode time gives the speed.
    let fast = emptyReply(1000);
    for (let i = 0; i <= 20; i++) fast = applyChunk(fast, { choices: [{ delta: { content: " x" } }] }, 1300);
    fast = applyChunk(fast, { choices: [{ delta: {}, finish_reason: "stop" }], headroom: { decode_ms: 100, failovers: [] } }, 1300);
    expect(replyTiming(fast)).toBe("first token after 0.3 s · 200.0 tokens/s");
  });
});

describe("workers side by side", () => {
  it("gives each worker's model, context, concurrency and measured speed", () => {
    const status = {
      workers: [
        { kind: "gpu", device: "sim", model: "kjv-demo", context_tokens: 1024 },
        { kind: "cpu", device: "cpu", model: "kjv-small", context_tokens: 3000 },
      ],
      queues: [{ device: "gpu", concurrency: 4, ms_per_token: 2.5 }, { device: "cpu", concurrency: 2, ms_per_token: null }],
    };
    expect(workerLines(status)).toEqual([
      { lane: "GPU", text: "GPU: kjv-demo · up to 1k tokens · 4 at a time · 400 tokens/s" },
      { lane: "CPU", text: "CPU: kjv-small · up to 3,000 tokens · 2 at a time · speed not measured yet" },
    ]);
    expect(tokenCount(131072)).toBe("128k");
  });

  it("says what the CPU KV cache holds against what was reserved, and the prompt cache's reuse", () => {
    expect(cpuKvLine({ memory: {} })).toBeNull();
    expect(gpuKvLine({ memory: {} })).toBeNull();
    const gpu_kv = { block_tokens: 16, block_bytes: 131072, resident_blocks: 24, resident_bytes: 3 * 1048576, reserved_bytes: 10 * 1048576, pool_blocks: 160, overcommit: 1, preemptions: 0 };
    expect(gpuKvLine({ memory: { gpu_kv } })).toBe("GPU KV cache: 24 of 160 blocks of 16 tokens (3.0 MiB) written, 10 MiB reserved for running requests");
    expect(gpuKvLine({ memory: { gpu_kv: { ...gpu_kv, overcommit: 4, preemptions: 2 } } })).toBe("GPU KV cache: 24 of 160 blocks of 16 tokens (3.0 MiB) written, 10 MiB reserved for running requests; overcommit 4×, 2 preempted");
    // A server without the pool's size (older) still gets the line.
    const { pool_blocks: _, ...older } = gpu_kv;
    expect(gpuKvLine({ memory: { gpu_kv: older } })).toBe("GPU KV cache: 24 blocks of 16 tokens (3.0 MiB) written, 10 MiB reserved for running requests");
    const memory = { cpu_kv_resident_bytes: 3.5 * 1048576, host_reserved_bytes: 12 * 1048576, cpu_prefix_cache: { capacity_blocks: 364, bytes: 2 * 1048576, hit_rate: 0.784 } };
    expect(cpuKvLine({ memory })).toBe("CPU KV cache: 3.5 MiB in use, 12 MiB reserved for running requests; prompt cache 2.0 MiB, 78% of prompt tokens reused");
    expect(cpuKvLine({ memory: { ...memory, cpu_prefix_cache: { capacity_blocks: 0, bytes: 0, hit_rate: 0 } } })).toBe("CPU KV cache: 3.5 MiB in use, 12 MiB reserved for running requests");
  });

  it("says on the reply when a fallback model answered", () => {
    const r = applyChunk(emptyReply(), { choices: [], headroom: { device: "cpu", degraded: true, fallback_model: "kjv-small", failovers: [] } });
    expect(r.fallbackModel).toBe("kjv-small");
  });
});

describe("models", () => {
  it("lists each served model with its role, where it is loaded, its bytes and last use", () => {
    const status = {
      models: [
        { id: "chat", role: "chat", state: "gpu", resident_bytes: { gpu: 512 * 1048576, cpu: 98 * 1048576 }, last_used_unix_ms: 90_000 },
        { id: "embed", role: "embedding", state: "cpu", resident_bytes: { cpu: 30 * 1048576 }, last_used_unix_ms: null },
      ],
    };
    expect(modelRows(status, 102_000)).toEqual([
      { id: "chat", role: "chat", where: "GPU", gpu: "512 MiB", cpu: "98 MiB", lastUsed: "12 s ago" },
      { id: "embed", role: "embedding", where: "CPU only", gpu: "—", cpu: "30 MiB", lastUsed: "—" },
    ]);
    expect(modelRows({})).toEqual([]);
  });

  it("says which models share a CPU worker, whose weights are in RAM once", () => {
    const shared = (id: string, other: string) => ({ id, role: "chat", state: "cpu", resident_bytes: { cpu: 15 * 1048576 }, cpu_worker_shared_with: [other], last_used_unix_ms: null });
    const rows = modelRows({ models: [shared("chat-a", "chat-b"), shared("chat-b", "chat-a")] }, 0);
    expect(rows.map((r) => r.cpu)).toEqual(["15 MiB, one worker with chat-b", "15 MiB, one worker with chat-a"]);
  });
});
