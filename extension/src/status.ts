// The status line text, built from contextd's StatusReply. Pure, so it is tested without a daemon.

export interface PageCounts {
  hot?: number;
  cold?: number;
  pinned?: number;
  dropped?: number;
  corrupt?: number;
}

export interface SessionStatus {
  session_id?: string;
  budget_tokens?: number;
  attention_tokens?: number;
  turn?: number;
  pages?: PageCounts | null;
  counters?: Record<string, number | string>;
}

export interface StatusReply {
  sessions?: SessionStatus[];
}

// The counter the server resets each turn and bumps for every page it loads back from disk.
export const RESTORED_COUNTER = "restored_pages_turn";

function count(value: number | string | undefined): number {
  const n = typeof value === "string" ? Number(value) : value ?? 0;
  return Number.isFinite(n) ? n : 0;
}

export function formatSession(session: SessionStatus): string {
  const pages = session.pages ?? {};
  const attention = count(session.attention_tokens);
  const budget = count(session.budget_tokens);
  const parts = [
    `kv hot ${count(pages.hot)} · cold ${count(pages.cold)} · pinned ${count(pages.pinned)}`,
    budget > 0 ? `attn ${attention}/${budget}` : `attn ${attention}`,
    `restored ${count(session.counters?.[RESTORED_COUNTER])}`,
  ];
  // Dropped and corrupt pages mean history that must be recomputed; worth the user's eye.
  const dropped = count(pages.dropped);
  const corrupt = count(pages.corrupt);
  if (dropped > 0) parts.push(`dropped ${dropped}`);
  if (corrupt > 0) parts.push(`corrupt ${corrupt}`);
  return parts.join(" | ");
}

export function statusText(reply: StatusReply, sessionId: string): string {
  const session = reply.sessions?.find((s) => s.session_id === sessionId);
  return session ? formatSession(session) : "kv ready · no pages yet";
}

export function downText(socketPath: string): string {
  return `kv contextd down (${socketPath})`;
}
