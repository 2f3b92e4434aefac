import assert from "node:assert/strict";
import { test } from "node:test";
import { canonicalJson, contextHeader, fingerprintPayload, shortHash } from "../src/fingerprint.ts";

// A chat-completions body as Pi sends it: system prompt, a user text part, an assistant tool
// call (content null) and its tool result, one function tool.
const payload = {
  model: "smollm2-135m",
  stream: true,
  messages: [
    { role: "system", content: "You are Pi. Current date: 2026-01-01" },
    { role: "user", content: [{ type: "text", text: 'héllo — 日本語 "quoted"\n' }] },
    {
      role: "assistant",
      content: null,
      tool_calls: [{ id: "call_1", type: "function", function: { name: "read", arguments: '{"path":"a.txt"}' } }],
    },
    { role: "tool", content: "file body", tool_call_id: "call_1" },
  ],
  tools: [
    {
      type: "function",
      function: {
        name: "read",
        description: "Read a file",
        parameters: { type: "object", properties: { path: { type: "string" } }, required: ["path"] },
      },
    },
  ],
};

test("canonical JSON sorts keys, drops undefined members and has no whitespace", () => {
  assert.equal(canonicalJson({ b: 1, a: [true, null, "x"], c: undefined }), '{"a":[true,null,"x"],"b":1}');
  assert.equal(canonicalJson({ z: { y: 2, x: 1 } }), '{"z":{"x":1,"y":2}}');
  assert.equal(canonicalJson([undefined]), "[null]");
  assert.equal(canonicalJson("日本\n"), '"日本\\n"');
});

// Expected values computed in Python with
// sha256(json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()[:16]
// so the server can check the same vector.
test("hashes match the Python reference vector", () => {
  const fp = fingerprintPayload(payload, "off");
  assert.deepEqual(fp, {
    v: 1,
    system: "09e19b9349393bd1",
    tools: "ba9e5b11eb97657c",
    thinking: "off",
    messages: ["f45c795b6e920ace", "234d9fd0ece8aa11", "e1fff68a8b726680"],
  });
  assert.equal(shortHash([]), "4f53cda18c2baa0c");
  assert.equal(shortHash(""), "12ae32cb1ec02d01");
});

test("the header has a fixed key order and no spaces", () => {
  const header = contextHeader(fingerprintPayload(payload, "high"));
  assert.match(header, /^\{"v":1,"system":"[0-9a-f]{16}","tools":"[0-9a-f]{16}","thinking":"high","messages":\[/);
  assert.ok(!header.includes(" "));
});

test("a longer conversation extends the message list; an edit breaks the prefix", () => {
  const before = fingerprintPayload(payload, "off");
  const longer = fingerprintPayload(
    { ...payload, messages: [...payload.messages, { role: "assistant", content: "done" }] },
    "off",
  );
  assert.deepEqual(longer.messages.slice(0, before.messages.length), before.messages);
  assert.equal(longer.messages.length, before.messages.length + 1);

  const edited = structuredClone(payload);
  edited.messages[2]!.tool_calls![0]!.function.arguments = '{"path":"b.txt"}';
  const after = fingerprintPayload(edited, "off");
  assert.equal(after.messages[0], before.messages[0]);
  assert.notEqual(after.messages[1], before.messages[1]);
  assert.equal(after.system, before.system);
});

test("system, developer or no instruction message; absent tools hash as []", () => {
  const developer = fingerprintPayload(
    { messages: [{ role: "developer", content: "You are Pi. Current date: 2026-01-01" }, payload.messages[1]] },
    "off",
  );
  assert.equal(developer.system, "09e19b9349393bd1");
  assert.equal(developer.tools, shortHash([]));
  assert.deepEqual(developer.messages, ["f45c795b6e920ace"]);

  const bare = fingerprintPayload({ messages: [payload.messages[1]] }, "off");
  assert.equal(bare.system, shortHash(""));
  assert.deepEqual(bare.messages, ["f45c795b6e920ace"]);

  assert.deepEqual(fingerprintPayload(undefined, "off").messages, []);
});

test("system prompt, tools and thinking level each change their own field", () => {
  const base = fingerprintPayload(payload, "off");
  const otherSystem = structuredClone(payload);
  otherSystem.messages[0]!.content = "You are Pi. Current date: 2026-01-02";
  assert.notEqual(fingerprintPayload(otherSystem, "off").system, base.system);
  assert.notEqual(fingerprintPayload({ ...payload, tools: [] }, "off").tools, base.tools);
  assert.equal(fingerprintPayload(payload, "medium").thinking, "medium");
});
