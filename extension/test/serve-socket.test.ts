// The status line must find the contextd that `kv-elision serve` started for itself, with no
// configuration but the root: the extension's socketPath() and the server's choice of socket
// (contextd/paths.py default_socket) are one rule. A real server on the tiny model, started as a
// user would (no --socket, no XDG_RUNTIME_DIR), and the extension's own gRPC client on the path
// the extension computes.
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import { socketPath } from "../src/config.ts";
import { callContextd, connectContextd } from "../src/contextd.ts";
import { PROTO, REPO_DIR, pythonPath } from "./helpers/contextd.ts";

const START_MS = 180_000; // a cold start imports torch and loads the tiny model on a busy machine
const ANSWER_MS = 10_000; // a contextd already serving answers at once

// Polls `found` until it gives a value, failing with `why()` past `ms`.
async function until<T>(ms: number, found: () => Promise<T | undefined>, why: () => string): Promise<T> {
  const deadline = Date.now() + ms;
  for (;;) {
    const value = await found();
    if (value !== undefined) return value;
    if (Date.now() > deadline) throw new Error(why());
    await new Promise((r) => setTimeout(r, 200));
  }
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const probe = createServer();
    probe.once("error", reject);
    probe.listen(0, "127.0.0.1", () => {
      const address = probe.address();
      probe.close(() => (typeof address === "object" && address ? resolve(address.port) : reject(new Error("no port"))));
    });
  });
}

test("the socket the extension looks at is where `kv-elision serve` started its contextd", async () => {
  const root = mkdtempSync(join(tmpdir(), "kv-serve-"));
  const env: NodeJS.ProcessEnv = { ...process.env, KV_ELISION_ROOT: root };
  for (const name of ["XDG_RUNTIME_DIR", "KV_ELISION_SOCKET", "KV_ELISION_API_KEY"]) delete env[name];
  const port = await freePort();
  const child = spawn(
    pythonPath(),
    ["-m", "serving.cli", "serve", "--model", "tiny-llama", "--budget", "1024", "--tail-tokens", "256",
     "--root", root, "--port", String(port)],
    { cwd: REPO_DIR, env, stdio: ["ignore", "pipe", "pipe"] },
  );
  let log = "";
  child.stdout?.on("data", (chunk: Buffer) => (log += chunk.toString()));
  child.stderr?.on("data", (chunk: Buffer) => (log += chunk.toString()));
  const exited = new Promise((r) => child.once("exit", r));
  const where = socketPath({ KV_ELISION_ROOT: root });
  try {
    // The server starts (or finds) its contextd before it listens: once /health answers, the
    // contextd is up, and the only question is where.
    await until(START_MS, async () => {
      if (child.exitCode !== null) throw new Error(`kv-elision serve exited with ${child.exitCode}:\n${log}`);
      const health = await fetch(`http://127.0.0.1:${port}/health`).catch(() => undefined);
      return health?.ok ? true : undefined;
    }, () => `kv-elision serve did not answer /health within ${START_MS} ms:\n${log}`);
    const status = await until(ANSWER_MS, async () => {
      if (!existsSync(where)) return undefined;
      const client = connectContextd(PROTO, where);
      try {
        return await callContextd<{ root: string; pid: number }>(client, "Status", {}, 1000);
      } catch {
        return undefined; // bound, not serving yet
      } finally {
        client.close();
      }
    }, () => `no contextd answered on ${where} (the server's log:\n${log})`);
    assert.equal(status.root, join(root, "contextd"), "another contextd answered there");
    assert.notEqual(status.pid, child.pid);
  } finally {
    child.kill("SIGTERM");
    await exited;
    rmSync(root, { recursive: true, force: true });
  }
});
