// The extension proper, loaded by index.ts once it knows Pi is new enough: the provider, the
// compaction policy, the notices, and the status line fed by contextd.
import type { ExtensionAPI, ExtensionContext, ExtensionUIContext } from "@earendil-works/pi-coding-agent";
import { PROVIDER, STATUS_KEY, findApiKey, loadConfig, serveHint } from "./config.ts";
import { COMPACTION_NOTICE, decideCompaction } from "./compaction.ts";
import { fetchModels } from "./models.ts";
import { REBUILT_HEADER, createKvProvider } from "./provider.ts";
import { StatusWatcher } from "./watcher.ts";

type Level = "info" | "warning" | "error";

export async function activate(pi: ExtensionAPI): Promise<void> {
  const config = loadConfig();
  // Awaited by Pi before startup continues; fetchModels never throws and gives up quickly.
  const { models, problem } = await fetchModels(config.url, undefined, await findApiKey());
  pi.registerProvider(createKvProvider(config.url, models));

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

  const select = (ctx: ExtensionContext, provider: string | undefined): void => {
    if (provider !== PROVIDER) {
      stopWatching();
      return;
    }
    say(ctx, COMPACTION_NOTICE, "info", COMPACTION_NOTICE);
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

  pi.on("session_start", (_event, ctx) => select(ctx, ctx.model?.provider));
  pi.on("model_select", (event, ctx) => select(ctx, event.model.provider));
  pi.on("session_shutdown", () => stopWatching());

  pi.on("session_before_compact", (event, ctx) => {
    const { preparation } = event;
    const files = new Set([...preparation.fileOps.read, ...preparation.fileOps.written, ...preparation.fileOps.edited]);
    const decision = decideCompaction(ctx.model?.provider, event.reason, event.customInstructions, {
      messages: preparation.messagesToSummarize.length + preparation.turnPrefixMessages.length,
      tokensBefore: preparation.tokensBefore,
      files: files.size,
    });
    if (decision.action === "allow") return undefined;
    say(ctx, decision.notice, "info", decision.once ? decision.notice : undefined);
    return { cancel: true };
  });

  // The server answers X-KV-Rebuilt when the fingerprint showed its cache no longer matches
  // (a rewind, a fork, an edited message, a compaction): correct, but the whole context was
  // prefilled again. An answer Pi left out of the next request (a truncated attempt it omits)
  // is dropped from the cache without a rebuild, and the server sends no header for it.
  pi.on("after_provider_response", (event, ctx) => {
    if (ctx.model?.provider !== PROVIDER) return;
    const reason = event.headers[REBUILT_HEADER];
    if (reason) say(ctx, `kv-elision rebuilt the KV cache: ${reason}`, "info");
  });
}
