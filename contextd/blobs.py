"""The canonical K/V store: immutable payload files, never database rows.

A payload is written to a temporary name in its session's folder, fsynced, renamed to a name
that carries its checksum, and the folder is fsynced, so a reader sees either no file or the
whole file. A payload is never rewritten in place: new bytes get a new name. Every read checks
the byte size and the xxh3-128 checksum recorded in the manifest; a missing or mismatched file
raises DataCorrupt and is never handed out.

The free-space reserve and the optional quota are checked here (`shortfall`); what to drop
when space runs short is the daemon's decision, not this module's.

Payloads are written by the serving process on the same host (contextd.client.Payloads: the file
first, then its manifest record through the daemon); the daemon reads them for `verify` and
deletes them. This is the one durable write path of the project. Files are 0600 in 0700 folders:
they hold the user's source code. A write that the filesystem refuses for want of space (ENOSPC,
EDQUOT) raises StoreFull, like a write the reserve refuses; any other OSError (EIO, EROFS, ...)
propagates as it is, and either way no file is left under a payload name.

Fault injection (`inject`, or `KV_ELISION_IO_FAULT=OP:ERRNO[:N[:TIMES]]` in the environment of a
process): every file operation here passes `_io(op, path)` first, so the reliability campaign
(benchmarks.faults, tests/reliability) can make the N-th write, fsync, rename, ... fail with ENOSPC,
EIO or EROFS exactly where the kernel would, on machines where a small tmpfs cannot be mounted.
Unset, it costs one global lookup per operation. Depends on xxhash and contextd.errors / .ids /
.paths / .crashpoints.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import xxhash

from contextd import crashpoints
from contextd.errors import DataCorrupt, FailedPrecondition, InvalidArgument, StoreFull
from contextd.ids import check_id
from contextd.paths import private_folder

TEMP_PREFIX = ".tmp-"
_IOV_MAX = 512
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

# ---------------------------------------------------------------------------- fault injection

IO_FAULT_ENV = "KV_ELISION_IO_FAULT"
IO_OPS = ("mkdir", "open", "write", "fsync", "rename", "dirsync", "unlink", "link")


@dataclass
class IOFault:
    """OSError(`error`) at the `nth` `op` from now on, and at the `times` - 1 after it (0: at
    every one from the nth on). `seen` and `fired` say how far it got."""

    op: str
    error: int
    nth: int = 1
    times: int = 1
    seen: int = 0
    fired: int = 0

    def __post_init__(self) -> None:
        if self.op not in IO_OPS:
            raise ValueError(f"unknown file operation {self.op!r}: use one of {', '.join(IO_OPS)}")
        if self.nth < 1 or self.times < 0:
            raise ValueError("a fault needs nth >= 1 and times >= 0")


def _parse_fault(spec: str) -> IOFault | None:
    """`OP:ERRNO[:N[:TIMES]]`, e.g. `write:ENOSPC`, `fsync:EIO:3`, `open:EROFS:1:0`."""
    if not spec:
        return None
    parts = spec.split(":")
    code = getattr(errno, parts[1], None) if len(parts) >= 2 else None
    if len(parts) > 4 or not isinstance(code, int) or not all(p.isdigit() for p in parts[2:]):
        raise ValueError(f"{IO_FAULT_ENV}={spec!r}: expected OP:ERRNO[:N[:TIMES]], e.g. write:ENOSPC:2")
    numbers = [int(p) for p in parts[2:]]
    return IOFault(parts[0], code, *numbers)


_fault: IOFault | None = _parse_fault(os.environ.get(IO_FAULT_ENV, ""))


def inject(op: str, error: int, nth: int = 1, times: int = 1) -> IOFault:
    """Arm one fault in this process (replacing any other); return it, to read `fired` later."""
    global _fault
    _fault = IOFault(op, error, nth, times)
    return _fault


def clear_fault() -> IOFault | None:
    """Disarm; return the fault that was armed (the disk has room again, the device came back)."""
    global _fault
    fault, _fault = _fault, None
    return fault


def _io(op: str, path: object) -> None:
    fault = _fault
    if fault is None or fault.op != op:
        return
    fault.seen += 1
    if fault.seen >= fault.nth and (fault.times == 0 or fault.fired < fault.times):
        fault.fired += 1
        raise OSError(fault.error, os.strerror(fault.error), str(path))

# ----------------------------------------------------------------------------------------------
_LOCATOR = re.compile(r"[A-Za-z0-9_:\-][A-Za-z0-9._:\-]{0,127}/[A-Za-z0-9_:\-][A-Za-z0-9._:\-]{0,200}")


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _io("dirsync", path)
        os.fsync(fd)
    finally:
        os.close(fd)


def checksum(data: bytes | bytearray | memoryview) -> str:
    """xxh3-128 of a payload as 32 lowercase hex digits."""
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class StoredBlob:
    locator: str
    byte_size: int
    checksum: str


@dataclass(frozen=True)
class Reserve:
    """Space the store must leave free on its filesystem, and an optional cap on its own size.

    The reserve is the larger of `bytes` and `percent` of the filesystem's size; a quota of 0
    means no cap beyond the reserve.
    """

    bytes: int = 1 << 30
    percent: float = 0.0
    quota_bytes: int = 0

    def __post_init__(self) -> None:
        if self.bytes < 0 or self.quota_bytes < 0:
            raise InvalidArgument("reserve and quota must not be negative")
        if not 0.0 <= self.percent < 100.0:
            raise InvalidArgument(f"reserve percent {self.percent} is outside [0, 100)")


class BlobStore:
    """Payload files under `root`, one folder per session."""

    def __init__(self, root: Path, reserve: Reserve | None = None) -> None:
        self.root = root
        self.reserve = reserve or Reserve()
        private_folder(root)  # payloads are the user's code: 0700 folders

    def locator(self, session_id: str, name: str, digest: str, suffix: str) -> str:
        check_id(session_id, "session_id")
        check_id(name, "payload name")
        return f"{session_id}/{name}.{digest[:16]}.{suffix}"

    def shared_locator(self, locator: str, session_id: str) -> str:
        """Where `session_id`'s share of the payload at `locator` is named: the same file name in its
        folder (names are unique per content and page)."""
        return f"{check_id(session_id, 'session_id')}/{self.path(locator).name}"

    def path(self, locator: str) -> Path:
        if _LOCATOR.fullmatch(locator) is None or "/." in locator:
            raise InvalidArgument(f"locator {locator[:60]!r} is not a store-relative payload name")
        return self.root / locator

    def write(self, session_id: str, name: str, data: bytes | Sequence[memoryview], suffix: str = "kv",
              sync_folder: bool = True) -> StoredBlob:
        """Write a payload durably under a fresh immutable name; return where it went.

        `data` is the bytes or a list of buffers written back to back (a block file straight
        from its arrays, see backends.blockfile.pack). The checksum is computed while writing.
        With `sync_folder=False` the file's contents are durable but its name is not until
        `sync_folder(session_id)`: a batch of pages pays one directory fsync, not one each."""
        check_id(session_id, "session_id")
        check_id(name, "payload name")
        pending = [memoryview(data)] if isinstance(data, bytes) else [memoryview(p).cast("B") for p in data if len(p)]
        size = sum(len(p) for p in pending)
        try:
            return self._write(session_id, name, pending, suffix, sync_folder)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise StoreFull(f"no room on the store's filesystem for a {size}-byte payload "
                                f"({exc.strerror}); nothing stored was touched") from exc
            raise

    def sync_folder(self, session_id: str) -> None:
        """Make the names of the session's payloads written so far durable."""
        check_id(session_id, "session_id")
        try:
            fsync_dir(self.root / session_id)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise StoreFull(f"no room on the store's filesystem to record new payload names "
                                f"({exc.strerror}); nothing recorded was touched") from exc
            raise

    def _write(self, session_id: str, name: str, pending: list[memoryview], suffix: str,
               sync_folder: bool) -> StoredBlob:
        folder = self.root / session_id
        _io("mkdir", folder)
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = folder / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        hasher = xxhash.xxh3_128()
        total = 0
        _io("open", temp)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for piece in pending:
                hasher.update(piece)
                total += len(piece)
            while pending:
                _io("write", temp)
                written = os.writev(fd, pending[:_IOV_MAX])
                if written <= 0:
                    raise OSError(f"{temp}: write made no progress")
                while written and written >= len(pending[0]):
                    written -= len(pending.pop(0))
                if written:
                    pending[0] = pending[0][written:]
            crashpoints.reached("serving.blob.temp_written")  # a kill here leaves a temporary file
            _io("fsync", temp)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            temp.unlink(missing_ok=True)
            raise
        os.close(fd)
        digest = hasher.hexdigest()
        locator = self.locator(session_id, name, digest, suffix)
        try:
            _io("rename", temp)
            os.replace(temp, self.path(locator))
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        crashpoints.reached("serving.blob.renamed")  # a kill here leaves a file no manifest row names
        if sync_folder:
            fsync_dir(folder)
        return StoredBlob(locator, total, digest)

    def read(self, locator: str, expected_checksum: str, expected_size: int) -> bytes:
        """The payload's bytes, after checking size and checksum; DataCorrupt otherwise."""
        path = self.path(locator)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise DataCorrupt(f"payload {locator} is missing from the store") from None
        if len(data) != expected_size:
            raise DataCorrupt(f"payload {locator} has {len(data)} bytes, the manifest says {expected_size}")
        actual = checksum(data)
        if actual != expected_checksum:
            raise DataCorrupt(f"payload {locator} failed its checksum ({actual} != {expected_checksum})")
        return data

    def exists(self, locator: str, size: int) -> bool:
        try:
            return self.path(locator).stat().st_size == size
        except FileNotFoundError:
            return False

    def link(self, locators: Sequence[str], session_id: str) -> dict[str, str]:
        """Give `session_id` the payloads at `locators` without copying a byte: a hard link each in
        its folder, under the same file name (names are unique per content and page). Returns old
        locator -> new; made durable with one folder fsync. All or nothing: a payload that is
        missing (FailedPrecondition) or a full disk (StoreFull) leaves no link behind."""
        folder = self.root / check_id(session_id, "session_id")
        made: dict[str, str] = {}
        try:
            _io("mkdir", folder)
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            for locator in locators:
                source = self.path(locator)
                target = self.shared_locator(locator, session_id)
                _io("link", source)
                os.link(source, self.path(target))
                made[locator] = target
            fsync_dir(folder)
        except BaseException as exc:
            for target in made.values():
                self.delete(target)
            if isinstance(exc, FileNotFoundError):
                raise FailedPrecondition(f"payload {exc.filename} went while it was being shared; "
                                         "nothing was shared, try again") from exc
            if isinstance(exc, OSError) and exc.errno in _NO_SPACE:
                raise StoreFull(f"no room on the store's filesystem to share {len(locators)} payloads "
                                f"({exc.strerror}); nothing was shared") from exc
            raise
        return made

    def delete(self, locator: str) -> int:
        """Remove a payload's name; return the bytes freed: 0 when it was already gone, or when
        another session still shares the file (a branch's hard link)."""
        path = self.path(locator)
        try:
            stat = path.stat()
            _io("unlink", path)
            path.unlink()
        except FileNotFoundError:
            return 0
        return stat.st_size if stat.st_nlink == 1 else 0

    def delete_session(self, session_id: str) -> int:
        """Remove a session's folder; return the bytes freed (files another session shares free none)."""
        folder = self.root / check_id(session_id, "session_id")
        if not folder.exists():
            return 0
        freed = sum(stat.st_size for p in folder.iterdir() if p.is_file() and (stat := p.stat()).st_nlink == 1)
        shutil.rmtree(folder)
        return freed

    def files(self) -> Iterator[tuple[str, Path]]:
        """Every file in the store as (locator, path), temporary files included."""
        for folder in sorted(self.root.iterdir()):
            if folder.is_dir():
                for path in sorted(folder.iterdir()):
                    if path.is_file():
                        yield f"{folder.name}/{path.name}", path

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def reserve_bytes(self) -> int:
        st = os.statvfs(self.root)
        return max(self.reserve.bytes, int(st.f_blocks * st.f_frsize * self.reserve.percent / 100.0))

    def shortfall(self, incoming: int, store_bytes: int) -> int:
        """Bytes that must be freed before `incoming` more can be written (0: go ahead)."""
        short_of_reserve = self.reserve_bytes() + incoming - self.free_bytes()
        over_quota = store_bytes + incoming - self.reserve.quota_bytes if self.reserve.quota_bytes else 0
        return max(0, short_of_reserve, over_quota)
