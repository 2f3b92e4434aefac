"""The campaign's objects part, on a real Ceph RGW the part starts (harness/rgw.py; root and
Debian's ceph-mon, ceph-osd and radosgw, which `make test` installs): a lost reply on every
conditional PUT of the object-store tier, and cache pressure while a server streams sessions
back. Where no RGW can start, the part says why and counts nothing.

Depends on harness.faults and harness.rgw.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.faults.objects import cache_pressure, lost_replies, new_bucket
from harness.faults.oracle import CaseOutcome
from harness.faults.processes import environ_set
from harness.faults.scenarios import CRASH_ENV, IO_FAULT_ENV
from harness.rgw import Rgw, missing


def run_objects_part(args: argparse.Namespace, work: Path, zygote: Any, log: Callable[[str], None]
                     ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    reason = missing()
    if reason:
        log(f"objects: skipped: {reason}")
        return {"lost_reply_cases": {"cases": 0, "stuck": 0, "skipped": reason},
                "cache_pressure_cases": {"cases": 0, "false_corrupt": 0, "skipped": reason}}, []
    folder = work / "objects"
    folder.mkdir(parents=True, exist_ok=True)
    rgw = Rgw(folder / "ceph").start()
    try:
        with contextlib.ExitStack() as environment:
            for name, value in [*rgw.environment.items(), (CRASH_ENV, None), (IO_FAULT_ENV, None),
                                ("KV_ELISION_API_KEY", None)]:
                environment.enter_context(environ_set(name, value))
            lost = lost_replies(folder, rgw, new_bucket(rgw))
            log(f"objects: {lost.cases} conditional PUTs with their reply lost, {lost.stuck} stuck")
            pressure = cache_pressure(folder, rgw, new_bucket(rgw), args.pressure_rounds)
            log(f"objects: {pressure.cases} sessions streamed back under cache pressure, "
                f"{pressure.false_corrupt} pages reported corrupt")
    finally:
        rgw.stop()
    outcomes = []
    for scope, problems in (("lost reply", lost.problems), ("cache pressure", pressure.problems)):
        for problem in problems:
            outcome = CaseOutcome(scope, "objects")
            outcome.fail(problem)
            outcomes.append(outcome)
    return {"lost_reply_cases": lost.as_dict(), "cache_pressure_cases": pressure.as_dict()}, outcomes
