// The status line against a real contextd process: a session written through gRPC shows up in
// the watcher's text, contextd dying shows as down, and a restarted contextd is found again.
// (Cold pages need payloads in contextd's store, which only the server writes; their count is
// covered by status.test.ts and by tests/e2e/test_pi.py against the real server.)
import assert from "node:assert/strict";
import { after, before, test } from "node:test";
import type * as grpc from "@grpc/grpc-js";
import { callContextd } from "../src/contextd.ts";
import { downText } from "../src/status.ts";
import { StatusWatcher } from "../src/watcher.ts";
import { Contextd, PROTO, writeRecord } from "./helpers/contextd.ts";

const SESSION = "019a-pi-session";
const contextd = new Contextd();
let client: grpc.Client;

function page(index: number, state: string): object {
  return { page_id: `p${index}`, index, token_start: index * 128, token_end: (index + 1) * 128, original_position: index * 128, state };
}

// Collects every text the watcher shows and lets a test wait for a particular one.
class Texts {
  readonly seen: string[] = [];
  private waiters: Array<() => void> = [];
  push = (text: string): void => {
    this.seen.push(text);
    for (const w of this.waiters.splice(0)) w();
  };
  async until(want: string | RegExp, timeoutMs = 15_000): Promise<string> {
    const deadline = Date.now() + timeoutMs;
    for (;;) {
      const last = this.seen.at(-1);
      if (last !== undefined && (typeof want === "string" ? last === want : want.test(last))) return last;
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`status never became ${want}; saw ${JSON.stringify(this.seen)}`);
      await new Promise<void>((r) => {
        const timer = setTimeout(r, left);
        this.waiters.push(() => {
          clearTimeout(timer);
          r();
        });
      });
    }
  }
}

before(async () => {
  await contextd.start();
  client = contextd.client();
});

after(async () => {
  client?.close();
  await contextd.dispose();
});

test("status text follows the session contextd holds for this Pi session", async () => {
  const texts = new Texts();
  const watcher = new StatusWatcher({ socketPath: contextd.socket, protoPath: PROTO, sessionId: SESSION, onText: texts.push, maxBackoffMs: 500 });
  watcher.start();
  try {
    await texts.until("kv ready · no pages yet");

    await callContextd(client, "OpenSession", { session_id: SESSION, model_id: "smollm2-135m", budget_tokens: 4096 });
    await callContextd(client, "OpenSession", { session_id: "someone-else", model_id: "smollm2-135m", budget_tokens: 4096 });
    await callContextd(client, "UpsertPages", { session_id: SESSION, pages: [0, 1, 2, 3].map((i) => page(i, "HOT")) });
    await callContextd(client, "SetPins", { session_id: SESSION, add: [{ page_id: "p3", kind: "system" }] });
    await writeRecord(client, SESSION, { attention_tokens: 384, counters: { restored_pages_turn: 2 } });
    await texts.until("kv hot 4 · cold 0 · pinned 1 | attn 384/4096 | restored 2");

    await writeRecord(client, SESSION, { attention_tokens: 384, counters: { restored_pages_turn: 0 } });
    await texts.until("kv hot 4 · cold 0 · pinned 1 | attn 384/4096 | restored 0");
    assert.ok(texts.seen.every((t, i) => i === 0 || t !== texts.seen[i - 1]), "only changes are shown");

    await contextd.stop("SIGKILL");
    await texts.until(downText(contextd.socket));

    await contextd.start();
    await texts.until("kv hot 4 · cold 0 · pinned 1 | attn 384/4096 | restored 0");
  } finally {
    watcher.stop();
  }
});

test("no contextd at all: the watcher says where it looked and keeps trying quietly", async () => {
  const texts = new Texts();
  const missing = `${contextd.root}/nowhere.sock`;
  const watcher = new StatusWatcher({ socketPath: missing, protoPath: PROTO, sessionId: SESSION, onText: texts.push, minBackoffMs: 20, maxBackoffMs: 40 });
  watcher.start();
  try {
    await texts.until(downText(missing), 5000);
    await new Promise((r) => setTimeout(r, 300)); // several retries
    assert.deepEqual(texts.seen, [downText(missing)]);
  } finally {
    watcher.stop();
  }
});

test("a proto that cannot be loaded is reported once, not retried", async () => {
  const texts = new Texts();
  const watcher = new StatusWatcher({ socketPath: contextd.socket, protoPath: "/nonexistent/contextd.proto", sessionId: SESSION, onText: texts.push });
  watcher.start();
  try {
    await texts.until(/^kv status unavailable: /, 2000);
  } finally {
    watcher.stop();
  }
});
