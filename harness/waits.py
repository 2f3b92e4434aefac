"""Waits on what another thread or process does, each with a deadline: the one place tests and
benchmarks poll (tests/ call no `time.sleep` of their own).

`wait_until` polls a condition that some other party makes true (a server's worker, a daemon,
a reader thread), failing with what was awaited once its deadline passes. `outage` holds a real
process's outage for a set time where the thing under test runs on a clock of its own that no
test can inject (gRPC's reconnect backoff). Depends on nothing of ours.
"""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.05


def wait_until(condition: Callable[[], bool], seconds: float, what: str, poll_s: float = POLL_S) -> None:
    """Return once `condition()` holds; AssertionError naming `what` if it still does not after
    `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {seconds:g} s for {what}")
        time.sleep(poll_s)


def outage(seconds: float) -> None:
    """Let an outage last `seconds` of wall time: for a component whose timers are its own (a gRPC
    channel's backoff), the length of the outage is the input under test."""
    time.sleep(seconds)
