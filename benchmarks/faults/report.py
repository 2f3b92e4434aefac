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
            ("connections", "hostile Content-Length values", "hostile_content_length.cases", ""),
            ("", "refused before the client timeout", "hostile_content_length.refused_at_once", "= cases"),
            ("", "slowloris clients", "slowloris.cases", ""),
            ("", "let go at the client timeout", "slowloris.let_go", "= cases"),
            ("", "clients that stopped reading", "stopped_reading.cases", ""),
            ("", "their turn ended", "stopped_reading.turn_ended", "= cases"),
            ("access", "access checks failed", "access_failures", "0"),
            ("", "routes another uid tried", "other_user_denied.routes", ""),
            ("", "denied", "other_user_denied.denied", "= routes"),
            ("hangs", "cases (wedged reads, MLX finalizer)", "hang_cases.cases", ""),
            ("", "wedged reads answered 503 in the deadline", "hang_cases.answered_503_in_deadline", "= wedged"),
            ("", "answered in the deadline", "hang_cases.answered_in_deadline", "= cases"),
            ("objects", "conditional PUTs with their reply lost", "lost_reply_cases.cases", ""),
            ("", "stuck", "lost_reply_cases.stuck", "0"),
            ("", "sessions streamed back under cache pressure", "cache_pressure_cases.cases", ""),
            ("", "pages reported corrupt", "cache_pressure_cases.false_corrupt", "0")]
    print(f"{'part':<11} {'measure':<44} {'value':>10}  goal", flush=True)
    for part, what, key, goal in rows:
        value = _figure(figures, key)
        if value is not None:
            print(f"{part:<11} {what:<44} {value!s:>10}  {goal}")
    for part, lines in failures.items():
        if lines:
            print(f"\n{part}: {len(lines)} cases did not hold" + (", the first 12:" if len(lines) > 12 else ":"))
        for line in lines[:12]:
            print(f"  - {line[:400]}")


def _figure(figures: dict[str, Any], key: str) -> Any:
    """The figure at `key`, a name or a dotted path into a part's object (None when absent)."""
    value: Any = figures
    for name in key.split("."):
        if not isinstance(value, dict) or name not in value:
            return None
        value = value[name]
    return value
