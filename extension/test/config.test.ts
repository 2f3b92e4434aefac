import assert from "node:assert/strict";
import { existsSync, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { test } from "node:test";
import { findApiKey, keyFilePath, protoPath, serveHint, serverUrl, socketPath } from "../src/config.ts";

test("server URL from KV_ELISION_URL, default 127.0.0.1:8088, no trailing slash", () => {
  assert.equal(serverUrl({}), "http://127.0.0.1:8088/v1");
  assert.equal(serverUrl({ KV_ELISION_URL: "http://box:9000/v1/" }), "http://box:9000/v1");
});

test("socket path follows contextd's own default", () => {
  assert.equal(socketPath({ KV_ELISION_SOCKET: "/x/s.sock", XDG_RUNTIME_DIR: "/run/u" }, "/home/u"), "/x/s.sock");
  assert.equal(socketPath({ XDG_RUNTIME_DIR: "/run/u" }, "/home/u"), "/run/u/kv-elision/contextd.sock");
  assert.equal(socketPath({}, "/home/u"), "/home/u/.local/state/kv-elision/run/contextd.sock");
  assert.equal(socketPath({ XDG_STATE_HOME: "/st" }, "/home/u"), "/st/kv-elision/run/contextd.sock");
  assert.equal(socketPath({ KV_ELISION_ROOT: "/data/kv" }, "/home/u"), "/data/kv/run/contextd.sock");
});

test("the proto is found in the repository next to the extension", () => {
  assert.equal(protoPath({}), resolve(import.meta.dirname, "..", "..", "proto", "contextd.proto"));
  assert.ok(existsSync(protoPath({})), protoPath({}));
  assert.equal(protoPath({ KV_ELISION_PROTO: "/p/c.proto" }), "/p/c.proto");
});

test("an installed package uses the proto `npm pack` put into it", () => {
  const installed = mkdtempSync(join(tmpdir(), "kv-pkg-"));
  try {
    assert.equal(protoPath({}, installed), join(installed, "..", "proto", "contextd.proto"));
    mkdirSync(join(installed, "proto"));
    writeFileSync(join(installed, "proto", "contextd.proto"), "");
    assert.equal(protoPath({}, installed), join(installed, "proto", "contextd.proto"));
  } finally {
    rmSync(installed, { recursive: true, force: true });
  }
});

test("the start hint uses the URL's port", () => {
  assert.equal(serveHint("m", "http://127.0.0.1:9000/v1"), "kv-elision serve --model m --budget 4096 --root DIR --port 9000");
});

// `kv-elision serve` makes its key in ROOT/api-key, ROOT being its --root, which defaults to
// contextd's default root: the extension looks where the server it talks to put it.
test("the key file is the server's ROOT/api-key, the root resolved as contextd resolves it", () => {
  assert.equal(keyFilePath({}, "/home/u"), "/home/u/.local/state/kv-elision/api-key");
  assert.equal(keyFilePath({ XDG_STATE_HOME: "/st" }, "/home/u"), "/st/kv-elision/api-key");
  assert.equal(keyFilePath({ KV_ELISION_ROOT: "/data/kv", XDG_STATE_HOME: "/st" }, "/home/u"), "/data/kv/api-key");
  assert.equal(keyFilePath({ KV_ELISION_KEY_FILE: "/k/key", KV_ELISION_ROOT: "/data/kv" }, "/home/u"), "/k/key");
});

test("the API key: KV_ELISION_API_KEY (blank: none), else the key file, else none and where it looked", async () => {
  const home = mkdtempSync(join(tmpdir(), "kv-home-"));
  try {
    const file = join(home, ".local", "state", "kv-elision", "api-key");
    assert.deepEqual(await findApiKey({}, home), { source: `KV_ELISION_API_KEY or ${file}` });
    mkdirSync(join(home, ".local", "state", "kv-elision"), { recursive: true });
    writeFileSync(file, "k-file\n", { mode: 0o600 });
    assert.deepEqual(await findApiKey({}, home), { key: "k-file", source: file });
    assert.deepEqual(await findApiKey({ KV_ELISION_API_KEY: "  " }, home), { key: "k-file", source: file });
    assert.deepEqual(await findApiKey({ KV_ELISION_API_KEY: " k-1 " }, home), { key: "k-1", source: "KV_ELISION_API_KEY" });
    writeFileSync(file, " \n");
    assert.deepEqual(await findApiKey({}, home), { source: `KV_ELISION_API_KEY or ${file}` });
  } finally {
    rmSync(home, { recursive: true, force: true });
  }
});
