"""The campaign's summary table: each figure next to its goal, then the cases that did not hold.

Depends on nothing of ours.
"""

from __future__ import annotations

from typing import Any


def print_table(figures: dict[str, Any], failures: dict[str, list[str]]) -> None:
    rows = [("crash", "crash points tried (kill -9)", "crash_points", ">= 200"),
            ("", "recovered exactly", "crash_recovered_exact", "= points"),
            ("", "pages lost", "pages_lost", "0"),
            ("", "pages half-present after a crash", "half_present_pages", "0"),
            ("", "turns in flight not answered 503", "crash_unclear_errors", "0"),
            ("storage", "faults injected", "faults_injected", ""),
            ("", "caught", "faults_caught", "= injected"),
            ("", "served corrupt", "served_corrupt", "0"),
            ("", "errors other than 507 / 503", "unclear_storage_errors", "0"),
            ("", "sessions intact once the fault is gone", "sessions_intact", "= injected"),
            ("fuzz", "malformed HTTP requests", "fuzz_http", ">= 10000"),
            ("", "malformed gRPC requests + raw writes", "fuzz_grpc", ">= 10000"),
            ("", "answers that were not a clear 4xx / status", "fuzz_unclear", "0"),
            ("", "process crashes", "crashes", "0"),
            ("", "server / contextd RSS growth (MiB)", "fuzz_rss_growth_mib", "bounded"),
            ("sessions", "interleaved turns (4 sessions)", "interleaved_turns", ""),
            ("", "answers different from the solo twin", "session_mismatches", "0"),
            ("", "cross-session leaks", "cross_session_leaks", "0"),
            ("", "forward tokens spent on switches", "switch_forward_tokens", "0"),
            ("", "contextd restarts under load: turns lost", "contextd_restart_lost", "0"),
            ("access", "access checks failed", "access_failures", "0")]
    print(f"{'part':<9} {'measure':<44} {'value':>10}  goal", flush=True)
    for part, what, key, goal in rows:
        if key in figures:
            print(f"{part:<9} {what:<44} {figures[key]!s:>10}  {goal}")
    for part, lines in failures.items():
        if lines:
            print(f"\n{part}: {len(lines)} cases did not hold" + (", the first 12:" if len(lines) > 12 else ":"))
        for line in lines[:12]:
            print(f"  - {line[:400]}")
