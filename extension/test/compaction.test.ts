import assert from "node:assert/strict";
import { test } from "node:test";
import { COMPACTION_NOTICE, decideCompaction, manualCompactionNotice } from "../src/compaction.ts";

const scope = { messages: 12, tokensBefore: 5321, files: 3 };

test("automatic compaction of the kv-elision provider is cancelled, with one notice per session", () => {
  for (const reason of ["threshold", "overflow"] as const) {
    assert.deepEqual(decideCompaction("kv-elision", reason, undefined, scope), {
      action: "cancel",
      notice: COMPACTION_NOTICE,
      once: true,
    });
  }
});

test("other providers, or none, compact as Pi decides", () => {
  for (const provider of ["anthropic", "openai", undefined]) {
    for (const reason of ["threshold", "overflow", "manual"] as const) {
      assert.deepEqual(decideCompaction(provider, reason, undefined, scope), { action: "allow" });
    }
  }
});

test("a bare /compact is explained, with what it would lose, and cancelled", () => {
  for (const instructions of [undefined, "", "   "]) {
    const decision = decideCompaction("kv-elision", "manual", instructions, scope);
    assert.equal(decision.action, "cancel");
    assert.ok(decision.action === "cancel" && !decision.once, "said every time the user asks");
    assert.equal(decision.action === "cancel" && decision.notice, manualCompactionNotice(scope));
  }
  const notice = manualCompactionNotice(scope);
  assert.match(notice, /^kv-elision: \/compact is not needed here\./);
  assert.match(notice, /whole transcript \(5321 tokens\)/);
  assert.match(notice, /replace 12 earlier messages, with what was read from or written to 3 files, by a summary/);
  assert.match(notice, /\/compact <instructions>$/);
  assert.match(manualCompactionNotice({ messages: 1, tokensBefore: 10, files: 0 }), /replace 1 earlier message by a summary/);
});

test("/compact with instructions compacts: the user asked for a summary", () => {
  assert.deepEqual(decideCompaction("kv-elision", "manual", "keep the file names", scope), { action: "allow" });
});
