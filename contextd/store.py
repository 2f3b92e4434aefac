"""LMDB tables with msgpack records, and the one writer that batches.

Every value is `xxh64(payload) || msgpack(payload)`: a record whose checksum fails to match is
reported as corrupt instead of being decoded into nonsense. Each table is a `Table` that names its
key type (contextd.keys) and its row type (contextd.records), so a transaction takes and returns
typed keys and rows only; the row types own the msgpack maps and the key types the key bytes.

Writes go through `Store.write(op)`. Callers on many threads hand in operations; whichever
caller finds the writer idle becomes the writer for everything queued at that moment and commits
it as one LMDB transaction (group commit). Each operation runs in its own nested transaction, so
one bad request aborts alone while the rest of the batch commits. A caller returns only after
the batch is durable under the configured sync mode.

A commit the disk refuses for want of space (ENOSPC, or LMDB's map full) fails its batch with
StoreFull, as a payload write does; nothing of the batch is applied.

The meta row holds the schema version. Opening a database of an older version runs the
`MIGRATIONS` that bring it up to `SCHEMA_VERSION`, in the one transaction that also records the
new version, so a crash mid-way leaves the old database as it was; a newer version is refused.

Depends on lmdb, msgpack, xxhash, contextd.errors, contextd.keys, contextd.records,
contextd.paths and contextd.wire (PageState); knows nothing about gRPC.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, Generic, TypeVar

import lmdb
import msgpack
import xxhash

from contextd import crashpoints
from contextd.errors import ContextdError, DataCorrupt, InvalidArgument, StoreFull
from contextd.keys import (
    EVERYTHING,
    SEP,
    Key,
    MetaKey,
    PageKey,
    PrefixKey,
    SegmentKey,
    SessionKey,
    SnapshotKey,
    StateKey,
    session_scope,
)
from contextd.paths import private_file, private_folder
from contextd.records import (
    HoldRow,
    LeaseRow,
    Meta,
    PageCounts,
    PageRow,
    PinRow,
    RecordRow,
    Row,
    SegmentRow,
    SessionRow,
    SnapshotRow,
)
from contextd.wire import PageState

# 3: PINNED is no longer a page state (a pinned page is HOT with a pin); 4: no summaries, and the
# prefix index (a new table: pages stored before it are not indexed, so no branch starts from them)
SCHEMA_VERSION = 4

K = TypeVar("K", bound=Key)
R = TypeVar("R", bound=Row)


@dataclass(frozen=True)
class Index(Generic[K]):
    """A table of keys only (its values are empty)."""

    name: str
    key: type[K]


@dataclass(frozen=True)
class Table(Index[K], Generic[K, R]):
    """A table of rows, each under its key."""

    row: type[R]


META = Table("meta", MetaKey, Meta)  # schema version, commit sequence, creation time
SESSIONS = Table("sessions", SessionKey, SessionRow)  # with page-count aggregates kept in step
MANIFEST = Table("kv_manifest", PageKey, PageRow)  # identity, range, state, locator, checksum, view
PAGE_STATES = Index("page_state", StateKey)  # the manifest by state
PINS = Table("pins", PageKey, PinRow)
LEASES = Table("leases", PageKey, LeaseRow)
SNAPSHOTS = Table("snapshots", SnapshotKey, SnapshotRow)  # recurrent-state snapshot slots
RECORDS = Table("records", SessionKey, RecordRow)  # turn, fingerprint, hashes, ledger, counters
SEGMENTS = Table("segments", SegmentKey, SegmentRow)  # the transcript, one segment a row
PREFIXES = Index("prefixes", PrefixKey)  # stored full pages by the chain hash of the tokens up to their end
HOLDS = Table("holds", SessionKey, HoldRow)  # with an object store: this contextd's hold on a session (handover)
TABLES: tuple[Index[Any], ...] = (META, SESSIONS, MANIFEST, PAGE_STATES, PINS, LEASES, SNAPSHOTS, RECORDS,
                                  SEGMENTS, PREFIXES, HOLDS)
# named databases of earlier schemas, opened only where they exist for the migration that drops them
# (blocks: schema 3's unit and cluster summaries, written for a plan-writing controller since removed)
RETIRED = ("blocks",)
# the tables whose keys start with a session and more (the others hold one row per session, or none)
SCOPED: tuple[Index[Any], ...] = (MANIFEST, PAGE_STATES, PINS, LEASES, SNAPSHOTS, SEGMENTS)


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


def encode(data: Mapping[str, Any]) -> bytes:
    """A stored value: a checksum, then the msgpack map (a row's `stored()`)."""
    payload: bytes = msgpack.packb(data, use_bin_type=True)
    return xxhash.xxh64_digest(payload) + payload


def decode(value: bytes, where: bytes) -> dict[str, Any]:
    digest, payload = value[:8], value[8:]
    if xxhash.xxh64_digest(payload) != digest:
        raise DataCorrupt(f"record {where!r} failed its checksum")
    data: dict[str, Any] = msgpack.unpackb(payload, raw=False)
    return data


class Txn:
    """A transaction over the tables, in typed keys and rows; read-only or read-write."""

    def __init__(self, txn: Any, dbs: dict[str, Any]) -> None:
        self._txn = txn
        self._dbs = dbs

    def get(self, table: Table[K, R], key: K) -> R | None:
        raw = key.encode()
        value = self._txn.get(raw, db=self._dbs[table.name])
        return None if value is None else table.row.load(decode(bytes(value), raw))

    def has(self, table: Index[K], key: K) -> bool:
        return self._txn.get(key.encode(), db=self._dbs[table.name]) is not None

    def put(self, table: Table[K, R], key: K, row: R) -> None:
        self._txn.put(key.encode(), encode(row.stored()), db=self._dbs[table.name])

    def add(self, index: Index[K], key: K) -> None:
        """Put a key in a table of keys only."""
        self._txn.put(key.encode(), b"", db=self._dbs[index.name])

    def delete(self, table: Index[K], key: K) -> bool:
        return bool(self._txn.delete(key.encode(), db=self._dbs[table.name]))

    def _cursor(self, table: Index[Any], scope: bytes, start_after: Key | None) -> Iterator[Any]:
        """An LMDB cursor's (key, value) pairs under scope, after start_after."""
        cursor = self._txn.cursor(db=self._dbs[table.name])
        after = None if start_after is None else start_after.encode()
        if not cursor.set_range(scope if after is None else after):
            return
        for raw, value in cursor.iternext(keys=True, values=True):
            raw = bytes(raw)
            if not raw.startswith(scope):
                return
            if raw != after:
                yield raw, value

    def scan_keys(self, table: Index[K], scope: bytes, start_after: K | None = None) -> Iterator[K]:
        """The keys under `scope` (a prefix from contextd.keys), in order, after `start_after`."""
        for raw, _ in self._cursor(table, scope, start_after):
            yield table.key.parse(raw)

    def scan(self, table: Table[K, R], scope: bytes, start_after: K | None = None) -> Iterator[tuple[K, R]]:
        """The rows under `scope` (a prefix from contextd.keys), in key order, after `start_after`."""
        for raw, value in self._cursor(table, scope, start_after):
            yield table.key.parse(raw), table.row.load(decode(bytes(value), raw))

    def scan_stored(self, table: Index[Any], scope: bytes) -> Iterator[tuple[bytes, dict[str, Any]]]:
        """The stored maps under `scope`, by raw key: for a migration, which reads rows that no
        longer load as today's row type."""
        for raw, value in self._cursor(table, scope, None):
            yield raw, decode(bytes(value), raw)

    def put_stored(self, table: Index[Any], raw: bytes, data: Mapping[str, Any]) -> None:
        """Put a stored map under a raw key: for a migration (see scan_stored)."""
        self._txn.put(raw, encode(data), db=self._dbs[table.name])

    def delete_raw(self, table: Index[Any], raw: bytes) -> None:
        """Delete a raw key: for a migration, whose old keys may no longer parse."""
        self._txn.delete(raw, db=self._dbs[table.name])

    def drop_retired(self, name: str) -> None:
        """Delete a retired table (RETIRED) with its rows, where this database has it: for a migration."""
        db = self._dbs.pop(name, None)
        if db is not None:
            self._txn.drop(db, delete=True)

    def delete_prefix(self, table: Index[Any], scope: bytes) -> int:
        keys = [raw for raw, _ in self._cursor(table, scope, None)]
        for raw in keys:
            self._txn.delete(raw, db=self._dbs[table.name])
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
            max_dbs=len(TABLES) + len(RETIRED) + 1,
            max_readers=256,
            sync=sync is not SyncMode.NONE,
            metasync=sync is SyncMode.FULL,
            subdir=True,
        )
        for name in ("data.mdb", "lock.mdb"):  # made by an older contextd with lmdb's default 0644
            private_file(path / name)
        self._dbs = {table.name: self._env.open_db(table.name.encode()) for table in TABLES}
        for name in RETIRED:
            try:
                self._dbs[name] = self._env.open_db(name.encode(), create=False)
            except lmdb.NotFoundError:
                continue
        self._cv = threading.Condition()
        self._queue: list[_Pending[Any]] = []
        self._writing = False
        self._closed = False
        self.last_commit_ms = 0.0
        self._init_meta()
        self.commit_seq = self._read_meta().commit_seq

    def _init_meta(self) -> None:
        with self._env.begin(write=True) as raw:
            txn = Txn(raw, self._dbs)
            meta = txn.get(META, MetaKey())
            if meta is None:
                txn.put(META, MetaKey(), Meta(SCHEMA_VERSION, 0, time.time()))
                return
            version = meta.schema_version
            while version in MIGRATIONS:
                MIGRATIONS[version](txn)
                version += 1
            if version != SCHEMA_VERSION:
                raise ContextdError(
                    f"database schema version {meta.schema_version} is not {SCHEMA_VERSION}; "
                    "this contextd cannot open it"
                )
            if version != meta.schema_version:
                txn.put(META, MetaKey(), replace(meta, schema_version=version))

    def _read_meta(self) -> Meta:
        with self.read() as txn:
            meta = txn.get(META, MetaKey())
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
                meta = txn.get(META, MetaKey())
                assert meta is not None, "the store writes its meta row when it opens"
                txn.put(META, MetaKey(), replace(meta, commit_seq=seq))
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


_PINNED = 3  # schema 2's PINNED page state, reserved in the proto since


def _unpin_states(txn: Txn) -> None:
    """Schema 2 to 3: PINNED stops being a page state. Schema 2 already kept every pin in the pins
    table, so a PINNED page becomes HOT (its manifest row and its state index key), and every
    session's counts are recomputed from its manifest and pins: `hot` now includes the pinned
    pages, and `pinned` counts the hot pages with a pin whatever their schema-2 state was."""
    pinned = [(raw, data) for raw, data in txn.scan_stored(MANIFEST, EVERYTHING) if data.get("state") == _PINNED]
    for raw, data in pinned:
        key = PageKey.parse(raw)
        txn.delete_raw(PAGE_STATES, SEP.join((key.session_id.encode(), str(_PINNED).encode(), key.page_id.encode())))
        txn.put_stored(MANIFEST, raw, {**data, "state": int(PageState.HOT)})
        txn.add(PAGE_STATES, StateKey(key.session_id, PageState.HOT, key.page_id))
    for session_key, session in list(txn.scan(SESSIONS, EVERYTHING)):
        counts = PageCounts()
        for page_key, page in txn.scan(MANIFEST, session_scope(session.session_id)):
            counts = counts.plus(page, txn.has(PINS, page_key), 1)
        txn.put(SESSIONS, session_key, replace(session, pages=counts))


def _drop_summaries(txn: Txn) -> None:
    """Schema 3 to 4: the plan-writing controller is gone, and with it the unit and cluster
    summaries (the `blocks` table), each page's unit (`block_id` in its manifest row) and each
    record's unit salt."""
    txn.drop_retired("blocks")
    for table, name in ((MANIFEST, "block_id"), (RECORDS, "unit_salt")):
        for raw, data in list(txn.scan_stored(table, EVERYTHING)):
            if name in data:
                txn.put_stored(table, raw, {k: v for k, v in data.items() if k != name})


# schema version -> what brings a database of that version to the next one
MIGRATIONS: dict[int, Callable[[Txn], None]] = {2: _unpin_states, 3: _drop_summaries}


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
