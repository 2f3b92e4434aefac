// Where the extension finds the kv-elision server and contextd. Every value comes from the
// environment so the same extension file serves a user's Pi and an isolated test run.
import { existsSync } from "node:fs";
import { readFile } from "node:fs/promises";
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
// Every route of `kv-elision serve` but /health wants a key (loopback is every local user). A
// server started with --api-key KEY has that one, which Pi is given in KV_ELISION_API_KEY; else
// the server makes one at its first start in ROOT/api-key (mode 0600), which the extension reads:
// KV_ELISION_KEY_FILE names the file, else it is under the root the server defaults to. With no
// key found the provider sends API_KEY_NONE (Pi's OpenAI client sends no request without a key),
// which the server refuses with a 401.
export const API_KEY_ENV = "KV_ELISION_API_KEY";
export const KEY_FILE_ENV = "KV_ELISION_KEY_FILE";
export const KEY_FILE_NAME = "api-key";
export const API_KEY_NONE = "kv-elision";

const EXTENSION_DIR = resolve(fileURLToPath(new URL(".", import.meta.url)), "..");

export interface KvConfig {
  url: string;
  socketPath: string;
  protoPath: string;
}

// The environment values the key lookup reads (Pi's auth context hands them over one by one).
export type KeyEnv = Partial<Record<"KV_ELISION_API_KEY" | "KV_ELISION_KEY_FILE" | "KV_ELISION_ROOT" | "XDG_STATE_HOME", string>>;

export interface FoundKey {
  key?: string;
  // Where the key came from; without one, where it was looked for.
  source: string;
}

// Read at every use, so a server that made a new key since Pi started is still answered.
export async function findApiKey(env: KeyEnv = process.env, home: string = homedir()): Promise<FoundKey> {
  const fromEnv = env.KV_ELISION_API_KEY?.trim();
  if (fromEnv) return { key: fromEnv, source: API_KEY_ENV };
  const file = keyFilePath(env, home);
  let key: string | undefined;
  try {
    key = (await readFile(file, "utf8")).trim() || undefined;
  } catch {
    key = undefined; // no file (another root, a server given --api-key) or not this user's to read
  }
  return key ? { key, source: file } : { source: `${API_KEY_ENV} or ${file}` };
}

export function keyFilePath(env: KeyEnv = process.env, home: string = homedir()): string {
  return env.KV_ELISION_KEY_FILE || join(stateRoot(env, home), KEY_FILE_NAME);
}

export function serverUrl(env: NodeJS.ProcessEnv = process.env): string {
  const raw = env.KV_ELISION_URL?.trim() || DEFAULT_URL;
  return raw.replace(/\/+$/, "");
}

// Mirrors contextd/paths.py default_root(): the --root `kv-elision serve` defaults to.
export function stateRoot(env: KeyEnv = process.env, home: string = homedir()): string {
  const state = env.XDG_STATE_HOME || join(home, ".local", "state");
  return env.KV_ELISION_ROOT || join(state, "kv-elision");
}

// Mirrors contextd/paths.py default_socket(), so both sides agree without configuration: ROOT is
// the server's --root (the contextd it starts keeps its data in ROOT/contextd, its socket here).
export function socketPath(env: NodeJS.ProcessEnv = process.env, home: string = homedir()): string {
  if (env.KV_ELISION_SOCKET) return env.KV_ELISION_SOCKET;
  if (env.XDG_RUNTIME_DIR) return join(env.XDG_RUNTIME_DIR, "kv-elision", "contextd.sock");
  return join(stateRoot(env, home), "run", "contextd.sock");
}

// In the repository the proto sits next to the extension (../proto); `npm pack` copies it into
// the package (proto/), so an installed package finds its own. KV_ELISION_PROTO overrides both.
export function protoPath(env: NodeJS.ProcessEnv = process.env, extensionDir: string = EXTENSION_DIR): string {
  if (env.KV_ELISION_PROTO) return env.KV_ELISION_PROTO;
  const packaged = join(extensionDir, "proto", "contextd.proto");
  return existsSync(packaged) ? packaged : join(extensionDir, "..", "proto", "contextd.proto");
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
