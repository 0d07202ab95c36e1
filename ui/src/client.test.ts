import { describe, expect, it } from "vitest";
import { ChatStream, settingsUrl } from "./client";

const chunk = (content: string, extra: object = {}) =>
  `data: ${JSON.stringify({ id: "chatcmpl-req_1", choices: [{ index: 0, delta: { content }, finish_reason: null }], ...extra })}\n\n`;

/** A reply without the clock readings, which differ between two runs. */
const content = ({ startedAt, firstTokenAt, doneAt, ...rest }: ReturnType<ChatStream["push"]>) => rest;

describe("ChatStream (both transports fold the server's SSE text with it)", () => {
  it("gives the same reply whether the text arrives whole or cut anywhere", () => {
    const text = chunk("And ") + chunk("God ") + chunk("said") + "data: [DONE]\n\n";
    const whole = new ChatStream().push(text);
    for (let cut = 1; cut < text.length; cut += 7) {
      const pieces = new ChatStream();
      pieces.push(text.slice(0, cut));
      expect(content(pieces.push(text.slice(cut)))).toEqual(content(whole));
    }
    expect(whole.text).toBe("And God said");
  });
});

describe("settingsUrl", () => {
  it("names a model in the query, encoded, and the first model without one", () => {
    expect(settingsUrl("http://h:1")).toBe("http://h:1/v1/settings");
    expect(settingsUrl("http://h:1", "kjv-embed")).toBe("http://h:1/v1/settings?model=kjv-embed");
    expect(settingsUrl("", "a b&c")).toBe("/v1/settings?model=a%20b%26c");
  });
});
