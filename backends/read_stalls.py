"""Reads that stop: the deadline of every wait on a file being read, the reads that ran past it,
and the hook that wedges a read for the tests.

A restore reads its files on reader threads (backends/section_reader.py) while it holds the
runtime's lock, so a disk or network file system that hangs must not hold it for ever: a wait
fails (`ReadStalled`) once no byte has arrived for READ_DEADLINE_S. The reader's thread may still
be in the kernel then, and may still write what it reads into the caller's buffers until it
returns; it is listed here (`stuck_reads`) until then, and a server refuses turns meanwhile
(serving/http.py). This is apart from the reader because it is what the rest of the process asks
about reads (the server's health, the fault campaign's hooks, its deadline) without reaching into
how a file is read.

Dependency rules: the standard library only.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "READ_DEADLINE_ENV",
    "READ_DEADLINE_S",
    "READ_HANG_ENV",
    "Progress",
    "ReadHook",
    "ReadStalled",
    "StuckRead",
    "before_read",
    "mark_stuck",
    "set_read_hook",
    "stuck_reads",
    "unmark_stuck",
]

# A wait on a reader fails (ReadStalled) once no byte has arrived for this many seconds: the disk
# or network file system under the store has hung, and a restore must not wait for it for ever,
# holding the runtime's lock. KV_ELISION_READ_DEADLINE sets it in a process's environment (the
# tests' wedged readers; a file system slower than any disk).
READ_DEADLINE_ENV = "KV_ELISION_READ_DEADLINE"
READ_DEADLINE_S = float(os.environ.get(READ_DEADLINE_ENV) or 30.0)
# Tests and the reliability campaign only: KV_ELISION_READ_HANG=FIFO[:N[:reader|caller]] wedges
# the N-th read (`_HangAt`).
READ_HANG_ENV = "KV_ELISION_READ_HANG"


class ReadStalled(TimeoutError):
    """No byte of a file being read arrived within READ_DEADLINE_S: its reader is stuck in the
    kernel (a hung disk or file system). Not a ContainerError: nothing says the file is bad, and a
    reader that may still write into the caller's buffers leaves them unusable until it returns
    (`stuck_reads`), so the whole read the caller was doing fails, not one file of it. An OSError,
    as the disk's own errors are."""


@dataclass(frozen=True)
class StuckRead:
    """A reader whose wait ran out while its thread was still in a read (`stuck_reads`)."""

    path: str
    stalled_s: float   # since its last byte arrived


class Progress:
    """When a reader (or the read queue it is on) last got bytes: a wait's deadline runs from there."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = time.monotonic()

    def touch(self) -> None:
        self.at = time.monotonic()


_STUCK_LOCK = threading.Lock()
# By the reader's id: (the reader, its path, its progress) for every reader past its deadline whose
# thread has not returned. Holding the reader keeps its id from being reused while it is listed.
_STUCK: dict[int, tuple[object, str, Progress]] = {}


def stuck_reads() -> list[StuckRead]:
    """The reads in this process that ran past their deadline and have not returned yet. While
    there is one, buffers it was given may still be written (a restore's free slots, zeroed again
    when it returns): a server refuses turns until it has returned, and its /health says so."""
    now = time.monotonic()
    with _STUCK_LOCK:
        return [StuckRead(path, now - progress.at) for _, path, progress in _STUCK.values()]


def mark_stuck(reader: object, path: str, progress: Progress, ended: threading.Event) -> None:
    """List `reader`, whose wait ran out, unless its thread has ended (`ended`) meanwhile."""
    with _STUCK_LOCK:
        if not ended.is_set():
            _STUCK[id(reader)] = (reader, path, progress)


def unmark_stuck(reader: object) -> None:
    """`reader`'s thread touches its file and buffers no more (called after `ended` is set)."""
    with _STUCK_LOCK:
        _STUCK.pop(id(reader), None)


ReadHook = Callable[[bool], None]


class _HangAt:
    """The read hook KV_ELISION_READ_HANG=FIFO[:N[:reader|caller]] installs: the N-th read request
    (1 unless given) on a reader's own thread (`reader`: a read queue's or a reader's thread) or on
    the thread that opened the file (`caller`: a restore reading a file itself) blocks in open(2)
    of FIFO until another process opens its writing end. It is stuck in the kernel, as a read from
    a hung disk is, for as long as the test wants; `O_WRONLY | O_NONBLOCK` on the FIFO releases it
    (ENXIO: no read has reached it yet)."""

    def __init__(self, spec: str) -> None:
        fifo, _, rest = spec.partition(":")
        nth, _, where = rest.partition(":")
        self.fifo = fifo
        self.nth = int(nth or 1)
        self.where = where or "reader"
        if self.where not in ("reader", "caller") or self.nth < 1 or not fifo:
            raise ValueError(f"{READ_HANG_ENV} is FIFO[:N[:reader|caller]], not {spec!r}")
        self.count = 0
        self.lock = threading.Lock()

    def __call__(self, on_opener: bool) -> None:
        if on_opener != (self.where == "caller"):
            return
        with self.lock:
            self.count += 1
            due = self.count == self.nth
        if due:
            with open(self.fifo, "rb"):
                pass


_read_hook: ReadHook | None = _HangAt(os.environ[READ_HANG_ENV]) if os.environ.get(READ_HANG_ENV) else None


def set_read_hook(hook: ReadHook | None) -> ReadHook | None:
    """Tests and the reliability campaign: call `hook(on_opener)` before every read request of a
    SectionReader (`on_opener`: on the thread that opened the file), to wedge a reader or run the
    garbage collector on a reader's thread. Returns the hook it replaces."""
    global _read_hook
    before, _read_hook = _read_hook, hook
    return before


def before_read(opener: int) -> None:
    """What a reader calls before every read request: the read hook, if one is set, told whether
    the request runs on `opener`, the thread that opened the file."""
    if _read_hook is not None:
        _read_hook(threading.get_ident() == opener)
