// The status line in Pi 1.6's interactive TUI, as a user sees it: the real Pi in a tmux pane
// (160x40) with kv-elision selected and a real contextd, read back with `tmux capture-pane`.
// test/fixtures/tui-session.txt is such a capture from a real session against `kv-elision serve`
// (SmolLM2-135M, two prompts); the live captures here must have the same footer: Pi's working
// directory, its stats line ending in the model, then the kv-elision status on its own line.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { after, before, test } from "node:test";
import type * as grpc from "@grpc/grpc-js";
import { callContextd } from "../src/contextd.ts";
import { Contextd, writeRecord } from "./helpers/contextd.ts";
import { deadUrl } from "./helpers/recording-server.ts";
import { DEFAULT_EXTENSION, DEFAULT_PI, piEnv } from "./pi-harness.mjs";

const FIXTURE = join(import.meta.dirname, "fixtures", "tui-session.txt");
const STATUS = /^kv hot \d+ · cold \d+ · pinned \d+ \| attn \d+\/\d+ \| restored \d+$/;
const MODEL = "smollm2-135m";

interface Footer {
  cwd: string;
  stats: string;
  status: string;
}

// The last three non-empty lines of a capture.
function footer(capture: string): Footer {
  const lines = capture.split("\n").map((line) => line.trimEnd()).filter((line) => line !== "");
  const [cwd = "", stats = "", status = ""] = lines.slice(-3);
  return { cwd, stats, status };
}

function tmuxAvailable(): void {
  try {
    execFileSync("tmux", ["-V"], { stdio: "ignore" });
  } catch {
    throw new Error("tmux is needed for the TUI tests: apt-get install -y tmux");
  }
}

const contextd = new Contextd();
let client: grpc.Client;
let url: string;

before(async () => {
  tmuxAvailable();
  await contextd.start();
  client = contextd.client();
  url = await deadUrl();
});

after(async () => {
  client?.close();
  await contextd.dispose();
});

test("the fixture: a real session's footer ends in the kv status line under Pi's stats line", () => {
  const { cwd, stats, status } = footer(readFileSync(FIXTURE, "utf8"));
  assert.match(cwd, /^\/tmp\//);
  assert.ok(stats.endsWith(MODEL), stats);
  assert.match(stats, /0\.\d%\/1\.0M/, "the server's 1,000,000-token window, barely used");
  assert.match(status, STATUS);
});

// One Pi TUI in its own tmux server (a socket of its own, ended with kill-server).
async function liveFooter(name: string, args: string[], settings: object): Promise<void> {
  const dir = mkdtempSync(join(tmpdir(), "kv-tui-"));
  const agentDir = join(dir, "agent");
  const cwd = join(dir, "cwd");
  mkdirSync(agentDir);
  mkdirSync(cwd);
  writeFileSync(join(agentDir, "settings.json"), JSON.stringify(settings));
  const socket = `kv-tui-${process.pid}-${name}`;
  const tmux = (...tmuxArgs: string[]): string => execFileSync("tmux", ["-L", socket, ...tmuxArgs], { encoding: "utf8" });
  const sessionId = randomUUID();
  const env = piEnv({ PI_CODING_AGENT_DIR: agentDir, KV_ELISION_URL: url, KV_ELISION_SOCKET: contextd.socket });
  const pi = [DEFAULT_PI, "--offline", "-ne", "-e", DEFAULT_EXTENSION, "--provider", "kv-elision", "--model", MODEL,
    "--session-id", sessionId, ...args];
  const capture = (): string => tmux("capture-pane", "-p", "-t", "pi");
  const until = async (want: string): Promise<Footer> => {
    const deadline = Date.now() + 30_000;
    for (;;) {
      const seen = footer(capture());
      if (seen.status === want) return seen;
      if (Date.now() > deadline) throw new Error(`status line never became ${JSON.stringify(want)}:\n${capture()}`);
      await new Promise((r) => setTimeout(r, 200));
    }
  };
  try {
    tmux("new-session", "-d", "-x", "160", "-y", "40", "-s", "pi", "-c", cwd, "env", "-i",
      ...Object.entries(env).map(([k, v]) => `${k}=${v}`), ...pi);
    await until("kv ready · no pages yet");
    await callContextd(client, "OpenSession", { session_id: sessionId, model_id: MODEL, budget_tokens: 4096 });
    await callContextd(client, "UpsertPages", {
      session_id: sessionId,
      pages: [0, 1, 2].map((i) => ({ page_id: `p${i}`, index: i, token_start: i * 128, token_end: (i + 1) * 128, state: "HOT" })),
    });
    await callContextd(client, "SetPins", { session_id: sessionId, add: [{ page_id: "p0", kind: "system" }] });
    await writeRecord(client, sessionId, { attention_tokens: 384, counters: { restored_pages_turn: 1 } });
    const live = await until("kv hot 3 · cold 0 · pinned 1 | attn 384/4096 | restored 1");
    assert.match(live.status, STATUS);
    assert.ok(live.stats.endsWith(MODEL), live.stats);
    assert.equal(live.cwd, cwd);
  } finally {
    try {
      tmux("kill-server");
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }
}

test("live: the status line in the default theme", () => liveFooter("system", [], {}));
test("live: the status line in the light theme", () => liveFooter("light", ["--use-theme", "light"], {}));
test("live: the status line in the dark theme, regular (not fullscreen) TUI", () =>
  liveFooter("regular", ["--use-theme", "dark"], { tuiMode: "regular" }));
