// Starts a real `headroom serve --gpu sim` for the end-to-end tests, each with its own data
// directory, and reads the address it prints.
import { spawn, spawnSync } from "node:child_process";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { createInterface } from "node:readline";

export const root = resolve(import.meta.dirname, "../..");
export const headroom = process.env.HEADROOM_BIN ?? join(root, "target/debug/headroom");

/** `config` is the headroom.toml text; `args` more `headroom serve` flags; `env` its environment's additions. */
export async function startServer({ config = "", args = [], env = {} } = {}) {
  const dir = mkdtempSync(join(tmpdir(), "headroom-e2e-"));
  writeFileSync(join(dir, "headroom.toml"), config);
  const child = spawn(headroom, ["serve", "--gpu", "sim", "--port", "0", "--model", "kjv-demo", "--config", join(dir, "headroom.toml"), "--data-dir", join(dir, "data"), ...args], {
    env: { ...process.env, HEADROOM_UI_DIR: join(root, "ui/dist"), ...env },
    stdio: ["ignore", "pipe", "inherit"],
  });
  const lines = createInterface({ input: child.stdout });
  const url = await new Promise((ok, fail) => {
    const timer = setTimeout(() => fail(new Error("headroom serve did not start in 120 s")), 120_000);
    lines.on("line", (line) => {
      const m = line.match(/ at (http:\/\/[^\s]+)/);
      if (m) {
        clearTimeout(timer);
        ok(m[1]);
      }
    });
    child.on("exit", (code) => fail(new Error(`headroom serve exited (${code})`)));
  });
  return { url, child, dir };
}

/** A second, smaller model for fallback tests: one layer trained for 20 steps on a few verses,
 *  written to `dir`/kjv-small; returns that folder. */
export function trainSmallModel(dir) {
  const corpus = Array.from({ length: 20 }, (_, c) => `\nGenesis ${c + 1}\n\n` + Array.from({ length: 10 }, (_, v) => `  ${v + 1} In the beginning God created the heaven and the earth, chapter ${c + 1} verse ${v + 1}.`).join("\n")).join("\n");
  const corpusFile = join(dir, "corpus.txt");
  writeFileSync(corpusFile, corpus);
  const folder = join(dir, "kjv-small");
  const trained = spawnSync(headroom, ["train", "--corpus", corpusFile, "--out", folder, "--steps", "20", "--layers", "1", "--hidden", "64", "--seq-len", "32", "--batch", "2"], { encoding: "utf8" });
  if (trained.status !== 0) throw new Error(`headroom train failed: ${trained.stderr}`);
  return folder;
}
