"""Long-session throughput: paged (bounded attention) against an unbounded cache, side by side.

Both runs start the real `kv-elision serve` on the same model and replay the same scripted agent
session (harness.workload) over HTTP: one with `--budget B` (pages evicted, stored, restored),
one with a budget larger than the whole session (nothing is ever evicted: an unbounded cache with
the same server code around it). Throughput counts every token that went through the model
(prefill + decode) per second of wall time of the turns.

    python -m benchmarks.session [--tokens 20000] [--budget 4096] [--model smollm2-135m]

Last line: one JSON object with paged_tok_s, unbounded_tok_s, overhead_pct, paged_peak_kv_bytes,
unbounded_peak_kv_bytes (attention K/V resident in the backend at its peak).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from harness.agent import AgentRun
from harness.workload import evidence_files
from serving.launcher import ServerProcess


def run_once(model: str, budget: int, tokens: int, files: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kvb-session-", dir="/tmp"))
    server = ServerProcess(root=root, model=model, budget=budget, extra=("--max-new-tokens", "8")).start()
    try:
        run = AgentRun(server, "bench", max_tokens=8)
        run.run(evidence_files(files, tokens_per_file=1000), until_tokens=tokens)
        stats = server.stats("bench")
        counters = stats["counters"]
        seconds = sum(t.seconds for t in run.turns)
        return {"tok_s": counters["model_forward_tokens"] / seconds, "seconds": seconds,
                "model_forward_tokens": counters["model_forward_tokens"], "session_tokens": stats["session_tokens"],
                "peak_attention_tokens": counters["peak_attention_tokens"],
                "peak_kv_bytes": counters["peak_attention_tokens"] * stats["kv_bytes_per_token"],
                "evicted_pages": counters["evicted_pages"], "stored_bytes": counters["stored_bytes"],
                "turns": len(run.turns)}
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=20_000, help="session length to reach")
    parser.add_argument("--budget", type=int, default=4096)
    args = parser.parse_args(argv)
    files = args.tokens // 900 + 4
    paged = run_once(args.model, args.budget, args.tokens, files)
    unbounded = run_once(args.model, max(2 * args.tokens, 65536), args.tokens, files)
    overhead = 100.0 * (unbounded["tok_s"] - paged["tok_s"]) / unbounded["tok_s"]
    print(f"{'':<10} {'tok/s':>8} {'seconds':>8} {'fwd tokens':>10} {'session':>8} {'peak attn':>9} "
          f"{'peak KV MiB':>11} {'evicted':>7}")
    for name, r in (("paged", paged), ("unbounded", unbounded)):
        print(f"{name:<10} {r['tok_s']:>8.1f} {r['seconds']:>8.1f} {r['model_forward_tokens']:>10} "
              f"{r['session_tokens']:>8} {r['peak_attention_tokens']:>9} {r['peak_kv_bytes'] / 2**20:>11.1f} "
              f"{r['evicted_pages']:>7}")
    print(json.dumps({"paged_tok_s": round(paged["tok_s"], 2), "unbounded_tok_s": round(unbounded["tok_s"], 2),
                      "overhead_pct": round(overhead, 2), "paged_peak_kv_bytes": paged["peak_kv_bytes"],
                      "unbounded_peak_kv_bytes": unbounded["peak_kv_bytes"], "budget_tokens": args.budget,
                      "paged_peak_attention_tokens": paged["peak_attention_tokens"],
                      "unbounded_peak_attention_tokens": unbounded["peak_attention_tokens"],
                      "session_tokens": paged["session_tokens"], "paged_evicted_pages": paged["evicted_pages"],
                      "paged_stored_bytes": paged["stored_bytes"], "model": args.model}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
