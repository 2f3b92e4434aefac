"""The campaign's storage part: every planned write fault and damaged payload, then the same faults
from a real kernel on a small tmpfs where mounting is allowed.

Depends on harness.faults.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.faults.oracle import CaseOutcome, Twins
from harness.faults.processes import Daemon
from harness.faults.scenarios import SCENARIOS
from harness.faults.storage import EXPECTED_STATUS, StorageCampaign, StorageCase, plan_storage, tmpfs, tmpfs_allowed
from harness.faults.zygote import Zygote


def run_storage_part(args: argparse.Namespace, work: Path, zygote: Zygote, log: Callable[[str], None]
                     ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    daemon = Daemon(work / "storage" / "root", work / "storage.sock")
    daemon.start()
    outcomes: list[CaseOutcome] = []
    tmpfs_cases = 0
    try:
        twins = Twins(zygote, daemon)
        campaign = StorageCampaign(zygote, daemon, twins)
        plan = [c for name in args.scenarios if name in SCENARIOS for c in plan_storage(twins, SCENARIOS[name])]
        log(f"storage: {len(plan)} injected and on-disk faults")
        for n, case in enumerate(plan):
            outcome = campaign.case(case)
            outcomes.append(outcome)
            if not outcome.exact:
                log(f"  [{n + 1}/{len(plan)}] {case.scenario}: {case.label}: {outcome.problems[0][:300]}")
        if tmpfs_allowed(work):
            found = run_tmpfs_cases(campaign, twins, work, log)
            tmpfs_cases = len(found)
            outcomes += found
        else:
            log("storage: mounting a tmpfs is not allowed here; the injected faults stand for it")
    finally:
        daemon.stop()
    reached = [o for o in outcomes if o.reached]
    figures = {"faults_injected": len(reached),
               "faults_caught": sum(bool(getattr(o, "caught", False)) for o in reached),
               "served_corrupt": sum(o.served_corrupt for o in reached),
               "unclear_storage_errors": sum(o.unclear_errors for o in reached),
               "sessions_intact": sum(bool(getattr(o, "intact", False)) for o in reached),
               "storage_half_present": sum(o.half_present for o in reached),
               "tmpfs_faults": tmpfs_cases, "faults_not_reached": len(outcomes) - len(reached),
               "pages_dropped_under_pressure": sum(getattr(o, "dropped", 0) for o in reached)}
    return figures, reached


def run_tmpfs_cases(campaign: StorageCampaign, twins: Twins, work: Path, log: Callable[[str], None]
                    ) -> list[CaseOutcome]:
    """The same faults from a real kernel: the store on a small tmpfs that fills up or turns
    read-only in the middle of a turn, then gets its space (or write access) back."""
    scenario = SCENARIOS["llama"]
    plain = twins.plain(scenario)
    evicting = next(i for i, a in enumerate(plain) if a["hits"].get("serving.evict.removed"))
    outcomes: list[CaseOutcome] = []
    variants: list[tuple[str, str, int, list[list[Any]], list[list[Any]], int]] = []
    for leave in (0, 48 << 10, 160 << 10):
        variants.append((f"store tmpfs full ({leave >> 10} KiB left) mid-turn", "store", 64,
                         [["fill", "{dir}", leave]], [["unfill", "{dir}"]], EXPECTED_STATUS["ENOSPC"]))
        variants.append((f"whole root on a full tmpfs ({leave >> 10} KiB left) mid-turn", "root", 96,
                         [["fill", "{dir}", leave]], [["unfill", "{dir}"]], EXPECTED_STATUS["ENOSPC"]))
    variants.append(("store tmpfs remounted read-only mid-turn", "store", 64, [["remount", "{dir}", "ro"]],
                     [["remount", "{dir}", "rw"]], EXPECTED_STATUS["EROFS"]))
    for n, (label, scope, size, before, after, expect) in enumerate(variants):
        base = work / f"tmpfs{n}"
        root = base / "root"
        mount_at = root / "store" if scope == "store" else root
        with tmpfs(mount_at, size):
            daemon = Daemon(root, base / "c.sock")
            daemon.start()
            try:
                fill = [[str(mount_at) if x == "{dir}" else x for x in a] for a in before]
                undo = [[str(mount_at) if x == "{dir}" else x for x in a] for a in after]
                case = StorageCase(f"tmpfs: {label}", "llama", "write", {str(evicting): fill}, {str(evicting): undo},
                                   expect=expect, daemon=daemon)
                outcome = campaign.case(case)
            finally:
                daemon.stop()
        outcome.scope = "llama/tmpfs"
        if not outcome.exact:
            log(f"  tmpfs: {label}: {outcome.problems[0][:300]}")
        outcomes.append(outcome)
    return outcomes
