"""Holding sessions and moving them between servers that share an object store (contextd.handover).

HoldSession takes a turn's lease or adopts a session another server exported; each WriteRecord
exports the session's state after its commit (`publish`), and a turn's record commits only while
this contextd holds the session (`before_record`). A session's `holds` row keeps the holder object
as this contextd last wrote it. Without an object store every session is this contextd's: a hold
is token 0 and the rest does nothing.

Its own module because it is the one concept that reads and writes the object store's view of a
session as a whole (its rows in, its rows out); the verbs that need a hold (contextd.sessions,
contextd.turns) ask `Holds` instead of the handover.

Depends on contextd.manifest, contextd.payloads, contextd.handover, contextd.store,
contextd.keys, contextd.records, contextd.ids and contextd.errors; not on another verb's module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from contextd.errors import InvalidArgument, SessionHeld
from contextd.handover import Handover, Holder, payloads_named
from contextd.ids import check_id
from contextd.keys import PageKey, SegmentKey, SessionKey, SnapshotKey, session_scope
from contextd.manifest import check_text, put_page, remove_rows, session_row
from contextd.payloads import Payloads
from contextd.records import (
    Hold,
    HoldRow,
    LeaseRow,
    PageCounts,
    PageRow,
    PinRow,
    RecordRow,
    SegmentRow,
    SessionRow,
    SnapshotRow,
)
from contextd.store import HOLDS, LEASES, MANIFEST, PINS, RECORDS, SEGMENTS, SESSIONS, SNAPSHOTS, Store, Txn


class Holds:
    """This contextd's holds on sessions; `handover` is None without an object store."""

    def __init__(self, store: Store, payloads: Payloads, handover: Handover | None, max_lease_s: float) -> None:
        self.store = store
        self.payloads = payloads
        self.handover = handover
        self.max_lease_s = max_lease_s

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
        check_text(model_id, "model_id", 512)
        if not 0 < lease_s <= self.max_lease_s:
            raise InvalidArgument(f"a lease of {lease_s:g} s is not in (0, {self.max_lease_s:g}]")
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
        assert self.handover is not None and self.payloads.tier is not None
        loaded = self.handover.load(holder)
        state, segments = loaded if loaded is not None else ({}, [])
        chunks = tuple(state.get("chunks", ()))
        named_before: list[str] = []

        def op(txn: Txn) -> None:
            named_before.extend(remove_rows(txn, session_id)[1])
            if loaded is not None:
                _put_rows(txn, session_id, state, segments)
            txn.put(HOLDS, SessionKey(session_id), _hold_row(holder, chunks))

        self.store.write(op)
        named = payloads_named(state) if loaded is not None else set()
        stale = (set(named_before) | self.payloads.take_unpublished(session_id)) - named
        self.payloads.discard(sorted(stale))

    def before_record(self, session_id: str) -> None:
        """Before a turn's record commits, with an object store: this contextd holds the session
        (a caller that never asked, such as a tool writing records itself, holds it here, unless
        another server exported it: that one's state is not overwritten)."""
        if self.handover is None:
            return
        with self.store.read() as txn:
            if txn.has(HOLDS, SessionKey(session_id)):
                return
        holder = self.handover.holder(session_id)
        if holder is not None and not holder.deleted:
            raise SessionHeld(f"session {session_id} is held by {holder.node} (token {holder.token}); "
                              "HoldSession adopts it before a turn is written here")
        self.hold_session(session_id)

    def publish(self, session_id: str) -> None:
        """After a turn's record commits, with an object store: export the session's state and make
        the holder name it (contextd.handover); then the objects the state stopped naming go.
        SessionHeld when another server took the session: the write is refused there, and this
        root's rows, now stale, are replaced at this server's next hold."""
        if self.handover is None:
            return
        with self.store.read() as txn:
            held = txn.get(HOLDS, SessionKey(session_id))
            assert held is not None, "write_record holds the session before its commit"
            session = session_row(txn, session_id)
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
        gone = self.payloads.take_unpublished(session_id)
        self.payloads.discard(sorted(gone - named))

    def remove(self, session_id: str, held: HoldRow | None) -> bool:
        """After a session's rows were deleted, given the hold they had: whether its objects are
        this contextd's to delete. With an object store and a hold, its exported state and holder
        go too, but only while this contextd still holds it (contextd.handover); a session another
        server took is that server's."""
        if self.handover is None or held is None:
            return True
        return self.handover.remove(session_id, _holder(held), held.chunks)


def _put_rows(txn: Txn, session_id: str, state: Mapping[str, Any], segments: Sequence[Mapping[str, Any]]) -> None:
    """Write an exported state's rows as `session_id`'s (pins before pages: a page's counts
    read its pin)."""
    for page_id, pin in state["pins"]:
        txn.put(PINS, PageKey(session_id, check_id(page_id, "page_id")), PinRow.load(pin))
    for page_id, lease in state["leases"]:
        txn.put(LEASES, PageKey(session_id, check_id(page_id, "page_id")), LeaseRow.load(lease))
    counts = PageCounts()
    for page in state["pages"]:
        counts = put_page(txn, session_id, counts, None, PageRow.load(page))
    for snapshot in state["snapshots"]:
        row = SnapshotRow.load(snapshot)
        txn.put(SNAPSHOTS, SnapshotKey(session_id, row.slot), row)
    for seq, segment in enumerate(segments):
        txn.put(SEGMENTS, SegmentKey(session_id, seq), SegmentRow.load(segment))
    txn.put(RECORDS, SessionKey(session_id), RecordRow.load(state["record"]))
    txn.put(SESSIONS, SessionKey(session_id), replace(SessionRow.load(state["session"]), pages=counts))


def _holder(row: HoldRow) -> Holder:
    return Holder(row.token, row.node, row.model_id, row.state, row.busy_until, row.etag)


def _hold_row(holder: Holder, chunks: Sequence[str]) -> HoldRow:
    return HoldRow(holder.token, holder.node, holder.model_id, holder.state, holder.busy_until, holder.etag,
                   tuple(chunks))
