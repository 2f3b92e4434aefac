// The provider's streamSimple: Pi's own OpenAI chat-completions client, plus the X-KV-Session and
// X-KV-Context headers on every request.
//
// Why a probe: in Pi 0.73.1 the OpenAI client (and so its headers) is built before the request
// body, and the body only becomes visible in onPayload, after the headers are fixed. So the body
// is built once with an onPayload that records it and stops before anything is sent; the
// fingerprint of that body goes into the headers of the real request. The real request's
// onPayload runs Pi's before_provider_request handlers and checks the final body still has the
// same fingerprint; if an extension rewrote messages, system prompt or tools there, the request
// fails with a clear error rather than carry a fingerprint of something it is not sending.
//
// Why the provider check: Pi registers a provider's streamSimple for its whole API type
// ("openai-completions"), so every OpenAI-compatible provider's requests pass through here; all
// but kv-elision's go straight to Pi's client, untouched.
import {
  createAssistantMessageEventStream,
  streamSimpleOpenAICompletions,
  type Api,
  type AssistantMessage,
  type AssistantMessageEvent,
  type AssistantMessageEventStream,
  type Context,
  type Model,
  type SimpleStreamOptions,
  type StopReason,
} from "@mariozechner/pi-ai";
import { PROVIDER, serveHint } from "./config.ts";
import { contextHeader, fingerprintPayload } from "./fingerprint.ts";

export const SESSION_HEADER = "X-KV-Session";
export const CONTEXT_HEADER = "X-KV-Context";
export const REBUILT_HEADER = "x-kv-rebuilt";

export type StreamSimple = (
  model: Model<Api>,
  context: Context,
  options?: SimpleStreamOptions,
) => AssistantMessageEventStream;

class PayloadCaptured extends Error {}

const piOpenAI: StreamSimple = (model, context, options) =>
  streamSimpleOpenAICompletions(model as Model<"openai-completions">, context, options);

export function createKvStream(base: StreamSimple = piOpenAI): StreamSimple {
  return (model, context, options) => {
    if (model.provider !== PROVIDER) return base(model, context, options);
    const outer = createAssistantMessageEventStream();
    void relay(base, model, context, options, outer);
    return outer;
  };
}

// Pi's agent loop passes its session id; requests Pi makes outside the loop (branch and
// compaction summaries) carry none and go without X-KV-Session, so they cannot disturb the
// session's cache with a foreign system prompt.
export function kvHeaders(payload: unknown, options: SimpleStreamOptions | undefined): Record<string, string> {
  const headers = splitContextHeader(contextHeader(fingerprintPayload(payload, options?.reasoning ?? "off")));
  if (options?.sessionId) headers[SESSION_HEADER] = options.sessionId;
  return headers;
}

// HTTP servers cap one header line (Python's at 64 KiB), and a session of thousands of messages
// outgrows that; so a long X-KV-Context continues in X-KV-Context-2, -3, ... (the server joins
// them in order). The text is ASCII (hex hashes, level names), so any cut is safe.
export const CONTEXT_PIECE_CHARS = 60_000;
export const CONTEXT_MAX_PIECES = 80;

export function splitContextHeader(text: string): Record<string, string> {
  const pieces = Math.max(1, Math.ceil(text.length / CONTEXT_PIECE_CHARS));
  if (pieces > CONTEXT_MAX_PIECES) {
    throw new Error(
      `kv-elision: the context fingerprint needs ${pieces} header pieces, more than the ${CONTEXT_MAX_PIECES} ` +
        "a server accepts; the session has too many messages for one request",
    );
  }
  const headers: Record<string, string> = {};
  for (let i = 0; i < pieces; i++) {
    headers[i === 0 ? CONTEXT_HEADER : `${CONTEXT_HEADER}-${i + 1}`] = text.slice(
      i * CONTEXT_PIECE_CHARS,
      (i + 1) * CONTEXT_PIECE_CHARS,
    );
  }
  return headers;
}

async function relay(
  base: StreamSimple,
  model: Model<Api>,
  context: Context,
  options: SimpleStreamOptions | undefined,
  outer: AssistantMessageEventStream,
): Promise<void> {
  try {
    const payload = await capturePayload(base, model, context, options);
    const added = kvHeaders(payload, options);
    const thinking = options?.reasoning ?? "off";
    const expected = contextHeader(fingerprintPayload(payload, thinking));
    const inner = base(model, context, {
      ...options,
      headers: { ...options?.headers, ...added },
      onPayload: async (next, innerModel) => {
        const replaced = await options?.onPayload?.(next, innerModel);
        const final = replaced === undefined ? next : replaced;
        if (contextHeader(fingerprintPayload(final, thinking)) !== expected) {
          throw new Error(
            "kv-elision: a before_provider_request handler changed the messages, system prompt or tools " +
              "after the context fingerprint was taken; not sending a request whose X-KV-Context would be wrong",
          );
        }
        return final;
      },
    });
    for await (const event of inner) outer.push(explainError(event, model));
    outer.end();
  } catch (error) {
    const reason: StopReason = options?.signal?.aborted ? "aborted" : "error";
    const text = error instanceof Error ? error.message : String(error);
    outer.push({ type: "error", reason, error: failedMessage(model, reason, text) });
    outer.end();
  }
}

async function capturePayload(
  base: StreamSimple,
  model: Model<Api>,
  context: Context,
  options: SimpleStreamOptions | undefined,
): Promise<unknown> {
  let captured: { payload: unknown } | undefined;
  const probe = base(model, context, {
    ...options,
    onPayload: (payload) => {
      captured = { payload };
      throw new PayloadCaptured("payload captured");
    },
    onResponse: undefined,
  });
  const result = await probe.result();
  if (!captured) throw new Error(result.errorMessage ?? "kv-elision: Pi built no request body");
  return captured.payload;
}

// Keeps Pi's text (its retry rule matches "Connection error") and says what to do about it.
export function explainError(event: AssistantMessageEvent, model: Model<Api>): AssistantMessageEvent {
  if (event.type !== "error" || event.reason !== "error") return event;
  const text = event.error.errorMessage ?? "";
  if (!/connection error|ECONNREFUSED|ENOTFOUND|fetch failed|socket hang up/i.test(text)) return event;
  const hint =
    `kv-elision server not reachable at ${model.baseUrl}; start it with ` +
    `\`${serveHint(model.id, model.baseUrl)}\` or set KV_ELISION_URL`;
  return { ...event, error: { ...event.error, errorMessage: `${text} (${hint})` } };
}

function failedMessage(model: Model<Api>, reason: StopReason, text: string): AssistantMessage {
  return {
    role: "assistant",
    content: [],
    api: model.api,
    provider: model.provider,
    model: model.id,
    usage: {
      input: 0,
      output: 0,
      cacheRead: 0,
      cacheWrite: 0,
      totalTokens: 0,
      cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0, total: 0 },
    },
    stopReason: reason,
    errorMessage: text,
    timestamp: Date.now(),
  };
}
