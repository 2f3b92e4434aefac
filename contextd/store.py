"""LMDB tables with msgpack records, and the one writer that batches.

Every value is `xxh64(payload) || msgpack(payload)`: a record whose checksum fails to match is
reported as corrupt instead of being decoded into nonsense. Keys are identifier parts joined by
NUL (see contextd.ids), so a session's rows are one contiguous prefix range in every table.

Writes go through `Store.write(op)`. Callers on many threads hand in operations; whichever
caller finds the writer idle becomes the writer for everything queued at that moment and commits
it as one LMDB transaction (group commit). Each operation runs in its own nested transaction, so
one bad request aborts alone while the rest of the batch commits. A caller returns only after
the batch is durable under the configured sync mode.

A commit the disk refuses for want of space (ENOSPC, or LMDB's map full) fails its batch with
StoreFull, as a payload write does; nothing of the batch is applied.

Depends on lmdb, msgpack, xxhash, contextd.errors and contextd.paths; knows nothing about gRPC.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Generic, TypeVar

import lmdb
import msgpack
import xxhash

from contextd import crashpoints
from contextd.errors import ContextdError, DataCorrupt, InvalidArgument, StoreFull
from contextd.paths import private_file, private_folder

SCHEMA_VERSION = 2

TABLES = (
    "meta",         # schema version, commit sequence, last commit latency
    "sessions",     # session_id -> session record, with page-count aggregates kept in step
    "kv_manifest",  # session, page_id -> page record (identity, range, state, locator, checksum, view)
    "page_state",   # session, state, page_id -> b"" (index for queries by state)
    "blocks",       # session, block_id -> unit / cluster record (pages, summary)
    "pins",         # session, page_id -> {"kind"}
    "leases",       # session, page_id -> {"until_turn", "expires_unix"}
    "snapshots",    # session, slot -> recurrent-state snapshot record
    "records",      # session -> the session record (turn, fingerprint, hashes, ledger, counters)
    "segments",     # session, seq (12 digits) -> one transcript segment (text, token ids, generated)
)


class SyncMode(Enum):
    """How much a commit waits for the disk. See docs/contextd.md for the risk of each."""

    FULL = "full"  # data and meta pages flushed before a commit returns: a crash loses nothing acknowledged
    META = "meta"  # data flushed, meta page not: a crash may lose the last acknowledged commits, never corrupts
    NONE = "none"  # nothing flushed: an OS crash or power loss may lose recent commits (a process crash loses none)

    @classmethod
    def parse(cls, text: str) -> SyncMode:
        try:
            return cls(text)
        except ValueError:
            raise InvalidArgument(f"unknown sync mode {text!r}: use one of full, meta, none") from None


def encode(record: dict[str, Any]) -> bytes:
    payload: bytes = msgpack.packb(record, use_bin_type=True)
    return xxhash.xxh64_digest(payload) + payload


def decode(value: bytes, where: bytes) -> dict[str, Any]:
    digest, payload = value[:8], value[8:]
    if xxhash.xxh64_digest(payload) != digest:
        raise DataCorrupt(f"record {where!r} failed its checksum")
    record: dict[str, Any] = msgpack.unpackb(payload, raw=False)
    return record


class Txn:
    """A transaction over named tables with record encoding; read-only or read-write."""

    def __init__(self, txn: Any, dbs: dict[str, Any]) -> None:
        self._txn = txn
        self._dbs = dbs

    def get(self, table: str, key: bytes) -> dict[str, Any] | None:
        value = self._txn.get(key, db=self._dbs[table])
        return None if value is None else decode(bytes(value), key)

    def has(self, table: str, key: bytes) -> bool:
        return self._txn.get(key, db=self._dbs[table]) is not None

    def put(self, table: str, key: bytes, record: dict[str, Any]) -> None:
        self._txn.put(key, encode(record), db=self._dbs[table])

    def put_raw(self, table: str, key: bytes, value: bytes = b"") -> None:
        self._txn.put(key, value, db=self._dbs[table])

    def delete(self, table: str, key: bytes) -> bool:
        return bool(self._txn.delete(key, db=self._dbs[table]))

    def scan_keys(self, table: str, prefix: bytes, start_after: bytes | None = None) -> Iterator[bytes]:
        cursor = self._txn.cursor(db=self._dbs[table])
        first = prefix if start_after is None else start_after
        if not cursor.set_range(first):
            return
        for key in cursor.iternext(keys=True, values=False):
            key = bytes(key)
            if not key.startswith(prefix):
                return
            if start_after is not None and key == start_after:
                continue
            yield key

    def scan(self, table: str, prefix: bytes, start_after: bytes | None = None
             ) -> Iterator[tuple[bytes, dict[str, Any]]]:
        cursor = self._txn.cursor(db=self._dbs[table])
        first = prefix if start_after is None else start_after
        if not cursor.set_range(first):
            return
        for key, value in cursor.iternext(keys=True, values=True):
            key = bytes(key)
            if not key.startswith(prefix):
                return
            if start_after is not None and key == start_after:
                continue
            yield key, decode(bytes(value), key)

    def delete_prefix(self, table: str, prefix: bytes) -> int:
        keys = list(self.scan_keys(table, prefix))
        for key in keys:
            self._txn.delete(key, db=self._dbs[table])
        return len(keys)


T = TypeVar("T")


@dataclass
class CommitInfo:
    commit_seq: int
    commit_ms: float


@dataclass
class _Pending(Generic[T]):
    op: Callable[[Txn], T]
    result: T | None = None
    error: BaseException | None = None
    info: CommitInfo | None = None
    done: bool = False


class Store:
    """The LMDB environment: named tables, group-committed writes, consistent reads."""

    def __init__(self, path: Path, sync: SyncMode = SyncMode.FULL, map_size: int = 1 << 34) -> None:
        private_folder(path)  # the records hold the transcript: the user's code
        self.sync = sync
        self._env = lmdb.open(
            str(path),
            mode=0o600,
            map_size=map_size,
            max_dbs=len(TABLES) + 1,
            max_readers=256,
            sync=sync is not SyncMode.NONE,
            metasync=sync is SyncMode.FULL,
            subdir=True,
        )
        for name in ("data.mdb", "lock.mdb"):  # made by an older contextd with lmdb's default 0644
            private_file(path / name)
        self._dbs = {name: self._env.open_db(name.encode()) for name in TABLES}
        self._cv = threading.Condition()
        self._queue: list[_Pending[Any]] = []
        self._writing = False
        self._closed = False
        self.last_commit_ms = 0.0
        self._init_meta()
        self.commit_seq = int(self._read_meta().get("commit_seq", 0))

    def _init_meta(self) -> None:
        with self._env.begin(write=True) as raw:
            txn = Txn(raw, self._dbs)
            meta = txn.get("meta", b"meta")
            if meta is None:
                txn.put("meta", b"meta", {"schema_version": SCHEMA_VERSION, "commit_seq": 0,
                                           "created_unix": time.time()})
            elif meta.get("schema_version") != SCHEMA_VERSION:
                raise ContextdError(
                    f"database schema version {meta.get('schema_version')} is not {SCHEMA_VERSION}; "
                    "this contextd cannot open it"
                )

    def _read_meta(self) -> dict[str, Any]:
        with self.read() as txn:
            meta = txn.get("meta", b"meta")
        assert meta is not None
        return meta

    def read(self) -> _ReadContext:
        """A consistent read-only snapshot: `with store.read() as txn: ...`."""
        return _ReadContext(self)

    def write(self, op: Callable[[Txn], T]) -> tuple[T, CommitInfo]:
        """Apply op in the next committed batch; return its result once the batch is durable.

        An exception raised by op aborts op alone and is re-raised here; the rest of its batch
        still commits. A failure of the commit itself fails every op in the batch.
        """
        pending: _Pending[T] = _Pending(op)
        with self._cv:
            if self._closed:
                raise ContextdError("store is closed")
            self._queue.append(pending)
            while not pending.done:
                if self._writing:
                    self._cv.wait()
                    continue
                self._writing = True
                batch, self._queue = self._queue, []
                self._cv.release()
                try:
                    self._commit(batch)
                finally:
                    self._cv.acquire()
                    self._writing = False
                    self._cv.notify_all()
        if pending.error is not None:
            raise pending.error
        assert pending.info is not None
        return pending.result, pending.info  # type: ignore[return-value]

    def _commit(self, batch: list[_Pending[Any]]) -> None:
        try:
            with self._env.begin(write=True) as outer:
                crashpoints.reached("contextd.commit.begin")
                for pending in batch:
                    child = self._env.begin(write=True, parent=outer)
                    try:
                        pending.result = pending.op(Txn(child, self._dbs))
                    except BaseException as exc:  # noqa: BLE001 - one op fails alone
                        child.abort()
                        pending.error = _no_room(exc, "this write was not applied")
                    else:
                        child.commit()
                seq = self.commit_seq + 1
                txn = Txn(outer, self._dbs)
                meta = txn.get("meta", b"meta") or {}
                meta["commit_seq"] = seq
                txn.put("meta", b"meta", meta)
                started = time.perf_counter()
            commit_ms = (time.perf_counter() - started) * 1000.0
        except BaseException as exc:  # noqa: BLE001 - the whole batch failed to commit
            failed = _no_room(exc, f"the batch of {len(batch)} writes was not applied")
            for pending in batch:
                pending.error = pending.error or failed
                pending.done = True
            return
        crashpoints.reached("contextd.commit.durable")
        self.commit_seq = seq
        self.last_commit_ms = commit_ms
        info = CommitInfo(seq, commit_ms)
        for pending in batch:
            pending.info = info
            pending.done = True

    def wait_for_commit(self, after_seq: int, timeout: float) -> int:
        """Block until a commit newer than after_seq lands or timeout passes; return the newest seq."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self.commit_seq <= after_seq and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            return self.commit_seq

    def close(self) -> None:
        """Let queued writes finish, then close the environment."""
        with self._cv:
            self._closed = True
            while self._writing or self._queue:
                self._cv.wait(0.05)
            self._cv.notify_all()
        self._env.sync(True)
        self._env.close()

    @property
    def path(self) -> str:
        return str(self._env.path())

    def _begin_read(self) -> Any:
        return self._env.begin(write=False)

    @property
    def dbs(self) -> dict[str, Any]:
        return self._dbs


def _no_room(exc: BaseException, what: str) -> BaseException:
    """StoreFull for LMDB's out-of-space errors (ENOSPC at commit, a full map at a put), else exc."""
    if not isinstance(exc, (lmdb.DiskError, lmdb.MapFullError)):
        return exc
    full = StoreFull(f"the database cannot grow ({exc}); {what}, everything committed before it stays")
    full.__cause__ = exc
    return full


class _ReadContext:
    def __init__(self, store: Store) -> None:
        self._store = store
        self._raw: Any = None

    def __enter__(self) -> Txn:
        self._raw = self._store._begin_read()
        return Txn(self._raw, self._store.dbs)

    def __exit__(self, *exc: object) -> None:
        self._raw.abort()
