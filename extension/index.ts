// kv-elision for Pi: a provider backed by the local kv-elision server, no compaction for it, and a
// status line showing where the session's KV pages are (from contextd).
//
// This entry point only checks that it runs in a Pi it supports; everything else is loaded after
// that check, so an older Pi gets one clear error instead of failing on an import it lacks.
import type { ExtensionAPI } from "@earendil-works/pi-coding-agent";
import { MIN_PI_VERSION, isAtLeast, olderPiMessage } from "./src/pi-version.ts";

export default async function kvElision(pi: ExtensionAPI): Promise<void> {
  // Pi before 0.99 lacks registerVirtualModel. It also maps no `@earendil-works/*` imports to
  // itself, so asking that package for a version there would load some other copy (or none).
  if (typeof (pi as Partial<ExtensionAPI>).registerVirtualModel !== "function") {
    throw new Error(olderPiMessage(undefined));
  }
  const { VERSION } = await import("@earendil-works/pi-coding-agent");
  if (!isAtLeast(VERSION, MIN_PI_VERSION)) throw new Error(olderPiMessage(VERSION));
  const { activate } = await import("./src/extension.ts");
  await activate(pi);
}
