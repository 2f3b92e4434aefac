"""The one place pages move: store, evict, restore, place, truncate, persist, and fill a
recovered session's resident pages. Every backend call that puts K/V into the cache, takes it
out, copies a page out or moves positions is in this module (tests/unit/test_page_moves.py
walks the tree for calls elsewhere).

Every move follows the same order, so a crash at any point leaves contextd describing a state
the session can resume from:
  store     the page's block is written as an immutable file (contextd.client.Payloads, the one
            durable write path), then recorded in the manifest (UpsertPages) under the id of its
            version (controller.pager.Page.page_id: the id carries the page's prefix hash), so
            no store replaces a version the last session record names; nothing is stored for a
            turn whose record contextd would refuse (contextd.wire.record_refusal);
  evict     only stored pages leave attention; the manifest says COLD after they have;
  restore   the decision's manifest records are looked up in one call (GetPages); the decision's
            one state commit (the evicted pages COLD, the restored ones HOT with their leases)
            runs while the files are read in parallel into free cache slots, verified and
            re-anchored, each held key at most once (Backend.insert_block_files: copies and
            arithmetic, never a forward pass); the pager calls a page HOT only once both are
            done, and a page whose payload failed its checks is then marked CORRUPT (which
            takes its lease off); a payload whose record names another history than the
            session's transcript gives the page (`foreign`) is never read in, and is marked
            CORRUPT too;
  persist   at the end of a turn: every resident page not yet stored, the pins, then the
            session record (counters, transcript segments) and the recurrent snapshots (at the
            end of the turn and before its answer) in one transaction, and last the deletion of
            superseded partial versions.
Rebuilding a session from contextd is serving.recovery's; it has this module fill the backend.

Depends on backends (protocol), controller (pager), contextd.client and serving.session /
page_records / scoring / transcript.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from backends import (
    Backend,
    Block,
    BlockFormatError,
    RecurrentSnapshot,
    StoredBlock,
    UnsupportedModelError,
)
from contextd import crashpoints
from contextd.client import Client, Pending, pb
from contextd.errors import DataCorrupt, FailedPrecondition
from contextd.wire import PageState, record_refusal
from controller.pager import PAGE_TOKENS, Decision, Page, Pager, Plan
from serving.page_records import SnapshotSlot, cold_payload, foreign, stored_payload
from serving.scoring import ControllerScorer, score_as_a_turn
from serving.session import Session, StoredPayload, Tally
from serving.transcript import TranscriptError

log = logging.getLogger("kv_elision.paging")

# A recovery or an adoption asks for its resident pages' records this many at a time (see
# fill_resident): a round of contextd's object-store downloads (four at a time) and a bit more.
FILL_PAGES = 8

# The session's first held tokens that scoring puts before every page it reads (`_sink`). A small
# model keeps much of its attention on the first tokens it saw (attention sinks; Xiao et al. 2023,
# StreamingLLM, keep 4); a stored page's first token was computed mid-session and does not play that
# part, so a page read alone skews its own score (docs/results/selectors.md has what they bought).
SINK_TOKENS = 4


class PageMover:
    """Carries the pager's decisions out on the backend and records them in contextd."""

    def __init__(self, backend: Backend, contextd: Client, tally: Tally, compress: bool = False,
                 controller: ControllerScorer | None = None, opening: Sequence[int] = ()) -> None:
        """`opening`: the chat template's user opening, read between a page and the question it
        scores (`score_as_a_turn`)."""
        self.backend = backend
        self.opening = list(opening)
        self.compress = compress
        self.contextd = contextd
        self.payloads = contextd.payloads()
        self.tally = tally
        self.controller = controller

    # ------------------------------------------------------------------ during a turn

    def empty(self) -> None:
        """Take every page and all recurrent state out of the backend (another session comes in,
        or a failed turn left its state unknown). The store keeps everything."""
        self.backend.reset()

    def newest_keys(self, tokens: int) -> np.ndarray | None:
        """Canonical keys of the newest `tokens` held tokens (a copy; nothing moves), or None for none."""
        end = self.backend.attention_tokens
        n = min(tokens, end)
        return self.backend.save_block(end - n, end).keys if n > 0 else None

    def make_room(self, session: Session, incoming: int) -> None:
        """Evict down to the low watermark when `incoming` more tokens would cross the high one
        (in the order the session's eviction advice gives, when it has one)."""
        pager = session.pager
        if pager.must_evict_for(incoming):
            order = self.advise_evictions(session, incoming)
            self.execute(session, pager.decide(Plan(evict_first=order) if order else None, incoming_tokens=incoming))

    def watch_attention(self, session: Session) -> None:
        """Before a prefill chunk: the backend reports the chunk's attention weights only where the
        session's attention order takes a vote from it (`AttentionOrder.voting`); other chunks run
        unwatched, at no cost."""
        order = session.attention
        if order is None or not order.voting:
            self.backend.observe_attention(0, [])
        else:
            self.backend.observe_attention(
                order.config.queries, order.config.watched_layers(len(self.backend.layer_view.attention_layers)))

    def observe_attention(self, session: Session, new_tokens: int) -> None:
        """After a prefill chunk of `new_tokens`: the session's attention order decays its scores
        and, from a voting chunk, adds the weights the forward reported (`Backend.attention_weights`).
        Its time is the turn's `advise` phase (the weights' rows inside the forward are not)."""
        order = session.attention
        if order is None:
            return
        observing = time.perf_counter()
        order.observe(session.pager, self.backend.attention_weights() if order.voting else None, new_tokens)
        session.timed("advise", observing)

    def advise_evictions(self, session: Session, incoming: int) -> list[int]:
        """The pages to evict first for `incoming` more tokens, by the session's eviction advice
        (controller.eviction: the pages least related to the last user message first, or least
        attended); [] without advice or when there is nothing to choose. Its time is the turn's
        `advise` phase."""
        if session.attention is not None:
            advising = time.perf_counter()
            try:
                return session.attention.order(session.pager, incoming)
            finally:
                session.timed("advise", advising)
        advisor = session.eviction
        if advisor is None:
            return []
        advising = time.perf_counter()
        try:
            cheap = None if self.controller is None else functools.partial(self.controller.holding, session)
            return advisor.order(session.pager, incoming, self.scorer(session, held=True), cheap)
        finally:
            session.timed("advise", advising)

    def scorer(self, session: Session, *, held: bool) -> Callable[[list[int], list[int]], dict[int, np.ndarray]]:
        """How this session's pages are scored: by the controller model when the server has one (a
        page in attention and a cold one alike), else by the serving model over their K/V, as held
        in attention (`held`: `score_held`, for the eviction advice) or as stored (`score_pages`,
        for a selector's cold candidates)."""
        if self.controller is not None:
            return functools.partial(self.score_by_controller, session)
        return functools.partial(self.score_held if held else self.score_pages, session)

    def score_by_controller(self, session: Session, indices: list[int], token_ids: list[int]
                            ) -> dict[int, np.ndarray]:
        """Query likelihood read by the controller model from the pages' text (serving.scoring);
        the same for a page in attention or cold. Counted as `controller_forward_tokens`."""
        assert self.controller is not None
        scores, forwarded = self.controller.score(session, indices, token_ids)
        self.tally.count(session, controller_forward_tokens=forwarded)
        return scores

    def score_held(self, session: Session, indices: list[int], token_ids: list[int]) -> dict[int, np.ndarray]:
        """Query likelihood over pages in attention, for the eviction advice: each page's K/V as
        held (`Backend.save_block`), scored like `score_pages` scores stored ones, in one forward
        (`score_as_a_turn`; counted as `controller_forward_tokens`, no forward over history). The
        engine takes the advice only for models whose layers are all full attention."""
        pager = session.pager
        blocks = [self.backend.save_block(pager.logical_start(i), pager.logical_start(i) + pager.pages[i].tokens)
                  for i in indices]
        scores, forwarded = score_as_a_turn(self.backend, blocks, self.opening, token_ids, self._sink())
        self.tally.count(session, controller_forward_tokens=forwarded)
        return dict(zip(indices, scores, strict=True))

    def _sink(self) -> Block | None:
        """The first `SINK_TOKENS` tokens held (the live view's start, a pinned system prompt's when
        there is one), as their K/V, for scoring to put before every page it reads."""
        n = min(SINK_TOKENS, self.backend.attention_tokens)
        return self.backend.save_block(0, n) if n else None

    def execute(self, session: Session, decision: Decision, scores: dict[int, float] | None = None) -> list[int]:
        """Store, evict, restore; return the pages that came back. Pages leave attention only once
        their payload is durable; a page whose payload is gone or corrupt stays out (said in the log)."""
        pager = session.pager
        storing = time.perf_counter()
        self.store(session, [i for i in decision.evict if not pager.pages[i].stored])
        session.timed("store", storing)
        for index in sorted(decision.evict, reverse=True):   # from the right: the offsets still to come hold
            start = pager.logical_start(index)
            self.backend.remove_attention_range(start, start + pager.pages[index].tokens)
        crashpoints.reached("serving.evict.removed")
        pager.apply(Decision(evict=decision.evict, restore=[], plan_used=decision.plan_used))
        restoring = time.perf_counter()
        evicted = [pb.PageStateChange(page_id=pager.pages[i].page_id, state=PageState.COLD.value,
                                      last_used_turn=pager.turn) for i in decision.evict]
        restored = self._restore(session, sorted(decision.restore), evicted, scores or {})
        session.timed("restore", restoring)
        for index in restored:
            session.restore_scores[index] = (scores or {}).get(index, 0.0)
        self.tally.count(session, evicted_pages=len(decision.evict), evicted_pages_turn=len(decision.evict),
                         restored_pages=len(restored), restored_pages_turn=len(restored))
        self.tally.peak(session, self.backend.attention_tokens)
        return restored

    def _restore(self, session: Session, indices: list[int], evicted: list[pb.PageStateChange],
                 scores: dict[int, float], ask: bool = False) -> list[int]:
        """Stream the pages' stored files into attention at their places in the timeline, all in
        one backend call (files read in parallel, each held key re-anchored once), while the
        decision's one state commit (`evicted`, then these pages HOT with leases) runs; return the
        pages that came back, ascending. A page whose payload is gone or corrupt stays out (said
        in the log).

        Where each payload is comes from what this server wrote or last read of it
        (`Persisted.payloads`) when its file is in the folder, else (or for every page, `ask`)
        from contextd, whose GetPages also brings back what only an object store holds. Each
        restored page's state change names the payload read, so contextd refuses the commit if a
        page changed meanwhile (dropped to make room, found corrupt): the pages then come out
        again and the decision is carried out on contextd's records. Not asking first saves a
        round trip (docs/results/restore.md)."""
        pager = session.pager
        if not indices:
            if evicted:
                self.contextd.set_page_states(session.session_id, evicted)
            return []
        payloads, learned = self._payloads(session, indices, ask)
        asked: list[tuple[int, StoredPayload]] = []
        for index in indices:
            payload = payloads.get(index)
            if payload is None:
                log.warning("session %s: page %d has no valid payload; it stays out", session.session_id, index)
                pager.pages[index].stored = False
                continue
            other = foreign(pager.pages[index], payload)
            if other:
                session.persisted.payloads.pop(pager.pages[index].page_id, None)
                log.warning("session %s: %s; it stays out", session.session_id,
                            self._report_corrupt(session, pager.pages[index].page_id, other))
                pager.pages[index].stored = False
                continue
            asked.append((index, payload))
        # Places in the held order before any of them goes in (ascending, as the call wants).
        files = [self._stored_block(session, payload, index, pager.logical_start(index)) for index, payload in asked]
        changes = evicted + [pb.PageStateChange(page_id=pager.pages[index].page_id, state=PageState.HOT.value,
                                                last_used_turn=pager.turn, score=scores.get(index, 0.0),
                                                restored_checksum=payload.checksum)
                             for index, payload in asked]
        until = pager.restore_lease_until()
        commit: Pending[pb.WriteAck] | None = None

        def send_commit() -> None:
            """Sent once the files are open and their first reads asked for, and not waited for:
            the commit runs in contextd while the payloads go in. On a Python thread of ours it
            shared the interpreter lock with the copies, which it slowed by more than it saved
            (docs/journal/2026-11-29-restore-path.md)."""
            nonlocal commit
            if changes:
                commit = self.contextd.start_set_page_states(
                    session.session_id, changes,
                    [pb.Lease(page_id=pager.pages[index].page_id, until_turn=until) for index, _ in asked])

        try:
            results = self.backend.insert_block_files(files, opened=send_commit)
        except BaseException:
            _settle(commit)
            raise
        went_in = [index for (index, _), result in zip(asked, results, strict=True) if result is None]
        try:
            _settle(commit)
        except FailedPrecondition as e:
            self._take_out(session, went_in)
            for index, _ in asked:
                session.persisted.payloads.pop(pager.pages[index].page_id, None)
            if ask:   # changed between contextd's answer and the commit: they stay out this turn
                log.warning("session %s: %s; the pages stay out", session.session_id, e)
                return self._restore(session, [], evicted, scores)
            log.info("session %s: %s; restoring from contextd's records", session.session_id, e)
            return self._restore(session, indices, evicted, scores, ask=True)
        restored: list[int] = []
        again: list[int] = []
        for (index, _), result in zip(asked, results, strict=True):
            if result is not None:
                session.persisted.payloads.pop(pager.pages[index].page_id, None)
                if index not in learned:   # read where this server last knew it: ask contextd once
                    again.append(index)
                    continue
                log.warning("session %s: %s; it stays out", session.session_id,
                            self._report_corrupt(session, pager.pages[index].page_id, result))
                pager.pages[index].stored = False
                continue
            pager.apply(Decision(evict=[], restore=[index], plan_used=False))
            restored.append(index)
            crashpoints.reached("serving.restore.inserted")
        if again:
            # Committed HOT with the others: back to COLD first, so contextd's answer is about them.
            self.contextd.set_page_states(session.session_id, [
                pb.PageStateChange(page_id=pager.pages[i].page_id, state=PageState.COLD.value,
                                   last_used_turn=pager.turn) for i in again])
            restored = sorted(restored + self._restore(session, again, [], scores, ask=True))
        return restored

    def _payloads(self, session: Session, indices: list[int], ask: bool) -> tuple[dict[int, StoredPayload], set[int]]:
        """Each page's payload for a restore (`_restore`), and which pages contextd was asked
        about. A page contextd holds no COLD payload for is left out."""
        pager = session.pager
        known = session.persisted.payloads
        payloads: dict[int, StoredPayload] = {}
        for index in [] if ask else indices:
            payload = known.get(pager.pages[index].page_id)
            if payload is not None and self.payloads.path(payload.locator).exists():
                payloads[index] = payload
        learned = {index for index in indices if index not in payloads}
        if learned:
            records = {r.page_id: r for r in self.contextd.get_pages(session.session_id,
                                                                     [pager.pages[i].page_id for i in learned])}
            for index in learned:
                page_id = pager.pages[index].page_id
                payload = cold_payload(records.get(page_id))
                if payload is None:
                    known.pop(page_id, None)
                    continue
                payloads[index] = known[page_id] = payload
        return payloads, learned

    def _take_out(self, session: Session, went_in: list[int]) -> None:
        """Remove pages a restore put into attention but did not commit (the pager still has them
        cold), from the right so the places of those still to remove hold. Every page but the
        timeline's last is full, so `n` earlier ones moved a page on by n pages."""
        pager = session.pager
        for n, index in reversed(list(enumerate(sorted(went_in)))):
            start = pager.logical_start(index) + n * PAGE_TOKENS
            self.backend.remove_attention_range(start, start + pager.pages[index].tokens)

    def score_pages(self, session: Session, indices: list[int], token_ids: list[int]) -> dict[int, np.ndarray]:
        """Query likelihood for a selector: how likely `token_ids` are as the next user turn after
        each cold page on its own, read over the page's stored K/V (`score_as_a_turn`, one forward;
        no forward over history). Counted as `controller_forward_tokens`. A page whose payload is
        gone or fails its checks is left out (and reported corrupt, as a restore would); a model
        that cannot score blocks apart (sliding-window or recurrent layers) scores none."""
        pager = session.pager
        records = {r.page_id: r for r in self.contextd.get_pages(session.session_id,
                                                                 [pager.pages[i].page_id for i in indices])}
        blocks: dict[int, Block] = {}
        for index in indices:
            payload = cold_payload(records.get(pager.pages[index].page_id))
            if payload is None:
                continue
            stored = self._stored_block(session, payload, index, 0)
            try:
                other = foreign(pager.pages[index], payload)
                if other:
                    raise BlockFormatError(other)
                blk = Block.read(stored.path, stored.checksum, stored.size, expect=self.backend.layer_view)
                stored.check_tokens(blk.token_ids)
            except BlockFormatError as e:
                log.warning("session %s: %s; not scored", session.session_id,
                            self._report_corrupt(session, pager.pages[index].page_id, e))
                pager.pages[index].stored = False
                continue
            blocks[index] = blk
        if not blocks:
            return {}
        try:
            scores, forwarded = score_as_a_turn(self.backend, list(blocks.values()), self.opening, token_ids,
                                                self._sink())
        except UnsupportedModelError as e:
            log.warning("session %s: pages not scored: %s", session.session_id, e)
            return {}
        self.tally.count(session, controller_forward_tokens=forwarded)
        return dict(zip(blocks, scores, strict=True))

    def _report_corrupt(self, session: Session, page_id: str, error: BlockFormatError | str) -> str:
        """Mark the page CORRUPT in contextd (its payload failed its checks, or holds another
        history's K/V: it is never served; contextd takes its lease off); return the reason."""
        reason = f"page {page_id}: {error}"
        self.contextd.report_corrupt(session.session_id, page_id, reason)
        return reason

    def _stored_block(self, session: Session, payload: StoredPayload, index: int, at: int,
                      position: int | None = None) -> StoredBlock:
        """What the backend needs to insert a page from its payload: the file, its checksum and
        size, and the transcript's tokens at the page's place (a file holding others is corrupt)."""
        page = session.pager.pages[index]
        return StoredBlock(self.payloads.path(payload.locator), at, payload.checksum, payload.byte_size,
                           _int32(session.transcript.ids[page.token_start:page.token_end]), position)

    def close_gaps(self, session: Session) -> None:
        """Renumber the held tokens 0..n-1 (re-anchoring the keys that move; no forward pass).

        Why: an evicted page leaves a gap in positions, and a restored page takes back the
        positions it had. RoPE is relative, so the model then reads a restored fact as far back
        as it was in the whole session: thousands of positions for a fact from the first file,
        a distance a small model cannot copy from (benchmarks.compare: SmolLM2-135M answered 0
        of 16 questions over gapped positions with the fact's page in view, and 13 of 16 when the
        same tokens were prefilled at contiguous positions). Closed, the working set reads like
        one short conversation. Once a turn, after the restores; its cost grows with the keys it
        moves (a forced compaction: docs/journal/2026-11-29-restore-path.md, "First figures")."""
        restoring = time.perf_counter()
        self.backend.compact_positions()
        session.timed("restore", restoring)

    def blend(self, indices: np.ndarray) -> int:
        """Recompute the held tokens at logical `indices` in the current view (`Backend.recompute`);
        return how many. Their exact K/V stay what a store of their pages writes, and `unblend`
        puts them back before the turn ends."""
        return self.backend.recompute(indices)

    def unblend(self) -> int:
        """The exact K/V back into every recomputed held token (`Backend.drop_recomputed`): between
        turns the cache holds what the stored pages and the stream say, as a recovery rebuilds it."""
        return self.backend.drop_recomputed()

    def place_near_question(self, session: Session, restored: list[int], new_tokens: int) -> bool:
        """Give this turn's restored pages the positions right before the turn's newest
        `new_tokens` (the question; everything held before them keeps its order ahead of the
        pages), instead of their place in the timeline; return whether any key moved. Only
        positions change (re-anchoring, no forward pass): the pages keep their place in the
        cache's logical order, so the pager's bookkeeping is untouched, and `close_gaps` at the
        end of the turn puts every position back in timeline order before anything is stored.

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
        """Write pages to the canonical store (payload first), then record them in one batch.

        First of all, even with nothing to store: the record this turn ends with must be one
        contextd takes (`check_record`). `execute` and `persist` store before they move anything,
        so a turn that would fail at its record fails here, before any durable change."""
        self.check_record(session)
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
            if page.tokens == PAGE_TOKENS and self.controller is not None:
                session.unread_pages.append(index)
            page.stored = True
            previous = session.persisted.page_ids.get(index)
            if previous is not None and previous != page.page_id:
                session.persisted.superseded.append((index, previous))
            session.persisted.page_ids[index] = page.page_id
            self.tally.count(session, stored_pages=1, stored_bytes=stored.byte_size)
            records.append(pb.Page(page_id=page.page_id, index=index, token_start=page.token_start,
                                   token_end=page.token_end, original_position=page.token_start,
                                   state=page.state.value, locator=stored.locator,
                                   byte_size=stored.byte_size, checksum=stored.checksum, dtype=block.view.dtype,
                                   layer_view=block.view.model_id, last_used_turn=pager.turn,
                                   prefix_hash=page.prefix_hash))
        self.payloads.sync_folder(session.session_id)   # one directory fsync for the batch, before the records
        self.contextd.upsert_pages(session.session_id, records)
        session.persisted.payloads.update((r.page_id, stored_payload(r)) for r in records)
        crashpoints.reached("serving.store.recorded")

    def check_record(self, session: Session) -> None:
        """Raise TranscriptError (a 400 for the client) when contextd would refuse the record of
        this turn as it stands: the client's message hashes and the new transcript segments, by
        contextd's own rule (contextd.wire.record_refusal). A client's input fails its turn here,
        with nothing stored, not at the end of the turn after pages were."""
        refused = record_refusal(session.transcript.message_hashes,
                                 [s.text for s in session.transcript.segments[session.persisted.segments:]])
        if refused:
            raise TranscriptError(f"session {session.session_id}: the turn cannot be recorded: {refused}")

    def snapshot_recurrent(self, session: Session) -> None:
        """On a hybrid, keep the recurrent state at this segment boundary (what a cut resumes from)."""
        snap = self.backend.snapshot_recurrent()
        if snap is None:
            return
        session.snapshots[session.transcript.tokens] = snap
        for tokens in sorted(session.snapshots)[:-8]:  # the newest boundaries are what rebuilds use
            del session.snapshots[tokens]

    def cut(self, session: Session, keep_segments: int) -> None:
        """Cut the session back to its first `keep_segments` transcript segments: attention, pager,
        indexes, recurrent state, then the transcript and what the record will keep. A cold
        page across the cut comes back whole first (checked against the transcript's tokens, so the
        transcript is cut last). No forward pass."""
        self._truncate(session, sum(len(s.ids) for s in session.transcript.segments[:keep_segments]))
        session.transcript.cut(keep_segments)
        session.persisted.segments = min(session.persisted.segments, keep_segments)

    def _truncate(self, session: Session, tokens: int) -> None:
        for order in (session.eviction, session.attention):   # the page the cut is in, and every page after it
            if order is not None:
                order.forget_scores(range(tokens // PAGE_TOKENS, len(session.pager.pages)))
        session.unread_pages = [i for i in session.unread_pages if i < tokens // PAGE_TOKENS]
        # Stored versions of pages the cut removes go once the record no longer names them.
        persisted = session.persisted
        for index in [i for i in persisted.page_ids if i * PAGE_TOKENS >= tokens]:
            persisted.superseded.append((index, persisted.page_ids.pop(index)))
        if tokens == 0:
            self.empty()
            session.pager = Pager(session.pager.config)
            session.snapshots.clear()
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
        # The page cut into a partial one (now the open page: the tail keeps it) loses its lease
        # here and in contextd alike, or a server that recovers the session would not hold one
        # the live server holds, and their next answers could differ.
        unleased = [cut_page.page_id] if cut_page is not None and tokens < cut_page.token_end \
            and cut_page.lease_until_turn > pager.turn else []
        pager.truncate(tokens)
        if unleased:
            self.contextd.set_leases(session.session_id, remove=unleased)
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

    def _store_snapshot(self, session: Session, slot: SnapshotSlot, snap: RecurrentSnapshot) -> pb.Snapshot:
        """Write a recurrent snapshot's payload; return its row for `slot`, labelled with a hash of
        the tokens it folded in: recovery takes it only for a transcript that starts with them."""
        label = session.transcript.prefix_hash(snap.stream_tokens)
        assert label is not None, "recurrent snapshots are taken at segment boundaries"
        stored = self.payloads.write(session.session_id, "snapshot-" + slot.value, snap.pieces(), suffix="rs",
                                     sync_folder=False)
        return pb.Snapshot(slot=slot.value, token_count=snap.stream_tokens, fingerprint=label,
                           locator=stored.locator, byte_size=stored.byte_size, checksum=stored.checksum)

    def persist(self, session: Session, make_record: Callable[[], pb.SessionRecord]) -> None:
        """Write-through at the end of a turn: every resident page not yet stored (the open page
        too), new pins, the recurrent state, then the record with the new transcript segments,
        so a restart or a session switch restores this exact state with copies and no forward pass."""
        pager, persisted = session.pager, session.persisted
        sid = session.session_id
        self.store(session, [i for i in pager.resident if not pager.pages[i].stored])
        held = self.backend.positions()
        persisted.resident_positions = {i: int(held[pager.logical_start(i)]) for i in pager.resident}
        pins = [(pager.pages[i].page_id, kind) for i, kind in pager.pins.items()
                if pager.pages[i].stored and pager.pages[i].page_id not in persisted.pins]
        if pins:
            self.contextd.set_pins(sid, add=pins)
            persisted.pins.update(page_id for page_id, _ in pins)
        crashpoints.reached("serving.persist.pages_stored")
        record = make_record()  # after the stores above: its counters include them
        snapshots = []
        if self.backend.is_hybrid:
            before = session.transcript.last_opener_start()
            if before is not None and before in session.snapshots:
                snapshots.append(self._store_snapshot(session, SnapshotSlot.BEFORE_ANSWER, session.snapshots[before]))
            end = session.snapshots[session.transcript.tokens]
            snapshots.append(self._store_snapshot(session, SnapshotSlot.END_OF_TURN, end))
            self.payloads.sync_folder(sid)
        keep = persisted.segments
        append = [pb.TranscriptSegment(text=s.text, token_ids=s.ids, generated=s.generated, opener=s.opener)
                  for s in session.transcript.segments[keep:]]
        self.contextd.write_record(sid, record, keep, append, snapshots)
        crashpoints.reached("serving.persist.recorded")
        persisted.segments = len(session.transcript.segments)
        # Only now that the new record no longer names them: a crash before this line still finds
        # every payload the last record needs (a regrown page of another history is stored under
        # an id of its own: Page.page_id). A page that grew back to the same version (cut back,
        # then the same tokens again, as a regenerated answer) is current, not superseded.
        gone = sorted({page_id for index, page_id in persisted.superseded
                       if index >= len(pager.pages) or pager.pages[index].page_id != page_id})
        persisted.superseded = []
        if gone:
            pinned = sorted(set(gone) & persisted.pins)
            if pinned:
                self.contextd.set_pins(sid, remove=pinned)
                persisted.pins -= set(pinned)
            self.contextd.set_leases(sid, remove=gone)
            self.contextd.delete_pages(sid, gone)
            for page_id in gone:
                persisted.payloads.pop(page_id, None)

    # ------------------------------------------------------------------ sessions

    def fill_resident(self, session: Session) -> int:
        """Fill an empty backend with the session's resident pages (streamed copies) and its
        recurrent state; return how many pages came back. The pages' records are asked for
        FILL_PAGES at a time, the next ones while these go in: with an object store, contextd
        downloads the next pages while these are read into the cache."""
        pager = session.pager
        resident = [pager.pages[i] for i in pager.resident]
        chunks = [resident[n:n + FILL_PAGES] for n in range(0, len(resident), FILL_PAGES)]
        pending = self.contextd.start_get_pages(session.session_id, [p.page_id for p in chunks[0]]) if chunks else None
        for n, chunk in enumerate(chunks):
            assert pending is not None
            records = {r.page_id: r for r in pending.result().pages}
            if n + 1 < len(chunks):
                pending = self.contextd.start_get_pages(session.session_id, [p.page_id for p in chunks[n + 1]])
            self._fill_pages(session, chunk, records)
        if self.backend.is_hybrid and session.transcript.tokens:  # an empty session has no recurrent state
            snap = session.snapshots.get(session.transcript.tokens)
            if snap is None:
                raise DataCorrupt(f"session {session.session_id}: no recurrent snapshot at "
                                  f"{session.transcript.tokens} tokens")
            self.backend.restore_recurrent(snap)
        return len(resident)

    def _fill_pages(self, session: Session, pages: list[Page], records: dict[str, pb.Page]) -> None:
        """Append resident pages to the backend, each at the position it held (`fill_resident`)."""
        files = []
        for page in pages:
            record = records.get(page.page_id)
            if record is None or not record.locator or PageState(record.state) in (
                    PageState.DROPPED, PageState.CORRUPT):
                raise DataCorrupt(f"session {session.session_id}: resident page {page.index} has no stored payload")
            other = foreign(page, stored_payload(record))
            if other:
                raise DataCorrupt(f"session {session.session_id}: resident "
                                  f"{self._report_corrupt(session, page.page_id, other)}")
            files.append(self._stored_block(session, stored_payload(record), page.index, self.backend.attention_tokens,
                                            session.persisted.resident_positions.get(page.index)))
        results = self.backend.insert_block_files(files)
        failed = [self._report_corrupt(session, page.page_id, result)
                  for page, result in zip(pages, results, strict=True) if result is not None]
        if failed:
            raise DataCorrupt(failed[0])
        for page, stored in zip(pages, files, strict=True):
            crashpoints.reached("serving.recover.resident_page")
            index = session.key_index
            if index is not None and page.tokens == PAGE_TOKENS and page.index not in index.pages:
                # The file just verified going in; its index layer is read again, alone.
                index.add_layer(page.index, Block.read_layer_keys(stored.path, index.layer))


def rewind(scratch: Backend, held: int, snap: RecurrentSnapshot | None = None) -> None:
    """Take a scratch backend (a fork, or one loaded for a measurement: no session's pages are in
    it, so nothing is stored or recorded) back to its first `held` tokens, with `snap` the
    recurrent state it had then; `held == 0` empties it, recurrent state included. What scoring
    does between candidate answers (serving.likelihood) and what benchmarks do between views."""
    if held == 0:
        scratch.reset()
        return
    scratch.remove_attention_range(held, scratch.attention_tokens)
    if snap is not None:
        scratch.restore_recurrent(snap)


def recompute_scratch(scratch: Backend, indices: np.ndarray) -> int:
    """Recompute held tokens of a scratch backend (a fork no session owns; `PageMover.blend` is a
    session's): what benchmarks compare blend policies with."""
    return scratch.recompute(indices)


def _settle(commit: Pending[pb.WriteAck] | None) -> None:
    """Wait for a commit begun beside other work; its error, if any, is raised (over the other
    work's error: the turn fails either way, and the commit's says what contextd holds)."""
    if commit is not None:
        commit.result()


def _int32(ids: list[int]) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)
