"""The campaign's oracle: uncrashed twins of a scenario (one run per sequence of completed
requests, computed once), what a case went through (`History`) and its outcome against its twin,
and the status a turn in flight must get when contextd dies (serving's own map says it).

Depends on serving.http_request, contextd.errors, the zygote and the campaign's scenarios.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from contextd.errors import DaemonUnavailable
from harness.faults.driver import job_drive
from harness.faults.processes import Daemon
from harness.faults.scenarios import Scenario
from harness.faults.zygote import Zygote
from serving.http_request import error_for

CONTEXTD_DOWN_STATUS = int(error_for(DaemonUnavailable("contextd is down")).status)


class Twins:
    """Uncrashed runs of a scenario, one per sequence of completed requests, computed once."""

    def __init__(self, zygote: Zygote, daemon: Daemon) -> None:
        self.zygote = zygote
        self.daemon = daemon
        self._done: dict[tuple[str, tuple[int, ...]], list[dict[str, Any]]] = {}
        self._n = 0

    def run(self, scenario: Scenario, sequence: Sequence[int]) -> list[dict[str, Any]]:
        """The ack event of each request of `sequence`, in order (answers, manifests, hits)."""
        key = (scenario.name, tuple(sequence))
        if key not in self._done:
            self._n += 1
            result = self.zygote.run(job_drive, {"scenario": scenario.name, "socket": str(self.daemon.socket),
                                                 "session": f"twin-{scenario.name}-{self._n}",
                                                 "sequence": list(sequence), "count": True})
            acks = result.of("ack")
            if result.status != 0 or len(acks) != len(sequence):
                raise RuntimeError(f"the twin of {key} failed ({result.status}): {result.error or result.events[-3:]}")
            self._done[key] = acks
        return self._done[key]

    def plain(self, scenario: Scenario) -> list[dict[str, Any]]:
        return self.run(scenario, range(len(scenario.users)))


@dataclass
class CaseOutcome:
    """One crash (or fault) case against its twin."""

    label: str
    scope: str
    reached: bool = True
    exact: bool = True
    problems: list[str] = field(default_factory=list)
    pages_lost: int = 0
    half_present: int = 0
    leaks: int = 0
    served_corrupt: int = 0
    unclear_errors: int = 0
    statuses: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def fail(self, why: str) -> None:
        self.exact = False
        if len(self.problems) < 6:
            self.problems.append(why)


class History:
    """What the client and the store went through in one case: the requests whose record was
    committed, in order (the twin's sequence), and the checks to run against that twin."""

    def __init__(self, n_requests: int) -> None:
        self.n = n_requests
        self.answers: dict[int, str] = {}
        self.completed: list[int] = []
        self.in_flight: int | None = None
        self.acks: list[tuple[int, dict[str, Any]]] = []        # (position in `completed`, ack event)
        self.inspections: list[tuple[int, dict[str, Any]]] = []  # (completed requests then, inspect event)
        self.recoveries: list[tuple[int, dict[str, Any]]] = []

    @property
    def next_request(self) -> int:
        return max(self.answers) + 1 if self.answers else 0

    def feed(self, events: list[dict[str, Any]], outcome: CaseOutcome) -> None:
        for e in events:
            if "sent" in e:
                self.in_flight = e["sent"]
            elif "ack" in e:
                self.answers[e["ack"]] = e["content"]
                self.completed.append(e["ack"])
                self.acks.append((len(self.completed), e))
                self.in_flight = None
            elif "failed" in e:
                outcome.statuses.append(int(e["status"]))
            elif "inspect" in e:
                turn = int(e["inspect"]["record_turn"])
                if self.in_flight is not None and turn == len(self.completed) + 1:
                    self.completed.append(self.in_flight)  # it died after its record: the re-send is a retry
                elif turn != len(self.completed):
                    outcome.fail(f"the record says {turn} turns, the client saw {len(self.completed)} "
                                 f"(+{'1 in flight' if self.in_flight is not None else '0'})")
                self.in_flight = None
                self.inspections.append((len(self.completed), e["inspect"]))
            elif "recovered" in e:
                self.recoveries.append((len(self.completed), e["recovered"]))

    def check(self, twin: list[dict[str, Any]], outcome: CaseOutcome) -> None:
        """Everything against the twin fed `completed` (answers, manifests after each request)."""
        def manifest_at(k: int) -> list[list[Any]]:
            return twin[k - 1]["manifest"] if k > 0 else []

        for k, found in self.inspections:
            present = {tuple(row[:1] + row[2:]) for row in found["manifest"]} if found else set()
            lost = [row[0] for row in manifest_at(k) if (row[0], row[2], row[3]) not in present
                    or row[0] in found["corrupt"]]
            outcome.pages_lost += len(lost)
            outcome.half_present += len(found["half_present"])
            if lost:
                outcome.fail(f"after {k} completed turns, pages lost: {lost[:4]}")
            if found["half_present"] or found["corrupt"]:
                outcome.fail(f"half-present {found['half_present'][:3]}, corrupt {found['corrupt'][:3]}")
        for k, recovered in self.recoveries:
            if k and [r[:2] for r in recovered["manifest"]] != [r[:2] for r in manifest_at(k)]:
                outcome.fail(f"after recovery at {k} turns the manifest differs from the twin's "
                             f"({_manifest_diff(recovered['manifest'], manifest_at(k))})")
        for position, ack in self.acks:
            want = twin[position - 1]
            if ack["content"] != want["content"]:
                outcome.fail(f"request {ack['ack']} (turn {position}): answer {ack['content']!r} != twin's "
                             f"{want['content']!r}")
            elif [r[:2] + r[3:] for r in ack["manifest"]] != [r[:2] + r[3:] for r in want["manifest"]]:
                # ids, states and sizes: K/V computed after a recovery may differ from the twin's in
                # the last bits (attention sums over another slot layout); what was stored before
                # the crash is compared byte for byte above
                outcome.fail(f"request {ack['ack']}: manifest differs from the twin's "
                             f"({_manifest_diff(ack['manifest'], want['manifest'])})")
            checks = ack["checks"]
            if not checks["ok"]:
                outcome.fail(f"request {ack['ack']}: {checks['why']}")
            outcome.leaks += int(bool(checks.get("leak")))
            outcome.served_corrupt += len(ack["served_corrupt"])


def _manifest_diff(got: list[list[Any]], want: list[list[Any]]) -> str:
    a, b = {r[0]: r[1:] for r in got}, {r[0]: r[1:] for r in want}
    extra, missing = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    moved = sorted(k for k in set(a) & set(b) if a[k][0] != b[k][0])
    other = sorted(k for k in set(a) & set(b) if a[k][1:] != b[k][1:])
    return f"extra {extra[:3]}, missing {missing[:3]}, other state {moved[:3]}, other bytes {other[:3]}"
