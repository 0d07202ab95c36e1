// End-to-end: the desktop app (src-tauri, a real WebKitGTK window under Xvfb) driven through
// tauri-driver and Debian's WebKitWebDriver, in plain WebDriver over fetch. The app embeds the
// server with the sim GPU; the window's UI talks to it over Tauri IPC. A chat round trip, then
// injected OOMs (through the app's HTTP API) must put the degraded notice on screen.
// Run under `xvfb-run -a dbus-run-session --`; screenshot to docs/screenshots/desktop.png.
import { spawn } from "node:child_process";
import { mkdtempSync, readFileSync, writeFileSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import assert from "node:assert/strict";
import { check, finish } from "./checks.mjs";
import { root, trainSmallModel } from "./server.mjs";

const app = process.env.HEADROOM_DESKTOP_BIN ?? join(root, "target/debug/headroom-desktop");
const driverBin = process.env.TAURI_DRIVER ?? "tauri-driver";
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const freePort = () =>
  new Promise((ok) => {
    const s = createServer().listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => ok(port));
    });
  });

const dir = mkdtempSync(join(tmpdir(), "headroom-desktop-e2e-"));
// A long breaker cool-down keeps degraded mode on screen long enough to look at.
writeFileSync(join(dir, "headroom.toml"), "[supervision.breaker]\ncooldown_ms = 60000\n");
const apiPort = await freePort();
const driverPort = await freePort();
const driver = spawn(driverBin, ["--port", String(driverPort), "--native-driver", "/usr/bin/WebKitWebDriver"], {
  env: {
    ...process.env,
    HEADROOM_GPU: "sim",
    // The fast fixture; the real default model has its own end-to-end test (tests/python/test_default_model.py).
    HEADROOM_MODEL: "kjv-demo",
    HEADROOM_PORT: String(apiPort),
    HEADROOM_DATA_DIR: join(dir, "data"),
    HEADROOM_CONFIG: join(dir, "headroom.toml"),
    NO_AT_BRIDGE: "1",
    WEBKIT_DISABLE_COMPOSITING_MODE: "1",
  },
  stdio: ["ignore", "inherit", "inherit"],
});
const wd = `http://127.0.0.1:${driverPort}`;
const api = `http://127.0.0.1:${apiPort}`;

async function call(method, path, body) {
  const r = await fetch(`${wd}${path}`, { method, headers: { "content-type": "application/json" }, body: body === undefined ? undefined : JSON.stringify(body) });
  const json = await r.json();
  if (!r.ok) throw new Error(`${method} ${path}: ${JSON.stringify(json.value).slice(0, 300)}`);
  return json.value;
}

async function waitFor(what, fn, timeoutMs = 30_000) {
  const deadline = Date.now() + timeoutMs;
  let last;
  while (Date.now() < deadline) {
    try {
      const v = await fn();
      if (v) return v;
    } catch (e) {
      last = e;
    }
    await sleep(200);
  }
  throw new Error(`timed out waiting for ${what}${last ? `: ${last.message}` : ""}`);
}


let session;
try {
  await waitFor("tauri-driver", () => fetch(`${wd}/status`).then((r) => r.ok), 20_000);
  session = (await call("POST", "/session", { capabilities: { alwaysMatch: { "tauri:options": { application: app } } } })).sessionId;
  const s = (path) => `/session/${session}${path}`;
  const run = (script, ...args) => call("POST", s("/execute/sync"), { script, args });
  const elements = async (css) => (await call("POST", s("/elements"), { using: "css selector", value: css })).map((e) => Object.values(e)[0]);
  const text = async (css) => run("const e = document.querySelector(arguments[0]); return e ? e.innerText : null;", css);
  const fault = (body) => fetch(`${api}/admin/sim/fault`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) }).then((r) => assert.equal(r.status, 200));
  const click = async (css) => call("POST", s(`/element/${(await elements(css))[0]}/click`), {});
  const patch = (body) => fetch(`${api}/v1/settings`, { method: "PATCH", headers: { "content-type": "application/json" }, body: JSON.stringify(body) }).then(async (r) => assert.equal(r.status, 200, await r.text()));

  async function chat(prompt) {
    const before = (await elements("[data-testid=reply]")).length;
    const [input] = await elements("[data-testid=prompt]");
    await call("POST", s(`/element/${input}/clear`), {});
    await call("POST", s(`/element/${input}/value`), { text: prompt });
    const [send] = await elements("[data-testid=send]");
    await call("POST", s(`/element/${send}/click`), {});
    await waitFor("the reply", async () => (await elements("[data-testid=reply]")).length > before);
    await waitFor("the reply to finish", async () => (await elements("[data-testid=send]")).length > 0, 60_000);
    return run(
      "const r = document.querySelectorAll('[data-testid=reply]')[arguments[0]]; const q = (t) => r.querySelector(`[data-testid=${t}]`)?.innerText ?? null; return { badge: q('device-badge'), notice: q('reply-notice'), text: r.querySelector('.text')?.innerText ?? '' };",
      before,
    );
  }

  await check("the window opens and shows the UI", async () => {
    assert.equal(await call("GET", s("/title")), "Headroom");
    await waitFor("the status bar", () => text("[data-testid=gpu-health]")).catch(async (e) => {
      // Load the UI's module once more to see why it did not start (WebKit keeps no console here).
      const src = await run("return document.querySelector('script[type=module]')?.src;");
      const why = await call("POST", s("/execute/async"), { script: "const done = arguments[arguments.length - 1]; import(arguments[0] + '?again').then(() => done('it loads on a second try'), (e) => done(String(e) + ' ' + (e.stack ?? '')));", args: [src] }).catch((x) => String(x));
      throw new Error(`${e.message}; the UI's module: ${JSON.stringify(why)}`);
    });
  });

  await check("the UI talks to the embedded server over Tauri IPC", async () => {
    assert.equal(await run("return '__TAURI_INTERNALS__' in window;"), true);
  });

  await check("the status bar says the simulated GPU is healthy", async () => {
    await waitFor("GPU healthy", async () => /GPU healthy \(simulated\)/.test((await text("[data-testid=gpu-health]")) ?? ""));
  });

  await check("a chat round trip is served by the GPU", async () => {
    const reply = await chat("In the beginning");
    assert.match(reply.badge ?? "", /GPU · sim/);
    assert.ok(reply.text.trim().length > 0, "the reply has text");
  });

  await check("Settings show the app's API endpoints; settings change over IPC: pausing the GPU sends replies to the CPU; resuming brings them back", async () => {
    await click("[data-testid=tab-settings]");
    await waitFor("the settings form", async () => (await elements("[data-testid=setting-gpu-paused]")).length > 0);
    // The app's API address, over IPC: what other programs on this machine are told to use.
    await waitFor("the API endpoints", async () => (await text("[data-testid=endpoint-ollama]")) === api);
    assert.equal(await text("[data-testid=endpoint-openai]"), `${api}/v1`);
    await click("[data-testid=setting-gpu-paused]");
    await click("[data-testid=settings-save]");
    await waitFor("GPU paused", async () => /GPU paused/.test((await text("[data-testid=gpu-health]")) ?? ""), 10_000);
    assert.match((await text("[data-testid=settings-result]")) ?? "", /Applied: gpu_paused/);
    const paused = await chat("Let there be light");
    assert.equal(paused.badge, "CPU");
    assert.match(paused.notice ?? "", /paused/);
    await click("[data-testid=setting-gpu-paused]");
    await click("[data-testid=settings-save]");
    await waitFor("GPU healthy again", async () => /GPU healthy \(simulated\)/.test((await text("[data-testid=gpu-health]")) ?? ""), 30_000);
    const resumed = await chat("In the beginning");
    assert.match(resumed.badge ?? "", /GPU · sim/);
    await click("[data-testid=tab-memory]");
  });

  await check("after injected OOMs the degraded notice appears and replies come from the CPU", async () => {
    for (let i = 0; i < 3; i++) {
      await fault({ fault: "oom_next_allocation" });
      const reply = await chat(`The LORD is my shepherd ${i}`);
      assert.equal(reply.badge, "CPU");
      assert.ok((reply.notice ?? "").length > 0, "the reply says why it ran on the CPU");
    }
    await waitFor("the degraded banner", async () => (await elements("[data-testid=degraded-banner]")).length > 0, 10_000);
    assert.match((await text("[data-testid=gpu-health]")) ?? "", /GPU (degraded|unavailable)/);
  });

  await check("the banner and the next reply say in plain words what happened and who answers", async () => {
    const plain = /^The GPU is out of memory; kjv-demo on the CPU is answering(, about \d+× slower)?, up to [\d,k]+ tokens\.$/;
    assert.match((await text("[data-testid=degraded-summary]")) ?? "", plain);
    const reply = await chat("Blessed are the meek");
    assert.equal(reply.badge, "CPU");
    assert.match(reply.notice ?? "", plain);
    // The limits behind Details: the CPU worker's model, context, concurrency and measured speed.
    const cpu = await run("return document.querySelector('[data-testid=degraded-worker-cpu]')?.textContent ?? null;");
    assert.match(cpu ?? "", /^CPU: kjv-demo · up to [\d,k]+ tokens · \d+ at a time · \d+ tokens\/s$/);
  });

  // The degraded window, as the README shows it.
  const png = await call("GET", s("/screenshot"));
  writeFileSync(join(root, "docs/screenshots/desktop.png"), Buffer.from(png, "base64"));

  await check("a reply queued behind another counts its expected wait down", async () => {
    await patch({ cpu_max_concurrency: 1 });
    const ahead = fetch(`${api}/v1/completions`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ model: "default", prompt: "And it came to pass", max_tokens: 900, ignore_eos: true }) });
    await waitFor("the CPU busy", async () => (await (await fetch(`${api}/v1/status`)).json()).queues.find((q) => q.device === "cpu").running === 1, 10_000);
    const [input] = await elements("[data-testid=prompt]");
    await call("POST", s(`/element/${input}/clear`), {});
    await call("POST", s(`/element/${input}/value`), { text: "The voice of one crying" });
    await click("[data-testid=send]");
    await waitFor("the countdown", async () => /^queued: (about \d+ (ms|s|min) left|any moment now)$/.test((await text("[data-testid=reply-delay]")) ?? ""), 10_000);
    await click("[data-testid=stop]");
    await waitFor("the reply stopped", async () => (await elements("[data-testid=send]")).length > 0, 10_000);
    assert.equal((await ahead).status, 200);
    await patch({ cpu_max_concurrency: 4 });
  });

  await check("a reply from a fallback model says which model answered", async () => {
    const folder = trainSmallModel(dir);
    // The chat so far goes with the message, and the small model's own tokenizer (trained on a
    // few verses) makes ~1.5x the served model's tokens of it: give it room past its trained
    // 1024, or the check runs into the fallback's context limit instead of the model tag.
    const config = JSON.parse(readFileSync(join(folder, "config.json"), "utf8"));
    writeFileSync(join(folder, "config.json"), JSON.stringify({ ...config, max_position_embeddings: 4096 }));
    await click("[data-testid=tab-settings]");
    await waitFor("the settings form", async () => (await elements("[data-testid=setting-fallback-model]")).length > 0);
    await click("[data-testid=setting-gpu-paused]");
    const [fallback] = await elements("[data-testid=setting-fallback-model]");
    await call("POST", s(`/element/${fallback}/clear`), {});
    await call("POST", s(`/element/${fallback}/value`), { text: folder });
    await click("[data-testid=settings-save]");
    await waitFor("the fallback's CPU worker", async () => /^CPU: kjv-small/.test((await text("[data-testid=setting-worker-cpu]")) ?? ""), 60_000);
    const reply = await chat("Genesis 1:1");
    assert.equal(reply.badge, "CPU");
    const last = "const r = [...document.querySelectorAll('[data-testid=reply]')].at(-1);";
    assert.equal(await run(`${last} return r.querySelector('[data-testid=reply-model]')?.innerText ?? null;`), "answered by kjv-small", `the reply said: ${await run(`${last} return r.innerText;`)}`);
    assert.match(reply.notice ?? "", /kjv-small on the CPU is answering/);
    await click("[data-testid=tab-memory]");
  });

} finally {
  if (session) await call("DELETE", `/session/${session}`).catch(() => {});
  driver.kill("SIGTERM");
  await sleep(500);
  rmSync(dir, { recursive: true, force: true });
}

finish();
