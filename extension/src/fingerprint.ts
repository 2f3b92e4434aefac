// The X-KV-Context header: short hashes of exactly what goes on the wire, so the server can tell
// whether its paged KV cache still belongs to the conversation it is asked to continue. Hashes
// (not text) keep the header small and let the server compare prefixes without re-tokenizing.
import { createHash } from "node:crypto";

export interface ContextFingerprint {
  v: 1;
  system: string;
  tools: string;
  thinking: string;
  messages: string[];
}

// JSON with object keys sorted (JS default string order), no whitespace, and values written the
// way JSON.stringify writes them; undefined members are dropped as they are on the wire.
// Python reproduces it with json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False).
export function canonicalJson(value: unknown): string {
  if (value === null || typeof value !== "object") {
    const text = JSON.stringify(value);
    return text === undefined ? "null" : text;
  }
  if (Array.isArray(value)) {
    return `[${value.map((item) => canonicalJson(item)).join(",")}]`;
  }
  const record = value as Record<string, unknown>;
  const members: string[] = [];
  for (const key of Object.keys(record).sort()) {
    const member = record[key];
    if (member === undefined || typeof member === "function" || typeof member === "symbol") continue;
    members.push(`${JSON.stringify(key)}:${canonicalJson(member)}`);
  }
  return `{${members.join(",")}}`;
}

export function shortHash(value: unknown): string {
  return createHash("sha256").update(canonicalJson(value), "utf8").digest("hex").slice(0, 16);
}

interface WireMessage {
  role?: unknown;
  content?: unknown;
}

function isInstruction(message: unknown): message is WireMessage {
  if (typeof message !== "object" || message === null) return false;
  const role = (message as WireMessage).role;
  return role === "system" || role === "developer";
}

// `payload` is the OpenAI chat-completions body Pi is about to POST. The leading system (or
// developer) message is the system part; every later message is hashed whole (role, content and,
// where present, tool_calls / tool_call_id / reasoning fields), so an edited tool call or result
// changes its hash just as an edited text does.
export function fingerprintPayload(payload: unknown, thinking: string): ContextFingerprint {
  const body = (typeof payload === "object" && payload !== null ? payload : {}) as {
    messages?: unknown;
    tools?: unknown;
  };
  const messages = Array.isArray(body.messages) ? body.messages : [];
  const first = messages[0];
  const hasSystem = isInstruction(first);
  const system = hasSystem ? (first as WireMessage).content ?? "" : "";
  const rest = hasSystem ? messages.slice(1) : messages;
  return {
    v: 1,
    system: shortHash(system),
    tools: shortHash(Array.isArray(body.tools) ? body.tools : []),
    thinking,
    messages: rest.map((message) => shortHash(message)),
  };
}

// Key order is fixed (v, system, tools, thinking, messages) so equal fingerprints give equal headers.
export function contextHeader(fingerprint: ContextFingerprint): string {
  return JSON.stringify({
    v: fingerprint.v,
    system: fingerprint.system,
    tools: fingerprint.tools,
    thinking: fingerprint.thinking,
    messages: fingerprint.messages,
  });
}
