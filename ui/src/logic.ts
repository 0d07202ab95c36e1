// What the UI shows, computed from what the server says. Pure functions: the components only
// render these, and vitest checks them without a browser.

/** One service event or status snapshot, as `/v1/events` and `/v1/status` send them. */
export type Json = Record<string, any>;

export type Health = "healthy" | "degraded" | "unavailable" | "cpu-only" | "paused" | "starting" | "unloaded";

export interface StatusView {
  health: Health;
  label: string;
  reason: string | null;
  simulated: boolean;
  gpuDevice: string | null;
  estimatedDelayMs: number | null;
  /** The served model: name, format and quantization, parameters and file size. */
  model: string | null;
  /** Where the model's layers live (see [`placementLine`]). */
  placement: string | null;
  /** While degraded: what it means for the person, in one sentence; `reason` holds the detail. */
  summary: string | null;
}

function formatCount(n: number): string {
  if (n >= 1e9) return `${(n / 1e9).toFixed(1)}B`;
  if (n >= 1e6) return `${Math.round(n / 1e6)}M`;
  return `${Math.round(n / 1e3)}K`;
}

/** "SmolLM2-135M-Instruct.Q4_1 · GGUF Q4_1 · 135M parameters · 98 MB" from `/v1/status`. */
export function modelLine(status: Json): string | null {
  if (typeof status.model !== "string") return null;
  const info: Json = status.model_info ?? {};
  const parts = [status.model];
  if (info.format) parts.push(`${String(info.format).toUpperCase()}${info.quantization ? ` ${info.quantization}` : ""}`);
  if (typeof info.parameters === "number") parts.push(`${formatCount(info.parameters)} parameters`);
  if (typeof info.file_bytes === "number") parts.push(`${Math.round(info.file_bytes / 1e6)} MB`);
  return parts.join(" · ");
}

const mib = (bytes: number) => `${Math.round(bytes / 1048576).toLocaleString("en")} MiB`;

/** Where the server placed the model's layers at start (`placement` of `/v1/status`): all on
 *  the GPU, or split with each device's share and the split's expected speed. */
export function placementLine(status: Json): string | null {
  const p: Json | null = status.placement ?? null;
  if (!p || typeof p.layers !== "number") return null;
  if (p.gpu_layers === 0) return `all ${p.layers} layers on the CPU: ${p.reason}`;
  if (p.head_on_gpu) return `all ${p.layers} layers on the GPU (${mib(p.gpu_weights_bytes)} of weights)`;
  const speed = typeof p.predicted_decode_tok_s === "number" ? ` · expected up to ${Math.round(p.predicted_decode_tok_s)} tokens/s` : "";
  return `split: the last ${p.gpu_layers} of ${p.layers} layers on the GPU (${mib(p.gpu_weights_bytes)}), the first ${p.layers - p.gpu_layers} and the output head on the CPU (${mib(p.cpu_weights_bytes)})${speed}`;
}

/** The status bar: GPU healthy, degraded (CPU serving GPU requests) or unavailable, and why. */
export function statusView(status: Json): StatusView {
  const workers: Json[] = status.workers ?? [];
  const gpu = workers.find((w) => w.kind === "gpu");
  const delay = typeof status.estimated_delay_ms === "number" ? status.estimated_delay_ms : null;
  const base = { simulated: !!gpu?.simulated, gpuDevice: gpu?.device ?? null, estimatedDelayMs: delay, model: modelLine(status), placement: placementLine(status), summary: null };
  if (!gpu) {
    return { ...base, health: "cpu-only", label: "CPU only", reason: "no GPU worker is configured" };
  }
  const sim = gpu.simulated ? " (simulated)" : "";
  if (status.degraded) {
    const down = gpu.state === "down";
    return {
      ...base,
      health: down ? "unavailable" : "degraded",
      label: down ? `GPU unavailable${sim}` : `GPU degraded${sim}`,
      reason: status.degraded_reason ?? "GPU requests are served by the CPU worker",
      summary: status.degraded_summary ?? "Requests meant for the GPU are answered on the CPU, more slowly.",
    };
  }
  // Several models share the GPU: another one's degraded mode is the service's too.
  const others: Json[] = (status.models ?? []).filter((m: Json) => m.degraded && m.id !== status.model);
  if (others.length > 0) {
    const names = others.map((m) => m.id).join(", ");
    return {
      ...base,
      health: "degraded",
      label: `GPU degraded${sim} for ${names}`,
      reason: `${names}: GPU requests are served by the CPU worker`,
      summary: others.map((m) => m.degraded_summary).filter(Boolean).join(" ") || `Requests for ${names} meant for the GPU are answered on the CPU, more slowly.`,
    };
  }
  if (status.gpu_paused) {
    return { ...base, health: "paused", label: `GPU paused${sim}`, reason: "paused in settings; requests go to the CPU worker" };
  }
  // Unloaded after its keep_alive: not a failure; the next GPU request loads it again.
  if (gpu.state === "unloaded") {
    // Several models share the GPU: another one holds it now (this one made way, or idled out).
    const holding: string[] = (status.models ?? []).filter((m: Json) => m.id !== status.model && (m.state === "gpu" || m.state === "split")).map((m: Json) => m.id);
    if (holding.length > 0) {
      return {
        ...base,
        health: "unloaded",
        label: `GPU${sim}: ${holding.join(", ")} loaded`,
        reason: `${status.model} is unloaded (it made way for another model or idled past its keep_alive); its next request loads it on the GPU`,
      };
    }
    const keep = status.gpu_residency?.keep_alive;
    return {
      ...base,
      health: "unloaded",
      label: `GPU idle${sim}: model unloaded`,
      reason: `unloaded after ${keep && keep !== "-1" ? `${keep} idle (keep_alive)` : "its keep_alive"}, VRAM freed; the next request loads it on the GPU`,
    };
  }
  if (gpu.state === "down" || gpu.state === "starting") {
    return { ...base, health: "starting", label: `GPU starting${sim}`, reason: "requests go to the CPU worker until it is ready" };
  }
  const split = gpu.split ? ` · split, ${gpu.split.gpu_layers} of ${gpu.split.layers} layers` : "";
  return { ...base, health: "healthy", label: `GPU healthy${sim}: ${gpu.device}${split}`, reason: null };
}

/** The settings form: text fields as typed, so a half-typed number is not lost. */
export interface SettingsForm {
  vramReserveMib: string;
  gpuPaused: boolean;
  fallbackModel: string;
  cpuMaxConcurrency: string;
  cpuMaxContextTokens: string;
  gpuDevice: string;
  /** "auto", a count, or empty for the config file's. */
  gpuLayers: string;
}

export function settingsForm(s: Json): SettingsForm {
  return {
    vramReserveMib: s.vram_reserve_mib == null ? "" : String(s.vram_reserve_mib),
    gpuPaused: !!s.gpu_paused,
    fallbackModel: s.fallback_model ?? "",
    cpuMaxConcurrency: String(s.cpu_max_concurrency ?? ""),
    cpuMaxContextTokens: String(s.cpu_max_context_tokens ?? ""),
    gpuDevice: String(s.gpu_device ?? 0),
    gpuLayers: s.gpu_layers == null ? "" : String(s.gpu_layers),
  };
}

/** The changes a form makes to `current`, as a merge patch, or what is wrong with the form.
 *  Empty optional fields mean automatic (null); the server checks ranges and says why. */
export function settingsPatch(current: Json, form: SettingsForm): { patch: Json; error: string | null } {
  const patch: Json = {};
  const whole = (text: string, label: string): number | null | string => {
    const t = text.trim();
    if (t === "") return null;
    if (!/^\d+$/.test(t)) return `${label}: "${t}" is not a whole number`;
    return Number(t);
  };
  const fields: [string, string, string, boolean][] = [
    ["vram_reserve_mib", form.vramReserveMib, "VRAM reserve", true],
    ["cpu_max_concurrency", form.cpuMaxConcurrency, "CPU concurrency", false],
    ["cpu_max_context_tokens", form.cpuMaxContextTokens, "CPU context limit", false],
    ["gpu_device", form.gpuDevice, "GPU device", false],
  ];
  for (const [key, text, label, optional] of fields) {
    const value = whole(text, label);
    if (typeof value === "string") return { patch: {}, error: value };
    if (value === null && !optional) return { patch: {}, error: `${label} is required` };
    if (value !== current[key]) patch[key] = value;
  }
  const layersText = form.gpuLayers.trim();
  let layers: number | string | null = layersText === "" ? null : layersText;
  if (layers !== null && layers !== "auto") {
    if (!/^\d+$/.test(layersText)) return { patch: {}, error: `GPU layers: "${layersText}" is not "auto" or a whole number` };
    layers = Number(layersText);
  }
  if (layers !== (current.gpu_layers ?? null)) patch.gpu_layers = layers;
  if (form.gpuPaused !== !!current.gpu_paused) patch.gpu_paused = form.gpuPaused;
  const fallback = form.fallbackModel.trim() || null;
  if (fallback !== (current.fallback_model ?? null)) patch.fallback_model = fallback;
  return { patch, error: null };
}

/** A reply in the chat, built from the stream's chunks. */
export interface Reply {
  requestId: string | null;
  text: string;
  device: string | null;
  degraded: boolean;
  /** Why the reply was served or resumed on the CPU, when it was, in plain words. */
  notice: string | null;
  /** The technical reason behind the notice (the failure, admission's figures), shown on demand. */
  detail: string | null;
  /** The CPU worker's smaller fallback model, when it answered instead of the one asked for. */
  fallbackModel: string | null;
  failovers: number;
  queuedMs: number | null;
  done: boolean;
  cancelled: boolean;
  error: string | null;
  finishReason: string | null;
  /** Measured here (ms since the epoch): sent, first text, done; and the text chunks between. */
  startedAt: number;
  firstTokenAt: number | null;
  doneAt: number | null;
  chunks: number;
  /** The worker's own decode time, from the final chunk: the speed when every chunk arrived
   *  within one millisecond here (a fast model whose stream the network delivered at once). */
  decodeMs: number | null;
}

export function emptyReply(now = Date.now()): Reply {
  return { requestId: null, text: "", device: null, degraded: false, notice: null, detail: null, fallbackModel: null, failovers: 0, queuedMs: null, done: false, cancelled: false, error: null, finishReason: null, startedAt: now, firstTokenAt: null, doneAt: null, chunks: 0, decodeMs: null };
}

/** "first token after 1.2 s · 23 tokens/s": what the person waited and the speed they got,
 *  measured by this client (a chunk carries one token). */
export function replyTiming(r: Reply): string | null {
  if (r.firstTokenAt === null) return null;
  const seconds = (ms: number) => (ms < 10_000 ? `${(ms / 1000).toFixed(1)} s` : `${Math.round(ms / 1000)} s`);
  const parts = [`first token after ${seconds(r.firstTokenAt - r.startedAt)}`];
  if (r.doneAt !== null && r.chunks > 1) {
    const ms = r.doneAt > r.firstTokenAt ? r.doneAt - r.firstTokenAt : r.decodeMs;
    if (ms) parts.push(`${((r.chunks - 1) / (ms / 1000)).toFixed(1)} tokens/s`);
  }
  return parts.join(" · ");
}

/** The expected wait, counting down from when the server estimated it; "any moment" once the
 *  estimate has run out and the reply still waits. */
export function countdown(estimatedMs: number | null, sinceMs: number, nowMs: number): string | null {
  if (estimatedMs === null || estimatedMs <= 0) return null;
  const left = estimatedMs - (nowMs - sinceMs);
  return left > 0 ? `${formatDelay(left)} left` : "any moment now";
}

/** Folds one OpenAI chat chunk (with Headroom's `headroom` extension) into the reply. */
export function applyChunk(reply: Reply, chunk: Json, now = Date.now()): Reply {
  const next = { ...reply };
  if (chunk.error) {
    next.error = chunk.error.message ?? "the request failed";
    next.done = true;
    next.doneAt = now;
    return next;
  }
  const h = chunk.headroom;
  if (h) {
    if (h.request_id) next.requestId = h.request_id;
    if (h.device) next.device = h.device;
    if (h.fallback_model) next.fallbackModel = h.fallback_model;
    if (h.degraded) next.degraded = true;
    // Mid-stream notices in plain words; the server's own message goes behind Details.
    const where = (device: string | undefined) => (device === "cpu" ? "the CPU" : device ? `the GPU (${device})` : "another worker");
    if (h.notice === "failover" || h.notice === "restart") {
      next.notice = h.notice === "restart" ? `The GPU failed; ${where(h.to)} answers again from the start.` : `The GPU failed; ${where(h.to)} continues where it stopped.`;
      next.detail = h.message ?? null;
      next.device = h.to ?? next.device;
      // A fallback model answers again from the start: its text replaces what came before.
      if (h.notice === "restart") next.text = "";
    } else if (h.notice === "waiting") {
      const wait = formatDelay(h.estimated_delay_ms);
      next.notice = `Waiting for ${where(h.queue)}${typeof h.ahead === "number" && h.ahead > 0 ? ` behind ${h.ahead} other${h.ahead > 1 ? "s" : ""}` : ""}${wait ? `, ${wait}` : ""}.`;
      next.detail = h.message ?? null;
    } else if (h.degraded && (h.degraded_summary || h.degraded_reason) && !next.notice) {
      next.notice = h.degraded_summary ?? h.degraded_reason;
      next.detail = h.degraded_reason ?? null;
    }
    // The final chunk's plain summary replaces a mid-stream notice; what that said stays behind it.
    if (h.degraded && h.degraded_summary && next.notice !== h.degraded_summary && Array.isArray(h.failovers)) {
      next.detail = [next.detail ?? next.notice, h.degraded_reason].filter((x) => x && x !== h.degraded_summary).join("; ") || null;
      next.notice = h.degraded_summary;
    }
    if (Array.isArray(h.failovers)) {
      next.failovers = h.failovers.length;
      if (h.failovers.length > 0 && !next.notice) {
        const f = h.failovers[h.failovers.length - 1];
        next.notice = `moved from ${f.from} to ${f.to}`;
        next.detail = f.reason;
      }
    }
    if (typeof h.queued_ms === "number") next.queuedMs = h.queued_ms;
    if (typeof h.decode_ms === "number" && h.decode_ms > 0) next.decodeMs = h.decode_ms;
  }
  const choice = chunk.choices?.[0];
  if (choice) {
    const content = choice.delta?.content;
    if (typeof content === "string" && content.length > 0) {
      next.text += content;
      next.chunks += 1;
      if (next.firstTokenAt === null) next.firstTokenAt = now;
    }
    if (choice.finish_reason) {
      next.finishReason = choice.finish_reason;
      next.done = true;
      next.doneAt = now;
    }
  }
  return next;
}

/** Splits a server-sent-events buffer into complete events; returns them and the rest. */
export function splitSse(buffer: string): { events: { event: string; data: string }[]; rest: string } {
  const events: { event: string; data: string }[] = [];
  let rest = buffer.replace(/\r\n/g, "\n");
  let end: number;
  while ((end = rest.indexOf("\n\n")) >= 0) {
    const block = rest.slice(0, end);
    rest = rest.slice(end + 2);
    let event = "message";
    const data: string[] = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    if (data.length > 0) events.push({ event, data: data.join("\n") });
  }
  return { events, rest };
}

const MIB = 1024 * 1024;

/** One point of the memory panel, in MiB. */
export interface MemoryPoint {
  t: number; // unix seconds
  vramUsed: number | null;
  /** The model's weights on the GPU. */
  vramWeights: number | null;
  /** What running requests hold (their grants, or the worker's reading if larger). */
  vramReserved: number | null;
  /** In use by anything else: other programs (a competitor on the sim GPU), allocator slack. */
  vramOther: number | null;
  /** Of what requests hold, the KV cache they have written so far (where the GPU worker counts
   *  its blocks): with KV overcommit, requests hold less than they could write. */
  vramKvWritten: number | null;
  vramLimit: number | null; // capacity less the reserve
  vramCapacity: number | null;
  hostUsed: number | null;
  /** With several models sharing the GPU: what each holds there (weights and its requests'
   *  grants), in the order of `MemoryHistory.modelIds`. */
  vramModels: (number | null)[];
}

/** A failover or breaker change, marked on the time axis. */
export interface Mark {
  t: number;
  label: string;
  kind: "failover" | "breaker" | "degraded" | "placement" | "residency";
}

/** The memory panel's history: the last `windowS` seconds of samples and marks. */
export class MemoryHistory {
  points: MemoryPoint[] = [];
  marks: Mark[] = [];
  /** The models sharing the GPU, when there are several: the chart stacks one area per model. */
  modelIds: string[] = [];
  constructor(readonly windowS = 300) {}

  addStatus(status: Json, tMs = Date.now()) {
    const gpu = status.memory?.gpu;
    const host = status.memory?.host;
    const mib = (b: unknown) => (typeof b === "number" ? b / MIB : null);
    const capacity = mib(gpu?.capacity_bytes);
    const reserve = mib(status.memory?.vram_reserve_bytes);
    const used = mib(gpu?.used_bytes);
    const weights = mib(gpu?.weights_bytes);
    const held = mib(status.memory?.gpu_held_bytes ?? gpu?.reserved_bytes);
    const models: Json[] = status.models ?? [];
    // Several models: one area per model (what each holds there) and what none of them holds,
    // in place of one model's parts.
    const several = models.length > 1;
    const ids = several ? models.map((m) => String(m.id)) : [];
    // Another set of models (a restart): the old samples no longer line up with the areas.
    if (ids.join("\n") !== this.modelIds.join("\n")) {
      this.modelIds = ids;
      if (several) this.points = [];
    }
    const limit = capacity !== null && reserve !== null ? capacity - reserve : null;
    this.push({
      t: tMs / 1000,
      vramUsed: used,
      vramWeights: several ? null : weights,
      vramReserved: several ? null : held,
      vramOther: several ? mib(status.memory?.gpu_other_bytes) : used !== null ? Math.max(0, used - (weights ?? 0) - (held ?? 0)) : null,
      vramKvWritten: several ? null : mib(status.memory?.gpu_kv?.resident_bytes),
      vramCapacity: capacity,
      // While the first of several models is unloaded its reading is gone: the limit stays.
      vramLimit: several ? (limit ?? this.points.at(-1)?.vramLimit ?? null) : limit,
      hostUsed: host ? (host.total_bytes - host.available_bytes) / MIB : null,
      vramModels: several ? models.map((m) => (typeof m.gpu_weights_bytes === "number" ? (m.gpu_weights_bytes + (m.gpu_held_bytes ?? 0)) / MIB : null)) : [],
    });
  }

  addEvent(name: string, event: Json) {
    const t = (event.at_unix_ms ?? Date.now()) / 1000;
    // With several models, a lifecycle mark names its model.
    const model: string | null = event.model && this.modelIds.length > 1 ? event.model : null;
    if (name === "failover") this.mark({ t, kind: "failover", label: `failover ${event.from}→${event.to}` });
    else if (name === "breaker_changed") this.mark({ t, kind: "breaker", label: `breaker ${event.to}` });
    else if (name === "degraded") this.mark({ t, kind: "degraded", label: event.degraded ? "degraded" : "recovered" });
    // The GPU worker's layers were placed again at a restart (more or less VRAM free).
    else if (name === "placement_changed") this.mark({ t, kind: "placement", label: `${model ? `${model}: ` : ""}layers ${event.gpu_layers}/${event.layers} on the GPU` });
    // keep_alive: the GPU's copy of the model left (VRAM freed) or is loading for a request.
    // With several models, an unload may be an eviction.
    else if (name === "gpu_model_unloaded") this.mark({ t, kind: "residency", label: model ? `${model} ${String(event.reason ?? "").startsWith("evicted") ? "evicted" : "unloaded"}` : "model unloaded (keep_alive)" });
    else if (name === "gpu_model_loading") this.mark({ t, kind: "residency", label: model ? `${model} loading on the GPU` : "model loading on the GPU" });
  }

  private push(p: MemoryPoint) {
    this.points.push(p);
    this.trim(p.t);
  }

  private mark(m: Mark) {
    this.marks.push(m);
    this.trim(m.t);
  }

  private trim(now: number) {
    const from = now - this.windowS;
    while (this.points.length > 0 && this.points[0].t < from) this.points.shift();
    while (this.marks.length > 0 && this.marks[0].t < from) this.marks.shift();
  }

  /** Columns for uPlot: time; VRAM stacked from the top (weights + requests + other programs,
   *  weights + requests, weights), so each part's area lies on the one below; the limit
   *  (capacity less the reserve); host RAM; the KV cache written, drawn inside the requests'
   *  part (weights + written). */
  columns(): (number | null)[][] {
    const sum = (...xs: (number | null)[]) => (xs.every((x) => x === null) ? null : xs.reduce<number>((a, x) => a + (x ?? 0), 0));
    if (this.modelIds.length > 1) return this.modelColumns(sum);
    return [
      this.points.map((p) => p.t),
      this.points.map((p) => sum(p.vramWeights, p.vramReserved, p.vramOther)),
      this.points.map((p) => sum(p.vramWeights, p.vramReserved)),
      this.points.map((p) => p.vramWeights),
      this.points.map((p) => p.vramLimit),
      this.points.map((p) => p.hostUsed),
      this.points.map((p) => (p.vramKvWritten === null ? null : sum(p.vramWeights, p.vramKvWritten))),
    ];
  }

  /** With several models: time; other programs on top of every model, then each model's area
   *  stacked on the ones before it (the last model's line first, the first model's alone at the
   *  bottom); the limit; host RAM. */
  private modelColumns(sum: (...xs: (number | null)[]) => number | null): (number | null)[][] {
    const n = this.modelIds.length;
    const upTo = (k: number) => this.points.map((p) => sum(...p.vramModels.slice(0, k)));
    const stacked = [];
    for (let k = n; k >= 1; k--) stacked.push(upTo(k));
    return [
      this.points.map((p) => p.t),
      this.points.map((p) => sum(...p.vramModels, p.vramOther)),
      ...stacked,
      this.points.map((p) => p.vramLimit),
      this.points.map((p) => p.hostUsed),
    ];
  }
}

/** "about 3 s", for the estimated-delay indicator. */
export function formatDelay(ms: number | null | undefined): string | null {
  if (ms === null || ms === undefined || ms <= 0) return null;
  if (ms < 1000) return `about ${Math.round(ms)} ms`;
  if (ms < 90_000) return `about ${Math.round(ms / 1000)} s`;
  return `about ${Math.round(ms / 60_000)} min`;
}

/** One API the service speaks, as a client program is configured to reach it. */
export interface Endpoint {
  api: string;
  url: string;
  hint: string;
}

/** The address each API's clients take, from where the service listens (`http://host:port`). */
export function apiEndpoints(address: string): Endpoint[] {
  const base = address.replace(/\/+$/, "");
  return [
    { api: "OpenAI", url: `${base}/v1`, hint: "base URL for OpenAI clients (openai packages, LangChain, Continue)" },
    { api: "Ollama", url: base, hint: "host for Ollama clients (OLLAMA_HOST, Open WebUI, the ollama packages)" },
  ];
}

/** A memory axis from 0 to a round value above the data, never spanning less than `minSpan`
 *  MiB: a flat line of a few KiB must not fill the chart's height with noise. */
export function axisRange(dataMax: number | null, minSpan: number): [number, number] {
  const top = Math.max((dataMax ?? 0) * 1.1, minSpan);
  const step = 10 ** Math.floor(Math.log10(top));
  const nice = [1, 2, 2.5, 5, 10].map((m) => m * step).find((v) => v >= top) ?? 10 * step;
  return [0, nice];
}

/** "512 MiB", "1.2 GiB", "0.5 MiB", or "--" without a value: the legend's readout. */
export function formatMiB(v: number | null | undefined): string {
  if (v == null || !Number.isFinite(v)) return "--";
  if (v >= 1024) return `${(v / 1024).toFixed(1)} GiB`;
  return `${v >= 10 ? Math.round(v).toLocaleString("en") : v.toFixed(1)} MiB`;
}

/** The stretches of time the service was degraded, from its degraded/recovered marks; one
 *  still open ends at `now`, one that began before the window starts at -Infinity. */
export function degradedSpans(marks: Mark[], now: number): [number, number][] {
  const spans: [number, number][] = [];
  let since: number | null = null;
  let seen = false;
  for (const m of marks) {
    if (m.kind !== "degraded") continue;
    if (m.label === "degraded") {
      if (since === null) since = m.t;
    } else if (since !== null) {
      spans.push([since, m.t]);
      since = null;
    } else if (!seen) {
      spans.push([-Infinity, m.t]);
    }
    seen = true;
  }
  if (since !== null) spans.push([since, now]);
  return spans;
}

/** 8192 → "8k", 3000 → "3,000": token counts as people write them. */
export function tokenCount(n: number): string {
  return n >= 1024 && n % 1024 === 0 ? `${n / 1024}k` : n.toLocaleString("en");
}

/** The CPU worker's KV cache: what its blocks hold now against what admission reserved for
 *  its requests, and its prompt cache (finished requests' blocks kept for prompts that begin
 *  the same way) with the share of looked-up prompt tokens it held. Null before a reading. */
export function cpuKvLine(status: Json): string | null {
  const memory = status.memory ?? {};
  const resident = memory.cpu_kv_resident_bytes;
  if (typeof resident !== "number") return null;
  const mib = (b: number) => formatMiB(b / 1048576);
  let line = `CPU KV cache: ${mib(resident)} in use, ${mib(memory.host_reserved_bytes ?? 0)} reserved for running requests`;
  const prefix = memory.cpu_prefix_cache;
  if (prefix && prefix.capacity_blocks > 0) {
    line += `; prompt cache ${mib(prefix.bytes)}, ${Math.round(100 * (prefix.hit_rate ?? 0))}% of prompt tokens reused`;
  }
  return line;
}

/** The GPU's KV cache in blocks (where its worker counts them: the sim GPU): the blocks the
 *  running requests wrote, of the pool the GPU has room for beside its weights and reserve,
 *  against what they reserved, and under overcommit the ratio and how many requests were
 *  preempted for a block. Null without a reading. */
export function gpuKvLine(status: Json): string | null {
  const kv = status.memory?.gpu_kv;
  if (!kv || typeof kv.resident_bytes !== "number") return null;
  const mib = (b: number) => formatMiB(b / 1048576);
  const of = typeof kv.pool_blocks === "number" ? ` of ${kv.pool_blocks}` : "";
  let line = `GPU KV cache: ${kv.resident_blocks}${of} blocks of ${kv.block_tokens} tokens (${mib(kv.resident_bytes)}) written, ${mib(kv.reserved_bytes)} reserved for running requests`;
  if (kv.overcommit > 1) line += `; overcommit ${kv.overcommit}×, ${kv.preemptions} preempted`;
  return line;
}

/** Each worker as a person compares them: its model, context limit, how many requests it runs
 *  at once and its measured decode speed ("CPU: kjv-demo · up to 1k tokens · 4 at a time ·
 *  320 tokens/s"), from `/v1/status`. */
export function workerLines(status: Json): { lane: string; text: string }[] {
  const workers: Json[] = status.workers ?? [];
  const queues: Json[] = Array.isArray(status.queues) ? status.queues : [];
  return workers.map((w) => {
    const lane = w.kind === "gpu" ? "GPU" : "CPU";
    const q = queues.find((x) => x.device === w.kind) ?? {};
    const parts = [w.model ?? "no model loaded"];
    if (typeof w.context_tokens === "number") parts.push(`up to ${tokenCount(w.context_tokens)} tokens`);
    if (typeof q.concurrency === "number") parts.push(`${q.concurrency} at a time`);
    parts.push(typeof q.ms_per_token === "number" && q.ms_per_token > 0 ? `${Math.round(1000 / q.ms_per_token)} tokens/s` : "speed not measured yet");
    return { lane, text: `${lane}: ${parts.join(" · ")}` };
  });
}

/** One served model in the Memory panel: several models share the GPU, and an idle one makes
 *  way for another (it loads again at its next request). */
export interface ModelRow {
  id: string;
  role: string;
  /** "GPU", "GPU + CPU (split)", or "CPU only" once the GPU's copy is unloaded or evicted. */
  where: string;
  gpu: string;
  cpu: string;
  /** "12 s ago", or "—" before its first request. */
  lastUsed: string;
}

/** A model's CPU worker: its weights, and the models it serves beside this one (one process,
 *  its weights in RAM once, so the column's MiB are not added up across those rows). */
function cpuColumn(m: Json): string {
  if (m.resident_bytes?.cpu == null) return "—";
  const shared: string[] = m.cpu_worker_shared_with ?? [];
  const bytes = formatMiB(m.resident_bytes.cpu / MIB);
  return shared.length ? `${bytes}, one worker with ${shared.join(", ")}` : bytes;
}

export function modelRows(status: Json, nowMs = Date.now()): ModelRow[] {
  const models: Json[] = status.models ?? [];
  const where: Record<string, string> = { gpu: "GPU", split: "GPU + CPU (split)", cpu: "CPU only" };
  const ago = (ms: number) => {
    const s = Math.max(0, Math.round((nowMs - ms) / 1000));
    return s < 90 ? `${s} s ago` : s < 5400 ? `${Math.round(s / 60)} min ago` : `${Math.round(s / 3600)} h ago`;
  };
  return models.map((m) => ({
    id: m.id,
    role: m.role ?? "chat",
    where: where[m.state] ?? m.state ?? "—",
    gpu: m.resident_bytes?.gpu != null ? formatMiB(m.resident_bytes.gpu / MIB) : "—",
    cpu: cpuColumn(m),
    lastUsed: typeof m.last_used_unix_ms === "number" ? ago(m.last_used_unix_ms) : "—",
  }));
}
