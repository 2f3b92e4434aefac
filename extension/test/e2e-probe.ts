// A test-only Pi extension for tests/e2e/test_pi.py, loaded next to the real one with `-e`.
// It changes nothing Pi sends; it only lets the test see what RPC mode does not show:
//   - every provider response's X-KV-* headers, one JSON line each in $KV_E2E_PROBE_LOG
//     ({"kind":"response","status":200,"session":"<Pi session id>","headers":{"x-kv-...":"..."}});
//   - `/kv-e2e-rewind N`: the /tree rewind Pi has no RPC command for. It navigates to the N-th user
//     message of the current branch without a summary, as choosing that message in /tree does (the
//     leaf moves to its parent, so the next prompt replaces that message and everything after it),
//     and logs {"kind":"rewind","target":ID,"leaf":ID,"cancelled":false,"session":"..."}.
import { appendFileSync } from "node:fs";
import type { ExtensionAPI, ExtensionContext } from "@earendil-works/pi-coding-agent";

export default function e2eProbe(pi: ExtensionAPI): void {
  const logPath = process.env.KV_E2E_PROBE_LOG;
  const log = (record: Record<string, unknown>): void => {
    if (logPath) appendFileSync(logPath, `${JSON.stringify(record)}\n`);
  };
  const sessionOf = (ctx: ExtensionContext): string => ctx.sessionManager.getSessionId();

  pi.on("after_provider_response", (event, ctx) => {
    const headers: Record<string, string> = {};
    for (const [name, value] of Object.entries(event.headers)) {
      if (name.toLowerCase().startsWith("x-kv-")) headers[name.toLowerCase()] = value;
    }
    log({ kind: "response", status: event.status, session: sessionOf(ctx), headers });
  });

  pi.registerCommand("kv-e2e-rewind", {
    description: "test only: rewind to before the N-th user message of this branch (no summary)",
    handler: async (args, ctx) => {
      const n = Number.parseInt(args.trim(), 10);
      const users = ctx.sessionManager
        .getBranch()
        .filter((entry) => entry.type === "message" && entry.message.role === "user");
      const target = users[n - 1];
      if (!target) throw new Error(`no user message ${args.trim()} on this branch (${users.length} there)`);
      const { cancelled } = await ctx.navigateTree(target.id, { summarize: false });
      log({ kind: "rewind", target: target.id, leaf: ctx.sessionManager.getLeafId(), cancelled, session: sessionOf(ctx) });
    },
  });
}
