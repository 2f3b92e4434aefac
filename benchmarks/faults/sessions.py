"""The campaign's sessions part: 4 sessions interleaved in one engine against their solo twins,
then through a real server, with contextd restarts under it.

Depends on harness.faults.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.faults.oracle import CaseOutcome, Twins
from harness.faults.processes import Daemon
from harness.faults.scenarios import session_scenarios
from harness.faults.sessions import job_sessions, server_sessions
from harness.faults.zygote import Zygote


def run_sessions_part(args: argparse.Namespace, work: Path, zygote: Zygote, log: Callable[[str], None]
                      ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    import random

    outcomes: list[CaseOutcome] = []
    figures: dict[str, Any] = {}
    daemon = Daemon(work / "sessions" / "root", work / "sessions.sock")
    daemon.start()
    try:
        twins = Twins(zygote, daemon)
        scenarios = session_scenarios(4)
        solo = [twins.run(sc, range(len(sc.users))) for sc in scenarios]
        rng = random.Random(15)
        mismatches = leaks = turns = switches = wasted = 0
        for trial in range(args.session_trials):
            schedule = [k for k, sc in enumerate(scenarios) for _ in sc.users]
            rng.shuffle(schedule)
            result = zygote.run(job_sessions, {"socket": str(daemon.socket), "scenarios": [sc.name for sc in scenarios],
                                             "sessions": [f"t{trial}-{sc.name}" for sc in scenarios],
                                             "schedule": schedule})
            outcome = CaseOutcome(f"4 sessions interleaved, trial {trial}", "sessions/in-process")
            if result.status != 0:
                outcome.fail(f"the run failed: {result.error[-500:]}")
            for ack in result.of("ack"):
                turns += 1
                want = solo[ack["session"]][ack["ack"]]
                if ack["content"] != want["content"]:
                    mismatches += 1
                    outcome.fail(f"session {ack['session']} request {ack['ack']}: {ack['content']!r} != solo "
                                 f"{want['content']!r}")
                if not ack["checks"]["ok"]:
                    leaks += int(bool(ack["checks"].get("leak")))
                    outcome.fail(f"session {ack['session']} request {ack['ack']}: {ack['checks']['why']}")
                wasted += ack["forward_not_fed"]
            done = result.of("done")
            if done:
                switches += done[0]["switches"]
                solo_prefill = sum(a["checks"]["counters"]["new_prefill_tokens"] for t in solo for a in t[-1:])
                figures.setdefault("switch_prefill_tokens", 0)
                figures["switch_prefill_tokens"] += done[0]["totals"]["new_prefill_tokens"] - solo_prefill
                figures.setdefault("switch_recovered_pages", 0)
                figures["switch_recovered_pages"] += done[0]["totals"]["recovered_pages"]
            outcomes.append(outcome)
        log(f"sessions: in-process: {turns} turns, {switches} switches, {mismatches} answers off, {leaks} leaks")
        figures.update(interleaved_turns=turns, session_switches=switches, session_mismatches=mismatches,
                       cross_session_leaks=leaks, switch_forward_tokens=wasted)
    finally:
        daemon.stop()
    found, more = server_sessions(work, log)
    for key, value in found.items():
        figures[key] = figures.get(key, 0) + value if isinstance(value, int) and key in figures else value
    outcomes += more
    return figures, outcomes
