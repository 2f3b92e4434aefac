// An HTTP endpoint that records what Pi's OpenAI client puts on the wire (headers and the JSON
// body) and answers with a one-word streamed chat completion, the way kv-elision serve streams.
// Used where a test asserts on exact request bytes; the real server is exercised by
// tests/e2e/test_pi.py.
import { createServer, type IncomingHttpHeaders, type Server } from "node:http";
import type { AddressInfo } from "node:net";

export interface Recorded {
  headers: IncomingHttpHeaders;
  body: unknown;
}

export class RecordingServer {
  readonly requests: Recorded[] = [];
  private readonly server: Server;
  // Set to hold answers back (abort tests); released by close().
  holdAnswers = false;

  constructor() {
    this.server = createServer((req, res) => {
      let raw = "";
      req.on("data", (chunk: Buffer) => (raw += chunk.toString()));
      req.on("end", () => {
        this.requests.push({ headers: req.headers, body: JSON.parse(raw) });
        if (this.holdAnswers) return;
        res.writeHead(200, { "content-type": "text/event-stream" });
        const base = { id: "c1", object: "chat.completion.chunk", created: 0, model: "m" };
        const chunk = (obj: object): boolean => res.write(`data: ${JSON.stringify({ ...base, ...obj })}\n\n`);
        chunk({ choices: [{ index: 0, delta: { role: "assistant", content: "hi" }, finish_reason: null }] });
        chunk({ choices: [{ index: 0, delta: {}, finish_reason: "stop" }] });
        chunk({ choices: [], usage: { prompt_tokens: 3, completion_tokens: 1, total_tokens: 4 } });
        res.end("data: [DONE]\n\n");
      });
    });
  }

  async start(): Promise<string> {
    await new Promise<void>((r) => this.server.listen(0, "127.0.0.1", r));
    return `http://127.0.0.1:${(this.server.address() as AddressInfo).port}/v1`;
  }

  async close(): Promise<void> {
    this.server.closeAllConnections();
    await new Promise((r) => this.server.close(r));
  }
}

// A URL nothing listens on: a port that was free a moment ago.
export async function deadUrl(): Promise<string> {
  const probe = createServer();
  await new Promise<void>((r) => probe.listen(0, "127.0.0.1", r));
  const { port } = probe.address() as AddressInfo;
  await new Promise((r) => probe.close(r));
  return `http://127.0.0.1:${port}/v1`;
}
