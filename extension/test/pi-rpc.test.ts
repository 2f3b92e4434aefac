// The real Pi 0.73.1 in RPC mode, through the harness, with a real contextd and no kv-elision
// server: Pi loads the extension, reports the dead server, cancels nothing it should not, and
// shows contextd's view of this very Pi session in the status line.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { after, before, test } from "node:test";
import type * as grpc from "@grpc/grpc-js";
import { callContextd } from "../src/contextd.ts";
import { Contextd } from "./helpers/contextd.ts";
import { startPi, statusTexts, uiRequests, type PiRpc } from "./pi-harness.mjs";

const contextd = new Contextd();
let client: grpc.Client;
let pi: PiRpc;
let deadUrl: string;

before(async () => {
  await contextd.start();
  client = contextd.client();
  const probe = createServer();
  await new Promise<void>((r) => probe.listen(0, "127.0.0.1", r));
  deadUrl = `http://127.0.0.1:${(probe.address() as AddressInfo).port}/v1`;
  await new Promise((r) => probe.close(r));
  pi = await startPi({
    env: { KV_ELISION_URL: deadUrl, KV_ELISION_SOCKET: contextd.socket },
    settings: { retry: { enabled: false } }, // one failed request, not three retries
  });
});

after(async () => {
  await pi?.close();
  client?.close();
  await contextd.dispose();
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
    pages: [0, 1, 2].map((i) => ({ page_id: `p${i}`, index: i, token_start: i * 128, token_end: (i + 1) * 128, state: i === 0 ? "PINNED" : "HOT" })),
  });
  await callContextd(client, "UpdateSession", { session_id: sessionId, attention_tokens: 384, counters: { restored_pages_turn: 1 } });
  const want = "kv hot 2 · cold 0 · pinned 1 | attn 384/4096 | restored 1";
  await pi.waitFor((e: UiEvent) => e.method === "setStatus" && e.statusText === want, { timeoutMs: 15_000 });
  assert.equal(statusTexts(pi.events).at(-1), want);
});

test("a prompt with the server down ends in a clear error, not a hang", async () => {
  const turn = await pi.prompt("hello", { timeoutMs: 60_000 });
  assert.equal(turn.assistant?.stopReason, "error");
  assert.match(turn.assistant?.errorMessage ?? "", new RegExp(`kv-elision server not reachable at ${deadUrl}`));
  assert.deepEqual(turn.events.filter((e: { type: string }) => e.type.startsWith("compaction")), []);
});
