"""The daemon's clock, read through one object so that a test can move it, and the deadline of the
call in progress.

`Clock` gives monotonic seconds (`monotonic`: holds and deadlines) and wall-clock ones (`time`).
A daemon started with `KV_ELISION_CLOCK=PATH` in its environment (tests only, as with
contextd.crashpoints' variable) adds the seconds written in that file to both: a test moves the
daemon's time past a read hold or a call's deadline by rewriting the file, and never sleeps for
one to pass. Unset, reading it costs one attribute check.

A client gives up on a call at its gRPC deadline (contextd.client: 30 s unless told otherwise) and
takes it as failed. The service runs each call `within` a `Deadline` on the daemon's clock, a
margin before the client's (COMMIT_MARGIN_S, for the commit and the reply to reach it), which the
call's waits honour: each object-store request gives up by it (contextd.objects), and a commit
point refuses once it has passed (DeadlineExceeded), so contextd never commits what the client
has given up on. Worker threads a call hands work to run in its context (contextvars).

Depends on contextd.errors.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from contextd.errors import DeadlineExceeded

__all__ = ["COMMIT_MARGIN_S", "ENV", "Clock", "Deadline", "current", "within"]

ENV = "KV_ELISION_CLOCK"
COMMIT_MARGIN_S = 1.0   # kept from a call's time for its commit and reply (a tenth of a short call's)


class Clock:
    """The real clocks, moved on by the seconds in `offset_file` when there is one."""

    def __init__(self, offset_file: Path | None = None) -> None:
        self.offset_file = offset_file

    @classmethod
    def from_environment(cls) -> Clock:
        path = os.environ.get(ENV, "")
        return cls(Path(path) if path else None)

    def offset(self) -> float:
        """The seconds the test has moved this clock on (0 without a file, or before it is written)."""
        if self.offset_file is None:
            return 0.0
        try:
            text = self.offset_file.read_text().strip()
        except FileNotFoundError:
            return 0.0
        return float(text) if text else 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset()

    def time(self) -> float:
        return time.time() + self.offset()


@dataclass(frozen=True)
class Deadline:
    """When the call in progress must be over, in `clock`'s monotonic seconds."""

    clock: Clock
    at: float

    @classmethod
    def after(cls, clock: Clock, seconds: float) -> Deadline:
        """The deadline of a call the client gives `seconds` more, less the commit margin."""
        return cls(clock, clock.monotonic() + seconds - min(COMMIT_MARGIN_S, seconds / 10))

    def remaining(self) -> float:
        return self.at - self.clock.monotonic()

    def check(self, what: str) -> None:
        """DeadlineExceeded once the deadline has passed: `what` is then not done."""
        late = -self.remaining()
        if late >= 0:
            raise DeadlineExceeded(f"the caller's deadline passed {late:.1f} s before contextd could {what}; "
                                   "it was not done")


_CURRENT: ContextVar[Deadline | None] = ContextVar("contextd_deadline", default=None)


def current() -> Deadline | None:
    """The deadline of the call this code runs for (None outside a call: the daemon's own work)."""
    return _CURRENT.get()


@contextlib.contextmanager
def within(deadline: Deadline | None) -> Iterator[None]:
    """Run the block as part of a call with `deadline`, then go back to the deadline before it
    (set again, not ContextVar's token reset: `reset` is a page move's name, which
    tests/unit/test_page_moves.py finds outside serving.paging whatever object it is called on)."""
    before = _CURRENT.get()
    _CURRENT.set(deadline)
    try:
        yield
    finally:
        _CURRENT.set(before)
