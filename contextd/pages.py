"""The KV manifest's verbs: pages written, moved between states, deleted, queried, marked corrupt,
and the pins and leases put on them.

Page life cycle (enforced here, whatever the caller asks):
  HOT -> COLD             only when the page has a stored payload (it is written before it leaves)
  COLD -> HOT             a restore (refused, given the payload the engine read, unless the
                          page is still COLD with that payload)
  COLD -> DROPPED         only by the pressure policy (contextd.retention), and never when pinned
                          or leased
  any -> CORRUPT          when a read or `verify` finds the payload missing or mismatched
  DROPPED/CORRUPT -> HOT  the engine recomputed it; the stale payload reference is cleared
Pinned and leased are not states: they are rows of the pins and leases tables, on a page in any
state (the engine pins only hot pages and never evicts them).

Every write is one commit that changes the pages through contextd.manifest's `put_page` and stores
the session's counts with them; a payload is in the durable tier before the commit that names it
and deleted only after the commit that stops naming it (contextd.payloads).

Depends on contextd.manifest, contextd.payloads, contextd.retention (a session over its quota is
trimmed after a write), contextd.store, contextd.keys, contextd.records, contextd.ids,
contextd.errors and contextd.wire; contextd.integrity marks pages corrupt through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from contextd.errors import FailedPrecondition, InvalidArgument, NotFound
from contextd.ids import check_id
from contextd.keys import PageKey, SessionKey, StateKey, session_scope, state_scope
from contextd.manifest import (
    check_batch,
    check_marks,
    check_text,
    commit,
    count,
    lower_hex,
    may_drop,
    put_page,
    session_row,
    unindex,
)
from contextd.payloads import Payloads
from contextd.records import LeaseRow, PageCounts, PageRow, PinRow, SessionRow, StateChange
from contextd.retention import Sweeper
from contextd.store import LEASES, MANIFEST, PAGE_STATES, SESSIONS, CommitInfo, Store, Table, Txn
from contextd.wire import PageState

HOT, COLD, DROPPED, CORRUPT = PageState.HOT, PageState.COLD, PageState.DROPPED, PageState.CORRUPT

Mark = TypeVar("Mark", PinRow, LeaseRow)


class Pages:
    """The page, pin and lease verbs over `store`."""

    def __init__(self, store: Store, payloads: Payloads, sweeper: Sweeper) -> None:
        self.store = store
        self.payloads = payloads
        self.sweeper = sweeper

    def _check_page(self, session_id: str, page: PageRow, committed: str = "") -> PageRow:
        """A page row as a writer sends it, checked; `committed` is the locator the manifest names
        for it now (its payload may be out of the folder with an object store)."""
        check_id(page.page_id, "page_id")
        if page.token_end < page.token_start:
            raise InvalidArgument(
                f"page {page.page_id}: token range [{page.token_start}, {page.token_end}) is inverted")
        check_text(page.dtype, "dtype", 256)
        check_text(page.layer_view, "layer_view", 256)
        if len(page.prefix_hash) > 32 or not lower_hex(page.prefix_hash):
            raise InvalidArgument(f"page {page.page_id}: prefix_hash must be at most 32 lowercase hex digits")
        if page.locator:
            if not page.locator.startswith(session_id + "/"):
                raise InvalidArgument(f"page {page.page_id}: locator is outside session {session_id}")
            if len(page.checksum) != 32 or not lower_hex(page.checksum):
                raise InvalidArgument(f"page {page.page_id}: checksum must be 32 lowercase hex digits")
            if page.locator != committed and not self.payloads.blobs.exists(page.locator, page.byte_size):
                raise FailedPrecondition(
                    f"page {page.page_id}: no payload of {page.byte_size} bytes at {page.locator}")
        elif page.state == COLD:
            raise FailedPrecondition(f"page {page.page_id}: a cold page needs a stored payload")
        if page.state in (DROPPED, CORRUPT):
            raise InvalidArgument(f"page {page.page_id}: only contextd marks pages dropped or corrupt")
        return page

    def _change_pages(self, session_id: str, move: Callable[[Txn, SessionRow, float], PageCounts]) -> CommitInfo:
        """One write in which `move` changes some of the session's pages (at time `now`) and
        returns the session's page counts after the move, which are stored with them."""
        def op(txn: Txn) -> None:
            session = session_row(txn, session_id)
            counts = move(txn, session, time.time())
            txn.put(SESSIONS, SessionKey(session_id), replace(session, pages=counts))

        return commit(self.store, op, "commit the pages' change")[1]

    def upsert_pages(self, session_id: str, pages: Sequence[PageRow]) -> CommitInfo:
        check_batch(pages, "pages")
        for p in pages:
            check_id(p.page_id, "page_id")
        with self.store.read() as txn:
            named = {p.page_id: (old.locator if (old := txn.get(MANIFEST, PageKey(session_id, p.page_id))) else "")
                     for p in pages}
        checked = [self._check_page(session_id, p, named[p.page_id]) for p in pages]
        if len({p.page_id for p in checked}) != len(checked):
            raise InvalidArgument("a page_id appears twice in one batch")
        self.payloads.commit([p.locator for p in checked if p.locator and p.locator != named[p.page_id]])
        replaced: list[str] = []

        def move(txn: Txn, session: SessionRow, now: float) -> PageCounts:
            counts = session.pages
            for page in checked:
                old = txn.get(MANIFEST, PageKey(session_id, page.page_id))
                if old is not None and old.locator and old.locator != page.locator:
                    replaced.append(old.locator)
                counts = put_page(txn, session_id, counts, old, replace(page, updated_unix=now))
            return counts

        info = self._change_pages(session_id, move)
        self.payloads.delete(replaced)
        self.sweeper.trim_session(session_id)
        return info

    def set_page_states(self, session_id: str, changes: Sequence[StateChange],
                        leases: Sequence[tuple[str, LeaseRow]] = ()) -> CommitInfo:
        """Move pages between HOT and COLD and, in the same commit, put `leases` on pages (a lease
        changes no count)."""
        check_batch([*changes, *leases], "state changes")
        check_marks(leases)
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
                counts = put_page(txn, session_id, counts, old, page)
            for page_id, lease in leases:
                if txn.get(MANIFEST, PageKey(session_id, page_id)) is None:
                    raise NotFound(f"{LEASES.name}: session {session_id} has no page {page_id!r}")
                txn.put(LEASES, PageKey(session_id, page_id), lease)
            return counts

        return self._change_pages(session_id, move)

    def delete_pages(self, session_id: str, page_ids: Sequence[str]) -> CommitInfo:
        check_batch(page_ids, "pages")
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
                if not may_drop(txn, session_id, page, session.turn, now, recorded=set()):
                    raise FailedPrecondition(f"page {page_id} is pinned or leased; it cannot be deleted")
                counts = count(txn, PageKey(session_id, page_id), counts, page, -1)
                unindex(txn, PageKey(session_id, page_id), page)
                txn.delete(MANIFEST, PageKey(session_id, page_id))
                txn.delete(PAGE_STATES, StateKey(session_id, page.state, page_id))
                if page.locator:
                    removed.append(page.locator)
            return counts

        info = self._change_pages(session_id, move)
        self.payloads.delete(removed)
        return info

    def query_pages(self, session_id: str, states: Sequence[PageState], start_after: str, limit: int
                    ) -> tuple[list[PageRow], str]:
        if start_after:
            check_id(start_after, "start_after")
        pages: list[PageRow] = []
        with self.store.read() as txn:
            session_row(txn, session_id)
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
        check_batch(page_ids, "pages")
        for page_id in page_ids:
            check_id(page_id, "page_id")
        with self.store.read() as txn:
            session_row(txn, session_id)
            found = [page for page_id in page_ids if (page := txn.get(MANIFEST, PageKey(session_id, page_id)))]
        lost = self.payloads.fetch([(p.locator, p.byte_size, p.checksum) for p in found
                                    if p.locator and p.state != CORRUPT])
        if not lost:
            return found
        by_locator = {p.locator: p for p in found}
        for locator, reason in lost.items():
            self.mark_corrupt(session_id, by_locator[locator].page_id, reason)
        with self.store.read() as txn:
            return [page for p in found if (page := txn.get(MANIFEST, PageKey(session_id, p.page_id)))]

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
            return put_page(txn, session_id, session.pages, old, page)

        return self._change_pages(session_id, move)

    def set_marks(self, table: Table[PageKey, Mark], session_id: str, add: Sequence[tuple[str, Mark]],
                  remove: Sequence[str]) -> CommitInfo:
        """Pins or leases (`table`): put each of `add` on its page, take those of `remove` off."""
        check_batch([*add, *remove], table.name)
        check_marks(add)
        for page_id in remove:
            check_id(page_id, "page_id")

        def op(txn: Txn) -> int:
            session = session_row(txn, session_id)
            counts = session.pages
            # the marked pages' counts are taken out and put back around the change: a pin moves a
            # hot page in or out of `pinned`, a lease changes nothing
            keys = [PageKey(session_id, page_id) for page_id in [*remove, *(page_id for page_id, _ in add)]]
            pages = {key: page for key in keys if (page := txn.get(MANIFEST, key)) is not None}
            for key, page in pages.items():
                counts = count(txn, key, counts, page, -1)
            for page_id in remove:
                txn.delete(table, PageKey(session_id, page_id))
            for page_id, mark in add:
                if PageKey(session_id, page_id) not in pages:
                    raise NotFound(f"{table.name}: session {session_id} has no page {page_id!r}")
                txn.put(table, PageKey(session_id, page_id), mark)
            for key, page in pages.items():
                counts = count(txn, key, counts, page, 1)
            txn.put(SESSIONS, SessionKey(session_id), replace(session, pages=counts))
            return len(add) + len(remove)

        return commit(self.store, op, "commit the marks")[1]

    def query_marks(self, table: Table[PageKey, Mark], session_id: str) -> list[tuple[str, Mark]]:
        """The session's pins or leases (`table`), by page id."""
        with self.store.read() as txn:
            session_row(txn, session_id)
            return [(key.page_id, mark) for key, mark in txn.scan(table, session_scope(session_id))]
