"""contextd's verbs: sessions, pages, payloads, pins, leases, snapshots, records, status.

Every row is a typed record of contextd.records whose fields carry the proto's field names (the
service converts by name), under a typed key of contextd.keys, in a typed table of
contextd.store. Every write verb is one operation in the store's group commit: applied whole or
not at all.

Page life cycle (enforced here, whatever the caller asks):
  HOT -> COLD             only when the page has a stored payload (it is written before it leaves)
  COLD -> HOT             a restore (refused, given the payload the engine read, unless the
                          page is still COLD with that payload)
  COLD -> DROPPED         only by the pressure policy, and never when pinned or leased
  any -> CORRUPT          when a read or `verify` finds the payload missing or mismatched
  DROPPED/CORRUPT -> HOT  the engine recomputed it; the stale payload reference is cleared
Pinned and leased are not states: they are rows of the pins and leases tables, on a page in any
state (the engine pins only hot pages and never evicts them).

Session rows carry page-count aggregates updated in the same transaction as the pages and the
pins (`pinned` counts the hot pages with a pin), so `status` costs O(sessions) and is always
consistent with the manifest.

With an object store configured (contextd.tiering), payloads are uploaded before the commit
that names them, brought back into the folder by the reads that name them, and deleted from both
tiers; the folder is then a bounded cache. Sessions are then also held and exported
(contextd.handover): HoldSession takes a turn's lease or adopts a session another server
exported, and each WriteRecord exports the session's state after its commit; a payload's object
is deleted only once a publish stops naming it.

Depends on contextd.store, contextd.keys, contextd.records, contextd.blobs, contextd.tiering /
objects / handover, contextd.ids, contextd.errors and contextd.wire; no gRPC types.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from contextd.blobs import TEMP_PREFIX, BlobStore, Reserve
from contextd.clock import Clock, current
from contextd.errors import DataCorrupt, FailedPrecondition, InvalidArgument, NotFound, SessionHeld, StoreFull
from contextd.handover import Handover, Holder, payloads_named
from contextd.ids import check_id
from contextd.keys import (
    EVERYTHING,
    MetaKey,
    PageKey,
    PrefixKey,
    SegmentKey,
    SessionKey,
    SnapshotKey,
    StateKey,
    prefix_scope,
    session_scope,
    state_scope,
)
from contextd.objects import ObjectStore, ObjectStoreConfig
from contextd.records import (
    Branch,
    GcResult,
    Hold,
    HoldRow,
    LeaseRow,
    PageCounts,
    PageRef,
    PageRow,
    PinRow,
    RecordRow,
    SegmentRow,
    SessionRow,
    SessionStatus,
    SnapshotRow,
    StateChange,
    Status,
    VerifyResult,
)
from contextd.store import (
    HOLDS,
    LEASES,
    MANIFEST,
    META,
    PAGE_STATES,
    PINS,
    PREFIXES,
    RECORDS,
    SCHEMA_VERSION,
    SCOPED,
    SEGMENTS,
    SESSIONS,
    SNAPSHOTS,
    CommitInfo,
    Store,
    SyncMode,
    Table,
    Txn,
)
from contextd.tiering import ObjectTier, Wanted
from contextd.wire import MAX_BATCH, MAX_TEXT, PageState, record_refusal

HOT, COLD, DROPPED, CORRUPT = PageState.HOT, PageState.COLD, PageState.DROPPED, PageState.CORRUPT

Mark = TypeVar("Mark", PinRow, LeaseRow)
T = TypeVar("T")


def _check_text(value: str, what: str, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {limit} are allowed")
    return value


def _lower_hex(value: str) -> bool:
    """Only lowercase hex digits (a checksum's or a prefix hash's alphabet)."""
    return all(c in "0123456789abcdef" for c in value)


def _check_batch(items: Sequence[Any], what: str) -> None:
    if len(items) > MAX_BATCH:
        raise InvalidArgument(f"{len(items)} {what} in one request; at most {MAX_BATCH} are allowed")


def _check_marks(marks: Sequence[tuple[str, PinRow | LeaseRow]]) -> None:
    """Pins or leases to put on pages: valid ids and marks, before anything is written."""
    for page_id, mark in marks:
        check_id(page_id, "page_id")
        mark.check(page_id)


@dataclass(frozen=True)
class Retention:
    """What a user keeps, on top of the free-space reserve and the store's total quota: a cap on
    each session's payloads (its least recently used cold pages are dropped past it) and an idle
    age past which a whole session is deleted (by `gc` and by the daemon's own sweep)."""

    session_quota_bytes: int = 0
    max_idle_s: float = 0.0

    def __post_init__(self) -> None:
        if self.session_quota_bytes < 0 or self.max_idle_s < 0:
            raise InvalidArgument("retention limits must not be negative")


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
        # Payload writes and the drops that make room for them are serialised, so two writers
        # cannot both count the same free bytes.
        self._space_lock = threading.RLock()
        self.tier: ObjectTier | None = None
        self.handover: Handover | None = None
        # session -> payload objects its manifest stopped naming, deleted at its next publish
        self._unpublished: dict[str, set[str]] = {}
        self._unpublished_lock = threading.Lock()
        if config.objects is not None:
            self.tier = ObjectTier(ObjectStore(config.objects, config.clock), self.blobs, config.cache_bytes,
                                   config.clock)
            self.handover = Handover(self.tier.objects, node_id(config.root))
            with self.store.read() as txn:
                committed = list(_payloads(txn, EVERYTHING))
            try:
                self.tier.start(committed)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        if self.tier is not None:
            self.tier.close()
        self.store.close()

    def _commit(self, op: Callable[[Txn], T], what: str) -> tuple[T, CommitInfo]:
        """`store.write(op)` at a call's commit point: refused (DeadlineExceeded) inside the
        transaction once the call's deadline has passed (contextd.clock). The client has given up
        on the call by then and takes it as failed, so it must find nothing of it done: a turn it
        sends again, or the next one, must not meet this one committed late behind it. Writes that
        record what already happened in the object store (a claim, a publish) are not commit
        points: they always land."""
        deadline = current()
        if deadline is None:
            return self.store.write(op)

        def checked(txn: Txn) -> T:
            deadline.check(what)
            return op(txn)

        return self.store.write(checked)

    # ----------------------------------------------------------------- the payloads' tiers

    def _commit_payloads(self, locators: Sequence[str]) -> None:
        """Before a commit names them: the payloads are in the durable tier (uploaded, with an
        object store; already, without)."""
        if self.tier is not None and locators:
            self.tier.commit(locators)

    def _delete_payloads(self, locators: Sequence[str]) -> int:
        """After a commit stopped naming them: the payloads' files go; the folder's bytes freed.
        With an object store their objects go at the session's next publish, not now: the state
        the holder names until then still names them, and an adopter must find them."""
        if self.tier is None:
            return sum(self.blobs.delete(locator) for locator in locators)
        with self._unpublished_lock:
            for locator in locators:
                self._unpublished.setdefault(locator.split("/", 1)[0], set()).add(locator)
        return self.tier.uncache(locators)

    def _discard_payloads(self, locators: Sequence[str]) -> None:
        """Payloads no committed row ever named (a failed branch's copies): gone from both tiers now."""
        if self.tier is not None:
            self.tier.delete(locators)
        else:
            for locator in locators:
                self.blobs.delete(locator)

    def _fetch_payloads(self, wanted: Sequence[Wanted], hold: bool = True) -> dict[str, str]:
        """Before a reader opens them: the payloads are in the folder (downloaded, with an object
        store), and with `hold` they stay there a while for a reader after this call (ObjectTier.fetch).
        Returns those the object store lost or holds other bytes of (locator -> why): they
        stay out of the folder, and their pages are marked corrupt by the caller."""
        if self.tier is None or not wanted:
            return {}
        return self.tier.fetch(wanted, hold)

    # ----------------------------------------------------------------- sessions

    @staticmethod
    def _session(txn: Txn, session_id: str) -> SessionRow:
        session = txn.get(SESSIONS, SessionKey(check_id(session_id, "session_id")))
        if session is None:
            raise NotFound(f"no session {session_id!r}")
        return session

    def open_session(self, session_id: str, model_id: str = "", fingerprint: str = "", budget_tokens: int = 0,
                     labels: Mapping[str, str] | None = None) -> SessionRow:
        key = SessionKey(check_id(session_id, "session_id"))
        _check_text(fingerprint, "fingerprint", 256)
        _check_text(model_id, "model_id", 512)
        labels = labels or {}
        if len(labels) > 64:
            raise InvalidArgument("at most 64 labels per session")

        def op(txn: Txn) -> SessionRow:
            now = time.time()
            session = txn.get(SESSIONS, key) or SessionRow(session_id, created_unix=now)
            session = replace(session, closed=False, model_id=model_id or session.model_id,
                              fingerprint=fingerprint or session.fingerprint,
                              budget_tokens=budget_tokens or session.budget_tokens,
                              labels={**session.labels, **labels}, updated_unix=now)
            txn.put(SESSIONS, key, session)
            return session

        return self._commit(op, "open the session")[0]

    def get_session(self, session_id: str) -> SessionRow:
        with self.store.read() as txn:
            return self._session(txn, session_id)

    def list_sessions(self, include_closed: bool) -> list[SessionRow]:
        with self.store.read() as txn:
            return [s for _, s in txn.scan(SESSIONS, EVERYTHING) if include_closed or not s.closed]

    def close_session(self, session_id: str) -> SessionRow:
        def op(txn: Txn) -> SessionRow:
            session = replace(self._session(txn, session_id), closed=True, updated_unix=time.time())
            txn.put(SESSIONS, SessionKey(session_id), session)
            return session

        return self._commit(op, "close the session")[0]

    def delete_session(self, session_id: str) -> tuple[int, int]:
        """Remove a session's rows, then its payloads. With an object store, its objects (payloads,
        holder, exported states) go only while this contextd holds it: a session another server
        took is that server's, and only this root's copy is deleted."""
        named: list[str] = []
        held: list[HoldRow] = []

        def op(txn: Txn) -> int:
            self._session(txn, session_id)
            if (hold := txn.get(HOLDS, SessionKey(session_id))) is not None:
                held.append(hold)
            pages, locators = self._remove_rows(txn, session_id)
            named.extend(locators)
            return pages

        pages, _ = self._commit(op, "delete the session")
        with self._unpublished_lock:
            named.extend(self._unpublished.pop(session_id, ()))
        # Files go after the commit: a crash in between leaves orphans for `gc`, never a
        # manifest entry pointing at nothing.
        if self.tier is None:
            return pages, self.blobs.delete_session(session_id)
        assert self.handover is not None
        if held and not self.handover.remove(session_id, _holder(held[0]), held[0].chunks):
            return pages, self.tier.uncache(named) + self.blobs.delete_session(session_id)
        return pages, self.tier.forget_session(session_id, named)

    def _remove_rows(self, txn: Txn, session_id: str) -> tuple[int, list[str]]:
        """Every row of a session (its hold included): the manifest rows removed and the payloads they
        and the snapshots named."""
        named = []
        for key, page in list(txn.scan(MANIFEST, session_scope(session_id))):
            self._unindex(txn, key, page)
            if page.locator:
                named.append(page.locator)
        named.extend(s.locator for _, s in txn.scan(SNAPSHOTS, session_scope(session_id)) if s.locator)
        removed = {table.name: txn.delete_prefix(table, session_scope(session_id)) for table in SCOPED}
        for table in (RECORDS, HOLDS, SESSIONS):
            txn.delete(table, SessionKey(session_id))
        return removed[MANIFEST.name], named

    # ----------------------------------------------------------------- holding and moving sessions

    def hold_session(self, session_id: str, model_id: str = "", lease_s: float = 30.0, renew: bool = False,
                     release: bool = False) -> Hold:
        """Hold `session_id` for a turn of `lease_s` seconds (contextd.handover): with an object store,
        renew this contextd's lease, or take the session over from the server that held it (its
        lease run out) and replace this root's rows of it by the state that server exported: the
        session is adopted. SessionHeld while another server's lease runs, and with `renew` (a turn
        in progress keeps its lease) whenever this contextd no longer holds it. `release` ends this
        contextd's lease now (a turn that failed), so another server need not wait for it to run
        out. Without an object store every session is this contextd's: token 0, nothing to do."""
        check_id(session_id, "session_id")
        _check_text(model_id, "model_id", 512)
        if not 0 < lease_s <= self.config.max_lease_s:
            raise InvalidArgument(f"a lease of {lease_s:g} s is not in (0, {self.config.max_lease_s:g}]")
        if self.handover is None:
            return Hold(0, False, "")
        with self.store.read() as txn:
            held = txn.get(HOLDS, SessionKey(session_id))
        claim = self.handover.claim(session_id, held.token if held is not None else 0, model_id,
                                    0.0 if release else lease_s, renew or release)
        if claim.adopted:
            self._adopt(session_id, claim.holder)
        else:
            chunks = held.chunks if held is not None else ()
            self.store.write(lambda txn: txn.put(HOLDS, SessionKey(session_id), _hold_row(claim.holder, chunks)))
        return Hold(claim.holder.token, claim.adopted, claim.previous_node)

    def _adopt(self, session_id: str, holder: Holder) -> None:
        """Replace this root's rows of `session_id` by the state `holder` names (none: the session
        starts over here). Payloads stay where they are: GetPages downloads them when a restore
        names them. What this root's rows named and the new state does not (a refused turn's
        pages) goes from both tiers: this contextd holds the session now, and no state names it."""
        assert self.tier is not None and self.handover is not None
        loaded = self.handover.load(holder)
        state, segments = loaded if loaded is not None else ({}, [])
        chunks = tuple(state.get("chunks", ()))
        named_before: list[str] = []

        def op(txn: Txn) -> None:
            named_before.extend(self._remove_rows(txn, session_id)[1])
            if loaded is not None:
                self._put_rows(txn, session_id, state, segments)
            txn.put(HOLDS, SessionKey(session_id), _hold_row(holder, chunks))

        self.store.write(op)
        named = payloads_named(state) if loaded is not None else set()
        with self._unpublished_lock:
            stale = (set(named_before) | self._unpublished.pop(session_id, set())) - named
        self.tier.delete(sorted(stale))

    def _put_rows(self, txn: Txn, session_id: str, state: Mapping[str, Any],
                  segments: Sequence[Mapping[str, Any]]) -> None:
        """Write an exported state's rows as `session_id`'s (pins before pages: a page's counts
        read its pin)."""
        for page_id, pin in state["pins"]:
            txn.put(PINS, PageKey(session_id, check_id(page_id, "page_id")), PinRow.load(pin))
        for page_id, lease in state["leases"]:
            txn.put(LEASES, PageKey(session_id, check_id(page_id, "page_id")), LeaseRow.load(lease))
        counts = PageCounts()
        for page in state["pages"]:
            counts = self._put_page(txn, session_id, counts, None, PageRow.load(page))
        for snapshot in state["snapshots"]:
            row = SnapshotRow.load(snapshot)
            txn.put(SNAPSHOTS, SnapshotKey(session_id, row.slot), row)
        for seq, segment in enumerate(segments):
            txn.put(SEGMENTS, SegmentKey(session_id, seq), SegmentRow.load(segment))
        txn.put(RECORDS, SessionKey(session_id), RecordRow.load(state["record"]))
        txn.put(SESSIONS, SessionKey(session_id), replace(SessionRow.load(state["session"]), pages=counts))

    def _publish(self, session_id: str) -> None:
        """After a turn's record commits: export the session's state and make the holder name it
        (contextd.handover); then the objects the state stopped naming go. SessionHeld when
        another server took the session: the write is refused there, and this root's rows, now
        stale, are replaced at this server's next hold."""
        assert self.tier is not None and self.handover is not None
        with self.store.read() as txn:
            held = txn.get(HOLDS, SessionKey(session_id))
            assert held is not None, "write_record holds the session before its commit"
            session = self._session(txn, session_id)
            record = txn.get(RECORDS, SessionKey(session_id))
            assert record is not None
            scope = session_scope(session_id)
            state = {"session": session.stored(), "record": record.stored(),
                     "pages": [p.stored() for _, p in txn.scan(MANIFEST, scope)],
                     "snapshots": [s.stored() for _, s in txn.scan(SNAPSHOTS, scope)],
                     "pins": [[k.page_id, pin.stored()] for k, pin in txn.scan(PINS, scope)],
                     "leases": [[k.page_id, lease.stored()] for k, lease in txn.scan(LEASES, scope)]}
            segments = [s.stored() for _, s in txn.scan(SEGMENTS, scope)]
        exported = self.handover.publish(session_id, _holder(held), held.chunks, state, segments)
        self.store.write(lambda txn: txn.put(HOLDS, SessionKey(session_id), _hold_row(exported.holder,
                                                                                       exported.chunks)))
        named = payloads_named(state)
        with self._unpublished_lock:
            gone = self._unpublished.pop(session_id, set())
        self.tier.delete(sorted(gone - named))

    def _check_hold(self, session_id: str) -> None:
        """Before a turn's record commits, with an object store: this contextd holds the session
        (a caller that never asked, such as a tool writing records itself, holds it here, unless
        another server exported it: that one's state is not overwritten)."""
        assert self.handover is not None
        with self.store.read() as txn:
            if txn.has(HOLDS, SessionKey(session_id)):
                return
        holder = self.handover.holder(session_id)
        if holder is not None and not holder.deleted:
            raise SessionHeld(f"session {session_id} is held by {holder.node} (token {holder.token}); "
                              "HoldSession adopts it before a turn is written here")
        self.hold_session(session_id)

    # ----------------------------------------------------------------- branches

    def find_prefix(self, model_id: str, fingerprint: str, prefix_hashes: Sequence[str]) -> tuple[str, int]:
        """The open session of this model and fingerprint, with a completed turn, whose stored
        full pages match `prefix_hashes` (page i's chain hash of the token ids up to its end)
        furthest from the first, and how many; ("", 0) when none matches the first. Of several,
        the one updated last. A chain hash at page i stands for every token before it, so the
        furthest match is found by bisection: O(log pages) index scans."""
        _check_batch(prefix_hashes, "prefix hashes")
        with self.store.read() as txn:
            eligible: dict[str, SessionRow | None] = {}

            def holders(i: int) -> list[SessionRow]:
                found = []
                for key in txn.scan_keys(PREFIXES, prefix_scope(prefix_hashes[i])):
                    if key.session_id not in eligible:
                        session = txn.get(SESSIONS, SessionKey(key.session_id))
                        fits = session is not None and not session.closed and session.model_id == model_id \
                            and session.fingerprint == fingerprint and txn.has(RECORDS, SessionKey(key.session_id))
                        eligible[key.session_id] = session if fits else None
                    if (session := eligible[key.session_id]) is not None:
                        found.append(session)
                return found

            low, high, best = 0, len(prefix_hashes), list[SessionRow]()
            while low < high:
                middle = (low + high) // 2
                found = holders(middle)
                if found:
                    best, low = found, middle + 1
                else:
                    high = middle
        if not best:
            return "", 0
        return max(best, key=lambda s: (s.updated_unix, s.session_id)).session_id, low

    def branch_session(self, session_id: str, parent_id: str) -> Branch:
        """A new session that is a copy of `parent_id` as its last completed turn left it: record,
        transcript segments, manifest, pins and recurrent snapshots. Every payload is shared, not
        copied: a hard link in the new session's folder (payloads are immutable, and the file is
        gone only when its last owner deletes it). Counters and leases start empty; the label
        `branch_of` names the parent. Links are made before the commit, with the space lock held
        from the read to the commit (no drop and no `gc` in between): a crash in between leaves
        files that no row names, which `gc` removes."""
        check_id(session_id, "session_id")
        if session_id == check_id(parent_id, "parent_id"):
            raise InvalidArgument(f"session {session_id} cannot branch from itself")
        # Held from the read to the commit: no drop (reclaim) and no `gc` between them can remove a
        # payload being shared, or a link made but not yet named by a row.
        with self._space_lock:
            with self.store.read() as txn:
                if txn.has(SESSIONS, SessionKey(session_id)):
                    raise FailedPrecondition(f"session {session_id} exists; a branch starts a new session")
                parent = self._session(txn, parent_id)
                record = txn.get(RECORDS, SessionKey(parent_id))
                if record is None:
                    raise FailedPrecondition(f"session {parent_id} has no completed turn to branch from")
                segments = [s for _, s in txn.scan(SEGMENTS, session_scope(parent_id))]
                pages = [p for _, p in txn.scan(MANIFEST, session_scope(parent_id))]
                pins = [(k.page_id, pin) for k, pin in txn.scan(PINS, session_scope(parent_id))]
                snapshots = [s for _, s in txn.scan(SNAPSHOTS, session_scope(parent_id))]
            shared = [p.locator for p in pages if p.locator and p.state in (HOT, COLD)] + \
                [s.locator for s in snapshots if s.locator]
            moved = self.blobs.link(shared, session_id) if self.tier is None else self.tier.copy(shared, session_id)

            def op(txn: Txn) -> SessionRow:
                if txn.has(SESSIONS, SessionKey(session_id)):
                    raise FailedPrecondition(f"session {session_id} exists; a branch starts a new session")
                now = time.time()
                for page_id, pin in pins:
                    txn.put(PINS, PageKey(session_id, page_id), pin)
                counts = PageCounts()
                for page in pages:
                    copy = replace(page, locator=moved.get(page.locator, ""), updated_unix=now)
                    if page.locator and page.locator not in moved:  # a corrupt page: nothing to share
                        copy = replace(copy, state=DROPPED, checksum="", byte_size=0)
                    counts = self._put_page(txn, session_id, counts, None, copy)
                for snapshot in snapshots:
                    if snapshot.locator in moved:
                        txn.put(SNAPSHOTS, SnapshotKey(session_id, snapshot.slot),
                                replace(snapshot, locator=moved[snapshot.locator]))
                for seq, segment in enumerate(segments):
                    txn.put(SEGMENTS, SegmentKey(session_id, seq), segment)
                txn.put(RECORDS, SessionKey(session_id), replace(record, counters={}))
                session = replace(parent, session_id=session_id, created_unix=now, updated_unix=now, counters={},
                                  pages=counts, closed=False, labels={**parent.labels, "branch_of": parent_id})
                txn.put(SESSIONS, SessionKey(session_id), session)
                return session

            try:
                session = self._commit(op, "commit the branch")[0]
            except BaseException:
                self._discard_payloads(list(moved.values()))
                raise
        sizes = {p.locator: p.byte_size for p in pages} | {s.locator: s.byte_size for s in snapshots}
        return Branch(session, len(pages), sum(sizes[locator] for locator in moved))

    # ----------------------------------------------------------------- pages

    def _check_page(self, session_id: str, page: PageRow, committed: str = "") -> PageRow:
        """A page row as a writer sends it, checked; `committed` is the locator the manifest names
        for it now (its payload may be out of the folder with an object store)."""
        check_id(page.page_id, "page_id")
        if page.token_end < page.token_start:
            raise InvalidArgument(
                f"page {page.page_id}: token range [{page.token_start}, {page.token_end}) is inverted")
        _check_text(page.dtype, "dtype", 256)
        _check_text(page.layer_view, "layer_view", 256)
        if len(page.prefix_hash) > 32 or not _lower_hex(page.prefix_hash):
            raise InvalidArgument(f"page {page.page_id}: prefix_hash must be at most 32 lowercase hex digits")
        if page.locator:
            if not page.locator.startswith(session_id + "/"):
                raise InvalidArgument(f"page {page.page_id}: locator is outside session {session_id}")
            if len(page.checksum) != 32 or not _lower_hex(page.checksum):
                raise InvalidArgument(f"page {page.page_id}: checksum must be 32 lowercase hex digits")
            if page.locator != committed and not self.blobs.exists(page.locator, page.byte_size):
                raise FailedPrecondition(
                    f"page {page.page_id}: no payload of {page.byte_size} bytes at {page.locator}")
        elif page.state == COLD:
            raise FailedPrecondition(f"page {page.page_id}: a cold page needs a stored payload")
        if page.state in (DROPPED, CORRUPT):
            raise InvalidArgument(f"page {page.page_id}: only contextd marks pages dropped or corrupt")
        return page

    @staticmethod
    def _count(txn: Txn, key: PageKey, counts: PageCounts, page: PageRow, sign: int) -> PageCounts:
        """`counts` with the page under `key` added (sign=1) or taken out (sign=-1), as pinned
        when the pins table holds it now."""
        return counts.plus(page, txn.has(PINS, key), sign)

    @classmethod
    def _put_page(cls, txn: Txn, session_id: str, counts: PageCounts, old: PageRow | None, page: PageRow
                  ) -> PageCounts:
        """Write a page and its state index entry; return the session's counts with the change."""
        key = PageKey(session_id, page.page_id)
        if old is not None:
            counts = cls._count(txn, key, counts, old, -1)
            txn.delete(PAGE_STATES, StateKey(session_id, old.state, old.page_id))
            cls._unindex(txn, key, old)
        txn.put(MANIFEST, key, page)
        txn.add(PAGE_STATES, StateKey(session_id, page.state, page.page_id))
        if page.prefix_hash and page.locator and page.state in (HOT, COLD):
            txn.add(PREFIXES, PrefixKey(page.prefix_hash, session_id, page.page_id))
        return cls._count(txn, key, counts, page, 1)

    @staticmethod
    def _unindex(txn: Txn, key: PageKey, page: PageRow) -> None:
        """Take a page out of the prefix index (where it was in it)."""
        if page.prefix_hash:
            txn.delete(PREFIXES, PrefixKey(page.prefix_hash, key.session_id, key.page_id))

    def _change_pages(self, session_id: str, move: Callable[[Txn, SessionRow, float], PageCounts]) -> CommitInfo:
        """One write in which `move` changes some of the session's pages (at time `now`) and
        returns the session's page counts after the move, which are stored with them."""
        def op(txn: Txn) -> None:
            session = self._session(txn, session_id)
            counts = move(txn, session, time.time())
            txn.put(SESSIONS, SessionKey(session_id), replace(session, pages=counts))

        return self._commit(op, "commit the pages' change")[1]

    def upsert_pages(self, session_id: str, pages: Sequence[PageRow]) -> CommitInfo:
        _check_batch(pages, "pages")
        for p in pages:
            check_id(p.page_id, "page_id")
        with self.store.read() as txn:
            named = {p.page_id: (old.locator if (old := txn.get(MANIFEST, PageKey(session_id, p.page_id))) else "")
                     for p in pages}
        checked = [self._check_page(session_id, p, named[p.page_id]) for p in pages]
        if len({p.page_id for p in checked}) != len(checked):
            raise InvalidArgument("a page_id appears twice in one batch")
        self._commit_payloads([p.locator for p in checked if p.locator and p.locator != named[p.page_id]])
        replaced: list[str] = []

        def move(txn: Txn, session: SessionRow, now: float) -> PageCounts:
            counts = session.pages
            for page in checked:
                old = txn.get(MANIFEST, PageKey(session_id, page.page_id))
                if old is not None and old.locator and old.locator != page.locator:
                    replaced.append(old.locator)
                counts = self._put_page(txn, session_id, counts, old, replace(page, updated_unix=now))
            return counts

        info = self._change_pages(session_id, move)
        self._delete_payloads(replaced)
        quota = self.config.retention.session_quota_bytes
        if quota:
            over = self.get_session(session_id).pages.bytes_on_disk - quota
            if over > 0:
                self.reclaim(over, session_id, partial=True)
        return info

    def set_page_states(self, session_id: str, changes: Sequence[StateChange],
                        leases: Sequence[tuple[str, LeaseRow]] = ()) -> CommitInfo:
        """Move pages between HOT and COLD and, in the same commit, put `leases` on pages (a lease
        changes no count)."""
        _check_batch([*changes, *leases], "state changes")
        _check_marks(leases)
        for change in changes:
            check_id(change.page_id, "page_id")
            if change.score != change.score:
                raise InvalidArgument(f"page {change.page_id}: score is NaN")
            if change.state not in (HOT, COLD):
                raise InvalidArgument(f"page {change.page_id}: state must be HOT or COLD (got {change.state})")

        def move(txn: Txn, session: SessionRow, now: float) -> PageCounts:
            counts = session.pages
            for change in changes:
                old = txn.get(MANIFEST, PageKey(session_id, change.page_id))
                if old is None:
                    raise NotFound(f"session {session_id} has no page {change.page_id!r}")
                if change.restored_checksum and (old.state != COLD or old.checksum != change.restored_checksum):
                    raise FailedPrecondition(
                        f"page {change.page_id} is {PageState(old.state).name} with checksum "
                        f"{old.checksum or 'none'}, not the COLD payload {change.restored_checksum} the restore read")
                page = replace(old, state=change.state, updated_unix=now,
                               last_used_turn=change.last_used_turn or old.last_used_turn)
                if page.state == HOT and old.state == COLD:
                    page = replace(page, score=change.score)
                if page.state == COLD and (not page.locator or old.state in (DROPPED, CORRUPT)):
                    raise FailedPrecondition(
                        f"page {page.page_id} has no valid stored payload; write it before marking it cold")
                if old.state in (DROPPED, CORRUPT):
                    page = replace(page, locator="", checksum="", byte_size=0)
                counts = self._put_page(txn, session_id, counts, old, page)
            for page_id, lease in leases:
                if txn.get(MANIFEST, PageKey(session_id, page_id)) is None:
                    raise NotFound(f"{LEASES.name}: session {session_id} has no page {page_id!r}")
                txn.put(LEASES, PageKey(session_id, page_id), lease)
            return counts

        return self._change_pages(session_id, move)

    def delete_pages(self, session_id: str, page_ids: Sequence[str]) -> CommitInfo:
        _check_batch(page_ids, "pages")
        for page_id in page_ids:
            check_id(page_id, "page_id")
        removed: list[str] = []

        def move(txn: Txn, session: SessionRow, now: float) -> PageCounts:
            counts = session.pages
            for page_id in page_ids:
                page = txn.get(MANIFEST, PageKey(session_id, page_id))
                if page is None:
                    raise NotFound(f"session {session_id} has no page {page_id!r}")
                # the owner deletes what its record no longer names: only pins and leases hold a page here
                if not self._may_drop(txn, session_id, page, session.turn, now, recorded=set()):
                    raise FailedPrecondition(f"page {page_id} is pinned or leased; it cannot be deleted")
                counts = self._count(txn, PageKey(session_id, page_id), counts, page, -1)
                self._unindex(txn, PageKey(session_id, page_id), page)
                txn.delete(MANIFEST, PageKey(session_id, page_id))
                txn.delete(PAGE_STATES, StateKey(session_id, page.state, page_id))
                if page.locator:
                    removed.append(page.locator)
            return counts

        info = self._change_pages(session_id, move)
        self._delete_payloads(removed)
        return info

    def query_pages(self, session_id: str, states: Sequence[PageState], start_after: str, limit: int
                    ) -> tuple[list[PageRow], str]:
        if start_after:
            check_id(start_after, "start_after")
        pages: list[PageRow] = []
        with self.store.read() as txn:
            self._session(txn, session_id)
            if not states:
                after = PageKey(session_id, start_after) if start_after else None
                for _, page in txn.scan(MANIFEST, session_scope(session_id), after):
                    pages.append(page)
                    if limit and len(pages) > limit:
                        break
            else:
                for state in sorted(set(states)):
                    for state_key in txn.scan_keys(PAGE_STATES, state_scope(session_id, state)):
                        if start_after and state_key.page_id <= start_after:
                            continue
                        indexed = txn.get(MANIFEST, PageKey(session_id, state_key.page_id))
                        assert indexed is not None, "page_state index points at a missing page"
                        pages.append(indexed)
                pages.sort(key=lambda p: p.page_id)
        if limit and len(pages) > limit:
            return pages[:limit], pages[limit - 1].page_id
        return pages, ""

    def get_pages(self, session_id: str, page_ids: Sequence[str]) -> list[PageRow]:
        """The named pages that exist, in the order asked: one lookup each, whatever the session's size."""
        _check_batch(page_ids, "pages")
        for page_id in page_ids:
            check_id(page_id, "page_id")
        with self.store.read() as txn:
            self._session(txn, session_id)
            found = [page for page_id in page_ids if (page := txn.get(MANIFEST, PageKey(session_id, page_id)))]
        lost = self._fetch_payloads([(p.locator, p.byte_size, p.checksum) for p in found
                                     if p.locator and p.state != CORRUPT])
        if not lost:
            return found
        by_locator = {p.locator: p for p in found}
        for locator, reason in lost.items():
            self.mark_corrupt(session_id, by_locator[locator].page_id, reason)
        with self.store.read() as txn:
            return [page for p in found if (page := txn.get(MANIFEST, PageKey(session_id, p.page_id)))]

    # ----------------------------------------------------------------- payloads

    @staticmethod
    def _store_bytes(txn: Txn) -> int:
        total = sum(session.pages.bytes_on_disk for _, session in txn.scan(SESSIONS, EVERYTHING))
        return total + sum(snap.byte_size for _, snap in txn.scan(SNAPSHOTS, EVERYTHING))

    def make_room(self, incoming: int) -> None:
        """Drop cold payloads until `incoming` bytes fit, or raise StoreFull having dropped nothing."""
        with self.store.read() as txn:
            needed = self.blobs.shortfall(incoming, self._store_bytes(txn))
        if needed:
            freed = self.reclaim(needed)[0]
            if freed < needed:
                raise StoreFull(
                    f"the store needs {needed} more bytes for a {incoming}-byte write and only {freed} could "
                    f"be freed from cold, unpinned, unleased pages (free {self.blobs.free_bytes()}, "
                    f"reserve {self.blobs.reserve_bytes()}, quota {self.blobs.reserve.quota_bytes or 'none'})")

    def _droppable(self, txn: Txn, session_id: str) -> list[tuple[int, float, str, str, int]]:
        """Cold payloads that may go (of one session, or of all), least recently used first:
        (last_used_turn, updated, session, page, size)."""
        now = time.time()
        candidates = []
        scope = [self._session(txn, session_id)] if session_id else [s for _, s in txn.scan(SESSIONS, EVERYTHING)]
        for session in scope:
            sid = session.session_id
            recorded = _recorded_resident(txn, sid)
            for state_key in txn.scan_keys(PAGE_STATES, state_scope(sid, COLD)):
                page = txn.get(MANIFEST, PageKey(sid, state_key.page_id))
                assert page is not None
                if not self._may_drop(txn, sid, page, session.turn, now, recorded):
                    continue
                candidates.append((page.last_used_turn, page.updated_unix, sid, page.page_id, page.byte_size))
        candidates.sort()
        return candidates

    @staticmethod
    def _may_drop(txn: Txn, sid: str, page: PageRow, turn: int, now: float, recorded: set[int]) -> bool:
        """Not pinned, not leased, and not in attention at the end of the last completed turn: a
        turn that fails after evicting a page (a 507) leaves it COLD in the manifest, yet the
        session resumes from that turn's record, which needs the page back exactly."""
        key = PageKey(sid, page.page_id)
        if page.index in recorded or txn.has(PINS, key):
            return False
        lease = txn.get(LEASES, key)
        return lease is None or not lease.active(turn, now)

    def reclaim(self, bytes_needed: int, session_id: str = "", partial: bool = False
                ) -> tuple[int, list[tuple[str, str]]]:
        """Drop the least recently used cold, unpinned, unleased payloads (of `session_id`, or of
        every session) until bytes_needed are freed.

        Nothing resident (hot) and nothing pinned or leased is ever dropped. When the
        droppable pages cannot cover bytes_needed, none is dropped and (0, []) is returned, unless
        `partial` (a session over its quota gives up what it can). With an object store, the
        folder's copies of committed payloads go first (least recently used), no page dropped.
        """
        if self.tier is not None and not session_id:
            evicted = self.tier.evict(bytes_needed, set())
            if evicted >= bytes_needed:
                return evicted, []
        with self._space_lock:
            with self.store.read() as txn:
                candidates = self._droppable(txn, session_id)
            chosen: list[tuple[str, str]] = []
            planned = 0
            for _, _, sid, page_id, size in candidates:
                if planned >= bytes_needed:
                    break
                chosen.append((sid, page_id))
                planned += size
            if planned < bytes_needed and not partial:
                return 0, []

            def op(txn: Txn) -> list[tuple[str, int]]:
                now = time.time()
                locators = []
                recorded: dict[str, set[int]] = {}
                for sid, page_id in chosen:
                    session = self._session(txn, sid)
                    page = txn.get(MANIFEST, PageKey(sid, page_id))
                    if sid not in recorded:
                        recorded[sid] = _recorded_resident(txn, sid)
                    # Re-check inside the write: the page may have been restored or pinned since.
                    if page is None or page.state != COLD or not self._may_drop(txn, sid, page, session.turn,
                                                                                 now, recorded[sid]):
                        continue
                    locators.append((page.locator, page.byte_size))
                    new = replace(page, state=DROPPED, locator="", checksum="", byte_size=0, updated_unix=now)
                    counts = self._put_page(txn, sid, session.pages, page, new)
                    txn.put(SESSIONS, SessionKey(sid), replace(session, pages=counts))
                return locators

            dropped = self.store.write(op)[0]
            self._delete_payloads([locator for locator, _ in dropped])
            # What the store's accounting (bytes_on_disk, the quotas) lost: a payload a branch still
            # shares frees no disk, yet counts no more against this session (docs/contextd.md).
            return sum(size for _, size in dropped), chosen

    def report_corrupt(self, session_id: str, page_id: str, reason: str) -> tuple[CommitInfo, int]:
        """A reader found a page's payload missing or failing its checks (ReportCorrupt); returns
        the commit and how many pages were marked CORRUPT. With an object store the folder is a
        cache: a copy it lost (evicted under the reader) or holds damaged is not a lost page. That
        copy goes and the object store's is fetched, checked; the page is marked only when that one
        is lost or damaged too, or when the folder's copy is whole (the reader's complaint is then
        about what the payload holds, such as other tokens than the page's)."""
        if self.tier is not None:
            with self.store.read() as txn:
                page = txn.get(MANIFEST, PageKey(session_id, check_id(page_id, "page_id")))
            if page is not None and page.locator and page.state != CORRUPT:
                try:
                    self.blobs.read(page.locator, page.checksum, page.byte_size)
                except DataCorrupt:
                    self.tier.uncache([page.locator])
                    lost = self.tier.fetch([(page.locator, page.byte_size, page.checksum)])
                    if page.locator not in lost:
                        return CommitInfo(self.store.commit_seq, 0.0), 0
                    reason = f"{reason}; {lost[page.locator]}"
        return self.mark_corrupt(session_id, page_id, reason), 1

    def mark_corrupt(self, session_id: str, page_id: str, reason: str) -> CommitInfo:
        key = PageKey(session_id, check_id(page_id, "page_id"))

        def move(txn: Txn, session: SessionRow, now: float) -> PageCounts:
            old = txn.get(MANIFEST, key)
            if old is None:
                raise NotFound(f"session {session_id} has no page {page_id!r}")
            # A page that can never be served again keeps no lease (a restore leases the pages it
            # reads before it knows whether they verify; a lease changes no count).
            txn.delete(LEASES, key)
            if old.state == CORRUPT:
                return session.pages
            page = replace(old, state=CORRUPT, updated_unix=now, corrupt_reason=reason[:512])
            return self._put_page(txn, session_id, session.pages, old, page)

        return self._change_pages(session_id, move)

    # ----------------------------------------------------------------- pins, leases

    def set_marks(self, table: Table[PageKey, Mark], session_id: str, add: Sequence[tuple[str, Mark]],
                  remove: Sequence[str]) -> CommitInfo:
        """Pins or leases (`table`): put each of `add` on its page, take those of `remove` off."""
        _check_batch([*add, *remove], table.name)
        _check_marks(add)
        for page_id in remove:
            check_id(page_id, "page_id")

        def op(txn: Txn) -> int:
            session = self._session(txn, session_id)
            counts = session.pages
            # the marked pages' counts are taken out and put back around the change: a pin moves a
            # hot page in or out of `pinned`, a lease changes nothing
            keys = [PageKey(session_id, page_id) for page_id in [*remove, *(page_id for page_id, _ in add)]]
            pages = {key: page for key in keys if (page := txn.get(MANIFEST, key)) is not None}
            for key, page in pages.items():
                counts = self._count(txn, key, counts, page, -1)
            for page_id in remove:
                txn.delete(table, PageKey(session_id, page_id))
            for page_id, mark in add:
                if PageKey(session_id, page_id) not in pages:
                    raise NotFound(f"{table.name}: session {session_id} has no page {page_id!r}")
                txn.put(table, PageKey(session_id, page_id), mark)
            for key, page in pages.items():
                counts = self._count(txn, key, counts, page, 1)
            txn.put(SESSIONS, SessionKey(session_id), replace(session, pages=counts))
            return len(add) + len(remove)

        return self._commit(op, "commit the marks")[1]

    def query_marks(self, table: Table[PageKey, Mark], session_id: str) -> list[tuple[str, Mark]]:
        """The session's pins or leases (`table`), by page id."""
        with self.store.read() as txn:
            self._session(txn, session_id)
            return [(key.page_id, mark) for key, mark in txn.scan(table, session_scope(session_id))]

    # ----------------------------------------------------------------- snapshots, records

    def put_snapshot(self, session_id: str, snapshot: SnapshotRow) -> CommitInfo:
        """Record a snapshot whose payload is already in the store; the slot's previous payload
        is deleted after the commit."""
        self._check_snapshot(session_id, snapshot)
        self._commit_payloads([snapshot.locator])
        replaced: list[str] = []

        def op(txn: Txn) -> None:
            self._session(txn, session_id)
            self._put_snapshot(txn, session_id, snapshot, replaced)

        info = self._commit(op, "commit the snapshot")[1]
        self._delete_payloads(replaced)
        return info

    def _check_snapshot(self, session_id: str, snapshot: SnapshotRow) -> None:
        slot = check_id(snapshot.slot, "snapshot slot")
        _check_text(snapshot.fingerprint, "fingerprint", 256)
        if not snapshot.locator.startswith(session_id + "/"):
            raise InvalidArgument(f"snapshot {slot}: locator is outside session {session_id}")
        if not self.blobs.exists(snapshot.locator, snapshot.byte_size):
            raise FailedPrecondition(f"snapshot {slot}: no payload of {snapshot.byte_size} bytes at {snapshot.locator}")

    @staticmethod
    def _put_snapshot(txn: Txn, session_id: str, snapshot: SnapshotRow, replaced: list[str]) -> None:
        """Put a checked snapshot in its slot; the slot's previous payload joins `replaced`."""
        key = SnapshotKey(session_id, snapshot.slot)
        old = txn.get(SNAPSHOTS, key)
        if old is not None and old.locator and old.locator != snapshot.locator:
            replaced.append(old.locator)
        txn.put(SNAPSHOTS, key, replace(snapshot, created_unix=time.time()))

    def query_snapshots(self, session_id: str) -> list[SnapshotRow]:
        with self.store.read() as txn:
            self._session(txn, session_id)
            found = [s for _, s in txn.scan(SNAPSHOTS, session_scope(session_id))]
        self._fetch_payloads([(s.locator, s.byte_size, s.checksum) for s in found if s.locator])
        return found

    def write_record(self, session_id: str, record: RecordRow, keep_segments: int, append: Sequence[SegmentRow],
                     snapshots: Sequence[SnapshotRow] = ()) -> CommitInfo:
        """The end of a turn in one transaction: the session's counters, turn and fingerprint, its
        record, its transcript cut back to `keep_segments` segments and extended by `append`, and
        its recurrent snapshots (the slots' previous payloads are deleted after the commit)."""
        refused = record_refusal(record.message_hashes, [segment.text for segment in append])
        if refused:
            raise InvalidArgument(refused)
        if len(snapshots) > 8 or len({s.slot for s in snapshots}) != len(snapshots):
            raise InvalidArgument("at most 8 snapshots, one per slot")
        for snapshot in snapshots:
            self._check_snapshot(session_id, snapshot)
        _check_text(record.fingerprint, "fingerprint", 256)
        if len(record.fingerprint_parts) > 8 or any(len(p) > 256 for p in record.fingerprint_parts):
            raise InvalidArgument("fingerprint_parts holds at most 8 strings of at most 256 characters")
        if len(record.counters) > 256 or any(len(name) > 64 for name in record.counters):
            raise InvalidArgument("at most 256 counters, names of at most 64 characters")
        if len(record.resident_pages) != len(record.resident_positions):
            raise InvalidArgument("resident_pages and resident_positions must have one entry each per page")
        _check_batch(record.ledger_pages, "ledger_pages")
        _check_batch(record.resident_pages, "resident_pages")
        if self.handover is not None:
            self._check_hold(session_id)
        self._commit_payloads([snapshot.locator for snapshot in snapshots])

        def op(txn: Txn) -> int:
            session = self._session(txn, session_id)
            old = txn.get(RECORDS, SessionKey(session_id)) or RecordRow()
            if keep_segments > old.segments:
                raise FailedPrecondition(f"session {session_id} has {old.segments} stored segments; "
                                         f"cannot keep {keep_segments}")
            tokens = old.tokens
            for seq in range(keep_segments, old.segments):
                gone = txn.get(SEGMENTS, SegmentKey(session_id, seq))
                assert gone is not None, "a session's segments are contiguous"
                tokens -= len(gone.token_ids)
                txn.delete(SEGMENTS, SegmentKey(session_id, seq))
            for n, segment in enumerate(append):
                tokens += len(segment.token_ids)
                txn.put(SEGMENTS, SegmentKey(session_id, keep_segments + n), segment)
            txn.put(RECORDS, SessionKey(session_id),
                    replace(record, segments=keep_segments + len(append), tokens=tokens))
            txn.put(SESSIONS, SessionKey(session_id), replace(
                session, turn=record.turn, attention_tokens=record.attention_tokens, fingerprint=record.fingerprint,
                counters=dict(record.counters), updated_unix=time.time()))
            for snapshot in snapshots:
                self._put_snapshot(txn, session_id, snapshot, replaced)
            return len(append)

        replaced: list[str] = []
        info = self._commit(op, "commit the turn")[1]
        self._delete_payloads(replaced)
        if self.handover is not None:
            self._publish(session_id)
        return info

    def read_record(self, session_id: str) -> tuple[RecordRow, list[SegmentRow]]:
        with self.store.read() as txn:
            self._session(txn, session_id)
            record = txn.get(RECORDS, SessionKey(session_id))
            if record is None:
                raise NotFound(f"session {session_id} has no record yet (no turn has completed)")
            segments = [s for _, s in txn.scan(SEGMENTS, session_scope(session_id))]
        if len(segments) != record.segments:
            raise DataCorrupt(f"session {session_id}: the record names {record.segments} segments, "
                              f"{len(segments)} are stored")
        return record, segments

    # ----------------------------------------------------------------- status, gc, verify

    def status(self, session_id: str, include_closed: bool) -> Status:
        with self.store.read() as txn:
            meta = txn.get(META, MetaKey())
            assert meta is not None, "the store writes its meta row when it opens"
            if session_id:
                sessions = [self._session(txn, session_id)]
            else:
                sessions = [s for _, s in txn.scan(SESSIONS, EVERYTHING) if include_closed or not s.closed]
            rows = tuple(SessionStatus(
                session_id=s.session_id, model_id=s.model_id, budget_tokens=s.budget_tokens,
                attention_tokens=s.attention_tokens, turn=s.turn, pages=s.pages, closed=s.closed,
                counters=s.counters, snapshots=sum(1 for _ in txn.scan_keys(SNAPSHOTS, session_scope(s.session_id))))
                for s in sessions)
            store_bytes = self._store_bytes(txn)
        return Status(commit_seq=meta.commit_seq, last_commit_ms=self.store.last_commit_ms,
                      store_bytes=store_bytes, free_bytes=self.blobs.free_bytes(),
                      reserve_bytes=self.blobs.reserve_bytes(), quota_bytes=self.blobs.reserve.quota_bytes,
                      session_quota_bytes=self.config.retention.session_quota_bytes,
                      max_idle_s=self.config.retention.max_idle_s, sync_mode=self.config.sync.value,
                      root=str(self.config.root), pid=os.getpid(), uptime_s=time.time() - self.started,
                      sessions=rows, schema_version=SCHEMA_VERSION,
                      node=self.handover.node if self.handover is not None else "",
                      **(self.tier.status() if self.tier is not None else {}))

    def idle_sessions(self) -> list[str]:
        """Sessions idle for longer than the retention's max idle age (none without one)."""
        max_idle = self.config.retention.max_idle_s
        if not max_idle:
            return []
        cutoff = self.config.clock.time() - max_idle
        with self.store.read() as txn:
            return [s.session_id for _, s in txn.scan(SESSIONS, EVERYTHING) if s.updated_unix < cutoff]

    def _referenced_locators(self) -> set[str]:
        with self.store.read() as txn:
            return {locator for locator, _ in _payloads(txn, EVERYTHING)}

    def gc(self, dry_run: bool) -> GcResult:
        """Remove payload files no manifest entry points at, stale temporary files, expired leases."""
        removed = {True: 0, False: 0}  # is a temporary file -> files removed
        bytes_freed = 0
        idle = self.idle_sessions()
        if not dry_run:
            bytes_freed += sum(self.delete_session(session_id)[1] for session_id in idle)
        with self._space_lock:
            refs = self._referenced_locators()
            grace = time.time() - 60.0  # a temp file younger than this may be a write in flight
            for locator, path in self.blobs.files():
                is_temp = path.name.startswith(TEMP_PREFIX)
                # a young payload file was written by an engine whose manifest upsert may not have landed
                # yet (a branch's links are made and named under this lock: never seen half-made here)
                if locator in refs or path.stat().st_mtime > grace:
                    continue
                removed[is_temp] += 1
                bytes_freed += path.stat().st_size
                if not dry_run:
                    path.unlink(missing_ok=True)

        def op(txn: Txn) -> int:
            now = time.time()
            expired = 0
            for _, session in txn.scan(SESSIONS, EVERYTHING):
                for lease_key, lease in list(txn.scan(LEASES, session_scope(session.session_id))):
                    if not lease.active(session.turn, now):
                        expired += 1
                        if not dry_run:
                            txn.delete(LEASES, lease_key)
            return expired

        objects, object_bytes = self._gc_objects(dry_run)
        return GcResult(orphan_files_removed=removed[False], temp_files_removed=removed[True],
                        leases_expired=self.store.write(op)[0], bytes_freed=bytes_freed,
                        idle_sessions_deleted=len(idle), orphan_objects_removed=objects,
                        object_bytes_freed=object_bytes)

    def _gc_objects(self, dry_run: bool) -> tuple[int, int]:
        """Objects older than the grace that nothing names: not this root's rows, not a delete
        deferred to the next publish, not the holder's state (which may name payloads the rows
        stopped naming before a restart forgot the deferred delete). Sessions another server
        holds are skipped: their names are in a state this daemon may not have read yet; so are
        sessions whose exported state cannot be read whole (a chunk missing or changed). The
        grace covers uploads not yet committed (a payload goes up before the row naming it)."""
        if self.tier is None or self.handover is None:
            return 0, 0
        objects = self.tier.objects
        cutoff = time.time() - self.config.object_gc_grace_s
        old: dict[str, list[tuple[str, int]]] = {}
        for under in ("payloads/", "sessions/"):
            for key, size, modified in objects.list_objects(under):
                if modified < cutoff:
                    session_id = key[len(objects.config.prefix + under):].split("/", 1)[0]
                    old.setdefault(session_id, []).append((key, size))
        removed = freed = 0
        for session_id, found in old.items():
            holder = self.handover.holder(session_id)
            if holder is not None and holder.node != self.handover.node:
                continue
            with self.store.read() as txn:
                named = {locator for locator, _ in _payloads(txn, session_scope(session_id))}
            with self._unpublished_lock:
                named |= self._unpublished.get(session_id, set())
            keep = {objects.key(locator) for locator in named}
            if holder is not None:
                try:
                    keep |= self.handover.named(holder, session_id)
                except DataCorrupt:
                    continue   # its state cannot say what it names: all of its objects are kept
            for key, size in found:
                if key in keep:
                    continue
                if not dry_run:
                    objects.delete_object(key)
                removed += 1
                freed += size
        return removed, freed

    def _check_payload(self, wanted: Wanted) -> None:
        """Read a payload whole and check its size and checksum (verify); DataCorrupt when it is
        lost. With an object store a folder copy that is missing or damaged is not a loss: it goes,
        and the object store's copy is fetched and checked in its place. Nothing is held for a
        reader afterwards: this is the read."""
        locator, size, checksum = wanted
        for reason in self._fetch_payloads([wanted], hold=False).values():
            raise DataCorrupt(reason)
        try:
            self.blobs.read(locator, checksum, size)
        except DataCorrupt:
            if self.tier is None:
                raise
            self.tier.uncache([locator])
            for reason in self.tier.fetch([wanted], hold=False).values():
                raise DataCorrupt(reason) from None

    def verify(self, session_id: str) -> VerifyResult:
        """Re-read and re-checksum every stored payload; mark failures corrupt."""
        with self.store.read() as txn:
            if session_id:
                self._session(txn, session_id)
            scope = session_scope(session_id) if session_id else EVERYTHING
            pages = [(k.session_id, p) for k, p in txn.scan(MANIFEST, scope) if p.locator and p.state != CORRUPT]
            snapshots = [(k.session_id, s) for k, s in txn.scan(SNAPSHOTS, scope) if s.locator]
        corrupt: list[PageRef] = []
        pages_ok = bytes_read = 0
        for sid, page in pages:
            try:
                self._check_payload((page.locator, page.byte_size, page.checksum))
            except DataCorrupt as exc:
                self.mark_corrupt(sid, page.page_id, str(exc))
                corrupt.append(PageRef(sid, page.page_id))
                continue
            pages_ok += 1
            bytes_read += page.byte_size
        for sid, snap in snapshots:
            try:
                self._check_payload((snap.locator, snap.byte_size, snap.checksum))
            except DataCorrupt:
                corrupt.append(PageRef(sid, f"snapshot:{snap.slot}"))
                continue
            bytes_read += snap.byte_size
        return VerifyResult(pages_checked=len(pages), pages_ok=pages_ok, corrupt=tuple(corrupt),
                            snapshots_checked=len(snapshots), bytes_read=bytes_read)


def _recorded_resident(txn: Txn, session_id: str) -> set[int]:
    """Indexes of the pages in attention at the end of the session's last completed turn."""
    record = txn.get(RECORDS, SessionKey(session_id))
    return set(record.resident_pages) if record is not None else set()


def _payloads(txn: Txn, scope: bytes) -> Iterator[tuple[str, int]]:
    """(locator, size) of every payload the manifest rows and snapshots under `scope` name."""
    for _, page in txn.scan(MANIFEST, scope):
        if page.locator:
            yield page.locator, page.byte_size
    for _, snapshot in txn.scan(SNAPSHOTS, scope):
        if snapshot.locator:
            yield snapshot.locator, snapshot.byte_size


def _holder(row: HoldRow) -> Holder:
    return Holder(row.token, row.node, row.model_id, row.state, row.busy_until, row.etag)


def _hold_row(holder: Holder, chunks: Sequence[str]) -> HoldRow:
    return HoldRow(holder.token, holder.node, holder.model_id, holder.state, holder.busy_until, holder.etag,
                   tuple(chunks))


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
