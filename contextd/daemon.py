"""contextd's core: the `Daemon` over one root, which owns the LMDB environment, the folder and
the configuration, and hands each verb to the collaborator of its concept.

Every row is a typed record of contextd.records whose fields carry the proto's field names (the
service converts by name), under a typed key of contextd.keys, in a typed table of
contextd.store. Every write verb is one operation in the store's group commit: applied whole or
not at all.

The collaborators, along the call chain (each imports only those after it, so there is no
circle; each is built here with what it needs, passed explicitly):
  contextd.integrity   ReportCorrupt and `verify`: whether a payload is lost
  contextd.pages       the manifest's verbs: pages, their states, pins and leases
  contextd.retention   drops under pressure, quotas, idle sessions, `gc`
  contextd.sessions    sessions as rows: open, close, list, delete
  contextd.branches    FindPrefix and BranchSession
  contextd.turns       a turn's record, transcript segments and snapshots
  contextd.holds       holding sessions, and moving them between servers (object store only)
  contextd.payloads    the payloads' two tiers, and the object deletes deferred to a publish
  contextd.manifest    what every verb's transaction does the same way, and the commit point
The verbs contextd.service calls are attributes of `Daemon`, each its collaborator's method.

Depends on every module above, contextd.store, contextd.blobs, contextd.tiering / objects /
handover, contextd.clock, contextd.keys, contextd.records and contextd.errors; no gRPC types.
Nothing of contextd imports it but the service, the server and the CLI.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from contextd.blobs import BlobStore, Reserve
from contextd.branches import Branches
from contextd.clock import Clock
from contextd.errors import InvalidArgument
from contextd.handover import Handover
from contextd.holds import Holds
from contextd.integrity import Integrity
from contextd.keys import EVERYTHING, MetaKey, session_scope
from contextd.manifest import named_payloads, session_row, store_bytes
from contextd.objects import ObjectStore, ObjectStoreConfig
from contextd.pages import Pages
from contextd.payloads import Payloads
from contextd.records import SessionStatus, Status
from contextd.retention import Retention, Sweeper
from contextd.sessions import Sessions
from contextd.store import META, SCHEMA_VERSION, SESSIONS, SNAPSHOTS, Store, SyncMode
from contextd.tiering import ObjectTier
from contextd.turns import Turns


@dataclass(frozen=True)
class DaemonConfig:
    root: Path
    sync: SyncMode = SyncMode.FULL
    reserve: Reserve = Reserve()
    retention: Retention = Retention()
    map_size: int = 1 << 34
    objects: ObjectStoreConfig | None = None   # the durable tier; None: the folder is
    cache_bytes: int = 0                       # with `objects`: the folder's bound (0: none)
    max_lease_s: float = 3600.0                # the longest turn lease HoldSession grants
    object_gc_grace_s: float = 3600.0          # `gc` leaves objects younger than this (uploads not yet committed)
    clock: Clock = field(default_factory=Clock)   # what holds and deadlines are read on (contextd.clock)

    def __post_init__(self) -> None:
        if self.map_size < 1 << 20:
            raise InvalidArgument("map size must be at least 1 MiB")
        if self.cache_bytes < 0:
            raise InvalidArgument("the cache size must not be negative")
        if self.object_gc_grace_s < 0 or self.max_lease_s <= 0:
            raise InvalidArgument("the object gc grace must not be negative, the longest lease must be positive")


class Daemon:
    """The verbs over one root: `ROOT/db` (LMDB) and `ROOT/store` (payload files)."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.started = time.time()
        self.store = Store(config.root / "db", config.sync, config.map_size)
        self.blobs = BlobStore(config.root / "store", config.reserve)
        self.tier: ObjectTier | None = None
        self.handover: Handover | None = None
        if config.objects is not None:
            self.tier = ObjectTier(ObjectStore(config.objects, config.clock), self.blobs, config.cache_bytes,
                                   config.clock)
            self.handover = Handover(self.tier.objects, node_id(config.root))
        # One lock for the drops, `gc`'s file walk and a branch's share (contextd.retention).
        space_lock = threading.RLock()
        payloads = Payloads(self.blobs, self.tier)
        holds = Holds(self.store, payloads, self.handover, config.max_lease_s)
        turns = Turns(self.store, payloads, holds)
        branches = Branches(self.store, payloads, space_lock)
        sessions = Sessions(self.store, payloads, holds)
        sweeper = Sweeper(self.store, payloads, sessions, self.handover, config.retention, config.clock,
                          config.object_gc_grace_s, space_lock)
        pages = Pages(self.store, payloads, sweeper)
        integrity = Integrity(self.store, payloads, pages)

        self.open_session = sessions.open_session
        self.get_session = sessions.get_session
        self.list_sessions = sessions.list_sessions
        self.close_session = sessions.close_session
        self.delete_session = sessions.delete_session
        self.hold_session = holds.hold_session
        self.find_prefix = branches.find_prefix
        self.branch_session = branches.branch_session
        self.upsert_pages = pages.upsert_pages
        self.set_page_states = pages.set_page_states
        self.delete_pages = pages.delete_pages
        self.query_pages = pages.query_pages
        self.get_pages = pages.get_pages
        self.set_marks = pages.set_marks
        self.query_marks = pages.query_marks
        self.report_corrupt = integrity.report_corrupt
        self.verify = integrity.verify
        self.reclaim = sweeper.reclaim
        self.idle_sessions = sweeper.idle_sessions
        self.gc = sweeper.gc
        self.put_snapshot = turns.put_snapshot
        self.query_snapshots = turns.query_snapshots
        self.write_record = turns.write_record
        self.read_record = turns.read_record

        if self.tier is not None:
            with self.store.read() as txn:
                committed = list(named_payloads(txn, EVERYTHING))
            try:
                self.tier.start(committed)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        self.store.close()

    def status(self, session_id: str, include_closed: bool) -> Status:
        with self.store.read() as txn:
            meta = txn.get(META, MetaKey())
            assert meta is not None, "the store writes its meta row when it opens"
            if session_id:
                sessions = [session_row(txn, session_id)]
            else:
                sessions = [s for _, s in txn.scan(SESSIONS, EVERYTHING) if include_closed or not s.closed]
            rows = tuple(SessionStatus(
                session_id=s.session_id, model_id=s.model_id, budget_tokens=s.budget_tokens,
                attention_tokens=s.attention_tokens, turn=s.turn, pages=s.pages, closed=s.closed,
                counters=s.counters, snapshots=sum(1 for _ in txn.scan_keys(SNAPSHOTS, session_scope(s.session_id))))
                for s in sessions)
            stored = store_bytes(txn)
        return Status(commit_seq=meta.commit_seq, last_commit_ms=self.store.last_commit_ms,
                      store_bytes=stored, free_bytes=self.blobs.free_bytes(),
                      reserve_bytes=self.blobs.reserve_bytes(), quota_bytes=self.blobs.reserve.quota_bytes,
                      session_quota_bytes=self.config.retention.session_quota_bytes,
                      max_idle_s=self.config.retention.max_idle_s, sync_mode=self.config.sync.value,
                      root=str(self.config.root), pid=os.getpid(), uptime_s=time.time() - self.started,
                      sessions=rows, schema_version=SCHEMA_VERSION,
                      node=self.handover.node if self.handover is not None else "",
                      **(self.tier.status() if self.tier is not None else {}))


def node_id(root: Path) -> str:
    """This root's name in holder objects: the host's name and a random suffix, made once and kept
    in ROOT/node-id (two roots on one host are two nodes)."""
    path = root / "node-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        node = f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        path.write_text(node + "\n")
        return node
