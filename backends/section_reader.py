"""Reading a container file on a background thread while its caller uses what has arrived.

A restore inserts a stored block layer group by layer group as its bytes come off the disk, so it
costs about the read, not the read plus the insert: `SectionReader` reads one file (header first,
then the bulk), hashing every request as it lands, and its caller waits for a section, or for the
first rows of one, then for the whole file and its checksum (`finish`) before anything read is
committed. With `land`, sections go straight into the caller's buffers (a runtime's slots) instead
of the reader's own. `ReadQueue` reads the files one caller opens on a few threads of its own, in
the order it opened them. Every wait has a deadline (backends/read_stalls.py).

The format itself (header, section table, codec) is backends/blockfile.py's; this module reads it.

Dependency rules: numpy, xxhash, backends.blockfile and backends.read_stalls only; knows nothing
of blocks, models or contextd.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import xxhash

from . import read_stalls
from .blockfile import IO_CHUNK_BYTES, ContainerError, Section, header_end, open_sized, parse_header, section_table
from .read_stalls import Progress, ReadStalled, before_read, mark_stuck, unmark_stuck

__all__ = ["ReadQueue", "SectionReader"]

# Copies out of the page cache have no readahead to keep ahead of: bigger requests, fewer calls.
_CACHED_CHUNK_BYTES = 1024 * 1024



class _Pieces:
    """Buffers that hold a file's bytes, in file order, each from a file offset: all of the file
    (a reader's `_pieces`, each from where the one before ends) or only the sections that land in
    the caller's buffers (`_landed_pieces`). Empty buffers are left out."""

    __slots__ = ("starts", "bufs")

    def __init__(self, starts: list[int], bufs: list[memoryview]) -> None:
        if not all(map(len, bufs)):
            starts, bufs = [o for o, b in zip(starts, bufs, strict=True) if len(b)], [b for b in bufs if len(b)]
        self.starts = starts
        self.bufs = bufs

    def between(self, start: int, end: int) -> list[memoryview]:
        """The buffers for the file's bytes [start, end) of pieces that cover the file, in order:
        the whole pieces inside it as they are, cut only at the two ends. Cutting every piece in
        a Python loop, twice a read (for the read, then again for its hash), slowed the restore of
        a SmolLM2 page, whose file lands in 180 pieces, warm and cold (the two alternated in one
        process: docs/journal/2026-11-29-restore-path.md, "A read's buffers without a Python loop
        per piece")."""
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        stop = bisect.bisect_left(self.starts, end)
        out = self.bufs[first:stop]
        if out:
            last_start = self.starts[stop - 1]
            if last_start + len(out[-1]) > end:
                out[-1] = out[-1][:end - last_start]
            if self.starts[first] < start:
                out[0] = out[0][start - self.starts[first]:]
        return out

    def overlapping(self, start: int, end: int) -> Iterator[tuple[int, memoryview]]:
        """The (file offset, buffer) pieces that hold any of the file's bytes [start, end), in
        order, whether or not the pieces cover the file; the first is found by bisection."""
        for j in range(max(0, bisect.bisect_right(self.starts, start) - 1), len(self.starts)):
            offset, buf = self.starts[j], self.bufs[j]
            if offset >= end:
                return
            if offset + len(buf) > start:
                yield offset, buf


class ReadQueue:
    """Reads the files a caller opens on a few threads of its own, in the order it opened them:
    every file's header first, then the bulk of each, `workers` files at a time, so the file the
    caller uses first arrives first (all at once, each would get a share of the disk and the
    first would arrive last). A thread per file cost more than it read: starting 32 of them was
    a sizeable share of a 32-page SmolLM2 restore (docs/journal/2026-12-06-backends-long-form.md).
    A thread with nothing queued waits up to `linger_s` for more before it ends: a caller that
    keeps one queue for its inserts starts no thread per insert (starting one was a visible share
    of a warm one-page restore: docs/journal/2026-11-29-restore-path.md, "Asking contextd nothing
    first")."""

    def __init__(self, workers: int, linger_s: float = 0.0) -> None:
        if workers < 1:
            raise ValueError("a read queue needs at least one worker")
        if linger_s < 0:
            raise ValueError("a read queue's threads cannot linger a negative time")
        self.workers = workers
        self.linger_s = linger_s
        self._cond = threading.Condition()
        self._heads: collections.deque[SectionReader] = collections.deque()
        self._bulk: collections.deque[SectionReader] = collections.deque()
        self._running = 0
        self._idle = 0
        # Its threads' progress, which its readers' waits share: a file queued behind another that
        # is being read is not stuck.
        self.progress = Progress()

    def add(self, reader: SectionReader) -> None:
        with self._cond:
            self._heads.append(reader)
            if self._idle:
                self._cond.notify()
            elif self._running < self.workers:
                try:
                    threading.Thread(target=self._work, name="kv-read-queue", daemon=True).start()
                except BaseException:   # no thread: the reader is not left queued for one
                    self._heads.remove(reader)
                    raise
                self._running += 1

    def withdraw(self, reader: SectionReader) -> bool:
        """Take a reader no worker has begun on off the queue; whether it was waiting there."""
        with self._cond:
            for waiting in (self._heads, self._bulk):
                if reader in waiting:
                    waiting.remove(reader)
                    return True
            return False

    def _next(self) -> tuple[SectionReader, bool] | None:
        """The next reader and whether its header is what is due, or None when this thread ends."""
        with self._cond:
            if not (self._heads or self._bulk) and self.linger_s:
                self._idle += 1
                self._cond.wait_for(lambda: bool(self._heads or self._bulk), timeout=self.linger_s)
                self._idle -= 1
            if self._heads:
                return self._heads.popleft(), True
            if self._bulk:
                return self._bulk.popleft(), False
            self._running -= 1
            return None

    def _work(self) -> None:
        while (due := self._next()) is not None:
            reader, head = due
            self.progress.touch()
            if not head:
                reader._read_bulk()
            elif reader._read_head():
                with self._cond:
                    stopped = reader._stopped.is_set()   # closed while its header was read: not queued again
                    if not stopped:
                        self._bulk.append(reader)
                if stopped:
                    reader._end()


class SectionReader:
    """Reads a container file on a background thread so a caller can use the sections that have
    arrived while the rest is still coming from disk (restore = max(read, insert), not the sum).

        with SectionReader(path, MAGIC, checksum, size) as rd:
            rd.wait("positions")          # rd.array(...) are views into the buffer being filled
            rd.wait("keys", rows=4)       # the first 4 rows (layers) of keys have arrived
            rd.finish()                   # all read and the checksum verified: only now commit

    The constructor only opens the file and checks its size; the header is read and checked on
    the thread too, so a caller opening several files has their first reads in flight at once
    (`header` and `sections` wait for it, and raise its error). With `queue`, that queue's threads
    read it, in turn (see ReadQueue). Nothing read may be committed before `finish()` returns:
    until then the checksum is unverified.

    With `landing` (section names), the caller may say where those sections go (`land`): into
    buffers of its own, such as the slots a block is restored into. From then on the reader reads
    them straight there, so those bytes are copied once, by the reader, instead of into this
    reader's buffer and then again by the caller; what it had read before is copied over by
    `land`. The reader does not wait for `land`: waiting until the caller had placed the slots
    made a warm page slower than not landing at all (benchmarks.restore:
    docs/journal/2026-11-29-restore-path.md, "Figures moved out of code comments").

    Every wait has a deadline: once no byte has arrived for READ_DEADLINE_S (the reader's thread,
    or its queue's, is stuck in the kernel on a hung disk), `header`, `wait` and `finish` raise
    ReadStalled, and `close` stops waiting for the thread. That thread may still write what it
    reads into the caller's buffers: it is listed in `stuck_reads` until it returns, and then
    zeroes what it wrote there (the caller cleared them meanwhile) and closes the file itself.
    """

    def __init__(self, path: str | os.PathLike[str], magic: bytes, expected_checksum: str, size: int,
                 queue: ReadQueue | None = None, landing: frozenset[str] = frozenset(),
                 read_here: bool = False) -> None:
        self._file = open_sized(path, size)
        self._path = os.fspath(path)
        self._magic = magic
        self._expected = expected_checksum
        self._size = size
        # Uninitialised: every byte is overwritten before it is used.
        self._mv = np.empty(size, dtype=np.uint8).data
        self._got = 0
        self._hasher = xxhash.xxh3_128()
        self._cond = threading.Condition()
        self._wanted = size
        self._head: tuple[dict[str, Any], int, dict[str, Section]] | None = None
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._ended = threading.Event()   # no thread touches the file or the buffer any more
        self._nowait: int | None = getattr(os, "RWF_NOWAIT", None)
        # Whether a read so far waited for the disk (always, where RWF_NOWAIT is not taken): a
        # file served so far from the page cache is likely all there.
        self.from_disk = self._nowait is None
        # Where each byte of the file goes: (file offset, buffer) pieces in file order; all of it
        # into this reader's buffer until `land` replaces them.
        self._pieces = _Pieces([0], [self._mv])
        self._landing = landing
        self._landed: frozenset[str] | None = None if landing else frozenset()
        self._landed_pieces = _Pieces([], [])
        self._queue = queue
        self._deadline_s = read_stalls.READ_DEADLINE_S
        self._progress = queue.progress if queue is not None else Progress()
        self._opener = threading.get_ident()
        self._stalled = False     # a wait ran out (ReadStalled): `close` does not wait again
        self._abandoned = False   # `close` returned with the thread still in a read: it cleans up
        # Whether the caller's thread reads the bulk, as it asks for it (`read_here`).
        self.pulled = read_here and self._read_head_cached()
        if self.pulled:
            return
        try:
            if queue is not None:
                queue.add(self)
            else:
                threading.Thread(target=self._run, name="kv-section-reader", daemon=True).start()
        except BaseException:   # no thread will read it
            self._file.close()
            raise

    def _read_head_cached(self) -> bool:
        """Read the header here, on the opening thread, if the page cache holds it; whether it
        did. Then the bulk is read on this thread too, as `wait` and `finish` ask for it, straight
        to where it lands and into this CPU's cache, with no hand-off to a reader thread. Where
        the disk has it, the file goes to the queue."""
        if self._nowait is None:
            return False
        # 64 KiB: a refused read of a whole 5.9 MB page cost far more kernel time than one of 64 KiB
        # and slowed the disk read that followed (docs/journal/2026-11-29-restore-path.md, "The
        # first file of an insert read by the thread that inserts it").
        upto = min(self._size, IO_CHUNK_BYTES)
        self._read(upto, wait=False)
        if self._got < upto:
            return False
        self._read_head()   # a bad header: the reader has failed and ended
        return True

    def _pull(self, upto: int) -> None:
        """A pulled reader: read up to byte `upto` here (see `_read_head_cached`)."""
        if self._ended.is_set():
            return
        try:
            self._read(upto)
            if self._got < upto:
                raise ContainerError("the file was closed before it was read")
        except BaseException as e:
            self._fail(e)
            return
        if self._got == self._size:
            self._end()

    def _run(self) -> None:
        if self._read_head():
            self._read_bulk()

    def _read_head(self) -> bool:
        """Read and check the header; whether the rest is to be read. On a failure (or a stop)
        the reader has ended."""
        try:
            if self._stopped.is_set():
                raise ContainerError("the file was closed before it was read")
            self._read(min(self._size, IO_CHUNK_BYTES))
            end = header_end(self._mv[:self._got])
            if end is not None:
                self._read(min(self._size, end))
            header, start = parse_header(self._magic, self._mv[:self._got])
            payload_len = int(header.get("payload_len", -1))
            if payload_len < 0 or start + payload_len != self._size:
                raise ContainerError(f"payload length mismatch: header says {payload_len}, "
                                     f"{self._size - start} bytes follow the header")
            sections = section_table(header)
            missing = self._landing - sections.keys()
            if missing:
                raise ContainerError(f"the file has no section {sorted(missing)[0]!r}")
        except BaseException as e:
            self._fail(e)
            return False
        with self._cond:
            self._head = (header, start, sections)
            self._cond.notify_all()
        return True

    def _read_bulk(self) -> None:
        try:
            self._read(self._size)
        except BaseException as e:
            self._fail(e)
            return
        self._end()

    def land(self, targets: dict[str, list[memoryview]]) -> None:
        """Say where the `landing` sections go: `targets[name]`, byte buffers whose concatenation
        is where that plain (uncompressed) section's bytes land, in file order; a landing section
        not in `targets` is read into this reader's buffer. Call once; the bytes read already are
        copied over here. A landed section's bytes are hashed as read and are not available
        through `rows` or `array`."""
        _, start, sections = self._wait_head()
        if self._landed is not None:
            raise RuntimeError("land() was already called")
        starts: list[int] = []
        bufs: list[memoryview] = []
        landed_starts: list[int] = []
        landed: list[memoryview] = []
        at = 0
        for name in sorted(targets, key=lambda n: sections[n].offset):
            if name not in self._landing:
                raise ValueError(f"section {name!r} was not opened for landing")
            found = sections[name]
            given = [memoryview(b).cast("B") for b in targets[name]]
            lengths = list(map(len, given))
            if found.frames is not None or sum(lengths) != found.nbytes:
                raise ValueError(f"section {name!r} cannot land in {sum(lengths)} bytes")
            first = start + found.offset
            if at < first:
                starts.append(at)
                bufs.append(self._mv[at:first])
            if given:
                offsets = list(itertools.accumulate(lengths[:-1], initial=first))
                starts += offsets
                bufs += given
                landed_starts += offsets
                landed += given
            at = first + found.nbytes
        if at < self._size:
            starts.append(at)
            bufs.append(self._mv[at:])
        with self._cond:
            # What was read already moves where it goes; a read in flight now is moved by the
            # reader once it returns (`_read`).
            self._pieces = _Pieces(starts, bufs)
            self._landed = frozenset(targets)
            self._landed_pieces = _Pieces(landed_starts, landed)
            self._move_landed(0, self._got)

    def _move_landed(self, start: int, end: int) -> None:
        """Copy the file's bytes [start, end), read into this reader's buffer, to where they land
        (only the landed pieces that overlap them: a SmolLM2 page lands in 180, and a loop over
        all of them was a measurable share of a warm restore: docs/journal/2026-11-29-restore-path.md,
        "Figures moved out of code comments")."""
        for offset, buf in self._landed_pieces.overlapping(start, end):
            a, b = max(start, offset), min(end, offset + len(buf))
            # numpy copies without the interpreter lock; a memoryview assignment holds it
            np.frombuffer(buf, np.uint8)[a - offset:b - offset] = np.frombuffer(self._mv[a:b], np.uint8)

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()
        self._end()

    def _end(self) -> None:
        """No thread touches the file or the caller's buffers any more. A reader `close` gave up
        on closes its file here, and is no longer stuck."""
        with self._cond:
            self._ended.set()
            abandoned = self._abandoned
        unmark_stuck(self)
        if abandoned:
            self._file.close()

    def _stall(self, what: str) -> ReadStalled:
        """A wait ran out: the reader is stuck until its thread returns (`stuck_reads`)."""
        self._stalled = True
        mark_stuck(self, self._path, self._progress, self._ended)
        return ReadStalled(f"{self._path}: no byte arrived for {self._deadline_s:g} s while {what} (a hung disk "
                           "or file system); the read failed and nothing of it is used")

    def _await(self, ready: Callable[[], bool], what: str) -> None:
        """Wait on `_cond` (held) until `ready()`; ReadStalled once no byte has arrived for the
        deadline, counted from this wait's start or the last byte, whichever is later."""
        began = time.monotonic()
        while not ready():
            left = max(self._progress.at, began) + self._deadline_s - time.monotonic()
            if left <= 0:
                raise self._stall(what)
            self._cond.wait(left)

    def _await_end(self) -> bool:
        """Wait until no thread touches the file, with `_await`'s deadline; whether it ended."""
        began = time.monotonic()
        while True:
            left = max(self._progress.at, began) + self._deadline_s - time.monotonic()
            if left <= 0 or self._ended.wait(left):
                return self._ended.is_set()

    def _read(self, upto: int, wait: bool = True) -> None:
        """Read and hash up to byte `upto`, publishing progress. What the page cache holds is
        copied in big requests without waiting for the disk (RWF_NOWAIT); the rest is read in
        IO_CHUNK_BYTES requests, which kernel readahead stays ahead of. Without `wait`, stop at
        the first byte the page cache does not hold."""
        fd = self._file.fileno()
        got = self._got
        while got < upto and not self._stopped.is_set():
            before_read(self._opener)
            pieces = self._pieces
            n = 0
            asked = 0
            if self._nowait is not None:
                asked = min(upto, got + _CACHED_CHUNK_BYTES) - got
                requests = pieces.between(got, got + asked)
                try:
                    n = os.preadv(fd, requests, got, self._nowait)
                except BlockingIOError:
                    n = 0
                except OSError:
                    self._nowait = None   # the file system does not take the flag
                    self.from_disk = True
            if n <= 0:
                self.from_disk = True
                if not wait:
                    return
                asked = min(upto, got + IO_CHUNK_BYTES) - got
                requests = pieces.between(got, got + asked)
                n = os.preadv(fd, requests, got)
                if not n:
                    raise ContainerError("file is shorter than its header says" if self._head is None
                                         else "file shrank while reading")
            self._progress.touch()
            # A whole request read (the usual case) hashes the buffers it was read into as they are.
            read = requests if n == asked else pieces.between(got, got + n)
            for buf in read:
                self._hasher.update(buf)
            # Publish progress, but wake the consumer only once what it waits for is here.
            with self._cond:
                if self._abandoned:
                    # Returned past its deadline: the caller cleared its buffers and went on. What
                    # landed there now is zeroed again, as the caller left them.
                    for buf in requests:
                        np.frombuffer(buf, np.uint8)[:] = 0
                    raise ContainerError("the read returned after the reader was closed")
                if self._pieces is not pieces:   # `land` came while these bytes were read
                    self._move_landed(got, got + n)
                got += n
                self._got = got
                if got >= self._wanted or got == self._size:
                    self._cond.notify_all()

    def _wait_head(self) -> tuple[dict[str, Any], int, dict[str, Section]]:
        with self._cond:
            self._await(lambda: self._head is not None or self._error is not None, "reading its header")
            if self._head is None:
                assert self._error is not None
                raise self._error
            return self._head

    @property
    def header(self) -> dict[str, Any]:
        """The container's header, once read and checked."""
        return self._wait_head()[0]

    @property
    def sections(self) -> dict[str, Section]:
        return self._wait_head()[2]

    def rows(self, section: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of `section` (call `wait(section, stop)` first): views into the
        buffer being filled, or decoded rows when the section is compressed."""
        _, first, sections = self._wait_head()
        self._check_held(section)
        return sections[section].rows(self._mv[first:], start, stop)

    def array(self, section: str) -> np.ndarray:
        """The whole of `section` (call `wait(section)` first)."""
        _, first, sections = self._wait_head()
        self._check_held(section)
        return sections[section].view(self._mv[first:])

    def _check_held(self, section: str) -> None:
        if section in self._landing and (self._landed is None or section in self._landed):
            raise RuntimeError(f"section {section!r} lands in the caller's buffers, not in the reader's")

    def wait(self, section: str, rows: int | None = None) -> None:
        """Block until `section` (or its first `rows` entries along axis 0) has been read."""
        _, first, sections = self._wait_head()
        found = sections[section]
        end = first + (found.offset + found.nbytes if rows is None else found.rows_end(rows))
        if self.pulled:
            self._pull(end)
        with self._cond:
            self._wanted = end
            self._await(lambda: self._got >= end or self._error is not None, f"reading its {section!r}")
            if self._error is not None and self._got < end:
                raise self._error

    def finish(self) -> None:
        """Wait for the whole file and verify its checksum."""
        if self.pulled:
            self._pull(self._size)
        if not self._await_end():
            raise self._stall("reading it to its end")
        if self._error is not None:
            raise self._error
        if self._got != self._size:
            raise ContainerError("the file was closed before it was read")
        if self._hasher.hexdigest() != self._expected:
            raise ContainerError("checksum mismatch (corrupted payload)")

    def close(self) -> None:
        """Stop reading and release the file once no thread touches it. Whoever still waits on
        this reader (`wait`, `header`) gets an error instead of waiting for bytes that will not come.
        A thread still in a read at the deadline (at once, for a reader whose wait ran out) is
        left to end on its own: it closes the file and zeroes what it read into the caller's
        buffers after this returned (`_read`), and is in `stuck_reads` until then."""
        with self._cond:
            self._stopped.set()
            if self._error is None and self._got < self._size:
                self._error = ContainerError("the file was closed before it was read")
            self._cond.notify_all()
        if self.pulled:   # no thread reads it
            self._end()
        if self._queue is not None and self._queue.withdraw(self):
            self._fail(ContainerError("the file was closed before it was read"))
        if not self._stalled:
            self._await_end()
        with self._cond:
            self._abandoned = not self._ended.is_set()
        if self._abandoned:
            self._stall("closing")
            return
        self._file.close()

    def __enter__(self) -> SectionReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
