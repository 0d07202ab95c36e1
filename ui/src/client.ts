// The one client module. Everything the UI asks of Headroom goes through a `Transport`; the
// browser (against `headroom serve`) uses HTTP. The desktop shell's Tauri IPC transport is to
// implement the same interface.

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
}

export class HttpTransport implements Transport {
  constructor(readonly base = "") {}

  async status(): Promise<Json> {
    const r = await fetch(`${this.base}/v1/status`);
    if (!r.ok) throw new Error(`GET /v1/status: ${r.status}`);
    return r.json();
  }

  events(onEvent: (name: string, data: Json) => void): () => void {
    const source = new EventSource(`${this.base}/v1/events`);
    const names = ["status", "breaker_changed", "degraded", "worker_started", "worker_exited", "worker_restart_scheduled", "health_check_failed", "failover", "memory_sample", "queue_changed"];
    for (const name of names) {
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
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += decoder.decode(value, { stream: true });
        const { events, rest } = splitSse(buffer);
        buffer = rest;
        for (const e of events) {
          if (e.data === "[DONE]") continue;
          reply = applyChunk(reply, JSON.parse(e.data));
          onReply(reply, estimatedDelayMs);
        }
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
}

/** The transport for where the UI runs. */
export function defaultTransport(): Transport {
  return new HttpTransport("");
}
