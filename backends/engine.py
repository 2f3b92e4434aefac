"""The serving loop: one backend, many sessions, a bounded working set, nothing recomputed.

Per turn: render the client's transcript, align it with the session's cache (backends.transcript),
prefill only the new tail in chunks, evicting pages between chunks when the pager says so, apply
the plan (restore / pin / evict), generate (evicting during decode when a long answer needs room),
then write every page that is not yet in the canonical store, snapshot the recurrent state and
record it all in contextd. A page is always written before its slots are freed, and a restore
copies the exact stored tensors back: `historical_forward_during_restore` stays 0.

The backend holds one session's cache at a time. Another session's turn first stores nothing
new (everything was written at the end of its last turn), resets the backend and restores that
session's resident pages and recurrent state from the store: copies, never a forward pass. The
same path brings a session back after a crash.

Depends on backends.base (protocol), backends.transcript, controller.pager and contextd.client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from backends.base import Backend, Block, RecurrentSnapshot
from backends.transcript import (
    Alignment,
    ChatFormat,
    Segment,
    Transcript,
    TranscriptError,
    align,
    assistant_key,
    parse_tool_calls,
)
from contextd.client import Client, Payloads, pb
from contextd.errors import DataCorrupt
from controller.keyindex import KeyIndex, KeyIndexConfig
from controller.pager import PAGE_TOKENS, Decision, Pager, PagerConfig, PageState, PinKind, Plan
from controller.selectors import RecencySelector, SelectionContext, Selector
from controller.units import Unit, UnitIndex

log = logging.getLogger("kv_elision.engine")

# What a tokenizer decodes a partial UTF-8 sequence to; such text is held back from the stream.
INCOMPLETE_CHARACTER = chr(0xFFFD)
TRANSCRIPT_SLOT = "transcript"
RECURRENT_SLOT = "recurrent"
STATE_TO_PB = {PageState.HOT: pb.HOT, PageState.COLD: pb.COLD, PageState.PINNED: pb.PINNED}


@dataclass(frozen=True)
class EngineConfig:
    budget_tokens: int = 4096
    high_watermark: float = 1.0
    low_watermark: float = 0.875
    tail_tokens: int = 512
    lease_turns: int = 2
    prefill_chunk: int = 256
    max_new_tokens: int = 512
    fixed_point_seed: int = 1234
    key_index: KeyIndexConfig = field(default_factory=KeyIndexConfig)

    def __post_init__(self) -> None:
        if self.prefill_chunk <= 0 or self.max_new_tokens <= 0:
            raise ValueError("prefill_chunk and max_new_tokens must be positive")
        self.pager_config()  # validates the budget knobs

    def pager_config(self) -> PagerConfig:
        return PagerConfig(budget_tokens=self.budget_tokens, high_watermark=self.high_watermark,
                           low_watermark=self.low_watermark, tail_tokens=self.tail_tokens,
                           lease_turns=self.lease_turns)


COUNTER_NAMES = ("model_forward_tokens", "new_prefill_tokens", "decoded_tokens", "historical_forward_during_restore",
                 "restored_pages", "evicted_pages", "peak_attention_tokens", "reprefilled_tokens", "rebuilds",
                 "recovered_pages", "stored_pages", "stored_bytes", "reanchored_keys", "compactions",
                 "fixed_point_resamples", "turns", "restored_pages_turn", "evicted_pages_turn", "plans_used",
                 "plans_rejected", "selector_ms", "cancelled_turns")


@dataclass
class ChatRequest:
    """What the server extracted from one /v1/chat/completions body."""

    session_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    thinking: str = "default"
    max_tokens: int | None = None
    temperature: float = 0.0
    seed: int | None = None
    message_hashes: list[str] | None = None
    plan: Plan | None = None
    cancelled: Callable[[], bool] | None = None  # polled between decoded tokens (the client went away)


@dataclass
class TurnEvent:
    """Streamed out of `Engine.chat`: `prepared` once the prompt is in, text deltas, one `final`."""

    delta: str = ""
    prepared: dict[str, Any] | None = None
    final: TurnResult | None = None


@dataclass
class TurnResult:
    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    prompt_tokens: int           # tokens of the whole transcript as rendered
    prefilled_tokens: int        # tokens that went through the model for the prompt this turn
    completion_tokens: int
    rebuilt: str = ""            # why cached state was not reused ("" when it was)
    sampled: str = ""            # why this turn was sampled instead of greedy
    counters: dict[str, int] = field(default_factory=dict)


@dataclass
class Session:
    session_id: str
    transcript: Transcript
    pager: Pager
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTER_NAMES, 0))
    snapshots: dict[int, RecurrentSnapshot] = field(default_factory=dict)  # tokens -> state (hybrids)
    last_answer: tuple[int, list[int], list[int]] | None = None  # (turn, prompt ids, answer ids)
    stored_ids: dict[int, str] = field(default_factory=dict)  # page index -> id of its stored version
    superseded: list[str] = field(default_factory=list)       # stored partial versions to delete
    units: UnitIndex = field(default_factory=UnitIndex)
    message_ends: set[int] = field(default_factory=set)        # pages where a message ends
    key_index: KeyIndex | None = None  # the model-native page index, when the selector uses one
    last_selection: str = ""


class Engine:
    """Owns the backend. Not thread-safe: the server runs every call on one worker thread."""

    def __init__(self, backend: Backend, chat_format: ChatFormat, contextd: Client, config: EngineConfig,
                 selector: Selector | None = None) -> None:
        self.backend = backend
        self.format = chat_format
        self.contextd = contextd
        self.payloads: Payloads = contextd.payloads()
        self.config = config
        self.selector: Selector = selector or RecencySelector()
        self.sessions: dict[str, Session] = {}
        self.active: str | None = None
        self.totals = dict.fromkeys(COUNTER_NAMES, 0)
        tokenizer = chat_format.tokenizer
        self.stop_ids = {int(t) for t in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"),
                                          tokenizer.convert_tokens_to_ids("<|endoftext|>")) if t is not None
                         and int(t) >= 0 and int(t) != getattr(tokenizer, "unk_token_id", -1)}

    # ------------------------------------------------------------------ accounting

    def _count(self, session: Session, name: str, n: int = 1) -> None:
        session.counters[name] += n
        self.totals[name] += n

    def _attention_peak(self, session: Session) -> None:
        held = self.backend.attention_tokens
        session.counters["peak_attention_tokens"] = max(session.counters["peak_attention_tokens"], held)
        self.totals["peak_attention_tokens"] = max(self.totals["peak_attention_tokens"], held)

    # ------------------------------------------------------------------ sessions

    def _new_session(self, session_id: str, fingerprint: Any) -> Session:
        session = Session(session_id, Transcript(fingerprint), Pager(self.config.pager_config()),
                          key_index=self._key_index())
        self.contextd.open_session(session_id, model_id=self.backend.model_name, fingerprint=fingerprint.combined(),
                                   budget_tokens=self.config.budget_tokens)
        return session

    def _activate(self, session_id: str, fingerprint: Any) -> Session:
        """Make `session_id` the backend's session: from memory, from contextd, or new."""
        session = self.sessions.get(session_id)
        if self.active == session_id and session is not None:
            return session
        self.backend.reset()
        self.active = None
        if session is None:
            session = self._load(session_id) or self._new_session(session_id, fingerprint)
            self.sessions[session_id] = session
        else:
            self._restore_resident(session)
        self.active = session_id
        return session

    def _load(self, session_id: str) -> Session | None:
        """Rebuild a session from contextd: transcript, page states, resident pages, recurrent state."""
        try:
            snapshots = {s.slot: s for s in self.contextd.query_snapshots(session_id)}
        except Exception:  # noqa: BLE001 - NotFound: a session contextd has never seen
            return None
        record_ref = snapshots.get(TRANSCRIPT_SLOT)
        if record_ref is None:
            return None
        record = msgpack.unpackb(self.payloads.blobs.read(record_ref.locator, record_ref.checksum,
                                                          record_ref.byte_size), raw=False)
        session = Session(session_id, Transcript.from_record(record["transcript"]),
                          Pager(self.config.pager_config()), key_index=self._key_index())
        pager = session.pager
        ids = session.transcript.ids
        pager.append(ids)
        pager.turn = record["turn"]
        pager.ledger = list(record["ledger"])
        for page, (state, pin, lease, stored) in zip(pager.pages, record["pages"], strict=True):
            page.state = PageState(state)
            page.pin = PinKind(pin) if pin else None
            page.lease_until_turn = lease
            page.stored = stored
        session.counters.update(record["counters"])
        session.stored_ids = {int(k): v for k, v in record["stored_ids"].items()}
        session.message_ends = set(record["message_ends"])
        session.units = UnitIndex(record["unit_salt"])
        session.units.update(pager, session.message_ends)
        summaries = {b.block_id: b.summary for b in self.contextd.query_blocks(session_id)}
        for unit in session.units.units.values():
            unit.summary = summaries.get(unit.unit_id, "")
        for cluster in session.units.clusters.values():
            cluster.summary = summaries.get(cluster.cluster_id, "")
        if RECURRENT_SLOT in snapshots and self.backend.is_hybrid:
            ref = snapshots[RECURRENT_SLOT]
            snap = RecurrentSnapshot.from_bytes(self.payloads.blobs.read(ref.locator, ref.checksum, ref.byte_size))
            session.snapshots[snap.stream_tokens] = snap
        recovered = self._restore_resident(session)
        self._count(session, "recovered_pages", recovered)
        self._index_stored_pages(session)
        # A turn that died mid-way may have moved pages in the manifest; the record is the truth.
        self.contextd.set_page_states(session_id, [(p.page_id, STATE_TO_PB[pager.effective_state(p)])
                                                   for p in pager.pages if p.stored], turn=pager.turn)
        log.info("session %s recovered from contextd: %d tokens, %d resident pages restored", session_id,
                 len(ids), recovered)
        return session

    def _key_index(self, wanted: bool | None = None) -> KeyIndex | None:
        """A new, empty model-native index when the selector (or the caller) wants one."""
        if not (self.selector.uses_key_index if wanted is None else wanted):
            return None
        return KeyIndex(self.config.key_index, len(self.backend.layer_view.attention_layers))

    def _index_stored_pages(self, session: Session) -> None:
        """Rebuild the model-native index of a recovered session from the canonical store: each
        stored full page not indexed yet (resident pages were, as they were restored) is read and
        checked once."""
        index = session.key_index
        if index is None:
            return
        manifest = {p.page_id: p for p in self.contextd.query_pages(session.session_id)}
        for page in session.pager.pages:
            record = manifest.get(page.page_id)
            if page.stored and page.tokens == PAGE_TOKENS and record is not None and page.index not in index.pages:
                index.add(page.index, self._read_block(session, record, page.index).keys)

    def _restore_resident(self, session: Session) -> int:
        """Fill an empty backend with the session's resident pages (copies) and recurrent state."""
        manifest = {p.page_id: p for p in self.contextd.query_pages(session.session_id)}
        restored = 0
        for page in session.pager.pages:
            if not page.resident:
                continue
            block = self._read_block(session, manifest.get(page.page_id), page.index)
            self.backend.insert_block(block, self.backend.attention_tokens)
            index = session.key_index
            if index is not None and page.tokens == PAGE_TOKENS and page.index not in index.pages:
                index.add(page.index, block.keys)
            restored += 1
        if self.backend.is_hybrid:
            snap = session.snapshots.get(session.transcript.tokens)
            if snap is None:
                raise DataCorrupt(f"session {session.session_id}: no recurrent snapshot at "
                                  f"{session.transcript.tokens} tokens")
            self.backend.restore_recurrent(snap)
        return restored

    def _read_block(self, session: Session, record: pb.Page | None, index: int) -> Block:
        if record is None or not record.locator:
            raise DataCorrupt(f"session {session.session_id}: page {index} has no stored payload")
        block = Block.from_bytes(self.payloads.read(session.session_id, record), expect=self.backend.layer_view)
        page = session.pager.pages[index]
        if block.token_ids.tolist() != session.transcript.ids[page.token_start:page.token_end]:
            raise DataCorrupt(f"session {session.session_id}: stored page {record.page_id} holds other tokens "
                              "than the transcript")
        return block

    # ------------------------------------------------------------------ the turn

    def chat(self, request: ChatRequest) -> Iterator[TurnEvent]:
        """Run one turn; yield text deltas, then one final event with the result."""
        before = dict(self.backend.counters)
        fingerprint = self.format.fingerprint(request.tools, request.thinking)
        self.format.normalize(request.messages, request.tools, {})  # a malformed request fails before any work
        session = self._activate(request.session_id, fingerprint)
        rendered = self.format.render(request.messages, request.tools, request.thinking, session.transcript.generated)
        session.pager.begin_turn()
        self._count(session, "turns")
        session.counters["restored_pages_turn"] = session.counters["evicted_pages_turn"] = 0

        alignment = align(session.transcript, fingerprint, rendered, request.message_hashes)
        if not alignment.new_text and not alignment.rebuild:
            # The client re-sent exactly what is cached (a retry of the last turn): regenerate it.
            alignment.reason = "the request repeats the cached transcript; regenerating the last answer"
        rebuilt = alignment.reason
        dropped = 0
        if alignment.rebuild:
            alignment, dropped = self._rebuild(session, alignment, rendered)
            session.transcript.fingerprint = fingerprint
            self._count(session, "rebuilds")
        if request.message_hashes is not None:
            session.transcript.message_hashes = list(request.message_hashes)

        segments = self._prompt_segments(session, request, rendered, alignment.new_text)
        prompt_ids = [t for segment, _, _ in segments for t in segment.ids]
        if not prompt_ids:
            raise TranscriptError("the request adds nothing after the cached transcript; send the next message")
        for segment, pin, tool_call in segments:
            self._prefill(session, segment, pin)
            session.message_ends.add(len(session.pager.pages) - 1)
            if tool_call:
                session.pager.mark_ledger(len(session.pager.pages) - 1)
        self._count(session, "reprefilled_tokens", min(dropped, len(prompt_ids)))
        self._apply_plan(session, request, alignment.new_text, len(prompt_ids))
        yield TurnEvent(prepared={"rebuilt": rebuilt, "prefilled_tokens": len(prompt_ids)})

        picked, finish, sampled = yield from self._generate(session, request, prompt_ids)
        result = self._finish_turn(session, picked, finish, before)
        result.prefilled_tokens = len(prompt_ids)
        result.prompt_tokens = session.transcript.tokens - len(picked)
        result.rebuilt = rebuilt
        result.sampled = sampled
        yield TurnEvent(final=result)

    def _prompt_segments(self, session: Session, request: ChatRequest, rendered: str, text: str
                         ) -> list[tuple[Segment, PinKind | None, bool]]:
        """Tokenize the new text in one segment per message, so a later edit keeps every message
        before it. Returns (segment, hard pin, ends a tool call). On a fresh session everything up
        to the end of the first user message (system prompt, tool schemas, objective) is pinned."""
        if not text:
            return []
        start = len(rendered) - len(text)
        ends = self.format.message_ends(request.messages, request.tools, request.thinking,
                                        session.transcript.generated, rendered, start)
        first_user = next((i for i, m in enumerate(request.messages) if m.get("role") == "user"), -1)
        fresh = session.transcript.tokens == 0
        segments: list[tuple[Segment, PinKind | None, bool]] = []
        cut = start
        for offset, index in [*ends, (len(rendered), len(request.messages))]:
            piece = rendered[cut:offset]
            if not piece:
                continue
            message = request.messages[index] if index < len(request.messages) else {}
            pin = PinKind.OBJECTIVE if fresh and index <= first_user else None
            tool_call = message.get("role") == "assistant" and bool(message.get("tool_calls"))
            segments.append((Segment(piece, self.format.encode(piece)), pin, tool_call))
            cut = offset
        return segments

    def _apply_plan(self, session: Session, request: ChatRequest, incoming: str, new_tokens: int) -> None:
        """Between prefill and decode: the request's own plan, else the selector's, through the
        pager's rules. Restored pages land at their place in the timeline, before the new text."""
        pager = session.pager
        held = sum(pager.pages[i].tokens for i in pager.protected() if pager.pages[i].resident)
        context = SelectionContext(session.session_id, pager, session.units, incoming,
                                   incoming_keys=self._incoming_keys(session, new_tokens),
                                   key_index=session.key_index,
                                   room_tokens=max(0, pager.config.low_tokens - held))
        if request.plan is not None:
            plan: Plan | None = request.plan
            session.last_selection = "plan from the request"
        else:
            selection = self.selector.select(context)
            plan = selection.plan
            session.last_selection = f"{self.selector.name}: {selection.note} ({selection.decided_ms:.0f} ms)"
            self._count(session, "selector_ms", int(selection.decided_ms))
        if plan is None:
            return
        decision = pager.decide(plan, incoming_tokens=0)
        self._count(session, "plans_used" if decision.plan_used else "plans_rejected")
        if decision.plan_rejected:
            session.last_selection += f"; rejected: {decision.plan_rejected}"
        self._execute(session, decision)
        self._attention_peak(session)

    def _incoming_keys(self, session: Session, new_tokens: int) -> Any:
        """Canonical keys of the turn's newest tokens (still in attention), for the key index."""
        if session.key_index is None:
            return None
        end = self.backend.attention_tokens
        n = min(new_tokens, self.config.key_index.incoming_tokens, end)
        return self.backend.save_block(end - n, end).keys if n > 0 else None

    def _prefill(self, session: Session, segment: Segment, pin: PinKind | None) -> None:
        chunk = self.config.prefill_chunk
        for i in range(0, len(segment.ids), chunk):
            part = segment.ids[i:i + chunk]
            self._make_room(session, len(part))
            self.backend.prefill(part)
            session.pager.append(part, pin=pin)
            self._attention_peak(session)
        session.transcript.segments.append(segment)
        self._snapshot_if_hybrid(session)

    def _make_room(self, session: Session, incoming: int) -> None:
        pager = session.pager
        if pager.must_evict_for(incoming):
            self._execute(session, pager.decide(None, incoming_tokens=incoming))

    def _execute(self, session: Session, decision: Decision) -> None:
        """Store, evict, restore. Pages leave attention only once their payload is durable."""
        pager = session.pager
        self._store_pages(session, [i for i in decision.evict if not pager.pages[i].stored])
        # From the right, so the logical offsets of pages still to remove stay valid.
        for index in sorted(decision.evict, reverse=True):
            start = pager.logical_start(index)
            self.backend.remove_attention_range(start, start + pager.pages[index].tokens)
        restorable: list[tuple[int, pb.Page]] = []
        if decision.restore:
            cold = {p.page_id: p for p in self.contextd.query_pages(session.session_id, [pb.COLD])}
            for index in decision.restore:
                record = cold.get(pager.pages[index].page_id)
                if record is None:  # dropped under disk pressure or corrupt: it cannot come back
                    log.warning("session %s: page %d has no valid payload; it stays out", session.session_id, index)
                    continue
                restorable.append((index, record))
            decision.restore = [i for i, _ in restorable]
        pager.apply(decision)
        for index, record in sorted(restorable):
            self.backend.insert_block(self._read_block(session, record, index), pager.logical_start(index))
        for name in ("evicted_pages", "evicted_pages_turn"):
            self._count(session, name, len(decision.evict))
        for name in ("restored_pages", "restored_pages_turn"):
            self._count(session, name, len(restorable))
        changed = [*decision.evict, *decision.restore]
        if changed:
            self.contextd.set_page_states(session.session_id, [
                (pager.pages[i].page_id, STATE_TO_PB[pager.effective_state(pager.pages[i])]) for i in changed],
                turn=pager.turn)
        if restorable:
            self.contextd.set_leases(session.session_id, add=[
                pb.Lease(page_id=pager.pages[i].page_id, until_turn=pager.pages[i].lease_until_turn)
                for i, _ in restorable])

    def _store_pages(self, session: Session, indices: list[int]) -> None:
        """Write pages to the canonical store (payload first), then record them in one batch."""
        if not indices:
            return
        pager = session.pager
        records = []
        for index in indices:
            page = pager.pages[index]
            start = pager.logical_start(index)
            block = self.backend.save_block(start, start + page.tokens)
            stored = self.payloads.write(session.session_id, page.page_id, block.to_bytes())
            if page.tokens == PAGE_TOKENS and session.key_index is not None:
                session.key_index.add(index, block.keys)
            page.stored = True
            previous = session.stored_ids.get(index)
            if previous is not None and previous != page.page_id:
                session.superseded.append(previous)
            session.stored_ids[index] = page.page_id
            self._count(session, "stored_pages")
            self._count(session, "stored_bytes", stored.byte_size)
            records.append(pb.Page(page_id=page.page_id, index=index, token_start=page.token_start,
                                   token_end=page.token_end, original_position=page.token_start,
                                   state=STATE_TO_PB[pager.effective_state(page)], locator=stored.locator,
                                   byte_size=stored.byte_size, checksum=stored.checksum, dtype=block.view.dtype,
                                   layer_view=block.view.model_id, last_used_turn=pager.turn))
        self.contextd.upsert_pages(session.session_id, records)

    def _snapshot_if_hybrid(self, session: Session) -> None:
        if not self.backend.is_hybrid:
            return
        snap = self.backend.snapshot_recurrent()
        assert snap is not None
        session.snapshots[session.transcript.tokens] = snap
        for tokens in sorted(session.snapshots)[:-8]:  # the newest boundaries are what rebuilds use
            del session.snapshots[tokens]

    # ------------------------------------------------------------------ rebuilds

    def _rebuild(self, session: Session, alignment: Alignment, rendered: str) -> tuple[Alignment, int]:
        """Drop every cached token after the kept prefix; return what to prefill and how much was dropped."""
        transcript = session.transcript
        # The recurrent state of a hybrid cannot be cut: keep only up to a segment boundary that has
        # a snapshot.
        keep = alignment.keep_segments
        # At least one segment must be prefilled again, or there would be no logits to answer from.
        while keep and (len(rendered) <= len("".join(s.text for s in transcript.segments[:keep]))
                        or (self.backend.is_hybrid
                            and sum(len(s.ids) for s in transcript.segments[:keep]) not in session.snapshots)):
            keep -= 1
        keep_tokens = sum(len(s.ids) for s in transcript.segments[:keep])
        kept_text = "".join(s.text for s in transcript.segments[:keep])
        if not rendered.startswith(kept_text):
            keep, keep_tokens, kept_text = 0, 0, ""
        dropped = transcript.tokens - keep_tokens
        log.warning("session %s: %s; keeping %d of %d cached tokens", session.session_id, alignment.reason,
                    keep_tokens, transcript.tokens)
        self._truncate(session, keep_tokens)
        transcript.segments = transcript.segments[:keep]
        kept = {k: [raw for raw in v if raw in kept_text] for k, v in transcript.generated.items()}
        transcript.generated = {k: v for k, v in kept.items() if v}
        session.last_answer = None
        return Alignment(keep, keep_tokens, rendered[len(kept_text):], reason=alignment.reason), dropped

    def _truncate(self, session: Session, tokens: int) -> None:
        """Cut the session back to its first `tokens` tokens: attention, pager, recurrent state."""
        if tokens == 0:
            self.backend.reset()
            session.pager = Pager(self.config.pager_config())
            session.snapshots.clear()
            session.units = UnitIndex(session.units.salt)
            session.message_ends.clear()
            if session.key_index is not None:
                session.key_index.clear()
            return
        pager = session.pager
        for page in pager.pages:  # a cold page across the cut comes back whole first
            if page.token_start < tokens < page.token_end and not page.resident:
                self._execute(session, Decision(evict=[], restore=[page.index], plan_used=False))
        pager.truncate(tokens)
        session.units.truncate(len(pager.pages))
        session.message_ends = {i for i in session.message_ends if i < len(pager.pages)}
        if session.key_index is not None:
            full = sum(1 for p in pager.pages if p.tokens == PAGE_TOKENS)
            session.key_index.truncate(full)
        held = sum(p.tokens for p in pager.pages if p.resident)
        if self.backend.attention_tokens > held:
            self.backend.remove_attention_range(held, self.backend.attention_tokens)
        for later in [t for t in session.snapshots if t > tokens]:
            del session.snapshots[later]
        if self.backend.is_hybrid:
            self.backend.restore_recurrent(session.snapshots[tokens])

    # ------------------------------------------------------------------ generation

    def _generate(self, session: Session, request: ChatRequest, prompt_ids: list[int]
                  ) -> Generator[TurnEvent, None, tuple[list[int], str, str]]:
        limit = min(request.max_tokens or self.config.max_new_tokens, self.config.max_new_tokens)
        greedy = request.temperature <= 0.0
        previous = session.last_answer
        repeat_of = previous[2] if greedy and previous is not None and previous[1] == prompt_ids else None
        prompt_logits = self.backend.last_logits()
        tokens_before = session.transcript.tokens
        picked, finish = yield from self._decode_loop(session, limit, greedy, request.temperature, request.seed,
                                                      hold_while=repeat_of, cancelled=request.cancelled)
        sampled = ""
        if repeat_of is not None and picked == repeat_of and finish != "cancelled":
            # The fixed point: the same input on the same working set gave the same greedy answer.
            # Take that answer back out of attention and sample this turn instead (seeded, reported).
            session.transcript.segments.pop()
            self._truncate(session, tokens_before)
            seed = self.config.fixed_point_seed + session.pager.turn
            first = _sample(prompt_logits, 0.8, seed)
            picked, finish = yield from self._decode_loop(session, limit, False, 0.8, seed, first=first,
                                                          cancelled=request.cancelled)
            self._count(session, "fixed_point_resamples")
            sampled = f"fixed point: the greedy answer repeated the previous turn's; sampled with seed {seed}"
        session.last_answer = (session.pager.turn, prompt_ids, picked)
        return picked, finish, sampled

    def _decode_loop(self, session: Session, limit: int, greedy: bool, temperature: float, seed: int | None,
                     first: int | None = None, hold_while: list[int] | None = None,
                     cancelled: Callable[[], bool] | None = None) -> Generator[TurnEvent, None, tuple[list[int], str]]:
        """Pick tokens until a stop token or the limit. Every picked token but a stop is fed, so the
        cache spells exactly the answer. With `hold_while`, text is held back while the answer
        matches that earlier answer (it may be replaced by a sampled one)."""
        pager = session.pager
        picked: list[int] = []
        emitted = ""
        finish = "length"
        gone = cancelled or (lambda: False)
        token = self.backend.decode(greedy=greedy, temperature=temperature, seed=seed) if first is None else first
        reseed = seed if first is not None else None  # a given first token was sampled outside: seed what follows
        while True:
            if token in self.stop_ids:
                finish = "stop"
                break
            picked.append(token)
            holding = hold_while is not None and picked == hold_while[:len(picked)]
            text = self.format.decode(picked)
            if not holding and not text.endswith(INCOMPLETE_CHARACTER) and len(text) > len(emitted):
                yield TurnEvent(delta=text[len(emitted):])
                emitted = text
            self._make_room(session, 1)
            token = self.backend.decode(picked[-1], greedy=greedy, temperature=temperature, seed=reseed)
            reseed = None
            pager.append([picked[-1]])
            self._attention_peak(session)
            if len(picked) >= limit:
                break
            if gone():
                # The turn ends here as if the limit were reached: the cache holds exactly what was
                # picked, and the turn is written through like any other.
                finish = "cancelled"
                self._count(session, "cancelled_turns")
                break
        text = self.format.decode(picked)
        if len(text) > len(emitted) and not (hold_while is not None and picked == hold_while):
            yield TurnEvent(delta=text[len(emitted):])
        session.transcript.segments.append(Segment(text, list(picked), generated=True))
        return picked, finish

    # ------------------------------------------------------------------ end of turn

    def _finish_turn(self, session: Session, picked: list[int], finish: str, before: dict[str, int]) -> TurnResult:
        pager = session.pager
        transcript = session.transcript
        raw = transcript.segments[-1].text
        content, calls = parse_tool_calls(raw)
        transcript.generated.setdefault(assistant_key(content, calls), []).append(raw)
        if calls and pager.pages:
            pager.mark_ledger(pager.pages[-1].index)
        if pager.pages:
            session.message_ends.add(len(pager.pages) - 1)
        self._snapshot_if_hybrid(session)
        after = self.backend.counters
        for name in ("model_forward_tokens", "new_prefill_tokens", "decoded_tokens",
                     "historical_forward_during_restore", "reanchored_keys", "compactions"):
            self._count(session, name, after[name] - before[name])
        self._persist(session)
        self._index_units(session)
        return TurnResult(content=content, tool_calls=calls, finish_reason="tool_calls" if calls else finish,
                          prompt_tokens=0, prefilled_tokens=0, completion_tokens=len(picked),
                          counters=self.session_counters(session))

    def _index_units(self, session: Session) -> None:
        """Close new units, record units and clusters (with any summaries written since) in
        contextd, and hand the new units to the selector for background summaries."""
        units = session.units
        closed = units.update(session.pager, session.message_ends)
        blocks = [pb.Block(block_id=u.unit_id, kind="unit", parent_id=u.cluster_id, summary=u.summary,
                           page_ids=[session.pager.pages[i].page_id for i in u.pages],
                           token_count=sum(session.pager.pages[i].tokens for i in u.pages))
                  for u in units.units.values()]
        blocks += [pb.Block(block_id=c.cluster_id, kind="cluster", child_ids=c.unit_ids, summary=c.summary)
                   for c in units.clusters.values()]
        if blocks:
            self.contextd.upsert_blocks(session.session_id, blocks)
        ids = session.transcript.ids
        pages = session.pager.pages

        def text_of(unit: Unit) -> str:
            return self.format.decode(ids[pages[unit.pages[0]].token_start:pages[unit.pages[-1]].token_end])

        context = SelectionContext(session.session_id, session.pager, units, "")
        self.selector.after_turn(context, closed, text_of)

    def _persist(self, session: Session) -> None:
        """Write-through at the end of a turn: every resident page not yet stored (the open page
        too), the recurrent state and the transcript, so a restart or a session switch restores
        this exact state with copies and no forward pass."""
        pager = session.pager
        self._store_pages(session, [p.index for p in pager.pages if p.resident and not p.stored])
        sid = session.session_id
        pins = [(p.page_id, p.pin.value) for p in pager.pages if p.pin is not None]
        if pins:
            self.contextd.set_pins(sid, add=pins)
        if self.backend.is_hybrid:
            snap = session.snapshots[session.transcript.tokens]
            self.contextd.put_snapshot(sid, pb.Snapshot(slot=RECURRENT_SLOT, token_count=snap.stream_tokens,
                                                        fingerprint=session.transcript.fingerprint.combined()),
                                       snap.to_bytes())
        record = {"transcript": session.transcript.to_record(), "turn": pager.turn, "ledger": pager.ledger,
                  "stored_ids": {str(k): v for k, v in session.stored_ids.items()},
                  "unit_salt": session.units.salt, "message_ends": sorted(session.message_ends),
                  "pages": [[p.state.value, p.pin.value if p.pin else "", p.lease_until_turn, p.stored]
                            for p in pager.pages],
                  "counters": session.counters}
        self.contextd.put_snapshot(sid, pb.Snapshot(slot=TRANSCRIPT_SLOT, token_count=session.transcript.tokens,
                                                    fingerprint=session.transcript.fingerprint.combined()),
                                   msgpack.packb(record, use_bin_type=True))
        if session.superseded:
            # Only now that the new record no longer names them: a crash before this line still
            # finds every payload the last record needs.
            self.contextd.set_pins(sid, remove=session.superseded)
            self.contextd.delete_pages(sid, session.superseded)
            session.superseded = []
        self.contextd.update_session(sid, turn=pager.turn, attention_tokens=self.backend.attention_tokens,
                                     fingerprint=session.transcript.fingerprint.combined(),
                                     counters=self.session_counters(session))

    def probe(self, request: ChatRequest, selectors: list[Selector]) -> dict[str, dict[str, Any]]:
        """Prefill the request's new messages, ask each selector what it would restore, then take the
        new tokens back out: nothing is generated and the session is left as it was. For measuring
        selectors (benchmarks.selectors and the retrieval tests)."""
        fingerprint = self.format.fingerprint(request.tools, request.thinking)
        session = self._activate(request.session_id, fingerprint)
        rendered = self.format.render(request.messages, request.tools, request.thinking, session.transcript.generated)
        alignment = align(session.transcript, fingerprint, rendered, request.message_hashes)
        if alignment.rebuild or not alignment.new_text:
            raise TranscriptError("a probe must extend the cached transcript")
        segments_before = len(session.transcript.segments)
        tokens_before = session.transcript.tokens
        new_tokens = 0
        for segment, pin, _ in self._prompt_segments(session, request, rendered, alignment.new_text):
            self._prefill(session, segment, pin)
            new_tokens += len(segment.ids)
        pager = session.pager
        held = sum(pager.pages[i].tokens for i in pager.protected() if pager.pages[i].resident)
        index = session.key_index
        if index is None and any(s.uses_key_index for s in selectors):
            index = session.key_index = self._key_index(wanted=True)
            self._index_stored_pages(session)
        context = SelectionContext(session.session_id, pager, session.units, alignment.new_text,
                                   incoming_keys=self._incoming_keys(session, new_tokens), key_index=index,
                                   room_tokens=max(0, pager.config.low_tokens - held))
        results: dict[str, dict[str, Any]] = {}
        for selector in selectors:
            selection = selector.select(context)
            restore: list[int] = []
            if selection.plan is not None:
                cleaned, rejected = pager.validate(selection.plan)
                restore = [] if rejected else cleaned.restore
            results[selector.name] = {"restore": restore, "decided_ms": selection.decided_ms, "note": selection.note,
                                      "resident": [p.index for p in pager.pages if p.resident]}
        session.transcript.segments = session.transcript.segments[:segments_before]
        self._truncate(session, tokens_before)
        return results

    def forget_active(self) -> None:
        """After a failed turn the backend's state is unknown: the next turn reloads from contextd."""
        if self.active is not None:
            self.sessions.pop(self.active, None)
        self.active = None
        self.backend.reset()

    # ------------------------------------------------------------------ reading

    def session_counters(self, session: Session) -> dict[str, int]:
        return {name: session.counters[name] for name in COUNTER_NAMES}

    def kv_bytes_per_token(self) -> int:
        """Attention K/V resident per held token: rotated keys, canonical rotary keys, values."""
        view = self.backend.layer_view
        itemsize = 4 if view.dtype == "float32" else 2
        return len(view.attention_layers) * view.num_kv_heads * (
            view.head_dim + view.rotary_dim + view.value_head_dim) * itemsize

    def stats(self, session_id: str | None) -> dict[str, Any]:
        """Counters, page states and budget of one session, or the server's totals."""
        if session_id is None:
            return {"counters": dict(self.totals), "sessions": sorted(self.sessions),
                    "budget_tokens": self.config.budget_tokens, "active_session": self.active,
                    "attention_tokens": self.backend.attention_tokens,
                    "kv_bytes_per_token": self.kv_bytes_per_token()}
        session = self.sessions.get(session_id)
        if session is None:
            raise KeyError(session_id)
        pager = session.pager
        return {"session_id": session_id, "counters": self.session_counters(session), "pages": pager.counts(),
                "session_tokens": session.transcript.tokens, "hot_tokens": pager.hot_tokens,
                "budget_tokens": self.config.budget_tokens, "turn": pager.turn,
                "attention_tokens": self.backend.attention_tokens if self.active == session_id else pager.hot_tokens,
                "fingerprint": session.transcript.fingerprint.combined(),
                "kv_bytes_per_token": self.kv_bytes_per_token(), "last_selection": session.last_selection,
                "key_index_pages": len(session.key_index.pages) if session.key_index else 0,
                "key_index_bytes": session.key_index.nbytes if session.key_index else 0}


def _sample(logits: Any, temperature: float, seed: int) -> int:
    z = np.asarray(logits, dtype=np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    return int(np.random.default_rng(seed).choice(p.shape[0], p=p))
