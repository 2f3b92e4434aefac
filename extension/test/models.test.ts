import assert from "node:assert/strict";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { test } from "node:test";
import { DEFAULT_CONTEXT_WINDOW, DEFAULT_MODEL_ID } from "../src/config.ts";
import { fetchModels, parseModels } from "../src/models.ts";

async function listen(server: Server): Promise<string> {
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}/v1`;
}

test("models keep the server's context window and output limit", () => {
  const [m] = parseModels({ data: [{ id: "qwen", name: "Qwen", context_window: 2_000_000, max_tokens: 512, reasoning: true }] });
  assert.equal(m!.id, "qwen");
  assert.equal(m!.name, "Qwen");
  assert.equal(m!.contextWindow, 2_000_000);
  assert.equal(m!.maxTokens, 512);
  assert.equal(m!.reasoning, true);
  assert.deepEqual(m!.input, ["text"]);
  assert.deepEqual(m!.compat, { supportsDeveloperRole: false });
});

test("without a reported window the model gets one far beyond any session", () => {
  const [m] = parseModels({ object: "list", data: [{ id: "smollm2-135m", object: "model" }] });
  assert.equal(m!.contextWindow, DEFAULT_CONTEXT_WINDOW);
  assert.equal(m!.reasoning, false);
});

test("unusable entries are skipped, duplicates dropped, nonsense numbers ignored", () => {
  const models = parseModels({ data: [null, { id: "" }, { id: 3 }, { id: "a", context_window: -1 }, { id: "a" }, { id: "b", max_tokens: 1.5 }] });
  assert.deepEqual(models.map((m) => m.id), ["a", "b"]);
  assert.equal(models[0]!.contextWindow, DEFAULT_CONTEXT_WINDOW);
});

test("a body without models is an error", () => {
  assert.throws(() => parseModels({ data: [] }), /no models/);
  assert.throws(() => parseModels({ models: [] }), /no `data` array/);
  assert.throws(() => parseModels("nope"), /no `data` array/);
});

test("fetchModels reads GET {url}/models", async () => {
  const server = createServer((req, res) => {
    assert.equal(req.url, "/v1/models");
    res.writeHead(200, { "content-type": "application/json" });
    res.end(JSON.stringify({ data: [{ id: "m1", context_window: 123_456 }] }));
  });
  try {
    const list = await fetchModels(await listen(server));
    assert.equal(list.problem, undefined);
    assert.deepEqual(list.models.map((m) => [m.id, m.contextWindow]), [["m1", 123_456]]);
  } finally {
    server.close();
  }
});

test("a server that is down gives the default model and a reason", async () => {
  const probe = createServer();
  const url = await listen(probe);
  await new Promise((r) => probe.close(r));
  const list = await fetchModels(url);
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
