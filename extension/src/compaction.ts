// kv-elision keeps the whole transcript servable by paging KV to disk, so Pi's compaction (a
// lossy summary) has nothing to fix for this provider. Automatic compaction (the threshold, an
// overflow or truncated-answer recovery) is cancelled; a manual /compact is explained and
// cancelled, unless the user gave instructions: then they asked for a summary and get one.
// Other providers keep Pi's behaviour.
import { PROVIDER } from "./config.ts";

export type CompactionReason = "manual" | "threshold" | "overflow";

// What a compaction would have replaced, from Pi's CompactionPreparation.
export interface CompactionScope {
  messages: number;
  tokensBefore: number;
  files: number;
}

export type CompactionDecision =
  | { action: "allow" }
  | { action: "cancel"; notice: string; once: boolean };

export const COMPACTION_NOTICE =
  "kv-elision: Pi's compaction is off for this provider; the transcript stays whole and the server pages its KV cache to disk.";

export function manualCompactionNotice(scope: CompactionScope): string {
  const files = scope.files > 0 ? `, with what was read from or written to ${plural(scope.files, "file")},` : "";
  return (
    "kv-elision: /compact is not needed here. The server pages the KV cache to disk, so the model keeps the whole " +
    `transcript (${scope.tokensBefore} tokens). Compacting would replace ${plural(scope.messages, "earlier message")}` +
    `${files} by a summary, and their exact text could not be brought back. Not compacted; ` +
    "to compact anyway, say what the summary should keep: /compact <instructions>"
  );
}

export function decideCompaction(
  provider: string | undefined,
  reason: CompactionReason,
  customInstructions: string | undefined,
  scope: CompactionScope,
): CompactionDecision {
  if (provider !== PROVIDER) return { action: "allow" };
  if (reason !== "manual") return { action: "cancel", notice: COMPACTION_NOTICE, once: true };
  if (customInstructions?.trim()) return { action: "allow" };
  return { action: "cancel", notice: manualCompactionNotice(scope), once: false };
}

function plural(n: number, noun: string): string {
  return `${n} ${noun}${n === 1 ? "" : "s"}`;
}
