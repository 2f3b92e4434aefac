import assert from "node:assert/strict";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";
import { DEFAULT_CONTEXT_WINDOW, DEFAULT_MAX_TOKENS, DEFAULT_MODEL_ID } from "../src/config.ts";
import { fetchModels, parseModels } from "../src/models.ts";
import { deadUrl } from "./helpers/recording-server.ts";

const URL_ = "http://127.0.0.1:8088/v1";

async function listen(server: Server): Promise<string> {
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1`;
}

// What `kv-elision serve` answers on GET /v1/models.
const SERVED = {
  object: "list",
  data: [{ id: "smollm2-135m", object: "model", owned_by: "kv-elision", created: 0, context_window: 1_000_000, budget_tokens: 4096, max_output_tokens: 24 }],
};

test("a served model keeps the server's window and output cap, and asks Pi for its session id", () => {
  const [m] = parseModels(SERVED, URL_);
  assert.ok(m);
  assert.deepEqual(m, {
    id: "smollm2-135m",
    name: "smollm2-135m (kv-elision)",
    api: "openai-completions",
    provider: "kv-elision",
    baseUrl: URL_,
    reasoning: false,
    input: ["text"],
    cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
    contextWindow: 1_000_000,
    maxTokens: 24,
    compat: { sendSessionAffinityHeaders: true, sessionAffinityFormat: "openai-nosession" },
  });
});

test("name and reasoning are taken when given", () => {
  const [m] = parseModels({ data: [{ id: "qwen", name: "Qwen", context_window: 2_000_000, max_output_tokens: 512, reasoning: true }] }, URL_);
  assert.equal(m!.name, "Qwen");
  assert.equal(m!.contextWindow, 2_000_000);
  assert.equal(m!.maxTokens, 512);
  assert.equal(m!.reasoning, true);
});

test("without reported limits: the addressable window and the server's default cap", () => {
  const [m] = parseModels({ object: "list", data: [{ id: "smollm2-135m", object: "model" }] }, URL_);
  assert.equal(m!.contextWindow, DEFAULT_CONTEXT_WINDOW);
  assert.equal(m!.maxTokens, DEFAULT_MAX_TOKENS);
  assert.equal(DEFAULT_MAX_TOKENS, 1024, "kv-elision serve --max-new-tokens defaults to 1024");
  assert.equal(m!.reasoning, false);
});

test("unusable entries are skipped, duplicates dropped, nonsense numbers ignored", () => {
  const models = parseModels(
    { data: [null, { id: "" }, { id: 3 }, { id: "a", context_window: -1 }, { id: "a" }, { id: "b", max_output_tokens: 1.5 }] },
    URL_,
  );
  assert.deepEqual(models.map((m) => m.id), ["a", "b"]);
  assert.equal(models[0]!.contextWindow, DEFAULT_CONTEXT_WINDOW);
  assert.equal(models[1]!.maxTokens, DEFAULT_MAX_TOKENS);
});

test("a body without models is an error", () => {
  assert.throws(() => parseModels({ data: [] }, URL_), /no models/);
  assert.throws(() => parseModels({ models: [] }, URL_), /no `data` array/);
  assert.throws(() => parseModels("nope", URL_), /no `data` array/);
});

test("fetchModels reads GET {url}/models", async () => {
  const server = createServer((req, res) => {
    assert.equal(req.url, "/v1/models");
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify(SERVED));
  });
  try {
    const url = await listen(server);
    const list = await fetchModels(url);
    assert.equal(list.problem, undefined);
    assert.deepEqual(list.models.map((m) => [m.id, m.contextWindow, m.maxTokens, m.baseUrl]), [["smollm2-135m", 1_000_000, 24, url]]);
  } finally {
    server.close();
  }
});

test("a server that is down gives the default model and a reason", async () => {
  const list = await fetchModels(await deadUrl());
  assert.deepEqual(list.models.map((m) => m.id), [DEFAULT_MODEL_ID]);
  assert.match(list.problem ?? "", /ECONNREFUSED/);
});

test("a server that never answers is given up on after the timeout", async () => {
  const server = createServer(() => {}); // accepts, never responds
  try {
    const url = await listen(server);
    const started = Date.now();
    const list = await fetchModels(url, 300);
    assert.ok(Date.now() - started < 2000);
    assert.equal(list.models[0]!.id, DEFAULT_MODEL_ID);
    assert.match(list.problem ?? "", /no answer in time/);
  } finally {
    server.closeAllConnections();
    server.close();
  }
});

test("an HTTP error gives the default model and the status", async () => {
  const server = createServer((_req, res) => {
    res.writeHead(503);
    res.end();
  });
  try {
    const list = await fetchModels(await listen(server));
    assert.match(list.problem ?? "", /HTTP 503/);
    assert.equal(list.models[0]!.id, DEFAULT_MODEL_ID);
  } finally {
    server.close();
  }
});

// `kv-elision serve` answers /v1/models only with `Authorization: Bearer KEY`.
test("fetchModels sends the API key, and a 401 says which key to set", async () => {
  const seen: Array<string | undefined> = [];
  const server = createServer((req, res) => {
    seen.push(req.headers.authorization);
    if (req.headers.authorization !== "Bearer k-1") {
      res.writeHead(401, { "content-type": "application/json" });
      res.end(JSON.stringify({ error: { message: "missing or wrong API key", type: "invalid_api_key", code: 401 } }));
      return;
    }
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify(SERVED));
  });
  try {
    const url = await listen(server);
    const ok = await fetchModels(url, 2000, { key: "k-1", source: "/root/kv/api-key" });
    assert.equal(ok.problem, undefined);
    assert.equal(ok.models[0]!.maxTokens, 24);
    const none = await fetchModels(url, 2000, { source: "KV_ELISION_API_KEY or /root/kv/api-key" });
    assert.match(
      none.problem ?? "",
      /HTTP 401 \(the server wants its API key, and there is none in KV_ELISION_API_KEY or \/root\/kv\/api-key: set KV_ELISION_KEY_FILE/,
    );
    const wrong = await fetchModels(url, 2000, { key: "k-2", source: "KV_ELISION_API_KEY" });
    assert.match(wrong.problem ?? "", /HTTP 401 .*refused the key in KV_ELISION_API_KEY/);
    assert.deepEqual(seen, ["Bearer k-1", undefined, "Bearer k-2"]);
  } finally {
    server.close();
  }
});
