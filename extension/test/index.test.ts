// The extension's wiring, with a stand-in for Pi's ExtensionAPI: what it registers, which
// compactions it cancels, and what it tells the user.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { test } from "node:test";
import type { ExtensionAPI, ProviderConfig } from "@mariozechner/pi-coding-agent";
import kvElision from "../index.ts";
import { COMPACTION_NOTICE, shouldCancelCompaction } from "../src/compaction.ts";

type Handler = (event: unknown, ctx: unknown) => unknown;

interface Harness {
  providers: Map<string, ProviderConfig>;
  handlers: Map<string, Handler[]>;
  emit(event: string, payload: unknown, ctx: unknown): unknown;
}

async function load(env: Record<string, string>): Promise<Harness> {
  const providers = new Map<string, ProviderConfig>();
  const handlers = new Map<string, Handler[]>();
  const pi = {
    registerProvider: (name: string, config: ProviderConfig) => providers.set(name, config),
    on: (event: string, handler: Handler) => handlers.set(event, [...(handlers.get(event) ?? []), handler]),
  } as unknown as ExtensionAPI;
  const saved = { ...process.env };
  Object.assign(process.env, env);
  try {
    await kvElision(pi);
  } finally {
    process.env = saved;
  }
  return {
    providers,
    handlers,
    emit: (event, payload, ctx) => {
      let result: unknown;
      for (const handler of handlers.get(event) ?? []) result = handler(payload, ctx) ?? result;
      return result;
    },
  };
}

async function deadUrl(): Promise<string> {
  const probe = createServer();
  await new Promise<void>((r) => probe.listen(0, "127.0.0.1", r));
  const { port } = probe.address() as AddressInfo;
  await new Promise((r) => probe.close(r));
  return `http://127.0.0.1:${port}/v1`;
}

function uiContext(provider: string | undefined, hasUI = true) {
  const notes: Array<[string, string | undefined]> = [];
  const statuses: Array<string | undefined> = [];
  return {
    notes,
    statuses,
    ctx: {
      hasUI,
      model: provider ? { provider, id: "m" } : undefined,
      sessionManager: { getSessionId: () => "session-1" },
      ui: {
        notify: (message: string, level?: string) => notes.push([message, level]),
        setStatus: (_key: string, text: string | undefined) => statuses.push(text),
      },
    },
  };
}

test("compaction is cancelled for kv-elision only", () => {
  assert.equal(shouldCancelCompaction("kv-elision"), true);
  assert.equal(shouldCancelCompaction("anthropic"), false);
  assert.equal(shouldCancelCompaction("openai"), false);
  assert.equal(shouldCancelCompaction(undefined), false);
});

test("with the server down, Pi still starts: default model, openai-completions, no hang", async () => {
  const started = Date.now();
  const pi = await load({ KV_ELISION_URL: await deadUrl() });
  assert.ok(Date.now() - started < 3000);
  const config = pi.providers.get("kv-elision");
  assert.ok(config);
  assert.equal(config.api, "openai-completions");
  assert.equal(typeof config.streamSimple, "function");
  assert.deepEqual(config.models?.map((m) => [m.id, m.contextWindow]), [["smollm2-135m", 1_000_000]]);
});

test("session_before_compact: cancel for kv-elision, leave other providers alone", async () => {
  const pi = await load({ KV_ELISION_URL: await deadUrl() });
  assert.deepEqual(pi.emit("session_before_compact", {}, uiContext("kv-elision").ctx), { cancel: true });
  assert.equal(pi.emit("session_before_compact", {}, uiContext("anthropic").ctx), undefined);
  assert.equal(pi.emit("session_before_compact", {}, uiContext(undefined).ctx), undefined);
});

test("the user is told once about compaction and once that the server is down", async () => {
  const pi = await load({ KV_ELISION_URL: await deadUrl(), KV_ELISION_SOCKET: join(tmpdir(), "kv-none.sock") });
  const ui = uiContext("kv-elision");
  pi.emit("session_start", { reason: "startup" }, ui.ctx);
  pi.emit("session_before_compact", {}, ui.ctx);
  pi.emit("model_select", { model: { provider: "kv-elision" } }, ui.ctx);
  assert.deepEqual(ui.notes.map(([m]) => m.slice(0, 40)), [COMPACTION_NOTICE.slice(0, 40), "kv-elision: server not reachable (GET ht"]);
  assert.match(ui.notes[1]![0], /ECONNREFUSED.*Start it with: kv-elision serve --model smollm2-135m/);
  assert.equal(ui.notes[1]![1], "warning");
  pi.emit("session_shutdown", {}, ui.ctx);
});

test("other providers hear nothing and get no status line", async () => {
  const pi = await load({ KV_ELISION_URL: await deadUrl() });
  const ui = uiContext("anthropic");
  pi.emit("session_start", { reason: "startup" }, ui.ctx);
  pi.emit("after_provider_response", { status: 200, headers: { "x-kv-rebuilt": "history-diverged" } }, ui.ctx);
  assert.deepEqual(ui.notes, []);
  assert.deepEqual(ui.statuses, []);
});

test("the status line comes up, and is cleared when the user switches provider", async () => {
  const socket = join(tmpdir(), `kv-none-${process.pid}.sock`);
  const pi = await load({ KV_ELISION_URL: await deadUrl(), KV_ELISION_SOCKET: socket });
  const ui = uiContext("kv-elision");
  pi.emit("session_start", { reason: "startup" }, ui.ctx);
  for (let i = 0; i < 250 && ui.statuses.length === 0; i++) await new Promise((r) => setTimeout(r, 20));
  assert.deepEqual(ui.statuses, [`kv contextd down (${socket})`]);
  pi.emit("model_select", { model: { provider: "anthropic" } }, ui.ctx);
  assert.deepEqual(ui.statuses, [`kv contextd down (${socket})`, undefined]);
});

test("a rebuild reported by the server is shown", async () => {
  const pi = await load({ KV_ELISION_URL: await deadUrl() });
  const ui = uiContext("kv-elision", false);
  const written: string[] = [];
  const write = process.stderr.write;
  process.stderr.write = ((chunk: string) => written.push(chunk) > 0) as typeof process.stderr.write;
  try {
    pi.emit("session_start", { reason: "startup" }, ui.ctx);
    pi.emit("after_provider_response", { status: 200, headers: { "x-kv-rebuilt": "history-diverged" } }, ui.ctx);
    pi.emit("session_before_compact", {}, ui.ctx);
  } finally {
    process.stderr.write = write;
  }
  // No UI (print and json modes): everything goes to stderr, the compaction notice once.
  assert.equal(written.filter((w) => w.startsWith("kv-elision: Pi's compaction is off")).length, 1);
  assert.ok(written.includes("kv-elision rebuilt the KV cache: history-diverged\n"));
  assert.deepEqual(ui.notes, []);
});
