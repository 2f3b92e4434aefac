// The model list comes from the server's OpenAI-style GET /v1/models, read once while Pi loads
// the extension. A server that is down must not stop Pi from starting, so every failure turns
// into the default model plus a message the extension shows once a UI exists.
import type { Model } from "@earendil-works/pi-ai";
import {
  API_KEY_ENV,
  DEFAULT_CONTEXT_WINDOW,
  DEFAULT_MAX_TOKENS,
  DEFAULT_MODEL_ID,
  KEY_FILE_ENV,
  MODELS_TIMEOUT_MS,
  PROVIDER,
  type FoundKey,
} from "./config.ts";

export type KvModel = Model<"openai-completions">;

export interface ModelList {
  models: KvModel[];
  // Set when the server could not be read and the default model stands in.
  problem?: string;
}

export interface ModelOptions {
  name?: string;
  contextWindow?: number;
  maxTokens?: number;
  reasoning?: boolean;
}

export function modelConfig(id: string, baseUrl: string, opts: ModelOptions = {}): KvModel {
  return {
    id,
    name: opts.name ?? `${id} (kv-elision)`,
    api: "openai-completions",
    provider: PROVIDER,
    baseUrl,
    reasoning: opts.reasoning ?? false,
    input: ["text"],
    // Local inference: nothing to bill, and Pi's cost column stays at zero.
    cost: { input: 0, output: 0, cacheRead: 0, cacheWrite: 0 },
    contextWindow: opts.contextWindow ?? DEFAULT_CONTEXT_WINDOW,
    maxTokens: opts.maxTokens ?? DEFAULT_MAX_TOKENS,
    // Pi sends its session id on every agent request (x-session-affinity, x-client-request-id);
    // the server keys its paged cache by it. Summaries Pi makes outside the session carry none.
    compat: { sendSessionAffinityHeaders: true, sessionAffinityFormat: "openai-nosession" },
  };
}

export function defaultModels(baseUrl: string, problem: string): ModelList {
  return { models: [modelConfig(DEFAULT_MODEL_ID, baseUrl)], problem };
}

function positiveInt(value: unknown): number | undefined {
  return typeof value === "number" && Number.isInteger(value) && value > 0 ? value : undefined;
}

// Accepts {data: [{id, name?, context_window?, max_output_tokens?, reasoning?}, ...]}; entries
// without a usable id are skipped rather than failing the whole list.
export function parseModels(body: unknown, baseUrl: string): KvModel[] {
  if (typeof body !== "object" || body === null || !Array.isArray((body as { data?: unknown }).data)) {
    throw new Error("response has no `data` array");
  }
  const seen = new Set<string>();
  const models: KvModel[] = [];
  for (const entry of (body as { data: unknown[] }).data) {
    if (typeof entry !== "object" || entry === null) continue;
    const raw = entry as Record<string, unknown>;
    const id = typeof raw.id === "string" ? raw.id.trim() : "";
    if (!id || seen.has(id)) continue;
    seen.add(id);
    const opts: ModelOptions = {};
    if (typeof raw.name === "string" && raw.name.trim()) opts.name = raw.name.trim();
    const contextWindow = positiveInt(raw.context_window);
    if (contextWindow !== undefined) opts.contextWindow = contextWindow;
    const maxTokens = positiveInt(raw.max_output_tokens);
    if (maxTokens !== undefined) opts.maxTokens = maxTokens;
    if (typeof raw.reasoning === "boolean") opts.reasoning = raw.reasoning;
    models.push(modelConfig(id, baseUrl, opts));
  }
  if (models.length === 0) throw new Error("the server lists no models");
  return models;
}

// The server answers /v1/models only with its key (config.ts, findApiKey), so it is sent here too.
export async function fetchModels(
  url: string,
  timeoutMs: number = MODELS_TIMEOUT_MS,
  found: FoundKey = { source: API_KEY_ENV },
): Promise<ModelList> {
  const endpoint = `${url}/models`;
  try {
    const headers: Record<string, string> = found.key ? { authorization: `Bearer ${found.key}` } : {};
    const response = await fetch(endpoint, { signal: AbortSignal.timeout(timeoutMs), headers });
    if (response.status === 401) {
      const why = found.key
        ? `refused the key in ${found.source}`
        : `wants its API key, and there is none in ${found.source}: set ${KEY_FILE_ENV} (or KV_ELISION_ROOT) ` +
          `to the server's ROOT/api-key, or ${API_KEY_ENV}`;
      return defaultModels(url, `GET ${endpoint} answered HTTP 401 (the server ${why})`);
    }
    if (!response.ok) return defaultModels(url, `GET ${endpoint} answered HTTP ${response.status}`);
    return { models: parseModels(await response.json(), url) };
  } catch (error) {
    return defaultModels(url, `GET ${endpoint} failed: ${describeFetchError(error)}`);
  }
}

// fetch() reports "fetch failed" and hides the useful part (ECONNREFUSED, ENOTFOUND) in `cause`.
export function describeFetchError(error: unknown): string {
  if (!(error instanceof Error)) return String(error);
  if (error.name === "TimeoutError") return "no answer in time";
  const cause = (error as { cause?: unknown }).cause;
  if (cause instanceof Error) {
    const code = (cause as { code?: unknown }).code;
    return typeof code === "string" ? `${code} (${cause.message})` : cause.message;
  }
  return error.message;
}
