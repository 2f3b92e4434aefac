// Where the extension finds the kv-elision server and contextd. Every value comes from the
// environment so the same extension file serves a user's Pi and an isolated test run.
import { homedir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const PROVIDER = "kv-elision";
export const STATUS_KEY = "kv-elision";
export const DEFAULT_URL = "http://127.0.0.1:8088/v1";
export const DEFAULT_MODEL_ID = "smollm2-135m";
// Pi compacts when context tokens exceed contextWindow - reserveTokens, and treats usage above
// contextWindow as an overflow (dropping the answer). A paging server has no such wall, so a
// model without a reported window gets one far beyond anything a session reaches.
export const DEFAULT_CONTEXT_WINDOW = 1_000_000;
export const DEFAULT_MAX_TOKENS = 4096;
// Reading /v1/models happens while Pi starts up; a dead or black-holed server must not stall it.
export const MODELS_TIMEOUT_MS = 2000;
// Pi resolves apiKey as an env var name first and sends the name itself when the var is unset;
// a local server ignores it, a server behind a key reads it from this variable.
export const API_KEY_ENV = "KV_ELISION_API_KEY";

const EXTENSION_DIR = resolve(fileURLToPath(new URL(".", import.meta.url)), "..");

export interface KvConfig {
  url: string;
  socketPath: string;
  protoPath: string;
}

export function serverUrl(env: NodeJS.ProcessEnv = process.env): string {
  const raw = env.KV_ELISION_URL?.trim() || DEFAULT_URL;
  return raw.replace(/\/+$/, "");
}

// Mirrors contextd/paths.py default_socket(), so both sides agree without configuration.
export function socketPath(env: NodeJS.ProcessEnv = process.env, home: string = homedir()): string {
  if (env.KV_ELISION_SOCKET) return env.KV_ELISION_SOCKET;
  if (env.XDG_RUNTIME_DIR) return join(env.XDG_RUNTIME_DIR, "kv-elision", "contextd.sock");
  const state = env.XDG_STATE_HOME || join(home, ".local", "state");
  const root = env.KV_ELISION_ROOT || join(state, "kv-elision");
  return join(root, "run", "contextd.sock");
}

// The proto lives next to the extension in the repository; KV_ELISION_PROTO serves a copy of
// the extension that was moved out of the checkout.
export function protoPath(env: NodeJS.ProcessEnv = process.env): string {
  return env.KV_ELISION_PROTO || join(EXTENSION_DIR, "..", "proto", "contextd.proto");
}

export function loadConfig(env: NodeJS.ProcessEnv = process.env): KvConfig {
  return { url: serverUrl(env), socketPath: socketPath(env), protoPath: protoPath(env) };
}

export function serveHint(modelId: string, url: string): string {
  const port = portOf(url);
  return `kv-elision serve --model ${modelId} --budget 4096 --root DIR --port ${port}`;
}

function portOf(url: string): string {
  try {
    const parsed = new URL(url);
    return parsed.port || (parsed.protocol === "https:" ? "443" : "80");
  } catch {
    return "8088";
  }
}
