// The real Pi 1.6 in RPC mode, loading the extension as `pi -e extension/index.ts` does, with a
// real contextd and no kv-elision server: Pi loads the extension, registers the provider from the
// server's defaults, reports the dead server, and shows contextd's view of this very Pi session in
// the status line. A second provider from models.json ("other", answered by a recording socket)
// shows that the extension leaves other providers alone.
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import type * as grpc from "@grpc/grpc-js";
import { callContextd } from "../src/contextd.ts";
import { Contextd, writeRecord } from "./helpers/contextd.ts";
import { RecordingServer, deadUrl } from "./helpers/recording-server.ts";
import { piVersion, startPi, statusTexts, uiRequests, type PiRpc } from "./pi-harness.mjs";

const contextd = new Contextd();
const other = new RecordingServer();
let client: grpc.Client;
let pi: PiRpc;
let url: string;

before(async () => {
  await contextd.start();
  client = contextd.client();
  url = await deadUrl();
  const otherUrl = await other.start();
  pi = await startPi({
    env: { KV_ELISION_URL: url, KV_ELISION_SOCKET: contextd.socket },
    settings: { retry: { enabled: false } }, // one failed request, not three retries
    agentFiles: {
      "models.json": {
        providers: { other: { baseUrl: otherUrl, api: "openai-completions", apiKey: "k", models: [{ id: "plain" }] } },
      },
    },
  });
});

after(async () => {
  await pi?.close();
  await other.close();
  client?.close();
  await contextd.dispose();
});

test("Pi 1.6 loads the extension: the kv-elision model, with the server's defaults", async () => {
  const { model } = await pi.getState();
  assert.equal(piVersion(), "1.6.0");
  assert.deepEqual(
    [model.provider, model.id, model.contextWindow, model.maxTokens, model.baseUrl],
    ["kv-elision", "smollm2-135m", 1_000_000, 1024, url],
  );
});

test("Pi starts with the server down and says so", () => {
  const notes = uiRequests(pi.events, "notify").map((e: { message: string; notifyType: string }) => [e.notifyType, e.message]);
  assert.equal(notes.length, 2, JSON.stringify(notes));
  assert.match(notes[0]![1], /compaction is off for this provider/);
  assert.equal(notes[1]![0], "warning");
  assert.match(notes[1]![1], /server not reachable .*ECONNREFUSED.*Start it with: kv-elision serve --model smollm2-135m/);
});

test("the status line shows what contextd holds for this Pi session", async () => {
  const { sessionId } = await pi.getState();
  assert.match(sessionId, /^[0-9a-f-]{36}$/);
  type UiEvent = { method?: string; statusText?: string };
  // contextd answers before the server has opened this session
  await pi.waitFor((e: UiEvent) => e.method === "setStatus" && e.statusText === "kv ready · no pages yet", { timeoutMs: 15_000 });
  await callContextd(client, "OpenSession", { session_id: sessionId, model_id: "smollm2-135m", budget_tokens: 4096 });
  await callContextd(client, "UpsertPages", {
    session_id: sessionId,
    pages: [0, 1, 2].map((i) => ({ page_id: `p${i}`, index: i, token_start: i * 128, token_end: (i + 1) * 128, state: "HOT" })),
  });
  await callContextd(client, "SetPins", { session_id: sessionId, add: [{ page_id: "p0", kind: "system" }] });
  await writeRecord(client, sessionId, { attention_tokens: 384, counters: { restored_pages_turn: 1 } });
  const want = "kv hot 3 · cold 0 · pinned 1 | attn 384/4096 | restored 1";
  await pi.waitFor((e: UiEvent) => e.method === "setStatus" && e.statusText === want, { timeoutMs: 15_000 });
  assert.equal(statusTexts(pi.events).at(-1), want);
});

test("a prompt with the server down ends in a clear error, not a hang", async () => {
  const turn = await pi.prompt("hello", { timeoutMs: 60_000 });
  assert.equal(turn.assistant?.stopReason, "error");
  assert.match(turn.assistant?.errorMessage ?? "", new RegExp(`^Connection error\\.: kv-elision server not reachable at ${url} \\(ECONNREFUSED .*\\); start it with`));
  assert.deepEqual(turn.events.filter((e: { type: string }) => e.type.startsWith("compaction")), []);
});

test("another provider: the status line goes, nothing of kv-elision reaches its requests, and it comes back", async () => {
  const switched = await pi.send({ type: "set_model", provider: "other", modelId: "plain" });
  assert.ok(switched.success, JSON.stringify(switched));
  assert.equal(statusTexts(pi.events).at(-1), undefined, "cleared");
  const notes = uiRequests(pi.events, "notify").length;
  const turn = await pi.prompt("hello", { timeoutMs: 60_000 });
  assert.equal(turn.assistant?.stopReason, "stop", turn.assistant?.errorMessage);
  const [request] = other.requests;
  assert.ok(request);
  assert.deepEqual(Object.keys(request.headers).filter((h) => /^x-kv-|affinity/.test(h)), []);
  assert.equal(uiRequests(pi.events, "notify").length, notes, "no kv-elision notice for another provider");

  const mark = pi.events.length;
  const back = await pi.send({ type: "set_model", provider: "kv-elision", modelId: "smollm2-135m" });
  assert.ok(back.success, JSON.stringify(back));
  type UiEvent = { method?: string; statusText?: string };
  const want = "kv hot 3 · cold 0 · pinned 1 | attn 384/4096 | restored 1";
  await pi.waitFor((e: UiEvent) => e.method === "setStatus" && e.statusText === want, { from: mark, timeoutMs: 15_000 });
});
