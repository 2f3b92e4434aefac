// kv-elision keeps the whole transcript servable by paging KV to disk, so Pi's compaction (a
// lossy summary) is switched off for this provider only; other providers keep Pi's behaviour.
import { PROVIDER } from "./config.ts";

export function shouldCancelCompaction(provider: string | undefined): boolean {
  return provider === PROVIDER;
}

export const COMPACTION_NOTICE =
  "kv-elision: Pi's compaction is off for this provider; the transcript stays whole and the server pages its KV cache to disk.";
