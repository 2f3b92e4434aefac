"""The campaign's hangs part: a read wedged on a read queue's thread and on the worker's own, and
the MLX greedy-step finalizer run by the collector on a restore's reader thread; each must be
answered within its deadline (the wedged ones 503, with /health 503 while stuck), and the server
must answer as a twin that never hung once the read returns.

Depends on harness.faults.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.faults.hangs import HangOutcome, finalizer_case, twin_answers, wedged_read_case
from harness.faults.oracle import CaseOutcome


def run_hangs_part(args: argparse.Namespace, work: Path, zygote: Any, log: Callable[[str], None]
                   ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    folder = work / "hangs"
    folder.mkdir(parents=True, exist_ok=True)
    expected = twin_answers(folder)
    found: list[HangOutcome] = []
    for where in ("reader", "caller"):
        found.append(wedged_read_case(folder / where, where, expected))
        log(f"hangs: {found[-1].case}: {found[-1].turn_status} in {found[-1].turn_s:.1f} s, "
            f"/health {found[-1].health_status}")
    if importlib.util.find_spec("mlx") is not None:
        found.append(finalizer_case(folder / "finalizer"))
        log(f"hangs: {found[-1].case}: {found[-1].turn_status} in {found[-1].turn_s:.1f} s")
    else:
        log("hangs: no mlx here: the finalizer case is left out")
    outcomes = []
    for case in found:
        outcome = CaseOutcome(case.case, "hangs")
        for problem in case.problems:
            outcome.fail(problem)
        outcomes.append(outcome)
    wedged = [case for case in found if case.case.startswith("wedged")]
    return {"hang_cases": {"cases": len(found), "wedged": len(wedged),
                           "answered_503_in_deadline": sum(case.answered_503_in_deadline for case in wedged),
                           "answered_in_deadline": sum(case.answered_in_deadline for case in found),
                           "recovered": sum(case.recovered for case in found),
                           "by_case": [case.as_dict() for case in found]}}, outcomes
