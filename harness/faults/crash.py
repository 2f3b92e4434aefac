"""Crashes: kill -9 at named crash points (contextd.crashpoints) in the serving code and in
contextd, planned over every point by how often an uncrashed run reaches it, each case recovered
and checked against its twin; and the history crash points, planned over the request of a
scenario whose client edits its history (a cut back and a regrow).

Depends on the zygote, the oracle and the campaign's processes and scenarios.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from harness.faults.driver import job_drive
from harness.faults.oracle import CONTEXTD_DOWN_STATUS, CaseOutcome, History, Twins
from harness.faults.processes import Daemon
from harness.faults.scenarios import Scenario
from harness.faults.zygote import Zygote


@dataclass(frozen=True)
class CrashSpec:
    where: str   # "server" (the serving child) or "contextd" (the daemon)
    name: str
    n: int

    def label(self) -> str:
        return f"{self.name}:{self.n}"


class CrashCampaign:
    def __init__(self, zygote: Zygote, daemon: Daemon, twins: Twins) -> None:
        self.zygote = zygote
        self.daemon = daemon
        self.twins = twins
        self.count = 0

    def case(self, scenario: Scenario, specs: Sequence[CrashSpec]) -> CaseOutcome:
        """Run the scenario under `specs` (one per process life: the first child dies at the first,
        the next at the second, ...), recover after each, finish the session, check it all."""
        self.count += 1
        sid = f"c{self.count:04d}-{scenario.name}"
        label = " then ".join(f"{s.where}:{s.label()}" for s in specs) or "none"
        outcome = CaseOutcome(label, "+".join(sorted({s.where for s in specs})))
        history = History(len(scenario.users))
        started = time.monotonic()
        lives = [*specs, None]
        for life, spec in enumerate(lives):
            if history.next_request >= history.n and life > 0 and spec is None:
                # every request was acknowledged before the last crash point was reached
                outcome.reached = False
                break
            params: dict[str, Any] = {"scenario": scenario.name, "socket": str(self.daemon.socket), "session": sid,
                                      "sequence": list(range(history.next_request, history.n)),
                                      "answers": history.answers, "inspect": life > 0}
            if spec is not None and spec.where == "server":
                params["crash"] = [spec.name, spec.n]
            if spec is not None and spec.where == "contextd":
                params["stays_up"] = True
                self.daemon.restart(crash=spec.label())
                self.daemon.watch()
                crashed_before = self.daemon.crashed
            result = self.zygote.run(job_drive, params)
            if spec is not None and spec.where == "contextd":
                self.daemon.unwatch()
                if self.daemon.crashed == crashed_before:
                    outcome.reached = False
                self.daemon.restart()  # no crash point left armed
            history.feed(result.events, outcome)
            for failed in result.of("failed"):
                if failed["status"] != CONTEXTD_DOWN_STATUS:
                    outcome.unclear_errors += 1
                    outcome.fail(f"a request in flight when contextd died got {failed['status']}, "
                                 f"not {CONTEXTD_DOWN_STATUS}: {failed['error'][:160]}")
            if spec is not None and spec.where == "server":
                if result.status != -signal.SIGKILL:
                    if result.status == 0:
                        outcome.reached = False
                        break
                    outcome.fail(f"the child ended with {result.status}, not at its crash point: {result.error[-600:]}")
                    break
            elif result.status != 0:
                outcome.fail(f"the run ended with {result.status}: {result.error[-600:]}")
                break
            if spec is None or spec.where == "contextd":
                break  # this life served the session to its end
        if outcome.reached and outcome.exact:
            # the manifest and the answers must be what an uncrashed server fed the completed requests gives
            twin = self.twins.run(scenario, history.completed)
            history.check(twin, outcome)
            if history.next_request < history.n:
                outcome.fail(f"the session stopped at request {history.next_request} of {history.n}")
        outcome.seconds = time.monotonic() - started
        return outcome


SERVER_POINTS = ("serving.prefill.chunk", "serving.decode.token", "serving.evict.removed",
                 "serving.restore.inserted", "serving.store.payload_written", "serving.store.recorded",
                 "serving.blob.temp_written", "serving.blob.renamed", "serving.persist.pages_stored",
                 "serving.persist.recorded")

CONTEXTD_POINTS = ("contextd.commit.begin", "contextd.commit.durable")


def _spread(total: int, k: int) -> list[int]:
    """k hit numbers spread evenly over 1..total (all of them when total <= k)."""
    if total <= k:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (k - 1)) for i in range(k)}) if k > 1 else [1]


def hit_in(plain: list[dict[str, Any]], name: str, request: int, k: int = 1) -> int:
    """The hit number of the `k`-th time `name` is reached while request `request` runs (the twin's counts)."""
    if plain[request]["hits"].get(name, 0) < k:
        raise ValueError(f"{name} is reached {plain[request]['hits'].get(name, 0)} times in request {request}")
    return int(sum(ack["hits"].get(name, 0) for ack in plain[:request])) + k


def plan_crashes(twins: Twins, scenario: Scenario, budget: int) -> list[list[CrashSpec]]:
    """About `budget` cases for one scenario, spread over every crash point by how often the
    uncrashed run reaches it: single crashes in the server and in contextd, and double ones (a
    crash, then another during the recovery: restoring resident pages, or contextd mid-commit)."""
    plain = twins.plain(scenario)
    totals: dict[str, int] = {}
    for ack in plain:
        for name, n in ack["hits"].items():
            totals[name] = totals.get(name, 0) + n
    capacity = {("server", name): totals.get(name, 0) for name in SERVER_POINTS if totals.get(name, 0)}
    capacity.update({("contextd", name): sum(ack["commits"] for ack in plain) for name in CONTEXTD_POINTS})

    def after_second(name: str) -> int:  # hits from the third request on: resident pages exist by then
        return totals.get(name, 0) - int(sum(ack["hits"].get(name, 0) for ack in plain[:2]))

    capacity[("double", "serving.store.recorded")] = after_second("serving.store.recorded")
    capacity[("double", "serving.decode.token")] = after_second("serving.decode.token")
    share = {kind: 0 for kind in capacity}
    left = budget
    while left > 0 and any(share[k] < capacity[k] for k in share):
        for kind in share:
            if left > 0 and share[kind] < capacity[kind]:
                share[kind] += 1
                left -= 1
    cases: list[list[CrashSpec]] = []
    resident = max(1, scenario.budget // 128 - 2)
    for (where, name), count in share.items():
        if where != "double":
            cases += [[CrashSpec(where, name, n)] for n in _spread(capacity[(where, name)], count)]
            continue
        early = totals.get(name, 0) - capacity[(where, name)]
        for k, n in enumerate(_spread(capacity[(where, name)], count)):
            second = (CrashSpec("server", "serving.recover.resident_page", 1 + k % resident)
                      if name == "serving.store.recorded"
                      else CrashSpec("contextd", "contextd.commit.begin", 1 + k % 3))
            cases.append([CrashSpec("server", name, early + n), second])
    return cases


def plan_history_crashes(twins: Twins, scenario: Scenario, budget: int) -> list[list[CrashSpec]]:
    """About `budget` single crashes, all while the request that edits the client's history runs
    (the session cut back to the edit, then everything after it prefilled again, regrown pages
    stored as they are evicted, then persisted), spread over the server's points by how often
    that request reaches them, and over its contextd commits. Every page the last record names
    must survive each (a regrown page once took the id, and with it the payload, of a page of the
    history before the edit)."""
    edit = scenario.edit
    if edit is None:
        raise ValueError(f"scenario {scenario.name} edits no history")
    plain = twins.plain(scenario)
    during = plain[edit.at]
    capacity = {("server", name): during["hits"].get(name, 0) for name in SERVER_POINTS if during["hits"].get(name)}
    capacity.update({("contextd", name): int(during["commits"]) for name in CONTEXTD_POINTS})
    share = {kind: 0 for kind in capacity}
    left = budget
    while left > 0 and any(share[k] < capacity[k] for k in share):
        for kind in share:
            if left > 0 and share[kind] < capacity[kind]:
                share[kind] += 1
                left -= 1
    commits_before = int(sum(ack["commits"] for ack in plain[:edit.at]))
    cases: list[list[CrashSpec]] = []
    for (where, name), count in share.items():
        for k in _spread(capacity[(where, name)], count):
            n = hit_in(plain, name, edit.at, k) if where == "server" else commits_before + k
            cases.append([CrashSpec(where, name, n)])
    return cases
