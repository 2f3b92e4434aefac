"""What contextd keeps and what it lets go: drops under pressure, per-session quotas, idle
sessions, and `gc` of what nothing names.

Nothing resident (hot), pinned, leased or in attention at the end of the last completed turn is
ever dropped (contextd.manifest's `may_drop`); the least recently used cold payloads go first, and
the drop commits before the files go, so the manifest never names a missing file. Drops, `gc`'s
file walk and a branch's share (contextd.branches) are serialised by one space lock, so two drops
never plan on the same pages, and a payload being shared or a link not yet named by a row is
neither dropped nor taken for an orphan.

Depends on contextd.manifest, contextd.payloads, contextd.sessions (an idle session is deleted
as DeleteSession deletes it), contextd.handover, contextd.store, contextd.keys, contextd.records,
contextd.blobs, contextd.clock, contextd.errors and contextd.wire; contextd.pages trims a session
over its quota through it.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from contextd.blobs import TEMP_PREFIX
from contextd.clock import Clock
from contextd.errors import DataCorrupt, InvalidArgument
from contextd.handover import Handover
from contextd.keys import EVERYTHING, PageKey, SessionKey, session_scope, state_scope
from contextd.manifest import may_drop, named_payloads, put_page, recorded_resident, session_row
from contextd.payloads import Payloads
from contextd.records import GcResult
from contextd.sessions import Sessions
from contextd.store import LEASES, MANIFEST, PAGE_STATES, SESSIONS, Store, Txn
from contextd.wire import PageState


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


class Sweeper:
    """Drops, quotas, idle sessions and `gc` over `store`; `handover` is None without an object
    store, and `object_gc_grace_s` is how young an object `gc` leaves (an upload not yet committed)."""

    def __init__(self, store: Store, payloads: Payloads, sessions: Sessions, handover: Handover | None,
                 retention: Retention, clock: Clock, object_gc_grace_s: float, space_lock: threading.RLock) -> None:
        self.store = store
        self.payloads = payloads
        self.sessions = sessions
        self.handover = handover
        self.retention = retention
        self.clock = clock
        self.object_gc_grace_s = object_gc_grace_s
        self.space_lock = space_lock

    def _droppable(self, txn: Txn, session_id: str) -> list[tuple[int, float, str, str, int]]:
        """Cold payloads that may go (of one session, or of all), least recently used first:
        (last_used_turn, updated, session, page, size)."""
        now = self.clock.time()
        candidates = []
        scope = [session_row(txn, session_id)] if session_id else [s for _, s in txn.scan(SESSIONS, EVERYTHING)]
        for session in scope:
            sid = session.session_id
            recorded = recorded_resident(txn, sid)
            for state_key in txn.scan_keys(PAGE_STATES, state_scope(sid, PageState.COLD)):
                page = txn.get(MANIFEST, PageKey(sid, state_key.page_id))
                assert page is not None
                if not may_drop(txn, sid, page, session.turn, now, recorded):
                    continue
                candidates.append((page.last_used_turn, page.updated_unix, sid, page.page_id, page.byte_size))
        candidates.sort()
        return candidates

    def reclaim(self, bytes_needed: int, session_id: str = "", partial: bool = False
                ) -> tuple[int, list[tuple[str, str]]]:
        """Drop the least recently used cold, unpinned, unleased payloads (of `session_id`, or of
        every session) until bytes_needed are freed.

        Nothing resident (hot) and nothing pinned or leased is ever dropped. When the
        droppable pages cannot cover bytes_needed, none is dropped and (0, []) is returned, unless
        `partial` (a session over its quota gives up what it can). With an object store, the
        folder's copies of committed payloads go first (least recently used), no page dropped.
        """
        if self.payloads.tier is not None and not session_id:
            evicted = self.payloads.tier.evict(bytes_needed, set())
            if evicted >= bytes_needed:
                return evicted, []
        with self.space_lock:
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
                now = self.clock.time()
                locators = []
                recorded: dict[str, set[int]] = {}
                for sid, page_id in chosen:
                    session = session_row(txn, sid)
                    page = txn.get(MANIFEST, PageKey(sid, page_id))
                    if sid not in recorded:
                        recorded[sid] = recorded_resident(txn, sid)
                    # Re-check inside the write: the page may have been restored or pinned since.
                    if page is None or page.state != PageState.COLD or not may_drop(txn, sid, page, session.turn,
                                                                                    now, recorded[sid]):
                        continue
                    locators.append((page.locator, page.byte_size))
                    new = replace(page, state=PageState.DROPPED, locator="", checksum="", byte_size=0,
                                  updated_unix=now)
                    counts = put_page(txn, sid, session.pages, page, new)
                    txn.put(SESSIONS, SessionKey(sid), replace(session, pages=counts))
                return locators

            dropped = self.store.write(op)[0]
            self.payloads.delete([locator for locator, _ in dropped])
            # What the store's accounting (bytes_on_disk, the quotas) lost: a payload a branch still
            # shares frees no disk, yet counts no more against this session (docs/contextd.md).
            return sum(size for _, size in dropped), chosen

    def trim_session(self, session_id: str) -> None:
        """After a write of the session's pages: past the retention's per-session quota, its least
        recently used droppable pages go, as many as it takes or as there are."""
        quota = self.retention.session_quota_bytes
        if quota:
            with self.store.read() as txn:
                over = session_row(txn, session_id).pages.bytes_on_disk - quota
            if over > 0:
                self.reclaim(over, session_id, partial=True)

    def idle_sessions(self) -> list[str]:
        """Sessions idle for longer than the retention's max idle age (none without one)."""
        max_idle = self.retention.max_idle_s
        if not max_idle:
            return []
        cutoff = self.clock.time() - max_idle
        with self.store.read() as txn:
            return [s.session_id for _, s in txn.scan(SESSIONS, EVERYTHING) if s.updated_unix < cutoff]

    def gc(self, dry_run: bool) -> GcResult:
        """Remove payload files no manifest entry points at, stale temporary files, expired leases."""
        removed = {True: 0, False: 0}  # is a temporary file -> files removed
        bytes_freed = 0
        idle = self.idle_sessions()
        if not dry_run:
            bytes_freed += sum(self.sessions.delete_session(session_id)[1] for session_id in idle)
        with self.space_lock:
            with self.store.read() as txn:
                refs = {locator for locator, _ in named_payloads(txn, EVERYTHING)}
            grace = time.time() - 60.0  # a temp file younger than this may be a write in flight
            for locator, path in self.payloads.blobs.files():
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
            now = self.clock.time()
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
        if self.payloads.tier is None or self.handover is None:
            return 0, 0
        objects = self.payloads.tier.objects
        cutoff = time.time() - self.object_gc_grace_s
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
                named = {locator for locator, _ in named_payloads(txn, session_scope(session_id))}
            named |= self.payloads.unpublished(session_id)
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
