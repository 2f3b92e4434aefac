// The kv-elision provider: Pi's own OpenAI chat-completions implementation, registered as a
// complete pi-ai provider, with one addition on the wire. Pi sends the session id itself
// (compat.sendSessionAffinityHeaders, see models.ts); what it does not send is X-KV-Context, the
// fingerprint of the request's context. That is computed in the fetch Pi's client sends through,
// from the exact JSON body about to go out (after every before_provider_request handler), so it
// always describes what the server receives.
import {
  createProvider,
  openAICompletionsApi,
  type Api,
  type FetchFunction,
  type Model,
  type Provider,
  type ProviderStreams,
} from "@earendil-works/pi-ai/compat";
import { API_KEY_NONE, PROVIDER, findApiKey, serveHint, type KeyEnv } from "./config.ts";
import { contextHeader, fingerprintPayload } from "./fingerprint.ts";
import { describeFetchError, type KvModel } from "./models.ts";

export const CONTEXT_HEADER = "X-KV-Context";
export const REBUILT_HEADER = "x-kv-rebuilt";

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

// Wraps the fetch Pi's OpenAI client uses for one request. `thinking` is Pi's thinking level for
// it ("off" when none). A failed connection says where it looked and how to start the server;
// Pi's client reports it as "Connection error.: <this message>", which Pi still retries.
function kvFetch(base: FetchFunction, model: Model<Api>, thinking: string): FetchFunction {
  return async (input, init) => {
    if (typeof init?.body !== "string") {
      throw new Error("kv-elision: the request body is not JSON text, so it has no context fingerprint");
    }
    const headers = new Headers(init.headers);
    const fingerprint = contextHeader(fingerprintPayload(JSON.parse(init.body), thinking));
    for (const [name, value] of Object.entries(splitContextHeader(fingerprint))) headers.set(name, value);
    try {
      return await base(input, { ...init, headers });
    } catch (error) {
      if (init.signal?.aborted) throw error;
      // Pi reports the deepest cause of a connection error, so this one carries none.
      throw new Error(
        `kv-elision server not reachable at ${model.baseUrl} (${describeFetchError(error)}); start it with ` +
          `\`${serveHint(model.id, model.baseUrl)}\` or set KV_ELISION_URL`,
      );
    }
  };
}

// Both entry points of Pi's implementation, each with the fingerprinting fetch. Agent turns and
// summaries use streamSimple (Pi's thinking level); stream is what extensions reach through
// ctx.modelRegistry.stream/complete (an OpenAI reasoning effort, if any).
function kvStreams(): ProviderStreams {
  const base = openAICompletionsApi();
  return {
    streamSimple: (model, context, options) =>
      base.streamSimple(model, context, {
        ...options,
        fetch: kvFetch(options?.fetch ?? fetch, model, options?.reasoning ?? "off"),
      }),
    stream: (model, context, options) => {
      const effort = (options as { reasoningEffort?: unknown } | undefined)?.reasoningEffort;
      return base.stream(model, context, {
        ...options,
        fetch: kvFetch(options?.fetch ?? fetch, model, typeof effort === "string" ? effort : "off"),
      });
    },
  };
}

export function createKvProvider(baseUrl: string, models: KvModel[]): Provider {
  return createProvider({
    id: PROVIDER,
    name: "kv-elision",
    baseUrl,
    auth: {
      apiKey: {
        name: "kv-elision server",
        // The server wants `Authorization: Bearer KEY` on every route but /health. The key Pi
        // stored for this provider (auth.json, `"kv-elision": {"type": "api_key", "key": ...}`)
        // wins, as for Pi's own providers; else KV_ELISION_API_KEY, else the key file the
        // server made (config.ts, findApiKey), read again for every request.
        resolve: async ({ ctx, credential }) => {
          const stored = credential?.key?.trim();
          if (stored) return { auth: { apiKey: stored }, source: "Pi's stored key" };
          const env: KeyEnv = {};
          for (const name of ["KV_ELISION_API_KEY", "KV_ELISION_KEY_FILE", "KV_ELISION_ROOT", "XDG_STATE_HOME"] as const) {
            const value = await ctx.env(name);
            if (value !== undefined) env[name] = value;
          }
          const found = await findApiKey(env);
          return { auth: { apiKey: found.key ?? API_KEY_NONE }, source: found.key ? found.source : `no key in ${found.source}` };
        },
      },
    },
    models,
    api: kvStreams(),
  });
}
