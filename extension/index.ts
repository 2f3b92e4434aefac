// kv-elision for Pi: a provider backed by the local kv-elision server, no compaction for it, and a
// status line showing where the session's KV pages are (from contextd).
import type { ExtensionAPI, ExtensionContext, ExtensionUIContext } from "@mariozechner/pi-coding-agent";
import { API_KEY_ENV, PROVIDER, STATUS_KEY, loadConfig, serveHint } from "./src/config.ts";
import { COMPACTION_NOTICE, shouldCancelCompaction } from "./src/compaction.ts";
import { fetchModels } from "./src/models.ts";
import { REBUILT_HEADER, createKvStream } from "./src/stream.ts";
import { StatusWatcher } from "./src/watcher.ts";

type Level = "info" | "warning" | "error";

export default async function kvElision(pi: ExtensionAPI): Promise<void> {
  const config = loadConfig();
  // Awaited by Pi before startup continues; fetchModels never throws and gives up quickly.
  const { models, problem } = await fetchModels(config.url);
  pi.registerProvider(PROVIDER, {
    name: "kv-elision",
    baseUrl: config.url,
    apiKey: API_KEY_ENV,
    api: "openai-completions",
    models,
    streamSimple: createKvStream(),
  });

  const said = new Set<string>();
  let watcher: StatusWatcher | undefined;
  let statusUi: ExtensionUIContext | undefined;

  // In print and json modes there is no UI (ctx.hasUI is false); stderr keeps stdout clean.
  const say = (ctx: ExtensionContext, message: string, level: Level, onceKey?: string): void => {
    if (onceKey) {
      if (said.has(onceKey)) return;
      said.add(onceKey);
    }
    if (ctx.hasUI) ctx.ui.notify(message, level);
    else process.stderr.write(`${message}\n`);
  };

  const stopWatching = (): void => {
    watcher?.stop();
    watcher = undefined;
    statusUi?.setStatus(STATUS_KEY, undefined);
    statusUi = undefined;
  };

  const activate = (ctx: ExtensionContext, provider: string | undefined): void => {
    if (provider !== PROVIDER) {
      stopWatching();
      return;
    }
    say(ctx, COMPACTION_NOTICE, "info", "compaction");
    if (problem) {
      const modelId = models[0]?.id ?? "";
      say(
        ctx,
        `kv-elision: server not reachable (${problem}); offering model ${modelId} until it is. ` +
          `Start it with: ${serveHint(modelId, config.url)}`,
        "warning",
        "server-down",
      );
    }
    // Without a UI, setStatus is a no-op; an open stream would only keep the process alive.
    if (!ctx.hasUI || watcher) return;
    const ui = ctx.ui;
    statusUi = ui;
    watcher = new StatusWatcher({
      socketPath: config.socketPath,
      protoPath: config.protoPath,
      sessionId: ctx.sessionManager.getSessionId(),
      onText: (text) => ui.setStatus(STATUS_KEY, text),
    });
    watcher.start();
  };

  pi.on("session_start", (_event, ctx) => activate(ctx, ctx.model?.provider));
  pi.on("model_select", (event, ctx) => activate(ctx, event.model.provider));
  pi.on("session_shutdown", () => stopWatching());

  pi.on("session_before_compact", (_event, ctx) => {
    if (!shouldCancelCompaction(ctx.model?.provider)) return undefined;
    say(ctx, COMPACTION_NOTICE, "info", "compaction");
    return { cancel: true };
  });

  // The server answers X-KV-Rebuilt when the fingerprint showed its cache no longer matches
  // (a rewind, a fork, an edited message): correct, but the whole context was prefilled again.
  pi.on("after_provider_response", (event, ctx) => {
    if (ctx.model?.provider !== PROVIDER) return;
    const reason = event.headers[REBUILT_HEADER];
    if (reason) say(ctx, `kv-elision rebuilt the KV cache: ${reason}`, "info");
  });
}
