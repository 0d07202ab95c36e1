import { mount } from "svelte";
import "uplot/dist/uPlot.min.css";

// WebKitGTK under the C.UTF-8 locale (the desktop app on a bare Linux) reports
// navigator.language "C", which no Intl constructor accepts; uPlot builds a NumberFormat with it
// as it loads, so the UI would not start. Report a language Intl accepts, then load the app.
try {
  new Intl.NumberFormat(navigator.language);
} catch {
  Object.defineProperty(navigator, "language", { value: "en-US", configurable: true });
}

import("./App.svelte").then(({ default: App }) => mount(App, { target: document.getElementById("app")! }));
