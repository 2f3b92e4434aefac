// The provider through pi-ai's real model runtime (createModels, the registry Pi itself uses) and
// Pi's real OpenAI chat-completions client, against a socket that records what arrives.
import assert from "node:assert/strict";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import { InMemoryCredentialStore, createModels, type Context } from "@earendil-works/pi-ai";
import { contextHeader, fingerprintPayload } from "../src/fingerprint.ts";
import { modelConfig } from "../src/models.ts";
import {
  CONTEXT_HEADER,
  CONTEXT_MAX_PIECES,
  CONTEXT_PIECE_CHARS,
  createKvProvider,
  splitContextHeader,
} from "../src/provider.ts";
import { RecordingServer, deadUrl } from "./helpers/recording-server.ts";

const context: Context = {
  systemPrompt: "You are Pi.",
  messages: [{ role: "user", content: "hello", timestamp: 0 }],
  tools: [],
};

const server = new RecordingServer();
let url: string;
// The key file the provider reads: the test's own, so a key of the user running the tests (in
// the default root) never reaches a request.
const keyDir = mkdtempSync(join(tmpdir(), "kv-key-"));
const keyFile = join(keyDir, "api-key");

before(async () => {
  url = await server.start();
  process.env.KV_ELISION_KEY_FILE = keyFile;
});

after(async () => {
  delete process.env.KV_ELISION_KEY_FILE;
  rmSync(keyDir, { recursive: true, force: true });
  await server.close();
});

function runtime(baseUrl: string, reasoning = false) {
  const models = createModels();
  const model = modelConfig("m", baseUrl, { reasoning });
  models.setProvider(createKvProvider(baseUrl, [model]));
  return { models, model };
}

function lastRequest() {
  const request = server.requests.at(-1);
  assert.ok(request, "the server saw no request");
  return request;
}

test("a request carries Pi's session id and the fingerprint of the exact body sent", async () => {
  const { models, model } = runtime(url);
  const result = await models.streamSimple(model, context, { sessionId: "session-42", maxRetries: 0 }).result();
  assert.equal(result.stopReason, "stop", result.errorMessage);
  const { headers, body } = lastRequest();
  assert.equal(headers["x-session-affinity"], "session-42");
  assert.equal(headers["x-kv-context"], contextHeader(fingerprintPayload(body, "off")));
  assert.equal(headers.session_id, undefined, "no underscore header for proxies to drop");
  assert.equal(headers.authorization, "Bearer kv-elision");
  assert.equal((body as { max_completion_tokens?: number }).max_completion_tokens, model.maxTokens);
});

// What the user of a server started without --api-key has: the key the server made in its root.
test("the key the server made is read from its file and sent, for every request", async () => {
  try {
    writeFileSync(keyFile, "made-1\n", { mode: 0o600 });
    const { models, model } = runtime(url);
    await models.streamSimple(model, context, { maxRetries: 0 }).result();
    assert.equal(lastRequest().headers.authorization, "Bearer made-1");
    writeFileSync(keyFile, "made-2\n"); // the server started again with a new key
    await models.streamSimple(model, context, { maxRetries: 0 }).result();
    assert.equal(lastRequest().headers.authorization, "Bearer made-2");
  } finally {
    rmSync(keyFile, { force: true });
  }
});

test("a key in KV_ELISION_API_KEY is sent as the bearer token, ahead of the key file", async () => {
  writeFileSync(keyFile, "made-1\n", { mode: 0o600 });
  process.env.KV_ELISION_API_KEY = "secret-1";
  try {
    const { models, model } = runtime(url);
    await models.streamSimple(model, context, { maxRetries: 0 }).result();
    assert.equal(lastRequest().headers.authorization, "Bearer secret-1");
  } finally {
    delete process.env.KV_ELISION_API_KEY;
    rmSync(keyFile, { force: true });
  }
});

// The extension's other source of the key: the credential Pi stores for the provider (auth.json,
// `"kv-elision": {"type": "api_key", "key": "..."}`); it wins over the environment, as for Pi's
// own providers.
test("a key Pi stored for the provider is sent, ahead of KV_ELISION_API_KEY", async () => {
  process.env.KV_ELISION_API_KEY = "from-env";
  try {
    const credentials = new InMemoryCredentialStore();
    await credentials.modify("kv-elision", async () => ({ type: "api_key", key: "stored-1" }));
    const models = createModels({ credentials });
    const model = modelConfig("m", url);
    models.setProvider(createKvProvider(url, [model]));
    await models.streamSimple(model, context, { maxRetries: 0 }).result();
    assert.equal(lastRequest().headers.authorization, "Bearer stored-1");
  } finally {
    delete process.env.KV_ELISION_API_KEY;
  }
});

// Pi's compaction and branch summaries ask with cacheRetention "none": they are not part of the
// session and must not reach the session's cache.
test("a request without prompt caching carries no session id, still a fingerprint", async () => {
  const { models, model } = runtime(url);
  await models.streamSimple(model, context, { sessionId: "session-42", cacheRetention: "none", maxRetries: 0 }).result();
  const { headers, body } = lastRequest();
  assert.equal(headers["x-session-affinity"], undefined);
  assert.equal(headers["x-kv-context"], contextHeader(fingerprintPayload(body, "off")));
});

// Pi's before_provider_request handlers run in onPayload; whatever they make of the body is what
// is sent, and so what is fingerprinted.
test("a body rewritten before sending is fingerprinted as rewritten", async () => {
  const { models, model } = runtime(url);
  await models
    .streamSimple(model, context, {
      maxRetries: 0,
      onPayload: (payload) => {
        const body = payload as { messages: unknown[] };
        return { ...body, messages: [...body.messages, { role: "user", content: "added by a hook" }] };
      },
    })
    .result();
  const { headers, body } = lastRequest();
  const sent = (body as { messages: Array<{ content: unknown }> }).messages;
  assert.equal(sent.at(-1)?.content, "added by a hook");
  assert.equal(headers["x-kv-context"], contextHeader(fingerprintPayload(body, "off")));
  assert.equal(JSON.parse(String(headers["x-kv-context"])).messages.length, 2);
});

test("the thinking level is part of the fingerprint, on both entry points", async () => {
  const { models, model } = runtime(url, true);
  await models.streamSimple(model, context, { reasoning: "high", maxRetries: 0 }).result();
  assert.equal(JSON.parse(String(lastRequest().headers["x-kv-context"])).thinking, "high");
  await models.stream(model, context, { reasoningEffort: "low", maxRetries: 0 }).result();
  assert.equal(JSON.parse(String(lastRequest().headers["x-kv-context"])).thinking, "low");
  await models.stream(model, context, { maxRetries: 0 }).result();
  assert.equal(JSON.parse(String(lastRequest().headers["x-kv-context"])).thinking, "off");
});

// Pi retries errors that read "Connection error"; the hint follows Pi's own text.
test("with no server, the error names the URL and how to start one", async () => {
  const dead = await deadUrl();
  const { models, model } = runtime(dead);
  const result = await models.streamSimple(model, context, { maxRetries: 0 }).result();
  assert.equal(result.stopReason, "error");
  const port = new URL(dead).port;
  assert.equal(
    result.errorMessage,
    `Connection error.: kv-elision server not reachable at ${dead} (ECONNREFUSED (connect ECONNREFUSED 127.0.0.1:${port})); ` +
      `start it with \`kv-elision serve --model m --budget 4096 --root DIR --port ${port}\` or set KV_ELISION_URL`,
  );
});

test("an aborted request is reported as aborted, not as an unreachable server", async () => {
  const held = new RecordingServer();
  held.holdAnswers = true;
  const heldUrl = await held.start();
  try {
    const { models, model } = runtime(heldUrl);
    const controller = new AbortController();
    const stream = models.streamSimple(model, context, { signal: controller.signal, maxRetries: 0 });
    while (held.requests.length === 0) await new Promise((r) => setTimeout(r, 10));
    controller.abort();
    const result = await stream.result();
    assert.equal(result.stopReason, "aborted");
    assert.doesNotMatch(result.errorMessage ?? "", /not reachable/);
  } finally {
    await held.close();
  }
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

test("a long fingerprint reaches the server in pieces through Pi's client", async () => {
  const { models, model } = runtime(url);
  const many: Context = {
    ...context,
    messages: Array.from({ length: 4000 }, (_, i) => ({ role: "user" as const, content: `m${i}`, timestamp: 0 })),
  };
  await models.streamSimple(model, many, { maxRetries: 0 }).result();
  const { headers, body } = lastRequest();
  const joined = [headers["x-kv-context"], headers["x-kv-context-2"]].join("");
  assert.equal(headers["x-kv-context-3"], undefined);
  assert.equal(joined, contextHeader(fingerprintPayload(body, "off")));
});
