// The end-to-end scripts' tiny TAP-like runner: each check prints ok / not ok and the run ends
// with the count and a failing exit status when any check failed.
const results = [];

export async function check(name, body) {
  try {
    await body();
    results.push([name, true]);
    console.log(`ok - ${name}`);
  } catch (e) {
    results.push([name, false]);
    console.log(`not ok - ${name}\n  ${String(e?.stack ?? e).split("\n").slice(0, 6).join("\n  ")}`);
  }
}

export function finish() {
  const failed = results.filter(([, ok]) => !ok).length;
  console.log(`${results.length - failed} passed, ${failed} failed`);
  process.exit(failed ? 1 : 0);
}
