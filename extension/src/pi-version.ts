// Which Pi the extension runs in. It is written against @earendil-works/pi-coding-agent 1.6 (a
// complete provider object, compaction reasons, session-affinity headers); older Pi cannot run it,
// and is told so instead of failing on an import or a missing feature halfway through loading.

export const MIN_PI_VERSION = "1.6.0";

// Release versions only ("1.6.0", "1.6.0-rc.1" counts as 1.6.0): enough to tell Pi lines apart.
function parts(version: string): [number, number, number] | undefined {
  const match = /^(\d+)\.(\d+)\.(\d+)/.exec(version.trim());
  if (!match) return undefined;
  return [Number(match[1]), Number(match[2]), Number(match[3])];
}

export function isAtLeast(version: string, minimum: string): boolean {
  const have = parts(version);
  const want = parts(minimum);
  if (!have || !want) return false;
  for (let i = 0; i < 3; i++) {
    if (have[i] !== want[i]) return (have[i] ?? 0) > (want[i] ?? 0);
  }
  return true;
}

// `version` is undefined when the host is too old to say (Pi before 0.99 has no
// pi.registerVirtualModel, and there `@earendil-works/pi-coding-agent` is not Pi itself).
export function olderPiMessage(version: string | undefined): string {
  const found = version ? `this is Pi ${version}` : "this Pi is older (0.73 or another pre-1.0 release)";
  return (
    `kv-elision needs Pi ${MIN_PI_VERSION} or newer (@earendil-works/pi-coding-agent, Node >= 22.19); ${found}. ` +
    "Install today's Pi with `npm install -g @earendil-works/pi-coding-agent`."
  );
}
