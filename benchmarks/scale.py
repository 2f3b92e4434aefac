"""Per-turn cost as a session grows to a million tokens: does the pause before each answer stay flat?

    python -m benchmarks.scale [--tiny-tokens 1000000] [--model-tokens 131072] [--budget 4096]

Two sessions, each driven turn by turn through a real `kv-elision serve` process and its real
contextd, the way an agent drives it (the whole transcript in every request; one `read` tool
result of ~2,000 tokens per turn, from harness.workload):

- a tiny random-weight model (tiny-llama) to `--tiny-tokens` (1M by default), so the model's
  forward pass is cheap and what is measured is kv-elision's own work;
- SmolLM2-135M to `--model-tokens` (128k by default), the embedded model at a real size.

Per turn, from the server's /v1/kv/stats (`last_turn`): the control-plane time (everything that
is not the model's forward: reading and parsing the request body, render, align, page decisions,
selection, stores, restores, contextd calls), the selector's decision time, the page indexes'
bytes; from /proc, the server's resident memory; from the disk, contextd's database and store
sizes. At the end of each session the server is killed with SIGKILL and started again:
`recovery_s` is the time from the restart to the session's next answer (process start, model
load, recovery from contextd, the turn itself). Figures per size are over the turns in a window
around that size (p50 / p95).

Output: a table, `bench-out/scale.png` (per-turn overhead against session tokens) and, last, one
JSON line: per size `turn_overhead_ms_p50/p95`, `select_ms_p95`, `index_rss_mb`, `rss_mb`,
`db_mb`, `store_mb`, `bytes_per_token`, `phase_ms_p95` (the overhead by phase: receive, prepare,
select, store, restore, persist), and per session `recovery_s`; plus `growth_16k_to_1m` = overhead
p95 at 1M / overhead p95 at 16k (tiny model), and `other_processes_cpu_share` with `reliable`
(benchmarks.stats: false above 10%).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.stats import print_result
from harness.agent import AgentRun, TurnRecord
from harness.procfs import machine_cpu_seconds, other_cpu_share, own_cpu_seconds, status_field
from harness.workload import evidence_files
from serving.launcher import ServerProcess
from serving.session import PHASES

OUT = Path(__file__).resolve().parent.parent / "bench-out"
SIZES = {"16k": 16_384, "128k": 131_072, "1m": 1_000_000}
WINDOW_TURNS = 12  # turns around a size that make up its figures


@dataclass
class Sample:
    session_tokens: int
    overhead_ms: float
    select_ms: float
    index_bytes: int
    rss_bytes: int
    phases: dict[str, float]   # the overhead by phase (serving.session.PHASES)


@dataclass
class Grown:
    samples: list[Sample] = field(default_factory=list)
    recovery_s: float = 0.0
    recovery_turn_ms: float = 0.0
    db_bytes: int = 0
    store_bytes: int = 0
    session_tokens: int = 0


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def grow(model: str, tokens: int, budget: int, work: Path, seed: int) -> Grown:
    """One session to `tokens`, a sample per turn; then kill -9, restart, and time the next answer."""
    server = ServerProcess(root=work / model, model=model, budget=budget,
                           extra=["--max-new-tokens", "8", "--tail-tokens", "512"])
    server.start()
    grown = Grown()
    try:
        run = AgentRun(server, "scale", max_tokens=8)
        files = evidence_files(tokens // 1800 + 2, tokens_per_file=2000, facts_per_file=1, seed=seed)

        def sample(record: TurnRecord) -> None:
            stats = server.stats("scale")
            last = stats["last_turn"]
            assert server.proc is not None
            grown.samples.append(Sample(record.session_tokens, last["overhead_ms"], last["select_ms"],
                                        stats["key_index_bytes"] + stats["lexical_index_bytes"],
                                        status_field(server.proc.pid, "VmRSS") * 1024,
                                        {p: last[f"{p}_ms"] for p in PHASES}))
            print(f"  {model}: {record.session_tokens:>9,} tokens  overhead {last['overhead_ms']:8.1f} ms  "
                  + "  ".join(f"{p} {last[f'{p}_ms']:6.1f}" for p in PHASES)
                  + f"  forward {last['forward_ms']:8.1f} ms", flush=True)

        run.run(files, on_turn=sample, until_tokens=tokens)
        grown.session_tokens = grown.samples[-1].session_tokens
        grown.db_bytes = folder_bytes(server.root / "contextd" / "db")
        grown.store_bytes = folder_bytes(server.root / "contextd" / "store")
        server.kill9()
        restarted = time.perf_counter()
        server.start()
        run.ask([{"role": "user", "content": "Go on with the next file."}])
        grown.recovery_s = time.perf_counter() - restarted
        grown.recovery_turn_ms = server.stats("scale")["last_turn"]["total_ms"]
    finally:
        server.stop()
    return grown


def window(samples: list[Sample], size: int) -> list[Sample]:
    """The turns closest to `size` tokens (at most WINDOW_TURNS of them)."""
    return sorted(samples, key=lambda s: abs(s.session_tokens - size))[:WINDOW_TURNS]


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def figures(grown: Grown, size: int) -> dict[str, Any]:
    near = window(grown.samples, size)
    overhead = [s.overhead_ms for s in near]
    return {"session_tokens": max(s.session_tokens for s in near),
            "turn_overhead_ms_p50": round(statistics.median(overhead), 1),
            "turn_overhead_ms_p95": round(p95(overhead), 1),
            "select_ms_p95": round(p95([s.select_ms for s in near]), 1),
            "index_rss_mb": round(max(s.index_bytes for s in near) / 2**20, 1),
            "rss_mb": round(max(s.rss_bytes for s in near) / 2**20, 1),
            "phase_ms_p95": {p: round(p95([s.phases[p] for s in near]), 1) for p in PHASES}}


def plot(runs: dict[str, Grown], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, grown in runs.items():
        ax.plot([s.session_tokens for s in grown.samples], [s.overhead_ms for s in grown.samples], label=name, lw=1)
    ax.set_xscale("log")
    ax.set_xlabel("session tokens")
    ax.set_ylabel("per-turn overhead (ms, not the model's forward)")
    ax.set_title("kv-elision: control-plane time per turn as the session grows")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tiny-tokens", type=int, default=SIZES["1m"])
    parser.add_argument("--model-tokens", type=int, default=SIZES["128k"])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args(argv)
    machine0, ours0 = machine_cpu_seconds(), own_cpu_seconds()
    work = Path(tempfile.mkdtemp(prefix="kvb-scale-", dir="/tmp"))
    try:
        runs = {"tiny-llama": grow("tiny-llama", args.tiny_tokens, args.budget, work, args.seed)}
        if args.model_tokens:
            runs[args.model] = grow(args.model, args.model_tokens, args.budget, work, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    plot(runs, OUT / "scale.png")
    result: dict[str, Any] = {"budget_tokens": args.budget}
    for name, grown in runs.items():
        sizes = {label: figures(grown, size) for label, size in SIZES.items() if size <= grown.session_tokens * 1.05}
        result[name] = {"sizes": sizes, "recovery_s": round(grown.recovery_s, 2),
                        "recovery_turn_ms": round(grown.recovery_turn_ms, 1), "session_tokens": grown.session_tokens,
                        "db_mb": round(grown.db_bytes / 2**20, 1), "store_mb": round(grown.store_bytes / 2**20, 1),
                        "bytes_per_token": round(grown.store_bytes / grown.session_tokens)}
        print(f"{name}: {grown.session_tokens:,} tokens, store {grown.store_bytes / 2**20:.0f} MiB "
              f"({grown.store_bytes / grown.session_tokens:.0f} B/token), db {grown.db_bytes / 2**20:.1f} MiB, "
              f"recovery {grown.recovery_s:.1f} s")
        for label, f in sizes.items():
            print(f"  {label:>5}: overhead p50 {f['turn_overhead_ms_p50']} ms, p95 {f['turn_overhead_ms_p95']} ms; "
                  f"select p95 {f['select_ms_p95']} ms; index {f['index_rss_mb']} MiB; RSS {f['rss_mb']} MiB")
    tiny = result["tiny-llama"]["sizes"]
    if "1m" in tiny and "16k" in tiny:
        result["growth_16k_to_1m"] = round(tiny["1m"]["turn_overhead_ms_p95"] / tiny["16k"]["turn_overhead_ms_p95"], 2)
    other = other_cpu_share(machine0, machine_cpu_seconds(), own_cpu_seconds() - ours0)
    print_result(result, other)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
