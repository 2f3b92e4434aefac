"""Storage faults: refused writes (ENOSPC, EDQUOT, EIO, EROFS at the file-I/O seam), damaged
payloads and snapshots, and where mounting is allowed a real full or read-only tmpfs. The status a
client must get comes from serving's own map (serving.http_request.ERROR_STATUS).

Depends on serving.http_request, contextd.errors, the zygote, the oracle and the campaign's processes and
scenarios.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contextd.errors import StoreFull
from harness.faults.driver import job_drive
from harness.faults.oracle import CaseOutcome, History, Twins
from harness.faults.processes import Daemon
from harness.faults.scenarios import SCENARIOS, Scenario
from harness.faults.zygote import Zygote
from serving.http_request import error_for


def expected_status(errno_name: str) -> int:
    """What a client must get when the store's disk refuses a write with this errno: contextd
    reports a want of space (ENOSPC, EDQUOT) as StoreFull and passes any other OSError on
    (contextd/blobs.py); serving's map says the status of each."""
    code = getattr(errno, errno_name)
    failure = StoreFull(os.strerror(code)) if code in (errno.ENOSPC, errno.EDQUOT) else OSError(code, os.strerror(code))
    return int(error_for(failure).status)


EXPECTED_STATUS = {name: expected_status(name) for name in ("ENOSPC", "EDQUOT", "EIO", "EROFS")}

WRITE_OPS = ("open", "write", "fsync", "rename", "dirsync")

DAMAGE = ("flip", "torn", "truncate", "empty", "append", "missing")


@dataclass
class StorageCase:
    label: str
    scenario: str
    kind: str                                   # "write" (a refused write) or "damage" (bytes on disk)
    before: dict[str, list[list[Any]]]
    after: dict[str, list[list[Any]]] = field(default_factory=dict)
    expect: int = 0                             # the status a client should get (write faults)
    daemon: Any = None                          # a daemon of its own (a tmpfs root), else the shared one


def plan_storage(twins: Twins, scenario: Scenario) -> list[StorageCase]:
    """Write faults at the first payload write of the first turn that evicts (mid-prefill) and at
    the last write of the probe turn (write-through: the open page, or the recurrent snapshot of a
    hybrid); damaged payloads where a restore, a recovery or the key index will read them."""
    plain = twins.plain(scenario)
    evicting = next(i for i, a in enumerate(plain) if a["hits"].get("serving.evict.removed"))
    last = len(plain) - 1
    cases: list[StorageCase] = []
    places = [("write-through", last)] if scenario.name == "hybrid" else [("eviction", evicting),
                                                                           ("write-through", last)]
    for name, status in EXPECTED_STATUS.items():
        for op in WRITE_OPS:
            for place, i in places:
                nth = 1 if place == "eviction" else plain[i]["hits"].get(f"io.{op}", 1)
                cases.append(StorageCase(f"{name} on {op} during {place}", scenario.name, "write",
                                         {str(i): [["inject", op, name, nth, 1]]}, expect=status))
    restored = next(((i, page) for i, a in enumerate(plain) if i > 0 for page in a["inserted"]
                     if [r for r in plain[i - 1]["manifest"] if r[0] == page and r[1] == 2]), None)
    for how in DAMAGE:
        if scenario.name == "hybrid":
            cases.append(StorageCase(f"{how} recurrent snapshot, read on recovery", scenario.name, "damage",
                                     {str(last): [["corrupt", "@snapshot", how], ["forget"]]}))
            continue
        if restored is not None:
            i, page = restored
            cases.append(StorageCase(f"{how} cold page, read by a restore", scenario.name, "damage",
                                     {str(i): [["corrupt", page, how]]}))
        cases.append(StorageCase(f"{how} resident page, read on recovery", scenario.name, "damage",
                                 {str(last): [["corrupt", "@resident", how], ["forget"]]}))
        cases.append(StorageCase(f"{how} cold page, read by the key index on recovery", scenario.name, "damage",
                                 {str(last): [["corrupt", "@cold", how], ["forget"]]}))
    return cases


def tmpfs_allowed(work: Path) -> bool:
    probe = work / "tmpfs-probe"
    probe.mkdir(exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(probe)]
    ok = subprocess.run(mount, capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(probe)], capture_output=True)
    return ok


@contextlib.contextmanager
def tmpfs(folder: Path, size_mib: int) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}M,mode=0700", "tmpfs", str(folder)], check=True,
                   capture_output=True)
    try:
        yield folder
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode == 0:
                break
            time.sleep(0.25)


class StorageCampaign:
    def __init__(self, zygote: Zygote, daemon: Daemon, twins: Twins) -> None:
        self.zygote = zygote
        self.daemon = daemon
        self.twins = twins
        self.count = 0

    def case(self, case: StorageCase) -> CaseOutcome:
        self.count += 1
        scenario = SCENARIOS[case.scenario]
        daemon = case.daemon or self.daemon
        sid = f"s{self.count:04d}-{scenario.name}"
        outcome = CaseOutcome(case.label, f"{case.scenario}/{case.kind}")
        started = time.monotonic()
        result = self.zygote.run(job_drive, {"scenario": case.scenario, "socket": str(daemon.socket), "session": sid,
                                             "sequence": list(range(len(scenario.users))), "stays_up": True,
                                             "before": case.before, "after": case.after})
        history = History(len(scenario.users))
        history.feed(result.events, outcome)
        outcome.exact = True  # History.feed may have failed it on the record count: re-judged below
        outcome.problems.clear()
        failed = result.of("failed")
        actions = [e["action"] for e in result.of("action")]
        outcome.served_corrupt = len(next((e["served_corrupt"] for e in result.of("done")), []))
        outcome.served_corrupt += sum(len(a["served_corrupt"]) for a in result.of("ack"))
        if result.status != 0:
            outcome.fail(f"the server gave up: {result.error[-500:]}")
        acks = result.of("ack")
        statuses = [int(e["status"]) for e in failed]
        bad = [a for a in acks if not a["checks"]["ok"]]
        outcome.leaks = sum(bool(a["checks"].get("leak")) for a in acks)
        complete = history.next_request >= history.n
        dropped = sorted({row[0] for a in acks for row in a["manifest"] if row[1] == 4})
        if case.kind == "write":
            fired = sum(int(e.get("fired", 0)) for e in [*failed, *acks])
            outcome.reached = fired > 0 or bool(failed) or bool(dropped)
            first = next((e for e in failed if e["failed"] != -1), None)
            if first is not None and int(first["status"]) != case.expect:
                outcome.unclear_errors += 1
                outcome.fail(f"answered {first['status']}, not {case.expect}: {first['error'][:200]}")
            if dropped:
                # the documented pressure policy: cold, unpinned, unleased pages are dropped to make
                # room; the session goes on without them (answers may differ from the twin's)
                outcome.dropped = len(dropped)  # type: ignore[attr-defined]
                outcome.caught = outcome.served_corrupt == 0 and not bad  # type: ignore[attr-defined]
                outcome.intact = complete and not bad  # type: ignore[attr-defined]
                if bad:
                    outcome.fail(f"request {bad[0]['ack']}: {bad[0]['checks']['why']}")
            else:
                refused = first is not None and not any(a.get("fired") for a in acks)
                if not refused:
                    outcome.fail("the refused write was not reported to the client")
                outcome.caught = refused and outcome.served_corrupt == 0  # type: ignore[attr-defined]
                intact = CaseOutcome(case.label, outcome.scope)
                replay = History(len(scenario.users))
                replay.feed(result.events, intact)
                if intact.exact:
                    replay.check(self.twins.run(scenario, replay.completed), intact)
                outcome.half_present = intact.half_present
                outcome.pages_lost = intact.pages_lost
                for problem in intact.problems:
                    outcome.fail(f"session not intact after the fault: {problem}")
                outcome.intact = intact.exact and complete  # type: ignore[attr-defined]
        else:
            damaged = [a for a in actions if "page" in a]
            outcome.reached = bool(damaged)
            for status in statuses:
                outcome.unclear_errors += 1
                outcome.fail(f"a damaged payload failed a request with {status}: "
                             f"{failed[0]['error'][:200]} (the server should say CORRUPT and go on)")
            if bad:
                outcome.fail(f"request {bad[0]['ack']}: {bad[0]['checks']['why']}")
            outcome.caught = outcome.served_corrupt == 0 and not bad  # type: ignore[attr-defined]
            outcome.intact = complete and not bad  # type: ignore[attr-defined]
        if not complete:
            outcome.fail(f"the session stopped at request {history.next_request} of {history.n}: "
                         f"{(result.error or str(failed[-1:]))[-300:]}")
        if outcome.served_corrupt:
            outcome.fail(f"{outcome.served_corrupt} corrupt payloads were streamed into attention")
        outcome.statuses = statuses
        outcome.seconds = time.monotonic() - started
        return outcome
