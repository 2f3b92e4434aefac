"""Branches: finding the stored session a prompt begins with, and starting a new session as its copy.

FindPrefix reads the prefix index (contextd.manifest keeps it in step with the manifest);
BranchSession copies a session's rows and shares its payloads (hard links, or copies in the
object store), so a payload has several owners and is gone only when its last owner lets go. The
share is made before the commit, under the space lock that `gc` and the drops under pressure
(contextd.retention) take too, so neither can remove a payload being shared or a link not yet
named by a row.

Depends on contextd.manifest, contextd.payloads, contextd.store, contextd.keys, contextd.records,
contextd.ids, contextd.errors and contextd.wire; not on another verb's module.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import replace

from contextd.errors import FailedPrecondition, InvalidArgument
from contextd.ids import check_id
from contextd.keys import PageKey, SegmentKey, SessionKey, SnapshotKey, prefix_scope, session_scope
from contextd.manifest import check_batch, commit, put_page, session_row
from contextd.payloads import Payloads
from contextd.records import Branch, PageCounts, SessionRow
from contextd.store import MANIFEST, PINS, PREFIXES, RECORDS, SEGMENTS, SESSIONS, SNAPSHOTS, Store, Txn
from contextd.wire import PageState


class Branches:
    """The branch verbs over `store`; `space_lock` is the one contextd.retention holds."""

    def __init__(self, store: Store, payloads: Payloads, space_lock: threading.RLock) -> None:
        self.store = store
        self.payloads = payloads
        self.space_lock = space_lock

    def find_prefix(self, model_id: str, fingerprint: str, prefix_hashes: Sequence[str]) -> tuple[str, int]:
        """The open session of this model and fingerprint, with a completed turn, whose stored
        full pages match `prefix_hashes` (page i's chain hash of the token ids up to its end)
        furthest from the first, and how many; ("", 0) when none matches the first. Of several,
        the one updated last. A chain hash at page i stands for every token before it, so the
        furthest match is found by bisection: O(log pages) index scans."""
        check_batch(prefix_hashes, "prefix hashes")
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
        with self.space_lock:
            with self.store.read() as txn:
                if txn.has(SESSIONS, SessionKey(session_id)):
                    raise FailedPrecondition(f"session {session_id} exists; a branch starts a new session")
                parent = session_row(txn, parent_id)
                record = txn.get(RECORDS, SessionKey(parent_id))
                if record is None:
                    raise FailedPrecondition(f"session {parent_id} has no completed turn to branch from")
                segments = [s for _, s in txn.scan(SEGMENTS, session_scope(parent_id))]
                pages = [p for _, p in txn.scan(MANIFEST, session_scope(parent_id))]
                pins = [(k.page_id, pin) for k, pin in txn.scan(PINS, session_scope(parent_id))]
                snapshots = [s for _, s in txn.scan(SNAPSHOTS, session_scope(parent_id))]
            shared = [p.locator for p in pages if p.locator and p.state in (PageState.HOT, PageState.COLD)] + \
                [s.locator for s in snapshots if s.locator]
            moved = self.payloads.share(shared, session_id)

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
                        copy = replace(copy, state=PageState.DROPPED, checksum="", byte_size=0)
                    counts = put_page(txn, session_id, counts, None, copy)
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
                session = commit(self.store, op, "commit the branch")[0]
            except BaseException:
                self.payloads.discard(list(moved.values()))
                raise
        sizes = {p.locator: p.byte_size for p in pages} | {s.locator: s.byte_size for s in snapshots}
        return Branch(session, len(pages), sum(sizes[locator] for locator in moved))
