import { defineConfig } from "vite";
import { svelte } from "@sveltejs/vite-plugin-svelte";

// `npm run dev` proxies the API to a `headroom serve` on 127.0.0.1:8080.
export default defineConfig({
  plugins: [svelte()],
  server: {
    proxy: Object.fromEntries(["/v1", "/metrics", "/healthz", "/readyz"].map((p) => [p, "http://127.0.0.1:8080"])),
  },
  test: { include: ["src/**/*.test.ts"] },
});
