"""The campaign's connections part: hostile Content-Length values, slowloris clients and a client
that stops reading its stream, against a real server with a short --client-timeout.

Depends on harness.faults and serving.launcher.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness.faults.connections import CLIENT_TIMEOUT_S, hostile_content_length, slowloris, stopped_reading
from harness.faults.oracle import CaseOutcome
from harness.faults.processes import environ_set
from harness.faults.scenarios import CRASH_ENV, IO_FAULT_ENV


def run_connections_part(args: argparse.Namespace, work: Path, zygote: Any, log: Callable[[str], None]
                         ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    from serving.launcher import ServerProcess

    server = ServerProcess(root=work / "connections", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "100000",
                                  "--client-timeout", str(CLIENT_TIMEOUT_S)])
    with environ_set(CRASH_ENV, None), environ_set(IO_FAULT_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        server.start()
    try:
        lengths = hostile_content_length(server)
        log(f"connections: {lengths.held} of {lengths.cases} hostile Content-Length values refused at once")
        loris = slowloris(server)
        log(f"connections: {loris.held} of {loris.cases} slowloris clients let go")
        stalled = stopped_reading(server)
        log(f"connections: {stalled.held} of {stalled.cases} clients that stopped reading had their turn ended")
    finally:
        server.stop()
    outcomes = []
    for name, cases in (("hostile Content-Length", lengths), ("slowloris", loris), ("stopped reading", stalled)):
        for problem in cases.problems:
            outcome = CaseOutcome(name, "connections")
            outcome.fail(problem)
            outcomes.append(outcome)
    return {"hostile_content_length": {"cases": lengths.cases, "refused_at_once": lengths.held},
            "slowloris": {"cases": loris.cases, "let_go": loris.held},
            "stopped_reading": {"cases": stalled.cases, "turn_ended": stalled.held}}, outcomes
