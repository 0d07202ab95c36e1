// The one client module. Everything the UI asks of Headroom goes through a `Transport`: the
// browser (against `headroom serve`) uses HTTP; the desktop window uses Tauri IPC, whose typed
// commands (src/bindings.ts, generated from src-tauri) call the embedded server's routes
// in-process. Both fold the server's SSE text with the same code.

import { Channel } from "@tauri-apps/api/core";
import { commands, type StreamFrame_Deserialize as Frame } from "./bindings";
import { applyChunk, emptyReply, splitSse, type Json, type Reply } from "./logic";

export interface ChatMessage {
  role: "system" | "user" | "assistant";
  content: string;
}

export interface Transport {
  status(): Promise<Json>;
  /** Follows service events until the returned function is called. */
  events(onEvent: (name: string, data: Json) => void): () => void;
  /** Streams a chat reply; `onReply` sees it grow. Aborting `signal` hangs up (cancels it). */
  chat(messages: ChatMessage[], options: { maxTokens: number; temperature: number }, onReply: (r: Reply, estimatedDelayMs: number | null) => void, signal: AbortSignal): Promise<Reply>;
  cancel(requestId: string): Promise<void>;
  /** The settings in force (`GET /v1/settings`); `model` names a served model (its fallback
   *  model and layer count are its own), default the first. */
  settings(model?: string): Promise<SettingsReply>;
  /** Changes settings (a JSON merge patch; the fallback model and layer count `model`'s);
   *  rejects with the server's message. */
  updateSettings(patch: Json, model?: string): Promise<SettingsReply>;
  /** Where other programs reach this service's HTTP API (`http://host:port`). */
  apiAddress(): Promise<string>;
}

/** What the server says about settings: all of them, and what a change did. */
export interface SettingsReply {
  /** The model the settings are for. */
  model: string;
  settings: Json;
  changed: string[];
  restart_required: string[];
  file: string | null;
}

/** `/v1/settings` under `base`, with `?model=` when a model is named. */
export function settingsUrl(base: string, model?: string): string {
  return model === undefined ? `${base}/v1/settings` : `${base}/v1/settings?model=${encodeURIComponent(model)}`;
}

/** Folds a chat stream's SSE text, in whatever pieces it arrives, into the growing reply. */
export class ChatStream {
  reply: Reply = emptyReply();
  private buffer = "";

  push(text: string): Reply {
    this.buffer += text;
    const { events, rest } = splitSse(this.buffer);
    this.buffer = rest;
    for (const e of events) {
      if (e.data === "[DONE]") continue;
      this.reply = applyChunk(this.reply, JSON.parse(e.data));
    }
    return this.reply;
  }
}

/** The service event names the UI follows. */
export const EVENT_NAMES = ["status", "breaker_changed", "degraded", "gpu_paused", "settings_changed", "worker_started", "worker_exited", "worker_restart_scheduled", "placement_changed", "gpu_model_unloaded", "gpu_model_loading", "health_check_failed", "failover", "memory_sample", "queue_changed"];

export class HttpTransport implements Transport {
  constructor(readonly base = "") {}

  async status(): Promise<Json> {
    const r = await fetch(`${this.base}/v1/status`);
    if (!r.ok) throw new Error(`GET /v1/status: ${r.status}`);
    return r.json();
  }

  events(onEvent: (name: string, data: Json) => void): () => void {
    const source = new EventSource(`${this.base}/v1/events`);
    for (const name of EVENT_NAMES) {
      source.addEventListener(name, (e) => {
        try {
          onEvent(name, JSON.parse((e as MessageEvent).data));
        } catch {
          /* a malformed event is skipped, never fatal */
        }
      });
    }
    return () => source.close();
  }

  async chat(messages: ChatMessage[], options: { maxTokens: number; temperature: number }, onReply: (r: Reply, estimatedDelayMs: number | null) => void, signal: AbortSignal): Promise<Reply> {
    let reply = emptyReply();
    const response = await fetch(`${this.base}/v1/chat/completions`, {
      method: "POST",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ model: "default", messages, max_tokens: options.maxTokens, temperature: options.temperature, stream: true }),
      signal,
    }).catch((e) => {
      if (signal.aborted) return null;
      throw e;
    });
    if (response === null) return { ...reply, cancelled: true, done: true };
    const delay = Number(response.headers.get("x-headroom-estimated-delay-ms") ?? NaN);
    const estimatedDelayMs = Number.isFinite(delay) ? delay : null;
    if (!response.ok || !response.body) {
      const body = await response.json().catch(() => ({}));
      return { ...reply, done: true, error: body?.error?.message ?? `HTTP ${response.status}` };
    }
    reply.device = response.headers.get("x-headroom-device");
    reply.requestId = response.headers.get("x-request-id");
    onReply(reply, estimatedDelayMs);
    const stream = new ChatStream();
    stream.reply = reply;
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        reply = stream.push(decoder.decode(value, { stream: true }));
        onReply(reply, estimatedDelayMs);
      }
    } catch (e) {
      if (!signal.aborted) throw e;
    }
    if (signal.aborted && !reply.done) reply = { ...reply, cancelled: true, done: true };
    return reply;
  }

  async cancel(requestId: string): Promise<void> {
    await fetch(`${this.base}/v1/requests/${encodeURIComponent(requestId)}/cancel`, { method: "POST" });
  }

  async settings(model?: string): Promise<SettingsReply> {
    return this.json(await fetch(settingsUrl(this.base, model)));
  }

  async updateSettings(patch: Json, model?: string): Promise<SettingsReply> {
    return this.json(await fetch(settingsUrl(this.base, model), { method: "PATCH", headers: { "content-type": "application/json" }, body: JSON.stringify(patch) }));
  }

  async apiAddress(): Promise<string> {
    return this.base || window.location.origin;
  }

  /** A JSON body, or the error body's message as the rejection. */
  private async json(r: Response): Promise<any> {
    const body = await r.json().catch(() => ({}));
    if (!r.ok) throw new Error(body?.error?.message ?? `HTTP ${r.status}`);
    return body;
  }
}

let nextStreamId = 1;

/** The desktop window's transport: typed Tauri commands; streams arrive through a `Channel`. */
export class TauriTransport implements Transport {
  async status(): Promise<Json> {
    const r = await commands.status();
    if (r.status === "error") throw new Error(r.error);
    return JSON.parse(r.data);
  }

  events(onEvent: (name: string, data: Json) => void): () => void {
    const id = nextStreamId++;
    let buffer = "";
    const channel = new Channel<Frame>();
    channel.onmessage = (frame) => {
      if (frame.kind !== "body") return;
      const { events, rest } = splitSse(buffer + frame.text);
      buffer = rest;
      for (const e of events) {
        try {
          onEvent(e.event, JSON.parse(e.data));
        } catch {
          /* a malformed event is skipped, never fatal */
        }
      }
    };
    void commands.events(id, channel);
    return () => void commands.hangUp(id);
  }

  chat(messages: ChatMessage[], options: { maxTokens: number; temperature: number }, onReply: (r: Reply, estimatedDelayMs: number | null) => void, signal: AbortSignal): Promise<Reply> {
    const id = nextStreamId++;
    const stream = new ChatStream();
    let estimatedDelayMs: number | null = null;
    return new Promise<Reply>((resolve, reject) => {
      const finish = (r: Reply) => resolve(signal.aborted && !r.done ? { ...r, cancelled: true, done: true } : r);
      const channel = new Channel<Frame>();
      channel.onmessage = (frame) => {
        switch (frame.kind) {
          case "head":
            if (frame.error) return resolve({ ...stream.reply, done: true, error: frame.error });
            stream.reply = { ...stream.reply, device: frame.device ?? null, requestId: frame.request_id ?? null };
            estimatedDelayMs = frame.estimated_delay_ms ?? null;
            onReply(stream.reply, estimatedDelayMs);
            break;
          case "body":
            try {
              onReply(stream.push(frame.text), estimatedDelayMs);
            } catch (e) {
              reject(e);
            }
            break;
          case "failed":
            finish({ ...stream.reply, done: true, error: frame.message });
            break;
          case "end":
            finish(stream.reply);
            break;
        }
      };
      // Hanging up drops the stream in the shell, which the server treats as a client hang-up.
      signal.addEventListener("abort", () => void commands.hangUp(id));
      commands
        .chat({ messages, max_tokens: options.maxTokens, temperature: options.temperature }, id, channel)
        .then((r) => {
          if (r.status === "error") finish({ ...stream.reply, done: true, error: r.error });
        }, reject);
    });
  }

  async cancel(requestId: string): Promise<void> {
    const r = await commands.cancel(requestId);
    if (r.status === "error") throw new Error(r.error);
  }

  async settings(model?: string): Promise<SettingsReply> {
    const r = await commands.settings(model ?? null);
    if (r.status === "error") throw new Error(r.error);
    return JSON.parse(r.data);
  }

  async updateSettings(patch: Json, model?: string): Promise<SettingsReply> {
    const r = await commands.updateSettings(JSON.stringify(patch), model ?? null);
    if (r.status === "error") throw new Error(r.error);
    return JSON.parse(r.data);
  }

  async apiAddress(): Promise<string> {
    const r = await commands.apiAddress();
    if (r.status === "error") throw new Error(r.error);
    return r.data;
  }
}

/** The transport for where the UI runs: IPC inside the desktop app, HTTP in a browser. */
export function defaultTransport(): Transport {
  return "__TAURI_INTERNALS__" in window ? new TauriTransport() : new HttpTransport("");
}
