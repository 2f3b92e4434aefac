import assert from "node:assert/strict";
import { test } from "node:test";
import { downText, formatSession, statusText } from "../src/status.ts";

const session = {
  session_id: "s1",
  budget_tokens: 4096,
  attention_tokens: 3968,
  pages: { hot: 25, cold: 440, pinned: 6, dropped: 0, corrupt: 0 },
  counters: { restored_pages_turn: 2, prefill_tokens_turn: 80 },
};

test("a session's pages, attention and restores on one line", () => {
  assert.equal(formatSession(session), "kv hot 25 · cold 440 · pinned 6 | attn 3968/4096 | restored 2");
});

test("missing counters and pages read as zero; no budget shows attention alone", () => {
  assert.equal(formatSession({ session_id: "s1", attention_tokens: 10 }), "kv hot 0 · cold 0 · pinned 0 | attn 10 | restored 0");
});

test("dropped and corrupt pages are shown only when there are some", () => {
  const text = formatSession({ ...session, pages: { ...session.pages, dropped: 3, corrupt: 1 } });
  assert.equal(text, "kv hot 25 · cold 440 · pinned 6 | attn 3968/4096 | restored 2 | dropped 3 | corrupt 1");
});

test("64-bit counters that arrive as strings are read as numbers", () => {
  assert.match(formatSession({ ...session, counters: { restored_pages_turn: "7" } }), /restored 7$/);
});

test("the Pi session is picked out of the reply; other sessions are ignored", () => {
  const reply = { sessions: [{ ...session, session_id: "other", pages: { hot: 1 } }, session] };
  assert.equal(statusText(reply, "s1"), formatSession(session));
  assert.equal(statusText(reply, "unknown"), "kv ready · no pages yet");
  assert.equal(statusText({}, "s1"), "kv ready · no pages yet");
});

test("contextd down names the socket it tried", () => {
  assert.equal(downText("/run/user/1000/kv-elision/contextd.sock"), "kv contextd down (/run/user/1000/kv-elision/contextd.sock)");
});
