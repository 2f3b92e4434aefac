"""The daemon's clock, read through one object so that a test can move it.

`Clock` gives monotonic seconds (`monotonic`: holds and deadlines) and wall-clock ones (`time`).
A daemon started with `KV_ELISION_CLOCK=PATH` in its environment (tests only, as with
contextd.crashpoints' variable) adds the seconds written in that file to both: a test moves the
daemon's time past a read hold or a call's deadline by rewriting the file, and never sleeps for
one to pass. Unset, reading it costs one attribute check.

Depends on nothing of ours.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["ENV", "Clock"]

ENV = "KV_ELISION_CLOCK"


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
