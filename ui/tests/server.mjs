// Starts a real `headroom serve --gpu sim` for the end-to-end tests, each with its own data
// directory, and reads the address it prints.
import { spawn } from "node:child_process";
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
