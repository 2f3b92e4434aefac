// Where the extension finds the kv-elision server and contextd. Every value comes from the
// environment so the same extension file serves a user's Pi and an isolated test run.
import { existsSync } from "node:fs";
import { homedir } from "node:os";
import { join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

export const PROVIDER = "kv-elision";
export const STATUS_KEY = "kv-elision";
export const DEFAULT_URL = "http://127.0.0.1:8088/v1";
export const DEFAULT_MODEL_ID = "smollm2-135m";
// Pi compacts when context tokens exceed contextWindow - reserveTokens, and treats usage above
// contextWindow as an overflow (dropping the answer). A paging server has no such wall: it reports
// the addressable session as its window, and a model without a reported window gets the same.
export const DEFAULT_CONTEXT_WINDOW = 1_000_000;
// Pi treats a `length` stop below the model's maxTokens as a truncated attempt: it omits that
// answer from later requests and tries to compact. So maxTokens must be the server's own cap
// (its max_output_tokens); without a reported one, the cap `kv-elision serve` starts with.
export const DEFAULT_MAX_TOKENS = 1024;
// Reading /v1/models happens while Pi starts up; a dead or black-holed server must not stall it.
export const MODELS_TIMEOUT_MS = 2000;
// A local server needs no key; one behind a key gets it from this variable. Without it the
// provider sends API_KEY_NONE, since Pi's OpenAI client refuses to send a request with no key.
export const API_KEY_ENV = "KV_ELISION_API_KEY";
export const API_KEY_NONE = "kv-elision";

const EXTENSION_DIR = resolve(fileURLToPath(new URL(".", import.meta.url)), "..");

export interface KvConfig {
  url: string;
  socketPath: string;
  protoPath: string;
  // The bearer token for a server started with --api-key (KV_ELISION_API_KEY); undefined: none.
  apiKey?: string;
}

export function apiKey(env: NodeJS.ProcessEnv = process.env): string | undefined {
  return env[API_KEY_ENV]?.trim() || undefined;
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

// In the repository the proto sits next to the extension (../proto); `npm pack` copies it into
// the package (proto/), so an installed package finds its own. KV_ELISION_PROTO overrides both.
export function protoPath(env: NodeJS.ProcessEnv = process.env, extensionDir: string = EXTENSION_DIR): string {
  if (env.KV_ELISION_PROTO) return env.KV_ELISION_PROTO;
  const packaged = join(extensionDir, "proto", "contextd.proto");
  return existsSync(packaged) ? packaged : join(extensionDir, "..", "proto", "contextd.proto");
}

export function loadConfig(env: NodeJS.ProcessEnv = process.env): KvConfig {
  return { url: serverUrl(env), socketPath: socketPath(env), protoPath: protoPath(env), apiKey: apiKey(env) };
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
