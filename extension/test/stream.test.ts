import assert from "node:assert/strict";
import { createServer, type IncomingHttpHeaders } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";
import {
  createAssistantMessageEventStream,
  type Api,
  type AssistantMessage,
  type Context,
  type Model,
  type SimpleStreamOptions,
} from "@mariozechner/pi-ai";
import { contextHeader, fingerprintPayload } from "../src/fingerprint.ts";
import {
  CONTEXT_HEADER,
  CONTEXT_MAX_PIECES,
  CONTEXT_PIECE_CHARS,
  SESSION_HEADER,
  createKvStream,
  splitContextHeader,
  type StreamSimple,
} from "../src/stream.ts";

function model(provider: string, baseUrl = "http://127.0.0.1:9/v1"): Model<Api> {
  return {
    id: "smollm2-135m",
    name: "smollm2-135m",
    api: "openai-completions",
    provider,
    baseUrl,
    reasoning: false,
    input: ["text"],
    cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
    contextWindow: 1_000_000,
    maxTokens: 64,
  };
}

const context: Context = {
  systemPrompt: "You are Pi.",
  messages: [{ role: "user", content: "hello", timestamp: 0 }],
  tools: [],
};

function reply(m: Model<Api>, text: string, errorMessage?: string): AssistantMessage {
  return {
    role: "assistant",
    content: errorMessage ? [] : [{ type: "text", text }],
    api: m.api,
    provider: m.provider,
    model: m.id,
    usage: {
      input: 1,
      output: 1,
      cacheRead: 0,
      cacheWrite: 0,
      totalTokens: 2,
      cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0, total: 0 },
    },
    stopReason: errorMessage ? "error" : "stop",
    ...(errorMessage ? { errorMessage } : {}),
    timestamp: 0,
  };
}

interface Call {
  options: SimpleStreamOptions | undefined;
  sent?: unknown;
}

// Behaves like Pi's OpenAI client where it matters here: builds the body from the context, hands
// it to onPayload (whose result replaces it), then "sends" it, or ends with an error event.
function fakeBase(calls: Call[], failWith?: string): StreamSimple {
  return (m, ctx, options) => {
    const stream = createAssistantMessageEventStream();
    const call: Call = { options };
    calls.push(call);
    void (async () => {
      try {
        let payload: unknown = {
          model: m.id,
          messages: [{ role: "system", content: ctx.systemPrompt }, ...ctx.messages.map((x) => ({ role: x.role, content: x.content }))],
          tools: ctx.tools ?? [],
        };
        const next = await options?.onPayload?.(payload, m);
        if (next !== undefined) payload = next;
        if (failWith) throw new Error(failWith);
        call.sent = payload;
        stream.push({ type: "done", reason: "stop", message: reply(m, "ok") });
      } catch (error) {
        stream.push({ type: "error", reason: "error", error: reply(m, "", (error as Error).message) });
      }
      stream.end();
    })();
    return stream;
  };
}

test("other providers go straight to Pi's client with their options untouched", async () => {
  const calls: Call[] = [];
  const options: SimpleStreamOptions = { apiKey: "k", sessionId: "s1", headers: { A: "b" } };
  const result = await createKvStream(fakeBase(calls))(model("openrouter"), context, options).result();
  assert.equal(result.stopReason, "stop");
  assert.equal(calls.length, 1);
  assert.equal(calls[0]!.options, options);
});

test("kv-elision requests carry the session id and the fingerprint of the body sent", async () => {
  const calls: Call[] = [];
  const hooked: unknown[] = [];
  const result = await createKvStream(fakeBase(calls))(model("kv-elision"), context, {
    apiKey: "k",
    sessionId: "01a2-session",
    reasoning: "high",
    headers: { Authorization: "Bearer x" },
    onPayload: (payload) => {
      hooked.push(payload);
      return undefined; // Pi's before_provider_request hook leaving the body as it is
    },
  }).result();
  assert.equal(result.stopReason, "stop");
  assert.equal(calls.length, 2, "one probe that sends nothing, one real request");
  assert.equal(calls[0]!.sent, undefined);
  assert.equal(hooked.length, 1, "Pi's hooks run once, for the real request");
  const headers = calls[1]!.options!.headers!;
  assert.equal(headers.Authorization, "Bearer x");
  assert.equal(headers[SESSION_HEADER], "01a2-session");
  assert.equal(headers[CONTEXT_HEADER], contextHeader(fingerprintPayload(calls[1]!.sent, "high")));
  assert.equal(JSON.parse(headers[CONTEXT_HEADER]!).thinking, "high");
});

test("requests outside the agent loop (no session id) get no X-KV-Session", async () => {
  const calls: Call[] = [];
  await createKvStream(fakeBase(calls))(model("kv-elision"), context, { apiKey: "k" }).result();
  const headers = calls[1]!.options!.headers!;
  assert.equal(headers[SESSION_HEADER], undefined);
  assert.equal(JSON.parse(headers[CONTEXT_HEADER]!).thinking, "off");
});

test("a hook that rewrites the messages fails the request instead of sending a wrong fingerprint", async () => {
  const calls: Call[] = [];
  const result = await createKvStream(fakeBase(calls))(model("kv-elision"), context, {
    apiKey: "k",
    sessionId: "s",
    onPayload: (payload) => ({ ...(payload as object), messages: [] }),
  }).result();
  assert.equal(result.stopReason, "error");
  assert.match(result.errorMessage ?? "", /before_provider_request handler changed/);
  assert.equal(calls[1]!.sent, undefined);
});

test("a hook that only changes other fields is fine", async () => {
  const calls: Call[] = [];
  const result = await createKvStream(fakeBase(calls))(model("kv-elision"), context, {
    apiKey: "k",
    onPayload: (payload) => ({ ...(payload as object), temperature: 0 }),
  }).result();
  assert.equal(result.stopReason, "stop");
  assert.equal((calls[1]!.sent as { temperature?: number }).temperature, 0);
});

test("connection errors keep Pi's text and say how to start the server", async () => {
  const result = await createKvStream(fakeBase([], "Connection error."))(model("kv-elision"), context, {
    apiKey: "k",
  }).result();
  assert.match(result.errorMessage ?? "", /^Connection error\. \(kv-elision server not reachable at http:\/\/127\.0\.0\.1:9\/v1/);
  assert.match(result.errorMessage ?? "", /kv-elision serve --model smollm2-135m/);
});

// The same path with Pi's real OpenAI client and a socket that records what arrives.
test("Pi's real openai-completions client sends both headers", async () => {
  let seen: { headers: IncomingHttpHeaders; body: unknown } | undefined;
  const server = createServer((req, res) => {
    let raw = "";
    req.on("data", (chunk: Buffer) => (raw += chunk.toString()));
    req.on("end", () => {
      seen = { headers: req.headers, body: JSON.parse(raw) };
      res.writeHead(200, { "content-type": "text/event-stream" });
      const chunk = (obj: object) => res.write(`data: ${JSON.stringify(obj)}\n\n`);
      const base = { id: "c1", object: "chat.completion.chunk", created: 0, model: "smollm2-135m" };
      chunk({ ...base, choices: [{ index: 0, delta: { role: "assistant", content: "hi" }, finish_reason: null }] });
      chunk({ ...base, choices: [{ index: 0, delta: {}, finish_reason: "stop" }] });
      res.end("data: [DONE]\n\n");
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  try {
    const { port } = server.address() as AddressInfo;
    const result = await createKvStream()(model("kv-elision", `http://127.0.0.1:${port}/v1`), context, {
      apiKey: "k",
      sessionId: "session-42",
      maxRetries: 0,
    }).result();
    assert.equal(result.stopReason, "stop", result.errorMessage);
    assert.ok(seen);
    assert.equal(seen.headers["x-kv-session"], "session-42");
    assert.equal(seen.headers["x-kv-context"], contextHeader(fingerprintPayload(seen.body, "off")));
  } finally {
    server.close();
  }
});

test("with Pi's real client and no server, the error names the URL", async () => {
  const probe = createServer();
  await new Promise<void>((r) => probe.listen(0, "127.0.0.1", r));
  const { port } = probe.address() as AddressInfo;
  await new Promise((r) => probe.close(r)); // a port that was just free: nothing listens there
  const result = await createKvStream()(model("kv-elision", `http://127.0.0.1:${port}/v1`), context, {
    apiKey: "k",
    maxRetries: 0,
  }).result();
  assert.equal(result.stopReason, "error");
  assert.match(result.errorMessage ?? "", new RegExp(`kv-elision server not reachable at http://127.0.0.1:${port}/v1`));
});

test("a long context fingerprint continues in X-KV-Context-2, -3, ... and joins back exactly", () => {
  const text = contextHeader({
    v: 1,
    system: "s",
    tools: "t",
    thinking: "off",
    messages: Array.from({ length: 8000 }, (_, i) => i.toString(16).padStart(16, "0")),
  });
  const headers = splitContextHeader(text);
  const names = Object.keys(headers);
  assert.deepEqual(names, [CONTEXT_HEADER, `${CONTEXT_HEADER}-2`, `${CONTEXT_HEADER}-3`]);
  assert.ok(Object.values(headers).every((piece) => piece.length <= CONTEXT_PIECE_CHARS));
  assert.equal(names.map((name) => headers[name]).join(""), text);
  assert.deepEqual(Object.keys(splitContextHeader('{"v":1}')), [CONTEXT_HEADER]);
  assert.throws(() => splitContextHeader("x".repeat(CONTEXT_PIECE_CHARS * CONTEXT_MAX_PIECES + 1)), /header pieces/);
});
