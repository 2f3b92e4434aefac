"""Named crash points, for the reliability campaign (benchmarks.faults).

`reached("serving.store.payload_written")` is a no-op unless the process was started with
`KV_ELISION_CRASH_AT=NAME:N`: then the N-th time NAME is reached, the process sends itself
SIGKILL, exactly as a power cut or an OOM kill would end it (no cleanup, no flush). The campaign
starts the server or the daemon with one crash point, lets it die there, restarts it and checks
what survived against an uncrashed twin. The cost when unset is one dictionary lookup.

Shared by both processes (serving imports it; it depends on nothing).
"""

from __future__ import annotations

import os
import signal

ENV = "KV_ELISION_CRASH_AT"


def _parse(spec: str) -> tuple[str, int] | None:
    if not spec:
        return None
    name, _, count = spec.rpartition(":")
    if not name or not count.isdigit() or int(count) < 1:
        raise ValueError(f"{ENV}={spec!r}: expected NAME:N with N >= 1")
    return name, int(count)


_TARGET = _parse(os.environ.get(ENV, ""))
_hits = 0


def reached(name: str) -> None:
    """Die here (SIGKILL) when this is the crash point the process was started with."""
    global _hits
    if _TARGET is None or _TARGET[0] != name:
        return
    _hits += 1
    if _hits == _TARGET[1]:
        os.kill(os.getpid(), signal.SIGKILL)
