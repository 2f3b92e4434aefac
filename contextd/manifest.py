"""What every verb's transaction does the same way: find the session, change a page with its
indexes and counts in step, name the payloads rows hold, remove a session's rows, commit.

Session rows carry page-count aggregates updated in the same transaction as the pages and the
pins (`pinned` counts the hot pages with a pin), so `status` costs O(sessions) and is always
consistent with the manifest. `put_page` is the one place a manifest row is written: it keeps the
page-state index, the prefix index and those counts in step, and every verb that moves a page
(contextd.pages, contextd.branches, contextd.holds, contextd.retention) goes through it, so none
of them can let an index or a count drift from the rows.

Also here, since every verb module needs them: the commit point under the caller's deadline and
the request checks the verbs share (text lengths, batch sizes, pins and leases to put).

Functions over a transaction (contextd.store's Txn) only; no state of its own. Depends on
contextd.store, contextd.keys, contextd.records, contextd.clock, contextd.ids, contextd.errors and
contextd.wire; never on a verb's module (they all import this one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from contextd.clock import current
from contextd.errors import InvalidArgument, NotFound
from contextd.ids import check_id
from contextd.keys import (
    EVERYTHING,
    PageKey,
    PrefixKey,
    SessionKey,
    StateKey,
    session_scope,
)
from contextd.records import LeaseRow, PageCounts, PageRow, PinRow, SessionRow
from contextd.store import (
    HOLDS,
    LEASES,
    MANIFEST,
    PAGE_STATES,
    PINS,
    PREFIXES,
    RECORDS,
    SCOPED,
    SESSIONS,
    SNAPSHOTS,
    CommitInfo,
    Store,
    Txn,
)
from contextd.wire import MAX_BATCH, MAX_TEXT, PageState

T = TypeVar("T")


def check_text(value: str, what: str, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {limit} are allowed")
    return value


def lower_hex(value: str) -> bool:
    """Only lowercase hex digits (a checksum's or a prefix hash's alphabet)."""
    return all(c in "0123456789abcdef" for c in value)


def check_batch(items: Sequence[Any], what: str) -> None:
    if len(items) > MAX_BATCH:
        raise InvalidArgument(f"{len(items)} {what} in one request; at most {MAX_BATCH} are allowed")


def check_marks(marks: Sequence[tuple[str, PinRow | LeaseRow]]) -> None:
    """Pins or leases to put on pages: valid ids and marks, before anything is written."""
    for page_id, mark in marks:
        check_id(page_id, "page_id")
        mark.check(page_id)


def commit(store: Store, op: Callable[[Txn], T], what: str) -> tuple[T, CommitInfo]:
    """`store.write(op)` at a call's commit point: refused (DeadlineExceeded) inside the
    transaction once the call's deadline has passed (contextd.clock). The client has given up
    on the call by then and takes it as failed, so it must find nothing of it done: a turn it
    sends again, or the next one, must not meet this one committed late behind it. Writes that
    record what already happened in the object store (a claim, a publish) are not commit
    points: they always land, through `store.write`."""
    deadline = current()
    if deadline is None:
        return store.write(op)

    def checked(txn: Txn) -> T:
        deadline.check(what)
        return op(txn)

    return store.write(checked)


def session_row(txn: Txn, session_id: str) -> SessionRow:
    """The session's row; NotFound when there is none."""
    session = txn.get(SESSIONS, SessionKey(check_id(session_id, "session_id")))
    if session is None:
        raise NotFound(f"no session {session_id!r}")
    return session


def count(txn: Txn, key: PageKey, counts: PageCounts, page: PageRow, sign: int) -> PageCounts:
    """`counts` with the page under `key` added (sign=1) or taken out (sign=-1), as pinned
    when the pins table holds it now."""
    return counts.plus(page, txn.has(PINS, key), sign)


def put_page(txn: Txn, session_id: str, counts: PageCounts, old: PageRow | None, page: PageRow) -> PageCounts:
    """Write a page and its state index entry; return the session's counts with the change."""
    key = PageKey(session_id, page.page_id)
    if old is not None:
        counts = count(txn, key, counts, old, -1)
        txn.delete(PAGE_STATES, StateKey(session_id, old.state, old.page_id))
        unindex(txn, key, old)
    txn.put(MANIFEST, key, page)
    txn.add(PAGE_STATES, StateKey(session_id, page.state, page.page_id))
    if page.prefix_hash and page.locator and page.state in (PageState.HOT, PageState.COLD):
        txn.add(PREFIXES, PrefixKey(page.prefix_hash, session_id, page.page_id))
    return count(txn, key, counts, page, 1)


def unindex(txn: Txn, key: PageKey, page: PageRow) -> None:
    """Take a page out of the prefix index (where it was in it)."""
    if page.prefix_hash:
        txn.delete(PREFIXES, PrefixKey(page.prefix_hash, key.session_id, key.page_id))


def may_drop(txn: Txn, sid: str, page: PageRow, turn: int, now: float, recorded: set[int]) -> bool:
    """Not pinned, not leased, and not in attention at the end of the last completed turn: a
    turn that fails after evicting a page (a 507) leaves it COLD in the manifest, yet the
    session resumes from that turn's record, which needs the page back exactly."""
    key = PageKey(sid, page.page_id)
    if page.index in recorded or txn.has(PINS, key):
        return False
    lease = txn.get(LEASES, key)
    return lease is None or not lease.active(turn, now)


def recorded_resident(txn: Txn, session_id: str) -> set[int]:
    """Indexes of the pages in attention at the end of the session's last completed turn."""
    record = txn.get(RECORDS, SessionKey(session_id))
    return set(record.resident_pages) if record is not None else set()


def named_payloads(txn: Txn, scope: bytes) -> Iterator[tuple[str, int]]:
    """(locator, size) of every payload the manifest rows and snapshots under `scope` name."""
    for _, page in txn.scan(MANIFEST, scope):
        if page.locator:
            yield page.locator, page.byte_size
    for _, snapshot in txn.scan(SNAPSHOTS, scope):
        if snapshot.locator:
            yield snapshot.locator, snapshot.byte_size


def store_bytes(txn: Txn) -> int:
    """The bytes every session's pages and every snapshot count against the quotas."""
    total = sum(session.pages.bytes_on_disk for _, session in txn.scan(SESSIONS, EVERYTHING))
    return total + sum(snap.byte_size for _, snap in txn.scan(SNAPSHOTS, EVERYTHING))


def remove_rows(txn: Txn, session_id: str) -> tuple[int, list[str]]:
    """Every row of a session (its hold included): the manifest rows removed and the payloads they
    and the snapshots named."""
    named = []
    for key, page in list(txn.scan(MANIFEST, session_scope(session_id))):
        unindex(txn, key, page)
        if page.locator:
            named.append(page.locator)
    named.extend(s.locator for _, s in txn.scan(SNAPSHOTS, session_scope(session_id)) if s.locator)
    removed = {table.name: txn.delete_prefix(table, session_scope(session_id)) for table in SCOPED}
    for table in (RECORDS, HOLDS, SESSIONS):
        txn.delete(table, SessionKey(session_id))
    return removed[MANIFEST.name], named
