// End-to-end: the built web UI in Debian's Chromium (playwright-core, no downloaded browser)
// against a real `headroom serve --gpu sim`. A chat round trip on the GPU; settings changed and
// applied (the VRAM reserve admission uses, kept across a reload); the GPU paused, a reply on
// the CPU, and a queued request cancelled from the UI; then injected OOMs open the breaker: the
// degraded banner, the CPU badge with its reason, and a stop; last, a second server with two
// models: the chart's area per model and an eviction's mark. Screenshots at 1024×700 and
// 1440×900 go to docs/screenshots/.
import { cpSync, mkdirSync, rmSync } from "node:fs";
import { join } from "node:path";
import assert from "node:assert/strict";
import { check, finish } from "./checks.mjs";
import { chromium } from "playwright-core";
import { root, startServer, trainSmallModel } from "./server.mjs";

const shots = join(root, "docs/screenshots");
mkdirSync(shots, { recursive: true });

// A long breaker cool-down keeps degraded mode on screen long enough to look at.
const server = await startServer({ config: "[supervision.breaker]\ncooldown_ms = 60000\n" });
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const fault = (body) => fetch(`${server.url}/admin/sim/fault`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body) }).then((r) => assert.equal(r.status, 200));

async function chat(page, text) {
  const before = await page.getByTestId("reply").count();
  await page.getByTestId("prompt").fill(text);
  await page.getByTestId("send").click();
  const reply = page.getByTestId("reply").nth(before);
  await reply.waitFor();
  await page.getByTestId("send").waitFor({ timeout: 60_000 }); // the button comes back when done
  return reply;
}

try {
  const page = await browser.newPage({ viewport: { width: 1440, height: 900 } });
  await page.goto(server.url);

  await check("the status bar says the simulated GPU is healthy", async () => {
    await page.getByTestId("gpu-health").filter({ hasText: "GPU healthy (simulated)" }).waitFor({ timeout: 20_000 });
  });

  await check("a chat streams a reply served by the GPU", async () => {
    const reply = await chat(page, "In the beginning");
    assert.match(await reply.getByTestId("device-badge").innerText(), /GPU · sim/);
    assert.ok((await reply.locator(".text").innerText()).trim().length > 0, "the reply has text");
    // What the person waited and the speed they got, measured in the page.
    assert.match(await reply.getByTestId("reply-timing").innerText(), /^first token after [\d.]+ s · [\d.]+ tokens\/s$/);
  });

  await check("a model unloaded by its keep_alive says so, and the next reply loads it on the GPU", async () => {
    const keepAlive = async (value) => {
      const r = await fetch(`${server.url}/api/generate`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ model: "default", keep_alive: value }) });
      const text = await r.text();
      assert.equal(r.status, 200, text);
      return JSON.parse(text).done_reason;
    };
    assert.equal(await keepAlive(0), "unload");
    await page.getByTestId("gpu-health").filter({ hasText: "GPU idle (simulated): model unloaded" }).waitFor({ timeout: 10_000 });
    assert.match(await page.getByTestId("status-reason").innerText(), /the next request loads it on the GPU/);
    await page.getByTestId("tab-memory").click();
    await page.getByTestId("model-row").filter({ hasText: "kjv-demo" }).filter({ hasText: "CPU only" }).waitFor({ timeout: 10_000 });
    const reply = await chat(page, "In the beginning");
    assert.match(await reply.getByTestId("device-badge").innerText(), /GPU · sim/);
    // keep_alive 0 stays in force (Ollama's meaning) until a request sets another: -1 loads
    // the model again if it went, and keeps it.
    assert.equal(await keepAlive(-1), "load");
    await page.getByTestId("gpu-health").filter({ hasText: "GPU healthy" }).waitFor({ timeout: 10_000 });
    await page.getByTestId("model-row").filter({ hasText: "kjv-demo" }).filter({ has: page.locator("td:nth-child(3)", { hasText: /^GPU$/ }) }).waitFor({ timeout: 10_000 });
  });

  await check("Settings show each API's endpoint; a new VRAM reserve is applied to admission and kept across a reload", async () => {
    await page.getByTestId("tab-settings").click();
    await page.getByTestId("endpoint-openai").filter({ hasText: `${server.url}/v1` }).waitFor({ timeout: 10_000 });
    assert.match(await page.getByTestId("setting-worker-cpu").innerText(), /^CPU: kjv-demo · up to [\d,k]+ tokens · 4 at a time/);
    assert.match(await page.getByTestId("gpu-kv").innerText(), /^GPU KV cache: \d+ of \d+ blocks of 16 tokens \([\d.,]+ MiB\) written, [\d.,]+ MiB reserved for running requests$/);
    assert.match(await page.getByTestId("cpu-kv").innerText(), /^CPU KV cache: [\d.,]+ MiB in use, [\d.,]+ MiB reserved for running requests(; prompt cache [\d.,]+ MiB, \d+% of prompt tokens reused)?$/);
    assert.equal(await page.getByTestId("endpoint-ollama").innerText(), server.url);
    await page.getByTestId("setting-vram-reserve").fill("1500");
    await page.getByTestId("settings-save").click();
    await page.getByTestId("settings-result").filter({ hasText: "Applied: vram_reserve_mib" }).waitFor({ timeout: 10_000 });
    // What admission uses, read back from the server's status, not the form.
    await page.getByTestId("tab-memory").click();
    await page.getByTestId("vram-reserve").filter({ hasText: "1,500 MiB" }).waitFor({ timeout: 10_000 });
    await page.reload();
    await page.getByTestId("tab-settings").click();
    assert.equal(await page.getByTestId("setting-vram-reserve").inputValue(), "1500");
    const bad = await page.getByTestId("setting-cpu-concurrency");
    await bad.fill("99");
    await page.getByTestId("settings-save").click();
    await page.getByTestId("settings-result").filter({ hasText: "cpu_max_concurrency must be 1 to 16" }).waitFor({ timeout: 10_000 });
    await page.getByRole("button", { name: "Revert" }).click();
  });

  await check("pausing the GPU sends replies to the CPU and says so", async () => {
    await page.getByTestId("setting-gpu-paused").check();
    await page.getByTestId("settings-save").click();
    await page.getByTestId("gpu-health").filter({ hasText: /GPU (paused|degraded|unavailable)/ }).waitFor({ timeout: 10_000 });
    assert.match(await page.getByTestId("gpu-health").innerText(), /GPU paused/);
    await page.screenshot({ path: join(shots, "settings-1440x900.png") });
    const reply = await chat(page, "Let there be light");
    assert.equal(await reply.getByTestId("device-badge").innerText(), "CPU");
    assert.match(await reply.getByTestId("reply-notice").innerText(), /paused/);
  });

  await check("a queued request is cancelled from the UI; the ones ahead of it finish", async () => {
    // One CPU slot (the CPU worker runs 4 together by default): two long requests from another
    // client take it and wait for it (two, so the UI's request stays queued for seconds, however
    // busy the machine).
    const patched = await fetch(`${server.url}/v1/settings`, {
      method: "PATCH",
      headers: { "content-type": "application/json" },
      body: JSON.stringify({ cpu_max_concurrency: 1 }),
    });
    assert.equal(patched.status, 200, await patched.text());
    const long = () =>
      fetch(`${server.url}/v1/completions`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify({ model: "default", prompt: "And it came to pass", max_tokens: 900, ignore_eos: true }),
      });
    const ahead = [long(), long()];
    await page.getByTestId("tab-memory").click();
    await page.locator(".queues tr", { hasText: "cpu" }).filter({ has: page.locator("td:nth-child(3)", { hasText: "1" }) }).filter({ has: page.locator("td:nth-child(2)", { hasText: "1" }) }).waitFor({ timeout: 10_000 });
    await page.getByTestId("prompt").fill("The voice of one crying");
    await page.getByTestId("send").click();
    const reply = page.getByTestId("reply").last();
    await page.locator('[data-testid=reply][data-request-id^="req_"]').nth((await page.getByTestId("reply").count()) - 1).waitFor({ timeout: 30_000 });
    const id = await reply.getAttribute("data-request-id");
    assert.equal((await (await fetch(`${server.url}/v1/requests/${id}`)).json()).state, "queued", "the UI's request waits behind the other");
    await reply.getByTestId("reply-delay").waitFor({ timeout: 5_000 });
    assert.match(await reply.getByTestId("reply-delay").innerText(), /^queued: (about \d+ (ms|s|min) left|any moment now)$/, "the expected wait counts down");
    await page.locator(".queues tr", { hasText: "cpu" }).filter({ has: page.locator("td:nth-child(2)", { hasText: "2" }) }).waitFor({ timeout: 5_000 });
    await page.screenshot({ path: join(shots, "queued-1440x900.png") });
    await page.getByTestId("stop").click();
    await reply.getByText("stopped").waitFor({ timeout: 10_000 });
    let state = "";
    for (let i = 0; i < 50 && state !== "cancelled"; i++) {
      state = (await (await fetch(`${server.url}/v1/requests/${id}`)).json()).state;
      if (state !== "cancelled") await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(state, "cancelled", `request ${id} on the server`);
    for (const done of await Promise.all(ahead)) {
      assert.equal(done.status, 200, "the requests ahead were not touched");
      assert.equal((await done.json()).usage.completion_tokens, 900);
    }
  });

  await check("resuming the GPU brings replies back to it", async () => {
    await page.getByTestId("tab-settings").click();
    await page.getByTestId("setting-gpu-paused").uncheck();
    await page.getByTestId("settings-save").click();
    await page.getByTestId("gpu-health").filter({ hasText: "GPU healthy (simulated)" }).waitFor({ timeout: 30_000 });
    const reply = await chat(page, "In the beginning");
    assert.match(await reply.getByTestId("device-badge").innerText(), /GPU · sim/);
    await page.getByTestId("tab-memory").click();
  });

  await check("after injected OOMs the breaker opens: degraded banner, CPU badge and why", async () => {
    for (let i = 0; i < 3; i++) {
      await fault({ fault: "oom_next_allocation" });
      const reply = await chat(page, `The LORD is my shepherd ${i}`);
      assert.equal(await reply.getByTestId("device-badge").innerText(), "CPU");
      assert.ok((await reply.getByTestId("reply-notice").innerText()).length > 0, "the reply says why it ran on the CPU");
    }
    await page.getByTestId("degraded-banner").waitFor({ timeout: 10_000 });
    assert.match(await page.getByTestId("gpu-health").innerText(), /GPU (degraded|unavailable)/);
  });

  // What happened, who answers and its limits, in one sentence; the figures one click deeper.
  const plain = /^The GPU is out of memory; kjv-demo on the CPU is answering(, about \d+× slower)?, up to [\d,k]+ tokens\.$/;
  await check("the banner says in plain words what happened, and the breaker's reason is behind Details", async () => {
    assert.match(await page.getByTestId("degraded-summary").innerText(), plain);
    const details = page.getByTestId("degraded-details");
    assert.equal(await details.locator("p").first().isVisible(), false, "the reason waits behind the toggle");
    await details.locator("summary").click();
    assert.match(await details.locator("p").first().innerText(), /allocation failures/);
    // The worker answering now beside the GPU's: model, limit, concurrency, measured speed.
    assert.match(await page.getByTestId("degraded-worker-cpu").innerText(), /^CPU: kjv-demo · up to [\d,k]+ tokens · \d+ at a time · \d+ tokens\/s$/, "the CPU's speed was measured by now");
    // The GPU worker may be restarting (no model loaded) while the breaker is open.
    assert.match(await page.getByTestId("degraded-worker-gpu").innerText(), /^GPU: .+ · \d+ at a time · (\d+ tokens\/s|speed not measured yet)$/);
    await details.locator("summary").click();
  });

  await check("while degraded a new reply goes to the CPU and says so plainly, with the reason and request id behind Details", async () => {
    const reply = await chat(page, "Blessed are the meek");
    assert.equal(await reply.getByTestId("device-badge").innerText(), "CPU");
    assert.match(await reply.getByTestId("reply-notice").innerText(), plain);
    const details = reply.getByTestId("reply-details");
    await details.locator("summary").click();
    assert.match(await details.innerText(), /GPU unavailable: .*allocation failures/);
    assert.match(await details.innerText(), /request req_/);
    // The same reply as people will see it: light and dark, both window sizes, Details closed and open.
    for (const scheme of ["light", "dark"]) {
      await page.emulateMedia({ colorScheme: scheme });
      for (const [width, height] of [[1440, 900], [1024, 700]]) {
        await page.setViewportSize({ width, height });
        for (const open of [false, true]) {
          if ((await details.getAttribute("open")) !== null !== open) await details.locator("summary").click();
          await reply.scrollIntoViewIfNeeded();
          await page.screenshot({ path: join(shots, `degraded-reply-${scheme}-${width}x${height}-details-${open ? "open" : "closed"}.png`) });
        }
      }
    }
    await page.emulateMedia({ colorScheme: "light" });
    await page.setViewportSize({ width: 1440, height: 900 });
  });

  await check("the memory panel draws the chart and marks the failovers", async () => {
    await page.getByTestId("tab-memory").click();
    await page.getByTestId("memory-chart").locator("canvas").first().waitFor();
    await page.locator(".marks li.failover").first().waitFor({ timeout: 10_000 });
    // The legend reads the latest values, with units, without hovering.
    const legend = page.getByTestId("memory-chart").locator(".u-legend");
    await legend.filter({ hasText: /weights\s*[\d.,]+ (MiB|GiB)/ }).waitFor({ timeout: 10_000 });
    // GPU memory by part, each with its own share.
    assert.match(await legend.innerText(), /requests\s*[\d.,]+ (MiB|GiB)/);
    assert.match(await legend.innerText(), /other programs\s*[\d.,]+ (MiB|GiB)/);
    assert.match(await legend.innerText(), /host RAM used\s*[\d.,]+ (MiB|GiB)/);
  });

  await check("stop cancels the request on the server", async () => {
    await page.locator("input[type=number]").fill("400");
    await page.getByTestId("prompt").fill("And God said");
    await page.getByTestId("send").click();
    const reply = page.getByTestId("reply").last();
    await page.locator('[data-testid=reply][data-request-id^="req_"]').nth((await page.getByTestId("reply").count()) - 1).waitFor({ timeout: 30_000 });
    const id = await reply.getAttribute("data-request-id");
    // The button moves while the reply grows the list (and while a banner comes or goes): a
    // click event, not a pointer waiting for it to stand still.
    await page.getByTestId("stop").dispatchEvent("click");
    await page.getByTestId("send").waitFor({ timeout: 10_000 });
    await reply.getByText("stopped").waitFor();
    let state = "";
    for (let i = 0; i < 50 && state !== "cancelled"; i++) {
      state = (await (await fetch(`${server.url}/v1/requests/${id}`)).json()).state;
      if (state !== "cancelled") await new Promise((r) => setTimeout(r, 100));
    }
    assert.equal(state, "cancelled", `request ${id} on the server`);
  });

  await page.screenshot({ path: join(shots, "ui-1440x900.png") });
  await page.setViewportSize({ width: 1024, height: 700 });
  await page.waitForTimeout(300);
  await page.screenshot({ path: join(shots, "ui-1024x700.png") });

  await check("nothing is cut off at 1024×700", async () => {
    for (const tab of ["tab-memory", "tab-settings"]) {
      await page.getByTestId(tab).click();
      const overflow = await page.evaluate(() => document.documentElement.scrollWidth - document.documentElement.clientWidth);
      assert.ok(overflow <= 0, `${tab}: the page is ${overflow}px wider than the window`);
    }
    await page.screenshot({ path: join(shots, "settings-1024x700.png") });
  });

  await check("in dark mode (the system's preference) the page and the chart follow it", async () => {
    await page.emulateMedia({ colorScheme: "dark" });
    await page.reload();
    await page.getByTestId("degraded-banner").or(page.getByTestId("gpu-health")).first().waitFor();
    const background = await page.evaluate(() => getComputedStyle(document.body).backgroundColor);
    assert.equal(background, "rgb(17, 24, 39)", "the dark background");
    await page.getByTestId("memory-chart").locator("canvas").first().waitFor();
    await page.waitForTimeout(1500); // a few status samples on the chart
    await page.screenshot({ path: join(shots, "ui-dark-1024x700.png") });
    await page.setViewportSize({ width: 1440, height: 900 });
    await page.screenshot({ path: join(shots, "ui-dark-1440x900.png") });
    await page.emulateMedia({ colorScheme: "light" });
  });

  await check("a reply from a fallback model says which model answered", async () => {
    const folder = trainSmallModel(server.dir);
    // The GPU paused, so the CPU worker answers whatever the breaker does meanwhile.
    await page.getByTestId("tab-settings").click();
    await page.getByTestId("setting-gpu-paused").check();
    await page.getByTestId("setting-fallback-model").fill(folder);
    await page.getByTestId("settings-save").click();
    await page.getByTestId("settings-result").filter({ hasText: "fallback_model" }).waitFor({ timeout: 10_000 });
    await page.getByTestId("gpu-health").filter({ hasText: /GPU (paused|degraded|unavailable)/ }).waitFor({ timeout: 10_000 });
    await page.getByTestId("setting-worker-cpu").filter({ hasText: /^CPU: kjv-small/ }).waitFor({ timeout: 60_000 });
    const reply = await chat(page, "Genesis 1:1");
    assert.equal(await reply.getByTestId("device-badge").innerText(), "CPU");
    assert.equal(await reply.getByTestId("reply-model").innerText(), "answered by kjv-small");
    assert.match(await reply.getByTestId("reply-notice").innerText(), /^The GPU is (paused in Settings|out of memory); kjv-small on the CPU is answering/);
    await page.getByTestId("tab-memory").click();
  });

  await check("with several models the chart stacks one area per model and marks an eviction; settings pick the model", async () => {
    // The page's model and a copy serving embeddings, on a sim GPU that holds one of them.
    const embedder = join(server.dir, "kjv-embed");
    cpSync(join(root, "models/kjv-demo"), embedder, { recursive: true });
    const models = await startServer({ config: `[memory]\nvram_reserve_mib = 0\n\n[[models]]\nsource = "${embedder}"\nrole = "embedding"\n`, args: ["--sim-vram-mib", "24"] });
    const other = await browser.newPage({ viewport: { width: 1440, height: 900 } });
    try {
      await other.goto(models.url);
      await other.getByTestId("tab-memory").click();
      const legend = other.getByTestId("memory-chart").locator(".u-legend");
      // One series per model (its weights and grants on the GPU), other programs, the limit.
      await legend.filter({ hasText: /kjv-demo\s*[\d.,]+ (MiB|GiB)/ }).waitFor({ timeout: 10_000 });
      assert.match(await legend.innerText(), /kjv-embed\s*[\d.,]+ (MiB|GiB)/);
      assert.match(await legend.innerText(), /other programs\s*[\d.,]+ (MiB|GiB)/);
      assert.match(await legend.innerText(), /limit \(less reserve\)\s*[\d.,]+ (MiB|GiB)/);
      assert.doesNotMatch(await legend.innerText(), /weights/, "the one-model parts give way to the models");
      const r = await fetch(`${models.url}/v1/embeddings`, { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify({ model: "kjv-embed", input: "In the beginning" }) });
      assert.equal(r.status, 200);
      assert.equal(r.headers.get("x-headroom-device"), "sim", "the chat model made way");
      await other.locator(".marks li.residency", { hasText: "kjv-demo evicted" }).waitFor({ timeout: 10_000 });
      await other.getByTestId("model-row").filter({ hasText: "kjv-embed" }).filter({ has: other.locator("td:nth-child(3)", { hasText: /^GPU$/ }) }).waitFor({ timeout: 10_000 });
      // Two more samples, so the areas show the turn.
      await new Promise((ok) => setTimeout(ok, 2500));
      await other.screenshot({ path: join(shots, "models-memory-1440x900.png") });
      // Settings: the fallback model and layer count are the chosen model's.
      await other.getByTestId("tab-settings").click();
      const pick = other.getByTestId("setting-model-select");
      assert.deepEqual(await pick.locator("option").allInnerTexts(), ["kjv-demo (chat)", "kjv-embed (embedding)"]);
      await pick.selectOption("kjv-embed");
      await other.getByTestId("setting-gpu-layers").fill("3");
      await other.getByTestId("settings-save").click();
      await other.getByTestId("settings-result").filter({ hasText: /settings-kjv-embed\.json/ }).waitFor({ timeout: 10_000 });
      const embedSettings = await (await fetch(`${models.url}/v1/settings?model=kjv-embed`)).json();
      assert.equal(embedSettings.settings.gpu_layers, 3);
      assert.equal((await (await fetch(`${models.url}/v1/settings`)).json()).settings.gpu_layers, null, "the first model's own stays");
    } finally {
      await other.close();
      models.child.kill("SIGTERM");
      rmSync(models.dir, { recursive: true, force: true });
    }
  });
} finally {
  await browser.close();
  server.child.kill("SIGTERM");
  rmSync(server.dir, { recursive: true, force: true });
}

finish();
