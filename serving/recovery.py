"""Recovery: bring a session back from contextd, after a restart, a crash or another session's turn.

The manifest is the truth for where a page is; the session record gives the transcript, the
counters and which pages attention held (at which positions) when the last completed turn
ended; pins and leases come from their tables. `rebuild` makes the in-memory session from
them and fixes what disagrees (a turn that died moved pages or granted leases; pages its record
never named), saying so in `Session.recovery_notes`. `bring_back` then has the page mover fill
the empty backend with the resident pages and the recurrent state (streamed copies, never a
forward pass) and indexes the stored pages for the selector. A resident page that fails its
checksum is marked corrupt by the mover; recovery then runs again without it, in the same call.
Pages are found by id, and an id names the page's history (controller.pager.Page.page_id); a
page whose record names another history than the transcript gives it is marked corrupt and
never served. A store written before ids carried the history is read: a page found only under
its earlier id (`Page.legacy_id`) keeps it until it changes.

Pages move only through serving.paging.PageMover: this module reads records and payload keys,
never the backend's cache.

Depends on backends (Block, RecurrentSnapshot), controller, contextd.client and serving.paging /
session / transcript.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from backends import Block, BlockFormatError, RecurrentSnapshot
from contextd.client import Client, pb
from contextd.errors import DataCorrupt, NotFound
from contextd.wire import PageState, PinKind
from controller.keyindex import KeyIndex
from controller.lexical import LexicalIndex
from controller.pager import PAGE_TOKENS, Pager, PagerConfig
from serving.page_records import SnapshotSlot, foreign, stored_payload
from serving.paging import PageMover
from serving.session import Session, SessionCounters, Tally
from serving.transcript import Fingerprint, Segment, Transcript

log = logging.getLogger("kv_elision.recovery")

SLOTS = frozenset(slot.value for slot in SnapshotSlot)


class Recovery:
    """Rebuilds sessions from contextd and has the mover put their resident pages back."""

    def __init__(self, mover: PageMover, contextd: Client, tally: Tally,
                 new_indexes: Callable[[], tuple[KeyIndex | None, LexicalIndex | None]]) -> None:
        self.mover = mover
        self.contextd = contextd
        self.payloads = mover.payloads
        self.hybrid = mover.backend.is_hybrid   # hybrids also need their recurrent snapshots
        self.tally = tally
        self.new_indexes = new_indexes

    def bring_back(self, session_id: str, config: PagerConfig) -> Session | None:
        """The session from contextd with its resident pages and recurrent state in the (empty)
        backend, or None when contextd has no completed turn of it."""
        session = self.rebuild(session_id, config)
        if session is None:
            return None
        try:
            recovered = self.mover.fill_resident(session)
        except DataCorrupt:
            # A resident page failed its checksum and is now marked CORRUPT: rebuilding again
            # starts the session over without it.
            self.mover.empty()
            session = self.rebuild(session_id, config)
            assert session is not None
            recovered = self.mover.fill_resident(session)
        self.tally.count(session, recovered_pages=recovered)
        self.index_stored_pages(session)
        log.info("session %s recovered from contextd: %d tokens, %d resident pages", session_id,
                 session.transcript.tokens, len(session.pager.resident))
        return session

    def index_stored_pages(self, session: Session) -> None:
        """Give a recovered session's indexes its stored full pages not indexed yet. The lexical
        index reads the transcript's token ids (no file). The key index (resident pages were
        indexed as they were restored) does one positioned read of the index layer's keys per
        page, not the whole payload (a SmolLM2 page is 5.9 MB, its index layer 98 KB)."""
        pager = session.pager
        lexical = session.lexical_index
        if lexical is not None:
            ids = session.transcript.ids
            for page in pager.pages:
                if page.stored and page.tokens == PAGE_TOKENS and page.index not in lexical.pages:
                    lexical.add(page.index, ids[page.token_start:page.token_end])
        index = session.key_index
        if index is None:
            return
        wanted = [p for p in pager.pages if p.stored and p.tokens == PAGE_TOKENS and p.index not in index.pages]
        records = {r.page_id: r for r in self.contextd.get_pages(session.session_id, [p.page_id for p in wanted])}
        for page in wanted:
            record = records.get(page.page_id)
            if record is None or not record.locator:
                continue
            try:
                keys = Block.read_layer_keys(self.payloads.path(record.locator), index.layer)
            except BlockFormatError as exc:
                log.warning("session %s: page %s cannot be indexed (%s)", session.session_id, page.page_id, exc)
                continue
            index.add_layer(page.index, keys)

    def rebuild(self, session_id: str, config: PagerConfig) -> Session | None:
        """The session as contextd holds it (nothing in the backend yet), or None when contextd has
        no completed turn of it."""
        try:
            reply = self.contextd.read_record(session_id)
        except NotFound:
            return None
        record = reply.record
        notes: list[str] = []
        segments = [Segment(s.text, list(s.token_ids), s.generated, s.opener) for s in reply.segments]
        fingerprint = Fingerprint(*record.fingerprint_parts)
        manifest = {p.page_id: p for p in self.contextd.query_pages(session_id)}
        pins = {p.page_id: PinKind(p.kind) for p in self.contextd.query_pins(session_id)}
        leases = {lease.page_id: lease.until_turn for lease in self.contextd.query_leases(session_id)}
        # A lease granted by a turn that did not complete (the crash came before its record).
        horizon = int(record.turn) + config.lease_turns
        stale = sorted(page_id for page_id, until in leases.items() if until > horizon)
        if stale:
            self.contextd.set_leases(session_id, remove=stale)
            leases = {page_id: until for page_id, until in leases.items() if until <= horizon}
        transcript = Transcript(fingerprint, segments, list(record.message_hashes))
        snapshots = self._recurrent_snapshots(session_id, transcript) if self.hybrid else {}
        snapshot = snapshots.get(SnapshotSlot.END_OF_TURN)
        pager = Pager(config)
        pager.append(transcript.ids)
        for page in pager.pages:
            if page.page_id not in manifest and page.legacy_id in manifest:
                page.stored_as = page.legacy_id   # a store written before ids carried the prefix
        resident = dict(zip(record.resident_pages, record.resident_positions, strict=True))
        usable = {page_id for page_id, p in manifest.items()
                  if p.locator and PageState(p.state) not in (PageState.DROPPED, PageState.CORRUPT)}
        self._refuse_foreign(session_id, pager, manifest, usable, notes)
        lost = [p.index for p in pager.pages if p.index in resident and p.page_id not in usable]
        if lost or (self.hybrid and (snapshot is None or snapshot.stream_tokens != transcript.tokens)):
            # What attention held cannot be put back exactly: the session starts over, and the
            # client's next request prefills it again (a rebuild, counted as such).
            what = f"resident page {lost[0]}" if lost else "the recurrent state"
            notes.append(f"{what} could not be brought back; the session starts over from its first message")
            transcript = Transcript(fingerprint, [], list(record.message_hashes))
            pager = Pager(config)
            resident, snapshots = {}, {}

        pager.turn = int(record.turn)
        pager.ledger = [i for i in record.ledger_pages if i < len(pager.pages)]
        key_index, lexical_index = self.new_indexes()
        session = Session(session_id, transcript, pager, key_index=key_index,
                          lexical_index=lexical_index, counters=SessionCounters.from_dict(dict(record.counters)))
        session.persisted.segments = len(transcript.segments)
        moved = []
        for page in pager.pages:
            stored = manifest.get(page.page_id)
            pager.recover(page.index, resident=page.index in resident, pin=pins.get(page.page_id),
                          lease_until_turn=int(leases.get(page.page_id, 0)),
                          last_used_turn=int(stored.last_used_turn) if stored is not None else 0)
            if stored is None:
                continue  # a hole: cold, never stored or dropped and gone; it cannot come back
            page.stored = page.page_id in usable
            session.persisted.page_ids[page.index] = page.page_id
            if page.stored:
                session.persisted.payloads[page.page_id] = stored_payload(stored)
            if page.stored and (PageState(stored.state) is PageState.COLD) != (page.state is PageState.COLD):
                moved.append(page)
        session.persisted.resident_positions = {int(i): int(p) for i, p in resident.items()}
        if moved:
            # A turn that did not complete moved these pages; the session resumes where the last
            # completed turn left attention, so the next answer is the one that turn implies.
            self.contextd.set_page_states(session_id, [
                pb.PageStateChange(page_id=p.page_id, state=p.state.value,
                                   last_used_turn=p.last_used_turn) for p in moved])
            names = ", ".join(p.page_id for p in moved[:3]) + (", ..." if len(moved) > 3 else "")
            notes.append(f"{len(moved)} pages moved by a turn that did not complete are back where the last "
                         f"completed turn left them ({names})")
        session.persisted.pins = {page_id for page_id in pins if page_id in session.persisted.page_ids.values()}
        for snap in snapshots.values():
            session.snapshots[snap.stream_tokens] = snap
        self._drop_strays(session, manifest, pins, leases, notes)
        session.recovery_notes = notes
        for note in notes:
            log.warning("session %s recovered: %s", session_id, note)
        return session

    def _refuse_foreign(self, session_id: str, pager: Pager, manifest: dict[str, pb.Page], usable: set[str],
                        notes: list[str]) -> None:
        """Take out of `usable` each page whose record names another history than the transcript
        gives it (serving.page_records.foreign: the same tokens after other ones, such as a store
        written under an id that did not carry the prefix and replaced by another history's
        version, or another server's), marking it CORRUPT: it is never served, and the session
        goes on as it does without a corrupt page (a resident one: from its first message)."""
        for page in pager.pages:
            other = foreign(page, stored_payload(manifest[page.page_id])) if page.page_id in usable else ""
            if other:
                reason = f"page {page.page_id}: {other}"
                self.contextd.report_corrupt(session_id, page.page_id, reason)
                usable.discard(page.page_id)
                notes.append(f"{reason}; it is marked corrupt and not served")

    def _recurrent_snapshots(self, session_id: str, transcript: Transcript) -> dict[SnapshotSlot, RecurrentSnapshot]:
        """The stored recurrent snapshots that belong to `transcript` (by the hash of the tokens
        each folded in), by slot; one that cannot be read or belongs elsewhere is left out."""
        found: dict[SnapshotSlot, RecurrentSnapshot] = {}
        for ref in self.contextd.query_snapshots(session_id):
            if ref.slot not in SLOTS:
                continue
            if ref.fingerprint != transcript.prefix_hash(ref.token_count):
                log.info("session %s: snapshot %s covers other tokens than the record; not used", session_id, ref.slot)
                continue
            try:
                found[SnapshotSlot(ref.slot)] = RecurrentSnapshot.read(self.payloads.path(ref.locator), ref.checksum,
                                                                       ref.byte_size)
            except BlockFormatError as exc:
                log.warning("session %s: the recurrent snapshot %s cannot be read (%s)", session_id, ref.slot, exc)
        return found

    def _drop_strays(self, session: Session, manifest: dict[str, pb.Page], pins: dict[str, PinKind],
                     leases: dict[str, int], notes: list[str]) -> None:
        """Manifest pages the record does not name (written by a turn that died before its record,
        or partial versions superseded before a crash) are deleted, with their pins and leases."""
        wanted = set(session.persisted.page_ids.values())
        strays = sorted(set(manifest) - wanted)
        if not strays:
            return
        sid = session.session_id
        pinned = [p for p in strays if p in pins]
        if pinned:
            self.contextd.set_pins(sid, remove=pinned)
        leased = [p for p in strays if p in leases]
        if leased:
            self.contextd.set_leases(sid, remove=leased)
        self.contextd.delete_pages(sid, strays)
        notes.append(f"deleted {len(strays)} stored pages the last completed turn does not name ({strays[0]}, ...)")
