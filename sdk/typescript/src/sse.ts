/** Server-sent events of a streaming answer (process output, lifecycle events, image imports) read from a fetch Response, and the base64 their data may carry. */

export function base64Bytes(text: string): Uint8Array {
  const bin = atob(text);
  return Uint8Array.from(bin, (c) => c.charCodeAt(0));
}

/** Server-sent events of a streaming answer; comments (keep-alives) and empty events skipped. */
export async function* readSSE(resp: Response): AsyncGenerator<{ event: string; data: string }> {
  if (!resp.body) return;
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let event = "message";
  let data: string[] = [];
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let nl: number;
      while ((nl = buffer.indexOf("\n")) >= 0) {
        const line = buffer.slice(0, nl).replace(/\r$/, "");
        buffer = buffer.slice(nl + 1);
        if (line === "") {
          if (data.length) yield { event, data: data.join("\n") };
          event = "message";
          data = [];
        } else if (line.startsWith(":")) {
          continue;
        } else {
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") event = val;
          else if (field === "data") data.push(val);
        }
      }
    }
  } finally {
    // A caller that stops early (break, return) ends the response too: releasing the
    // lock alone would leave the connection open, and node would not exit.
    await reader.cancel().catch(() => {});
    reader.releaseLock();
  }
}
