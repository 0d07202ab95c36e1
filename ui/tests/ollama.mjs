// The official `ollama` npm package against a real `headroom serve --gpu sim`: the client
// programs built for Ollama work unchanged. A streaming chat, the model listing, an error in
// Ollama's shape, and streaming chats that lose their GPU worker (kill at full load: every GPU
// slot streaming, more chats queued behind them) and still finish with the tokens they would
// have had, through the CPU worker.
import assert from "node:assert/strict";
import { rmSync } from "node:fs";
import { Ollama } from "ollama";
import { check, finish } from "./checks.mjs";
import { startServer } from "./server.mjs";

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** A served client and its helpers; `env` reaches the server (a negative control's defect). */
async function serve(env = {}) {
  const server = await startServer({ env });
  const url = server.url;
  const client = new Ollama({ host: url });
  const fault = (body) => fetch(`${url}/admin/sim/fault`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) }).then(async (r) => assert.equal(r.status, 200, await r.text()));
  const status = () => fetch(`${url}/v1/status`).then((r) => r.json());
  const failovers = async () => Number((await (await fetch(`${url}/metrics`)).text()).match(/headroom_failovers_total\{from="sim",to="cpu"\} (\d+)/)?.[1] ?? 0);
  /** One streamed chat: its chunks as the client saw them. */
  async function streamedChat(seed, onChunk = () => {}) {
    const parts = [];
    const stream = await client.chat({ model: "kjv-demo", messages: [{ role: "user", content: `And God said ${seed}` }], stream: true, options: { num_predict: 24, seed, temperature: 0.8 } });
    for await (const part of stream) {
      parts.push(part);
      onChunk(part);
    }
    return parts;
  }
  const stop = () => {
    server.child.kill("SIGTERM");
    rmSync(server.dir, { recursive: true, force: true });
  };
  return { client, fault, status, failovers, streamedChat, stop };
}
const text = (parts) => parts.map((p) => p.message.content).join("");

/** Kills the GPU worker with every slot streaming and chats queued; each must finish as it would have. */
async function failoverAtFullLoad({ fault, status, failovers, streamedChat }) {
  const gpu = (s) => s.queues.find((q) => q.device === "gpu");
  const slots = gpu(await status()).concurrency;
  const seeds = Array.from({ length: slots + 2 }, (_, i) => 10 + i);
  // What each chat says with a healthy GPU (a request's tokens do not depend on its batch).
  const healthy = await Promise.all(seeds.map((seed) => streamedChat(seed)));
  const before = await failovers();
  await fault({ fault: "slowdown", factor: 30 });
  const started = new Set();
  const chats = seeds.map((seed) => streamedChat(seed, () => started.add(seed)));
  chats.forEach((c) => c.catch(() => {})); // judged below, all together
  for (let i = 0; ; i++) {
    const s = await status();
    const waiting = s.queues.reduce((n, q) => n + q.waiting, 0);
    if (gpu(s).running === slots && started.size >= slots && waiting >= 1) break;
    assert.ok(i < 600, `the GPU never filled: ${JSON.stringify(s.queues)}`);
    await sleep(50);
  }
  await fault({ fault: "reset", after_tokens: 1 });
  const answers = await Promise.all(chats);
  await fault({ fault: "clear" });
  assert.ok((await failovers()) >= before + 1, "the streams moved from the sim GPU to the CPU");
  answers.forEach((parts, i) => {
    assert.ok(parts.at(-1).done, `chat ${i} ended with Ollama's final object`);
    assert.equal(text(parts), text(healthy[i]), `chat ${i} has the tokens it would have had`);
  });
}

const served = await serve();
const { client: ollama, streamedChat } = served;
try {
  await check("a streamed chat arrives in pieces and ends with Ollama's final object", async () => {
    const parts = await streamedChat(1);
    assert.ok(parts.length > 2, "several chunks");
    assert.ok(parts.slice(0, -1).every((p) => !p.done), "only the last chunk is done");
    const last = parts.at(-1);
    assert.ok(last.done && ["stop", "length"].includes(last.done_reason));
    assert.ok(last.eval_count > 0 && last.eval_duration > 0 && last.total_duration >= last.eval_duration);
    assert.ok(text(parts).length > 0);
  });

  await check("list names the served model", async () => {
    const { models } = await ollama.list();
    assert.deepEqual(models.map((m) => m.model), ["kjv-demo:latest"]);
  });

  await check("an unknown model is a ResponseError 404 that names the served one", async () => {
    await assert.rejects(ollama.chat({ model: "llama3.2", messages: [{ role: "user", content: "hi" }] }), (e) => e.name === "ResponseError" && e.status_code === 404 && /kjv-demo/.test(e.error));
  });

  await check("embed gives one vector of length 1 per input, the same one the older embeddings route gives", async () => {
    const { embeddings } = await ollama.embed({ model: "kjv-demo", input: ["In the beginning", "Blessed are the meek"] });
    assert.equal(embeddings.length, 2);
    assert.ok(embeddings[0].length > 16 && embeddings[0].length === embeddings[1].length);
    assert.ok(Math.abs(embeddings[0].reduce((s, x) => s + x * x, 0) - 1) < 1e-4);
    const { embedding } = await ollama.embeddings({ model: "kjv-demo", prompt: "In the beginning" });
    assert.ok(embedding.every((x, i) => Math.abs(x - embeddings[0][i]) < 1e-3));
  });

  await check("streaming chats that lose the GPU worker at full load all finish with their own tokens", () => failoverAtFullLoad(served));
} finally {
  served.stop();
}

// Negative control: a server whose Ollama streams end at a failover (the defect switched back
// on) must fail the same check, or the check proves nothing.
const control = await serve({ HEADROOM_TEST_DEFECT: "ollama-stream-ends-at-failover" });
try {
  await check("negative control: with streams that end at a failover, the full-load check fails", async () => {
    await assert.rejects(failoverAtFullLoad(control), /the GPU failed mid-answer/);
  });
} finally {
  control.stop();
}
finish();
