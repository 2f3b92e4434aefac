"""The one place pages move: store, evict, restore, truncate, persist and recover.

Every move follows the same order, so a crash at any point leaves contextd describing a state
the session can resume from:
  store     the page's block is written as an immutable file (contextd.client.Payloads, the one
            durable write path), then recorded in the manifest (UpsertPages);
  evict     only stored pages leave attention; the manifest says COLD after they have;
  restore   the manifest record is looked up by id (GetPages), the file is streamed into free
            cache slots, verified and re-anchored (Backend.insert_block_file: copies and
            arithmetic, never a forward pass), and only then is the page HOT in the pager and in
            the manifest, with a lease;
  persist   at the end of a turn: every resident page not yet stored, the pins, then the
            session record (counters, transcript segments) and the recurrent snapshots (at the
            end of the turn and before its answer) in one transaction, and last the deletion of
            superseded partial versions;
  recover   a session not in memory is rebuilt from contextd: the record gives the transcript,
            the manifest gives every page's state (it is the truth), pins and leases come from
            their tables; what disagrees is fixed and said (`Session.recovery_notes`).

Depends on backends (protocol), controller (pager, units, key index), contextd.client and
serving.session / serving.transcript.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import numpy as np

from backends import Backend, Block, BlockFormatError, BlockMismatchError, RecurrentSnapshot
from contextd import crashpoints
from contextd.client import Client, pb
from contextd.errors import DataCorrupt, NotFound
from controller.keyindex import KeyIndex
from controller.lexical import LexicalIndex
from controller.pager import PAGE_TOKENS, Decision, Pager, PagerConfig, PageState, PinKind
from controller.units import UnitIndex
from serving.session import Session, SessionCounters
from serving.transcript import Fingerprint, Segment, Transcript

log = logging.getLogger("kv_elision.paging")

RECURRENT_SLOT = "recurrent"
# The recurrent state before the newest turn opener. A client that did not receive an answer
# (a crash after the record was written) re-sends the turn; a hybrid cannot cut its recurrent
# state back, so without this second slot the whole session would be prefilled again.
BEFORE_ANSWER_SLOT = "recurrent-before-answer"


class Tally:
    """Counts into a session's counters and the server's totals at once."""

    def __init__(self) -> None:
        self.totals = SessionCounters()

    def count(self, session: Session, **deltas: int) -> None:
        session.counters.add(**deltas)
        self.totals.add(**deltas)

    def peak(self, session: Session, attention_tokens: int) -> None:
        session.counters.peak(attention_tokens)
        self.totals.peak(attention_tokens)


def message_end_pages(segments: Iterable[Segment]) -> set[int]:
    """Pages in which a segment (one message, or one answer) ends."""
    ends: set[int] = set()
    tokens = 0
    for segment in segments:
        tokens += len(segment.ids)
        if segment.ids:
            ends.add((tokens - 1) // PAGE_TOKENS)
    return ends


class PageMover:
    """Carries the pager's decisions out on the backend and records them in contextd."""

    def __init__(self, backend: Backend, contextd: Client, tally: Tally,
                 new_indexes: Callable[[], tuple[KeyIndex | None, LexicalIndex | None]],
                 compress: bool = False) -> None:
        self.backend = backend
        self.compress = compress
        self.contextd = contextd
        self.payloads = contextd.payloads()
        self.tally = tally
        self.new_indexes = new_indexes

    # ------------------------------------------------------------------ during a turn

    def make_room(self, session: Session, incoming: int) -> None:
        """Evict down to the low watermark when `incoming` more tokens would cross the high one."""
        pager = session.pager
        if pager.must_evict_for(incoming):
            self.execute(session, pager.decide(None, incoming_tokens=incoming))

    def execute(self, session: Session, decision: Decision, scores: dict[int, float] | None = None) -> list[int]:
        """Store, evict, restore; return the pages that came back. Pages leave attention only once
        their payload is durable; a page whose payload is gone or corrupt stays out (said in the log)."""
        pager = session.pager
        storing = time.perf_counter()
        self.store(session, [i for i in decision.evict if not pager.pages[i].stored])
        session.timed("store", storing)
        # From the right, so the logical offsets of pages still to remove stay valid.
        for index in sorted(decision.evict, reverse=True):
            start = pager.logical_start(index)
            self.backend.remove_attention_range(start, start + pager.pages[index].tokens)
        crashpoints.reached("serving.evict.removed")
        pager.apply(Decision(evict=decision.evict, restore=[], plan_used=decision.plan_used))
        restoring = time.perf_counter()
        restored = self._restore(session, sorted(decision.restore))
        session.timed("restore", restoring)
        for index in restored:
            session.restore_scores[index] = (scores or {}).get(index, 0.0)
        self.tally.count(session, evicted_pages=len(decision.evict), evicted_pages_turn=len(decision.evict),
                         restored_pages=len(restored), restored_pages_turn=len(restored))
        changes = [pb.PageStateChange(page_id=pager.pages[i].page_id, state=pb.COLD, last_used_turn=pager.turn)
                   for i in decision.evict]
        changes += [pb.PageStateChange(page_id=pager.pages[i].page_id, state=pager.effective_state(pager.pages[i]).name,
                                       last_used_turn=pager.turn, score=(scores or {}).get(i, 0.0))
                    for i in restored]
        if changes:
            self.contextd.set_page_states(session.session_id, changes)
        if restored:
            self.contextd.set_leases(session.session_id, add=[
                pb.Lease(page_id=pager.pages[i].page_id, until_turn=pager.pages[i].lease_until_turn) for i in restored])
        self.tally.peak(session, self.backend.attention_tokens)
        return restored

    def _restore(self, session: Session, indices: list[int]) -> list[int]:
        """Stream each page's stored file into attention at its place in the timeline (ascending, so
        each lands after the ones before it); return those that came back."""
        if not indices:
            return []
        pager = session.pager
        records = {r.page_id: r for r in self.contextd.get_pages(session.session_id,
                                                                 [pager.pages[i].page_id for i in indices])}
        restored = []
        for index in indices:
            record = records.get(pager.pages[index].page_id)
            if record is None or record.state != pb.COLD or not record.locator:
                log.warning("session %s: page %d has no valid payload; it stays out", session.session_id, index)
                pager.pages[index].stored = False
                continue
            try:
                self._insert(session, record, index, pager.logical_start(index))
            except DataCorrupt as exc:
                log.warning("session %s: %s; it stays out", session.session_id, exc)
                pager.pages[index].stored = False
                continue
            pager.apply(Decision(evict=[], restore=[index], plan_used=False))
            restored.append(index)
            crashpoints.reached("serving.restore.inserted")
        return restored

    def _insert(self, session: Session, record: pb.Page, index: int, at: int, position: int | None = None) -> Block:
        """The server's restore of one page, from its manifest record to keys re-anchored in the
        cache (timed by benchmarks.restore): a verified streaming read, no forward pass. A payload
        that fails its checksum or holds other tokens is reported corrupt to contextd."""
        page = session.pager.pages[index]
        expected = session.transcript.ids[page.token_start:page.token_end]
        try:
            return self.backend.insert_block_file(self.payloads.path(record.locator), at, checksum=record.checksum,
                                                  size=record.byte_size, token_ids=_int32(expected),
                                                  position=position)
        except (BlockFormatError, BlockMismatchError) as exc:
            if isinstance(exc, BlockMismatchError) and "other tokens" not in str(exc):
                raise  # a block of another model: a configuration error, not a corrupt page
            reason = f"page {record.page_id}: {exc}"
            self.contextd.report_corrupt(session.session_id, record.page_id, reason)
            raise DataCorrupt(reason) from None

    def close_gaps(self, session: Session) -> None:
        """Renumber the held tokens 0..n-1 (re-anchoring the keys that move; no forward pass).

        Why: an evicted page leaves a gap in positions, and a restored page takes back the
        positions it had. RoPE is relative, so the model then reads a restored fact as far back
        as it was in the whole session: thousands of positions for a fact from the first file,
        a distance a small model cannot copy from (benchmarks.compare: SmolLM2-135M answered 0
        of 16 questions over gapped positions with the fact's page in view, and 13 of 16 when the
        same tokens were prefilled at contiguous positions). Closed, the working set reads like
        one short conversation. Once a turn, after the restores: ~20 ms for 2,000 moved keys."""
        restoring = time.perf_counter()
        self.backend.compact_positions()
        session.timed("restore", restoring)

    def refresh(self, session: Session, restored: list[int]) -> int:
        """Prefill the restored pages' tokens again in the current view (after everything held,
        the new message included) and put those K/V in the pages' places; return the tokens
        prefilled. Opt-in (`kv-elision serve --refresh`): it is a forward pass over history,
        counted as `refresh_forward_tokens`, never as a restore.

        Why: a restored page's K/V were computed in the context the page was first read in; the
        same tokens prefilled afresh in the current view read differently (benchmarks.compare's
        fresh reference view answered greedily where the served view did not, docs/proof.md).
        This measures how much of that gap is the restored pages' staleness. The stored payload
        stays the original: a page evicted again, or a recovered session, holds the stored K/V."""
        if not restored:
            return 0
        backend, pager = self.backend, session.pager
        ids = session.transcript.ids
        snap = backend.snapshot_recurrent()   # hybrids: the refresh must not fold into the stream state
        refreshed = 0
        for index in sorted(restored):
            page = pager.pages[index]
            tokens = ids[page.token_start:page.token_start + page.tokens]
            end = backend.attention_tokens
            backend.prefill(tokens)
            block = backend.save_block(end, end + len(tokens))
            backend.remove_attention_range(end, backend.attention_tokens)
            start = pager.logical_start(index)
            backend.remove_attention_range(start, start + len(tokens))
            backend.insert_block(block, start)
            refreshed += len(tokens)
        if snap is not None:
            backend.restore_recurrent(snap)
        return refreshed

    def place_near_question(self, session: Session, restored: list[int], new_tokens: int) -> bool:
        """Give this turn's restored pages the positions right before the new message (after the
        tail's earlier messages), instead of their place in the timeline; return whether any key
        moved. Only positions change (re-anchoring, no forward pass): the pages keep their place
        in the cache's logical order, so the pager's bookkeeping is untouched, and `close_gaps` at
        the end of the turn puts every position back in timeline order before anything is stored.

        Why: a restored fact otherwise sits behind the model's own recent answers, which SmolLM2
        copies (docs/proof.md: most wrong answers repeated a value from the hot tail)."""
        if not restored or new_tokens <= 0:
            return False
        pager = session.pager
        held = self.backend.attention_tokens
        new_start = held - min(new_tokens, held)
        moved = np.zeros(held, dtype=bool)
        for index in restored:
            start = pager.logical_start(index)
            moved[start:min(start + pager.pages[index].tokens, new_start)] = True
        if not moved.any():
            return False
        rest = ~moved
        rest[new_start:] = False
        ranked = np.concatenate([np.flatnonzero(rest), np.flatnonzero(moved), np.arange(new_start, held)])
        base = int(self.backend.positions().min()) if held else 0
        positions = np.empty(held, dtype=np.int64)
        positions[ranked] = base + np.arange(held, dtype=np.int64)
        placing = time.perf_counter()
        self.backend.reposition(positions)
        session.timed("restore", placing)
        return True

    def store(self, session: Session, indices: list[int]) -> None:
        """Write pages to the canonical store (payload first), then record them in one batch."""
        if not indices:
            return
        pager = session.pager
        records = []
        for index in indices:
            page = pager.pages[index]
            start = pager.logical_start(index)
            block = self.backend.save_block(start, start + page.tokens)
            stored = self.payloads.write(session.session_id, page.page_id, block.pieces(compress=self.compress),
                                         sync_folder=False)
            crashpoints.reached("serving.store.payload_written")
            if page.tokens == PAGE_TOKENS and session.key_index is not None:
                session.key_index.add(index, block.keys)
            if page.tokens == PAGE_TOKENS and session.lexical_index is not None:
                session.lexical_index.add(index, block.token_ids)
            page.stored = True
            previous = session.stored_ids.get(index)
            if previous is not None and previous != page.page_id:
                session.superseded.append((index, previous))
            session.stored_ids[index] = page.page_id
            self.tally.count(session, stored_pages=1, stored_bytes=stored.byte_size)
            records.append(pb.Page(page_id=page.page_id, index=index, token_start=page.token_start,
                                   token_end=page.token_end, original_position=page.token_start,
                                   state=pager.effective_state(page).name, locator=stored.locator,
                                   byte_size=stored.byte_size, checksum=stored.checksum, dtype=block.view.dtype,
                                   layer_view=block.view.model_id, last_used_turn=pager.turn))
        self.payloads.sync_folder(session.session_id)   # one directory fsync for the batch, before the records
        self.contextd.upsert_pages(session.session_id, records)
        crashpoints.reached("serving.store.recorded")

    def snapshot_recurrent(self, session: Session) -> None:
        """On a hybrid, keep the recurrent state at this segment boundary (what a cut resumes from)."""
        snap = self.backend.snapshot_recurrent()
        if snap is None:
            return
        session.snapshots[session.transcript.tokens] = snap
        for tokens in sorted(session.snapshots)[:-8]:  # the newest boundaries are what rebuilds use
            del session.snapshots[tokens]

    def truncate(self, session: Session, tokens: int) -> None:
        """Cut the session back to its first `tokens` tokens: attention, pager, units, index and
        recurrent state. A cold page across the cut comes back whole first. No forward pass."""
        # Stored versions of pages the cut removes go once the record no longer names them.
        for index in [i for i in session.stored_ids if i * PAGE_TOKENS >= tokens]:
            session.superseded.append((index, session.stored_ids.pop(index)))
        if tokens == 0:
            self.backend.reset()
            session.pager = Pager(session.pager.config)
            session.snapshots.clear()
            session.units = UnitIndex(session.units.salt)
            session.message_ends.clear()
            if session.key_index is not None:
                session.key_index.clear()
            if session.lexical_index is not None:
                session.lexical_index.clear()
            return
        pager = session.pager
        cut_page = pager.pages[(tokens - 1) // PAGE_TOKENS] if tokens < pager.total_tokens else None
        across = [cut_page.index] if cut_page is not None and tokens < cut_page.token_end and not cut_page.resident \
            else []
        if across:
            self.execute(session, Decision(evict=[], restore=across, plan_used=False))
        pager.truncate(tokens)
        session.units.truncate(len(pager.pages))
        session.message_ends = {i for i in session.message_ends if i < len(pager.pages)}
        if session.key_index is not None:
            session.key_index.truncate(tokens // PAGE_TOKENS)
        if session.lexical_index is not None:
            session.lexical_index.truncate(tokens // PAGE_TOKENS)
        held = pager.hot_tokens
        if self.backend.attention_tokens > held:
            self.backend.remove_attention_range(held, self.backend.attention_tokens)
        for later in [t for t in session.snapshots if t > tokens]:
            del session.snapshots[later]
        if self.backend.is_hybrid:
            self.backend.restore_recurrent(session.snapshots[tokens])

    # ------------------------------------------------------------------ end of turn

    def _store_snapshot(self, session: Session, slot: str, snap: RecurrentSnapshot) -> pb.Snapshot:
        """Write a recurrent snapshot's payload; return its row for `slot`, labelled with a hash of
        the tokens it folded in: recovery takes it only for a transcript that starts with them."""
        label = session.transcript.prefix_hash(snap.stream_tokens)
        assert label is not None, "recurrent snapshots are taken at segment boundaries"
        stored = self.payloads.write(session.session_id, "snapshot-" + slot, snap.pieces(), suffix="rs",
                                     sync_folder=False)
        return pb.Snapshot(slot=slot, token_count=snap.stream_tokens, fingerprint=label,
                           locator=stored.locator, byte_size=stored.byte_size, checksum=stored.checksum)

    def persist(self, session: Session, make_record: Callable[[], pb.SessionRecord]) -> None:
        """Write-through at the end of a turn: every resident page not yet stored (the open page
        too), new pins, the recurrent state, then the record with the new transcript segments,
        so a restart or a session switch restores this exact state with copies and no forward pass."""
        pager = session.pager
        sid = session.session_id
        self.store(session, [i for i in pager.resident if not pager.pages[i].stored])
        held = self.backend.positions()
        session.resident_positions = {i: int(held[pager.logical_start(i)]) for i in pager.resident}
        pins = [(pager.pages[i].page_id, kind.value) for i, kind in pager.pins.items()
                if pager.pages[i].stored and pager.pages[i].page_id not in session.recorded_pins]
        if pins:
            self.contextd.set_pins(sid, add=pins)
            session.recorded_pins.update(page_id for page_id, _ in pins)
        crashpoints.reached("serving.persist.pages_stored")
        record = make_record()  # after the stores above: its counters include them
        snapshots = []
        if self.backend.is_hybrid:
            before = session.transcript.last_opener_start()
            if before is not None and before in session.snapshots:
                snapshots.append(self._store_snapshot(session, BEFORE_ANSWER_SLOT, session.snapshots[before]))
            end = session.snapshots[session.transcript.tokens]
            snapshots.append(self._store_snapshot(session, RECURRENT_SLOT, end))
            self.payloads.sync_folder(sid)
        keep = session.stored_segments
        append = [pb.TranscriptSegment(text=s.text, token_ids=s.ids, generated=s.generated, opener=s.opener)
                  for s in session.transcript.segments[keep:]]
        self.contextd.write_record(sid, record, keep, append, snapshots)
        crashpoints.reached("serving.persist.recorded")
        session.stored_segments = len(session.transcript.segments)
        # Only now that the new record no longer names them: a crash before this line still finds
        # every payload the last record needs. A page that grew back to a version of the same id
        # (cut back, then filled again) is current, not superseded.
        gone = sorted({page_id for index, page_id in session.superseded
                       if index >= len(pager.pages) or pager.pages[index].page_id != page_id})
        session.superseded = []
        if gone:
            self.contextd.set_pins(sid, remove=sorted(set(gone) & session.recorded_pins))
            self.contextd.set_leases(sid, remove=gone)
            session.recorded_pins -= set(gone)
            self.contextd.delete_pages(sid, gone)

    # ------------------------------------------------------------------ sessions

    def fill_resident(self, session: Session) -> int:
        """Fill an empty backend with the session's resident pages (streamed copies) and its
        recurrent state; return how many pages came back."""
        pager = session.pager
        resident = [pager.pages[i] for i in pager.resident]
        records = {r.page_id: r for r in self.contextd.get_pages(session.session_id, [p.page_id for p in resident])}
        for page in resident:
            record = records.get(page.page_id)
            if record is None or not record.locator or record.state in (pb.DROPPED, pb.CORRUPT):
                raise DataCorrupt(f"session {session.session_id}: resident page {page.index} has no stored payload")
            block = self._insert(session, record, page.index, self.backend.attention_tokens,
                                 session.resident_positions.get(page.index))
            crashpoints.reached("serving.recover.resident_page")
            index = session.key_index
            if index is not None and page.tokens == PAGE_TOKENS and page.index not in index.pages:
                index.add(page.index, block.keys)
        if self.backend.is_hybrid and session.transcript.tokens:  # an empty session has no recurrent state
            snap = session.snapshots.get(session.transcript.tokens)
            if snap is None:
                raise DataCorrupt(f"session {session.session_id}: no recurrent snapshot at "
                                  f"{session.transcript.tokens} tokens")
            self.backend.restore_recurrent(snap)
        return len(resident)

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

    def recover(self, session_id: str, config: PagerConfig) -> Session | None:
        """Rebuild a session from contextd, or None when contextd has no completed turn of it."""
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
        snapshots = self._recurrent_snapshots(session_id, transcript) if self.backend.is_hybrid else {}
        snapshot = snapshots.get(RECURRENT_SLOT)
        pager = Pager(config)
        pager.append(transcript.ids)
        resident = dict(zip(record.resident_pages, record.resident_positions, strict=True))
        usable = {page_id for page_id, p in manifest.items() if p.locator and p.state not in (pb.DROPPED, pb.CORRUPT)}
        lost = [p.index for p in pager.pages if p.index in resident and p.page_id not in usable]
        if lost or (self.backend.is_hybrid and (snapshot is None or snapshot.stream_tokens != transcript.tokens)):
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
        session = Session(session_id, transcript, pager, UnitIndex(record.unit_salt), key_index=key_index,
                          lexical_index=lexical_index, counters=SessionCounters.from_dict(dict(record.counters)))
        session.stored_segments = len(transcript.segments)
        session.message_ends = message_end_pages(transcript.segments)
        moved = []
        for page in pager.pages:
            stored = manifest.get(page.page_id)
            pager.recover(page.index, resident=page.index in resident, pin=pins.get(page.page_id),
                          lease_until_turn=int(leases.get(page.page_id, 0)),
                          last_used_turn=int(stored.last_used_turn) if stored is not None else 0)
            if stored is None:
                continue  # a hole: cold, never stored or dropped and gone; it cannot come back
            page.stored = page.page_id in usable
            session.stored_ids[page.index] = page.page_id
            if page.stored and (stored.state == pb.COLD) != (page.state is PageState.COLD):
                moved.append(page)
        session.resident_positions = {int(i): int(p) for i, p in resident.items()}
        if moved:
            # A turn that did not complete moved these pages; the session resumes where the last
            # completed turn left attention, so the next answer is the one that turn implies.
            self.contextd.set_page_states(session_id, [
                pb.PageStateChange(page_id=p.page_id, state=pager.effective_state(p).name,
                                   last_used_turn=p.last_used_turn) for p in moved])
            names = ", ".join(p.page_id for p in moved[:3]) + (", ..." if len(moved) > 3 else "")
            notes.append(f"{len(moved)} pages moved by a turn that did not complete are back where the last "
                         f"completed turn left them ({names})")
        session.recorded_pins = {page_id for page_id in pins if page_id in session.stored_ids.values()}
        for snap in snapshots.values():
            session.snapshots[snap.stream_tokens] = snap
        self._drop_strays(session, manifest, pins, leases, notes)
        summaries = {b.block_id: b.summary for b in self.contextd.query_blocks(session_id)}
        session.units.update(pager, session.message_ends)
        for unit in session.units.units.values():
            unit.summary = summaries.get(unit.unit_id, "")
        for cluster in session.units.clusters.values():
            cluster.summary = summaries.get(cluster.cluster_id, "")
        session.recorded_summaries = summaries
        session.recovery_notes = notes
        for note in notes:
            log.warning("session %s recovered: %s", session_id, note)
        return session

    def _recurrent_snapshots(self, session_id: str, transcript: Transcript) -> dict[str, RecurrentSnapshot]:
        """The stored recurrent snapshots that belong to `transcript` (by the hash of the tokens
        each folded in), by slot; one that cannot be read or belongs elsewhere is left out."""
        found: dict[str, RecurrentSnapshot] = {}
        for ref in self.contextd.query_snapshots(session_id):
            if ref.slot not in (RECURRENT_SLOT, BEFORE_ANSWER_SLOT):
                continue
            if ref.fingerprint != transcript.prefix_hash(ref.token_count):
                log.info("session %s: snapshot %s covers other tokens than the record; not used", session_id, ref.slot)
                continue
            try:
                found[ref.slot] = RecurrentSnapshot.read(self.payloads.path(ref.locator), ref.checksum, ref.byte_size)
            except BlockFormatError as exc:
                log.warning("session %s: the recurrent snapshot %s cannot be read (%s)", session_id, ref.slot, exc)
        return found

    def _drop_strays(self, session: Session, manifest: dict[str, pb.Page], pins: dict[str, PinKind],
                     leases: dict[str, int], notes: list[str]) -> None:
        """Manifest pages the record does not name (written by a turn that died before its record,
        or partial versions superseded before a crash) are deleted, with their pins and leases."""
        wanted = set(session.stored_ids.values())
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


def _int32(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)
