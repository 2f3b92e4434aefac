"""Many sessions through one server: its memory stays flat, and every session can be answered again.

    python -m benchmarks.soak [--sessions 500] [--turns 20] [--alive 10] [--model tiny-llama] [--budget 1024]

One real `kv-elision serve` and its contextd, with the server's defaults (one resident cache,
`--sessions-in-memory` 16) but `--tail-tokens 256` (512 leaves no room under a 1,024 budget),
driven over HTTP as agents drive it (harness.agent: the whole transcript in every request, the
server's replies put back as the assistant's messages).
`--alive` clients each play one session at a time, `--turns` turns each (the opening, then a file
read per turn: ~200-token files, so a session outgrows the budget and pages move), until
`--sessions` sessions have been played.

Read when the 50th and the last session end: the server's resident memory (`rss_mb_50`,
`rss_mb_500` with the defaults; /proc) and contextd's LMDB file, in all and per session it keeps (`lmdb_mb_*`,
`lmdb_kb_per_session_*`: contextd keeps every session unless a retention limit is set, so the
database grows with the sessions kept and not otherwise). Afterwards every session is asked one
more question: `answerable` counts those answered (200) that prefilled no more than the question
(less than one page: none of their history was prefilled again), though most of them had left the
server's memory (`sessions_left_memory`, from /v1/kv/stats).

The last line is one JSON object: those figures, `rss_ratio` (500 over 50), `turn_ms_p50` / `_p95`,
`other_processes_cpu_share` and `reliable` (benchmarks.stats). Not part of `make test`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile, print_result
from harness.agent import AgentRun
from harness.procfs import machine_cpu_seconds, other_cpu_share, own_cpu_seconds, status_field
from harness.workload import agent_turns, evidence_files
from serving.launcher import ServerProcess

# The question each session is asked after the soak: a page is 128 tokens, the question is far less.
QUESTION = {"role": "user", "content": "Which file did you read first? Answer with its path."}
PAGE_TOKENS = 128
# When memory is read: after this many sessions have ended, and after the last.
FIRST_READING = 50


@dataclass
class Soak:
    """What the client threads share: the next session to play, the runs, what was read when."""

    server: ServerProcess
    sessions: int
    turns: int
    next_session: int = 0
    ended: int = 0
    runs: dict[int, AgentRun] = field(default_factory=dict)
    turn_ms: list[float] = field(default_factory=list)
    readings: dict[int, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self) -> int | None:
        with self.lock:
            if self.next_session >= self.sessions or self.failures:
                return None
            self.next_session += 1
            return self.next_session - 1

    def play(self, index: int) -> None:
        run = AgentRun(self.server, f"soak-{index:04d}", max_tokens=8)
        files = evidence_files(self.turns - 1, tokens_per_file=200, seed=index)
        run.ask([])
        for added in agent_turns(files):
            run.ask(added)
        with self.lock:
            self.runs[index] = run
            self.turn_ms.extend(t.seconds * 1e3 for t in run.turns)
            self.ended += 1
            if self.ended in (FIRST_READING, self.sessions):
                self.readings[self.ended] = memory(self.server, self.ended)

    def client(self) -> None:
        while (index := self.take()) is not None:
            try:
                self.play(index)
            except Exception as exc:  # noqa: BLE001 - reported, and the other clients stop taking sessions
                with self.lock:
                    self.failures.append(f"session {index}: {exc}")


def lmdb_bytes(server: ServerProcess) -> int:
    assert server.contextd is not None
    return sum(path.stat().st_size for path in server.contextd.root.rglob("*.mdb"))


def memory(server: ServerProcess, ended: int) -> dict[str, float]:
    assert server.proc is not None
    rss_mb = status_field(server.proc.pid, "VmRSS") / 1024
    db = lmdb_bytes(server)
    return {"rss_mb": round(rss_mb, 1), "lmdb_mb": round(db / 2**20, 2),
            "lmdb_kb_per_session": round(db / 1024 / ended, 1)}


def answerable(server: ServerProcess, runs: dict[int, AgentRun]) -> tuple[int, list[str]]:
    """Sessions that answer one more question without prefilling their history again."""
    good, notes = 0, []
    for index, run in sorted(runs.items()):
        try:
            record = run.ask([QUESTION])
        except RuntimeError as exc:
            notes.append(f"session {index}: {exc}")
            continue
        if record.prefilled < PAGE_TOKENS:
            good += 1
        else:
            notes.append(f"session {index}: prefilled {record.prefilled} tokens for the question")
    return good, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument("--alive", type=int, default=10, help="sessions played at the same time")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--work", default=None, help="folder for the server's data (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.sessions < FIRST_READING or args.turns < 2 or args.alive < 1:
        parser.error(f"play at least {FIRST_READING} sessions of at least 2 turns, with at least one alive")
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="kve-soak-"))
    server = ServerProcess(root=work / "server", model=args.model, budget=args.budget,
                           extra=["--max-new-tokens", "8", "--tail-tokens", "256"])
    try:
        server.start()
        machine, own = machine_cpu_seconds(), own_cpu_seconds()
        started = time.perf_counter()
        soak = Soak(server, args.sessions, args.turns)
        clients = [threading.Thread(target=soak.client, name=f"soak-client-{n}") for n in range(args.alive)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        if soak.failures:
            raise RuntimeError("; ".join(soak.failures[:5]))
        played_s = time.perf_counter() - started
        good, notes = answerable(server, soak.runs)
        for note in notes[:10]:
            print(note)
        totals = server.stats()
    finally:
        server.stop()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    first, last = soak.readings[FIRST_READING], soak.readings[args.sessions]
    result: dict[str, Any] = {
        "model": args.model, "budget": args.budget, "sessions": args.sessions, "turns": args.turns,
        "alive": args.alive, "played_s": round(played_s, 1),
        f"rss_mb_{FIRST_READING}": first["rss_mb"], f"rss_mb_{args.sessions}": last["rss_mb"],
        "rss_ratio": round(last["rss_mb"] / first["rss_mb"], 3),
        f"lmdb_mb_{FIRST_READING}": first["lmdb_mb"], f"lmdb_mb_{args.sessions}": last["lmdb_mb"],
        f"lmdb_kb_per_session_{FIRST_READING}": first["lmdb_kb_per_session"],
        f"lmdb_kb_per_session_{args.sessions}": last["lmdb_kb_per_session"],
        "answerable": good, "sessions_left_memory": totals.get("sessions_left_memory"),
        "sessions_in_memory": len(totals["sessions"]),
        "turn_ms_p50": round(percentile(soak.turn_ms, 50), 1), "turn_ms_p95": round(percentile(soak.turn_ms, 95), 1)}
    print(f"{args.sessions} sessions x {args.turns} turns, {args.alive} alive, in {played_s:.0f} s: "
          f"RSS {first['rss_mb']} MB after {FIRST_READING}, {last['rss_mb']} MB after {args.sessions}; "
          f"LMDB {first['lmdb_mb']} -> {last['lmdb_mb']} MB; answerable {good}/{args.sessions}")
    print_result(result, other_cpu_share(machine, machine_cpu_seconds(), own_cpu_seconds() - own))
    return 0 if good == args.sessions else 1


if __name__ == "__main__":
    raise SystemExit(main())
