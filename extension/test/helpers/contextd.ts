// Starts a real contextd (the Python daemon from this repository) in a temporary root, for the
// tests that talk gRPC to it. The interpreter comes from KV_ELISION_PYTHON, else the repository's
// virtual environment that `make` bootstraps.
import { spawn, type ChildProcess } from "node:child_process";
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import type * as grpc from "@grpc/grpc-js";
import { callContextd, connectContextd } from "../../src/contextd.ts";

const EXTENSION_DIR = resolve(dirname(fileURLToPath(import.meta.url)), "..", "..");
export const REPO_DIR = resolve(EXTENSION_DIR, "..");
export const PROTO = join(REPO_DIR, "proto", "contextd.proto");

export function pythonPath(): string {
  return process.env.KV_ELISION_PYTHON || resolve(EXTENSION_DIR, "../.venv/bin/python");
}

export class Contextd {
  readonly root: string;
  readonly socket: string;
  private child: ChildProcess | undefined;
  private log = "";

  constructor() {
    this.root = mkdtempSync(join(tmpdir(), "kv-ctxd-"));
    this.socket = join(this.root, "s.sock");
  }

  async start(timeoutMs = 30_000): Promise<void> {
    const python = pythonPath();
    if (!existsSync(python)) {
      throw new Error(`no Python at ${python}: run \`make\` at the repository root or set KV_ELISION_PYTHON`);
    }
    const child = spawn(
      python,
      ["-m", "contextd.cli", "serve", "--root", this.root, "--socket", this.socket, "--reserve-bytes", "0"],
      { cwd: REPO_DIR, stdio: ["ignore", "pipe", "pipe"] },
    );
    this.child = child;
    child.stdout?.on("data", (chunk: Buffer) => (this.log += chunk.toString()));
    child.stderr?.on("data", (chunk: Buffer) => (this.log += chunk.toString()));
    const deadline = Date.now() + timeoutMs;
    while (Date.now() < deadline) {
      if (child.exitCode !== null) throw new Error(`contextd exited with ${child.exitCode}:\n${this.log}`);
      if (existsSync(this.socket)) {
        const client = this.client();
        try {
          await callContextd(client, "Status", {}, 1000);
          return;
        } catch {
          // bound but not serving yet
        } finally {
          client.close();
        }
      }
      await new Promise((r) => setTimeout(r, 100));
    }
    throw new Error(`contextd did not come up within ${timeoutMs} ms:\n${this.log}`);
  }

  client(): grpc.Client {
    return connectContextd(PROTO, this.socket);
  }

  // SIGKILL by default: the status line must survive contextd dying without a goodbye.
  async stop(signal: NodeJS.Signals = "SIGKILL"): Promise<void> {
    const child = this.child;
    this.child = undefined;
    if (!child || child.exitCode !== null || child.signalCode !== null) return;
    const exited = new Promise((r) => child.once("exit", r));
    child.kill(signal);
    await exited;
  }

  async dispose(): Promise<void> {
    await this.stop();
    rmSync(this.root, { recursive: true, force: true });
  }
}

// What the server writes at the end of a turn, reduced to what the status line shows.
export async function writeRecord(
  client: grpc.Client,
  sessionId: string,
  record: { attention_tokens: number; counters: Record<string, number> },
): Promise<void> {
  await callContextd(client, "WriteRecord", { session_id: sessionId, record });
}
