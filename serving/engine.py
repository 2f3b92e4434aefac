"""One turn: activate the session, align the transcript, prefill the new text, apply the plan,
generate, finish. Pages move only through serving.paging.PageMover.

Per turn: render the client's transcript, align it with the session's cache
(serving.transcript), prefill only the new tail in chunks (the mover evicts between chunks when
the pager says so), let the selector advise which cold pages come back (controller), generate
(evicting during decode when a long answer needs room), then persist: every page not yet in the
canonical store, the recurrent snapshot and the session record. A restore copies the exact stored
tensors back: `historical_forward_during_restore` stays 0.

Up to `resident_sessions` sessions keep a cache of their own (forks of the backend that share its
weights), least recently used first out: a turn for a resident session only points the engine at
its cache, with no page I/O. A session without one takes a free cache, or the least recently used
session's, emptied, and has its resident pages and recurrent state restored from the store:
copies, never a forward pass. The same path (serving.recovery) brings a session back after a crash.

A session that contextd does not know yet, whose prompt begins with whole stored pages of another
session (a Pi `/fork`, a resumed branch, a subagent with the same system prompt and tools),
starts as a branch of it: contextd's prefix index names the parent by the prompt's prefix chain
(controller.pager.PrefixChain: the same model, template, tools and thinking, or no match),
contextd copies the parent's record and manifest sharing every payload, the session is brought
back as after a restart, and its first turn cuts back to where the prompt departs from the
parent's transcript, exactly as a rewind of the parent would, and prefills only what follows.

What the server keeps of each session in memory, and for how long, is serving.session_table's;
what reads a turn from the inside (serving.watch, benchmarks) is an observer (serving.observe)
the turn calls at fixed points.

Depends on backends (protocol, slots), controller, contextd.client and serving.paging / prompt / decoding /
recovery / session / session_table / transcript / turn / chat_format / observe / scoring.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field

import numpy as np

from backends import Backend, BackendError, Counters, DecodeStep
from contextd import crashpoints
from contextd.client import Client, pb
from contextd.errors import ContextdError, FailedPrecondition, NotFound, StoreFull
from contextd.wire import PinKind
from controller.blend import DEFAULT_BLEND, BlendPolicy, view_parts
from controller.eviction import (
    EVICTION_ORDERS,
    AttentionOrder,
    AttentionOrderConfig,
    EvictionAdviceConfig,
    EvictionAdvisor,
)
from controller.hybrid import HybridConfig
from controller.keyindex import KeyIndex, KeyIndexConfig
from controller.lexical import DEFAULT_LEXICAL, LexicalConfig, LexicalIndex
from controller.pager import Pager, PagerConfig, Plan, PrefixChain
from controller.selectors import RecencySelector, SelectionContext, Selector
from serving.chat_format import ChatFormat
from serving.decoding import Decoder
from serving.observe import TurnObserver
from serving.paging import PageMover
from serving.prompt import begin_message, keep_focus, piece_texts, prompt_pieces
from serving.recovery import Recovery
from serving.scoring import ControllerScorer
from serving.session import Session, SessionCounters, Tally, TurnTimings
from serving.session_table import SessionTable, TurnPhase, TurnState
from serving.transcript import (
    Alignment,
    Fingerprint,
    Segment,
    Transcript,
    TranscriptError,
    align,
    parse_tool_calls,
    recomputed_tokens,
)
from serving.turn import ChatRequest, FinishReason, Prepared, TurnEvent, TurnResult

log = logging.getLogger("kv_elision.engine")

# The newest ids of a turn handed to the selector: more than any selector reads (256 by default).
INCOMING_IDS = 1024
# Where a turn's restored pages sit (in RoPE positions) while its answer is read and written:
# at their place in the timeline, or right before the new message (PageMover.place_near_question).
PLACEMENTS = ("timeline", "question")
# With placement "question", restored pages sit right before the turn's newest tokens, at most this
# many: before the question at the end of a long message (RULER's one long message, a pasted
# document), not before the message's start, which may have left attention: the span the
# selectors read the question from.
QUESTION_TOKENS = HybridConfig.incoming_tokens
# A new session branches from a stored one only when they share at least this many whole pages:
# one page of system prompt saves a ~128-token prefill, less than copying a long parent's manifest.
MIN_BRANCH_PAGES = 2


@dataclass(frozen=True)
class EngineConfig:
    budget_tokens: int = 4096
    high_watermark: float = 1.0
    low_watermark: float = 0.875
    tail_tokens: int = 512
    lease_turns: int = 2
    # Of a fresh session's first user message (the objective), the tokens hard-pinned: a first
    # message that is a long text (a pasted document, RULER's one long message) would otherwise
    # pin its first pages, up to the pin cap, for the whole session.
    objective_tokens: int = 256
    prefill_chunk: int = 256
    max_new_tokens: int = 512
    fixed_point_seed: int = 1234
    compress_pages: bool = False   # store K/V shuffle-zstd compressed (benchmarks.restore measures what it pays)
    placement: str = "question"    # where restored pages sit while the answer is read: "timeline" or "question"
    # Held tokens recomputed before the answer (controller.blend); None: the default where the model
    # allows it (not on a model with recurrent layers), else none.
    blend: BlendPolicy | None = None
    key_index: KeyIndexConfig = field(default_factory=KeyIndexConfig)
    lexical_index: LexicalConfig = DEFAULT_LEXICAL
    resident_sessions: int = 1     # sessions whose caches stay in memory (each a budget's worth of K/V)
    # Sessions whose state (transcript, pager, indexes) stays in memory; beyond it the least recently
    # used idle one leaves, and its next turn brings it back from contextd (serving.session_table).
    sessions_in_memory: int = 16
    batch_decode: bool = True      # resident sessions decoding at once share one forward (Engine.decode_batch)
    session_lease_s: float = 30.0  # with an object store: how long a turn holds its session unrenewed
    # "model": the pages least related to the last user message leave first; "attention": the
    # pages the model's attention read least (controller.eviction)
    evict_order: str = "recency"
    eviction: EvictionAdviceConfig = field(default_factory=EvictionAdviceConfig)
    attention_order: AttentionOrderConfig = field(default_factory=AttentionOrderConfig)

    def __post_init__(self) -> None:
        if self.prefill_chunk <= 0 or self.max_new_tokens <= 0:
            raise ValueError("prefill_chunk and max_new_tokens must be positive")
        if self.objective_tokens < 0:
            raise ValueError(f"objective_tokens must not be negative, got {self.objective_tokens}")
        if self.session_lease_s <= 0:
            raise ValueError(f"session_lease_s must be positive, got {self.session_lease_s}")
        if self.resident_sessions < 1:
            raise ValueError(f"resident_sessions must be >= 1, got {self.resident_sessions}")
        if self.sessions_in_memory < self.resident_sessions:
            raise ValueError(f"sessions_in_memory ({self.sessions_in_memory}) must be at least "
                             f"resident_sessions ({self.resident_sessions})")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, not {self.placement!r}")
        if self.evict_order not in EVICTION_ORDERS:
            raise ValueError(f"evict_order must be one of {', '.join(EVICTION_ORDERS)}, not {self.evict_order!r}")
        self.pager_config()  # validates the budget knobs

    def pager_config(self) -> PagerConfig:
        return PagerConfig(budget_tokens=self.budget_tokens, high_watermark=self.high_watermark,
                           low_watermark=self.low_watermark, tail_tokens=self.tail_tokens,
                           lease_turns=self.lease_turns)


class Engine:
    """Owns the backend and its forks. Not thread-safe: the server runs every call on one worker thread.
    `self.backend` (and the mover's) is the cache of the session being served."""

    def __init__(self, backend: Backend, chat_format: ChatFormat, contextd: Client, config: EngineConfig,
                 selector: Selector | None = None, controller: ControllerScorer | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`controller`: a separate model that scores pages for the re-ranker and the eviction advice
        (serving.scoring); without one the serving model scores them over their K/V. `clock`: what
        lease renewals are timed by (seconds, monotonic)."""
        self.format = chat_format
        self.contextd = contextd
        self.config = config
        self.selector: Selector = selector or RecencySelector()
        self.tally = Tally()
        # The page mover holds the cache being served (`self.backend`): one current backend.
        self.mover = PageMover(backend, contextd, self.tally, compress=config.compress_pages, controller=controller,
                               opening=chat_format.user_opening)
        self._check_scoring(self.selector, controller)
        self.blend = self._blend_policy(config.blend)
        # No forward reports its attention weights but the chunks an attention order takes a vote
        # from (PageMover.watch_attention turns it on for them).
        backend.observe_attention(0, [])
        self.recovery = Recovery(self.mover, contextd, self.tally, self._indexes)
        self.sessions = SessionTable(backend, resident=config.resident_sessions,
                                     in_memory=config.sessions_in_memory, fork=backend.fork)
        self.clock = clock
        self.decoder = Decoder(self.mover, chat_format, self.tally, config.fixed_point_seed)
        # Measurement hooks (serving.observe): what reads a turn from the inside, which the turn
        # calls at fixed points and never depends on.
        self.observers: list[TurnObserver] = []

    def check_scoring(self, selector: Selector) -> None:
        """Refuse a selector that must score pages apart over their stored K/V on a model whose
        pages this engine cannot score so (`_check_scoring`): ValueError saying why."""
        self._check_scoring(selector, self.mover.controller)

    def _check_scoring(self, selector: Selector, controller: ControllerScorer | None) -> None:
        """Refuse what must score pages apart over their stored K/V (one forward, so every layer
        full attention) on a model with sliding-window or recurrent layers and no controller model."""
        if not self.backend.is_hybrid or controller is not None:
            return
        for asks, scoring, instead in (
                (selector.scores_pages, f"the {selector.name} selector scores each candidate", "--selector hybrid"),
                (self.config.evict_order == "model", "the eviction order 'model' scores the pages in attention",
                 "--evict-order recency")):
            if asks:
                raise ValueError(f"{scoring} apart, over the stored K/V, in one forward, which needs every layer "
                                 "to be full attention; this model has sliding-window or recurrent layers "
                                 f"(use {instead}, or a full-attention --controller-model)")

    def _blend_policy(self, asked: BlendPolicy | None) -> BlendPolicy:
        """The blend the engine runs: the one asked for (refused with the reason on a model that cannot
        recompute held tokens), else the default where the model can, else none."""
        refusal = self.backend.recompute_refusal
        if asked is None:
            if refusal is not None:
                log.info("the blend is off for this model: %s", refusal)
                return BlendPolicy()
            return DEFAULT_BLEND
        if refusal is not None and not asked.off:
            raise ValueError(f"--blend cannot run on this model: {refusal} (use --blend none)")
        return asked

    @property
    def backend(self) -> Backend:
        """The cache of the session being served (the page mover's)."""
        return self.mover.backend

    @property
    def active(self) -> str | None:
        """The session whose cache `backend` is now."""
        return self.sessions.active

    @property
    def totals(self) -> SessionCounters:
        return self.tally.totals

    # ------------------------------------------------------------------ sessions

    def _indexes(self) -> tuple[KeyIndex | None, LexicalIndex | None]:
        """New, empty page indexes: the ones the selector searches."""
        return (self.new_key_index() if self.selector.uses_key_index else None,
                self.new_lexical_index() if self.selector.uses_lexical_index else None)

    def new_key_index(self) -> KeyIndex:
        """An empty key index for this model (a session's, or a probe's for a selector that searches one)."""
        return KeyIndex(self.config.key_index, len(self.backend.layer_view.attention_layers))

    def new_lexical_index(self) -> LexicalIndex:
        """An empty lexical index for this tokenizer (a session's, or a probe's)."""
        return LexicalIndex(self.config.lexical_index, stop_ids=self.format.template_ids,
                            token_bytes=self.format.token_bytes)

    def _take_cache(self, session_id: str) -> None:
        """Point the engine at `session_id`'s cache: its own when it is resident (nothing moves),
        else one the table hands it (serving.session_table; `_activate` fills it)."""
        table = self.sessions
        own = table.cache_of(session_id)
        session = table.get(session_id)
        if own is not None and session is not None and table.active != session_id:
            self.tally.count(session, session_switches=1)
            table.active = session_id
        self._use(table.take_cache(session_id))

    def _use(self, cache: Backend) -> None:
        self.mover.backend = cache

    def resume(self, session_id: str) -> None:
        """Point the engine back at a session whose turn is in progress, before its next step (the
        server's worker interleaves the turns of resident sessions): its cache, as it left it."""
        cache = self.sessions.cache_of(session_id)
        if cache is None:
            raise RuntimeError(f"session {session_id} has no cache to resume its turn in")
        self._use(cache)
        self.sessions.active = session_id

    def activate(self, session_id: str, fingerprint: Fingerprint) -> Session:
        """Bring `session_id` into a cache of its own, as a turn does first (the fault campaign's
        driver and `probe` use it on their own)."""
        self._take_cache(session_id)
        return self._activate(session_id, fingerprint)

    def _activate(self, session_id: str, fingerprint: Fingerprint) -> Session:
        """Make `session_id` the backend's session: from memory, from contextd, or new."""
        table = self.sessions
        session = table.get(session_id)
        if table.active == session_id and session is not None:
            table.touch(session_id)
            return session
        switched = table.active is not None   # another session's cache leaves the backend
        self.mover.empty()
        table.active = None
        if session is None:
            session = self.recovery.bring_back(session_id, self.config.pager_config())
            if session is None:
                key_index, lexical_index = self._indexes()
                session = Session(session_id, Transcript(fingerprint), Pager(self.config.pager_config()),
                                  key_index=key_index, lexical_index=lexical_index)
                self.contextd.open_session(session_id, model_id=self.backend.model_name,
                                           fingerprint=fingerprint.combined(), budget_tokens=self.config.budget_tokens)
            if self.config.evict_order == "model":
                session.eviction = EvictionAdvisor(self.config.eviction, self.format.template_ids)
            elif self.config.evict_order == "attention":
                session.attention = AttentionOrder(self.config.attention_order)
            for let_go in table.add(session):
                log.info("session %s left memory (more than %d sessions); contextd keeps it", let_go,
                         table.in_memory)
        else:
            table.touch(session_id)
            self.tally.count(session, recovered_pages=self.mover.fill_resident(session))
        if switched:
            self.tally.count(session, session_switches=1)
        table.active = session_id
        return session

    # ------------------------------------------------------------------ the turn

    def chat(self, request: ChatRequest) -> Generator[TurnEvent, int | None, None]:
        """Run one turn; yield text deltas, then one final event with the result, then pauses
        while the controller model reads ahead (`_read_ahead`). Between two events another
        session's turn may run (the server's worker), after which `resume` must point the engine
        back at this one. An event's `decode` step takes the token sent back
        (`Engine.decode_batch` ran it) or, when nothing is sent, runs in the turn; an exception
        thrown back (that forward failed) is raised where the turn would have decoded."""
        session_id = request.session_id
        # Before the turn marks its session busy: an observer's branch may need the session's cache.
        for observer in list(self.observers):
            observer.before_turn(request)
        turn = self.sessions.begin_turn(session_id)
        steps = self._turn(request, turn)
        answer: int | None = None
        failure: Exception | None = None
        answered = False   # the final event is out: its record ended the lease
        try:
            while True:
                try:
                    event = steps.throw(failure) if failure is not None else steps.send(answer)
                except StopIteration:
                    answered = True
                    return
                answer, failure = None, None
                answered = answered or event.final is not None
                if not answered:   # renewing after the final record would take the lease again
                    self._renew(session_id, turn)
                paused = time.perf_counter()
                try:
                    answer = yield event
                except Exception as exc:  # noqa: BLE001 - handed to the turn, which raises it
                    failure = exc
                turn.paused_ms += (time.perf_counter() - paused) * 1e3
        finally:
            steps.close()
            self.sessions.end_turn(session_id)
            if turn.held_at is not None and not answered:
                self._release(session_id)

    def decode_batch(self, steps: dict[str, DecodeStep]) -> list[int]:
        """Run the waiting decode steps of several turns in progress (session -> its step, as its
        turn's last event carried it) in one batched forward where the backend can. Each turn's
        time counts the whole forward: its token was in it, so it is not time spent waiting."""
        started = time.perf_counter()
        tokens = self.backend.decode_batch(list(steps.values()))
        spent = (time.perf_counter() - started) * 1e3
        batched = len(steps) > 1 and self.backend.batches_decode
        for session_id in steps:
            turn = self.sessions.turn(session_id)
            if turn is not None:
                turn.paused_ms -= spent
            if batched:
                self.tally.count(self.sessions[session_id], batched_decode_tokens=1)
        return tokens

    def _hold(self, session_id: str, turn: TurnState, renew: bool = False) -> bool:
        """Hold the session for this turn (contextd.handover). With an object store that several
        servers share, the session may have been served elsewhere since this server last did:
        contextd then adopted the state that server exported, and what this server keeps of the
        session in memory is stale; the session comes back from contextd as after a restart.
        Returns whether it was adopted."""
        hold = self.contextd.hold_session(session_id, self.backend.model_name, self.config.session_lease_s, renew)
        turn.held_at = self.clock()
        if hold.adopted:
            log.info("session %s adopted from %s (token %d)", session_id, hold.previous_node or "a deletion",
                     hold.token)
            self.forget(session_id)
        return hold.adopted

    def _renew(self, session_id: str, turn: TurnState) -> None:
        """Between two steps of a turn: renew its lease once a third of it has passed, so a long
        prefill or answer keeps its session. A session taken over meanwhile fails the turn
        (SessionHeld): it is never taken back from inside a turn."""
        held = turn.held_at
        if held is not None and self.clock() - held >= self.config.session_lease_s / 3:
            self._hold(session_id, turn, renew=True)

    def _release(self, session_id: str) -> None:
        """A turn that failed ends its lease at once (a completed one ended it with its record), so
        another server's request for the session does not wait for the lease to run out. Best
        effort: a session already lost, or a contextd not answering, has nothing to release."""
        try:
            self.contextd.hold_session(session_id, self.backend.model_name, self.config.session_lease_s, release=True)
        except ContextdError as exc:
            log.info("session %s: its failed turn's lease was not released (%s)", session_id, exc)

    def _turn(self, request: ChatRequest, turn: TurnState) -> Generator[TurnEvent, int | None, None]:
        """One turn (`chat`); `turn`: its values that `chat` shares (time paused, the lease)."""
        started = time.perf_counter()
        fingerprint = self.format.fingerprint(request.tools, request.thinking)
        known = self.sessions.get(request.session_id)
        # A malformed request fails before any work.
        self.format.check(request.messages, known.render_memo if known is not None else None)
        adopted = self._hold(request.session_id, turn)
        if adopted:
            known = None
        activating = time.perf_counter()
        parent = self._branch(request, fingerprint) if known is None else ""
        self._take_cache(request.session_id)
        before = self.backend.counters
        session = self._activate(request.session_id, fingerprint)
        if adopted:
            self.tally.count(session, adoptions=1)
        session.phase_ms = {"receive": request.received_ms, "activate": (time.perf_counter() - activating) * 1e3}
        preparing = time.perf_counter()
        rendering = self.format.render(request.messages, request.tools, request.thinking, session.transcript.generated,
                                       session.render_memo)
        session.render_memo = rendering.memo
        rendered = rendering.text
        session.pager.begin_turn()
        self.tally.count(session, turns=1)
        session.counters.restored_pages_turn = session.counters.evicted_pages_turn = 0

        alignment = align(session.transcript, fingerprint, rendered, request.message_hashes)
        if parent:
            # The parent's transcript past the point where this prompt departs from it is not
            # this session's history: leaving it is the branch, not a change of the client's history.
            alignment = Alignment(alignment.keep_segments, alignment.keep_tokens, alignment.new_text)
        cached = len(session.transcript.segments)
        if not alignment.new_text and alignment.keep_segments == cached and not alignment.rebuild:
            # The client re-sent exactly what is cached (a retry of the last turn): regenerate it.
            alignment = Alignment(alignment.keep_segments, alignment.keep_tokens, "",
                                  reason="the request repeats the cached transcript; regenerating the last answer")
        rebuilt = "" if parent else alignment.reason
        reprefilled = 0
        if alignment.rebuild or alignment.keep_segments < cached:
            alignment, dropped = self._cut_back(session, alignment, rendered)
            reprefilled = recomputed_tokens(dropped, alignment.new_text)
            if not rebuilt and reprefilled and not parent:
                rebuilt = "answers the client did not replay were dropped; the state before them was prefilled again"
            if rebuilt:
                self.tally.count(session, rebuilds=1, reprefilled_tokens=reprefilled)
            elif not parent:
                self.tally.count(session, tail_drops=1)
            session.transcript.fingerprint = fingerprint
        if parent:
            self.tally.count(session, branches=1, branch_kept_tokens=alignment.keep_tokens)
        if request.message_hashes is not None:
            session.transcript.message_hashes = list(request.message_hashes)

        pieces = prompt_pieces(self.format, session, request, rendering, alignment.new_text)
        prompt_ids = [t for piece in pieces for t in piece.segment.ids]
        session.timed("prepare", preparing)
        if not prompt_ids:
            raise TranscriptError("the request adds nothing after the cached transcript; send the next message")
        # The template's opening of the answer is prefilled after the plan: the logits the first
        # answer token comes from then see the restored pages too.
        body, opener = (pieces[:-1], pieces[-1:]) if pieces[-1].segment.opener else (pieces, [])
        keep_focus(self.format, session, request)
        for n, piece in enumerate(body, start=1):
            begin_message(session, piece)
            yield from self.prefill(session, piece.segment, piece.pin, logits=n == len(body) and not opener)
            if piece.tool_call:
                session.pager.mark_ledger(len(session.pager.pages) - 1)
        new_tokens = sum(len(p.segment.ids) for p in body)
        restored, placed = self._apply_plan(session, request, new_tokens)
        for observer in self.observers:
            observer.view_planned(session, self.backend, restored, new_tokens,
                                  [t for piece in opener for t in piece.segment.ids])
        if opener:   # the opening's forward gives the answer logits that read the recomputed view
            self._blend(session, restored, new_tokens)
        for piece in opener:
            if session.attention is not None:
                session.attention.begin_opening()
            yield from self.prefill(session, piece.segment, piece.pin, logits=True)
        for observer in self.observers:
            observer.answer_view(session, self.backend, restored)
        yield TurnEvent(prepared=Prepared(prefilled_tokens=len(prompt_ids), rebuilt=rebuilt))

        turn.phase = TurnPhase.DECODE
        picked, finish, sampled = yield from self.decoder.generate(
            session, request, prompt_ids,
            min(request.max_tokens or self.config.max_new_tokens, self.config.max_new_tokens))
        self.mover.unblend()     # the exact K/V again before anything is stored or the next turn
        if placed:
            self.mover.close_gaps(session)   # timeline positions again before anything is stored
        result = self._finish_turn(session, turn, picked, finish, before, started)
        result.prefilled_tokens = len(prompt_ids)
        result.prompt_tokens = session.transcript.tokens - len(picked)
        result.rebuilt = rebuilt
        result.sampled = sampled
        yield TurnEvent(final=result)
        turn.phase = TurnPhase.READ_AHEAD
        for observer in self.observers:
            observer.answered(session)
        yield from self._read_ahead(session)

    def _read_ahead(self, session: Session) -> Generator[TurnEvent, int | None, None]:
        """After the answer is out, the controller model (if any) reads the pages this turn stored,
        one at a time with a pause after each (`ControllerScorer.read_next`, counted as
        `controller_forward_tokens`): the client has its answer and an agent runs its tool
        meanwhile; the session's next turn waits for the reading, but other sessions' turns and the
        stats readers go between two pages, where reading them all at once would hold the worker
        for the whole prefill. Best effort: a page it cannot read now is read when it is scored."""
        controller = self.mover.controller
        reading = 0.0
        while controller is not None and session.unread_pages:
            started = time.perf_counter()
            try:
                self.tally.count(session, controller_forward_tokens=controller.read_next(session))
            except (BackendError, ValueError) as exc:
                log.warning("session %s: the controller model did not read this turn's pages ahead: %s",
                            session.session_id, exc)
                session.unread_pages = []
            reading += time.perf_counter() - started
            if session.unread_pages:
                yield TurnEvent()
        session.read_ahead_ms = reading * 1e3

    def _branch(self, request: ChatRequest, fingerprint: Fingerprint) -> str:
        """Make a session contextd does not know a branch of the stored session whose pages its
        prompt begins with furthest; return the parent's id ("" when there is none to share)."""
        try:
            self.contextd.get_session(request.session_id)
            return ""
        except NotFound:
            pass
        rendering = self.format.render(request.messages, request.tools, request.thinking, {}, None)
        chain = PrefixChain()
        for piece, _ in piece_texts(self.format, rendering, rendering.text, len(request.messages)):
            chain.extend(self.format.encode(piece))
        found = self.contextd.find_prefix(self.backend.model_name, fingerprint.combined(), chain.hashes)
        if found.pages < MIN_BRANCH_PAGES:
            return ""
        try:
            branch = self.contextd.branch_session(request.session_id, found.session_id)
        except (FailedPrecondition, StoreFull) as exc:
            # The parent changed under the copy, or there is no room for the links: start fresh.
            log.warning("session %s does not branch from %s: %s", request.session_id, found.session_id, exc)
            return ""
        log.info("session %s branches from %s: %d of its prompt's pages are stored there, %d pages shared",
                 request.session_id, found.session_id, found.pages, branch.pages)
        return found.session_id

    def selection_context(self, session: Session, new_tokens: int) -> SelectionContext:
        """What a selector reads to choose this turn's restores (the turn's, and serving.probe's)."""
        ids, pages = session.transcript.ids, session.pager.pages
        return SelectionContext(session.session_id, session.pager,
                                incoming_keys=self._incoming_keys(new_tokens, session.key_index),
                                key_index=session.key_index, room_tokens=session.pager.room(),
                                lexical_index=session.lexical_index,
                                incoming_ids=ids[len(ids) - min(new_tokens, INCOMING_IDS):],
                                scorer=self.mover.scorer(session, held=False),
                                page_ids=lambda i: ids[pages[i].token_start:pages[i].token_end])

    def _apply_plan(self, session: Session, request: ChatRequest, new_tokens: int
                    ) -> tuple[list[int], bool]:
        """Between prefill and decode: the request's own plan, else the selector's, through the
        pager's rules. Restored pages land at their place in the timeline, before the new text;
        with placement "question" their positions then move next to the new message. Returns the
        pages restored and whether positions were moved."""
        pager = session.pager
        scores: dict[int, float] = {}
        restored: list[int] = []
        if request.plan is not None:
            plan: Plan | None = request.plan
            session.last_selection = "plan from the request"
        else:
            choosing = time.perf_counter()
            selection = self.selector.select(self.selection_context(session, new_tokens))
            session.timed("select", choosing)
            plan, scores = selection.plan, selection.scores
            session.last_selection = f"{self.selector.name}: {selection.note} ({selection.decided_ms:.0f} ms)"
            self.tally.count(session, selector_ms=int(selection.decided_ms))
        if plan is not None:
            if (session.eviction is not None or session.attention is not None) and not plan.evict_first:
                coming = pager.incoming_for(plan)
                if pager.must_evict_for(coming):
                    plan = dataclasses.replace(plan, evict_first=self.mover.advise_evictions(session, coming))
            decision = pager.decide(plan, incoming_tokens=0)
            self.tally.count(session, plans_used=int(decision.plan_used), plans_rejected=int(not decision.plan_used))
            if decision.plan_rejected:
                session.last_selection += f"; rejected: {decision.plan_rejected}"
            restored = self.mover.execute(session, decision, scores)
        self.mover.close_gaps(session)
        placed = self.config.placement == "question" and self.mover.place_near_question(
            session, restored, min(new_tokens, QUESTION_TOKENS))
        return restored, placed

    def _blend(self, session: Session, restored: list[int], new_tokens: int) -> None:
        """Recompute what the blend policy names of the planned view, before the answer's opening is
        prefilled (the backend counts it as blend forward tokens)."""
        policy = self.blend
        if policy.off:
            return
        parts = view_parts(session.pager, restored, new_tokens, self.backend.positions())
        self.mover.blend(policy.choose(parts))   # a forward: its time is the turn's forward_ms

    def _incoming_keys(self, new_tokens: int, key_index: KeyIndex | None) -> np.ndarray | None:
        """Canonical keys of the turn's newest tokens (still in attention), for the key index."""
        if key_index is None:
            return None
        return self.mover.newest_keys(min(new_tokens, self.config.key_index.incoming_tokens))

    def prefill(self, session: Session, segment: Segment, pin: PinKind | None, logits: bool
                ) -> Generator[TurnEvent, int | None, None]:
        """Prefill one segment in chunks, pausing after each (another session's turn may run).
        Only the last chunk of a segment that needs them computes logits (`Backend.extend`). An
        objective pin covers the segment's first `objective_tokens` tokens (the pages they touch)."""
        chunk = self.config.prefill_chunk
        pinned = self.config.objective_tokens if pin is PinKind.OBJECTIVE else len(segment.ids)
        for i in range(0, len(segment.ids), chunk):
            part = segment.ids[i:i + chunk]
            self.mover.make_room(session, len(part))
            self.mover.watch_attention(session)
            if logits and i + chunk >= len(segment.ids):
                self.backend.prefill(part)
            else:
                self.backend.extend(part)
            crashpoints.reached("serving.prefill.chunk")
            split = min(max(pinned - i, 0), len(part))
            if split:
                session.pager.append(part[:split], pin=pin)
            if split < len(part):
                session.pager.append(part[split:])
            self.mover.observe_attention(session, len(part))
            self.tally.peak(session, self.backend.attention_tokens)
            yield TurnEvent()
        session.transcript.append(segment)
        self.mover.snapshot_recurrent(session)

    # ------------------------------------------------------------------ rebuilds

    def _cut_back(self, session: Session, alignment: Alignment, rendered: str) -> tuple[Alignment, list[Segment]]:
        """Take every cached token after the kept prefix out (a truncation: no forward pass);
        return what to prefill and the segments dropped."""
        transcript = session.transcript
        # The recurrent state of a hybrid cannot be cut: keep only up to a segment boundary that has
        # a snapshot. At least one segment must be prefilled again, or there would be no logits.
        keep = alignment.keep_segments
        while keep and (len(rendered) <= sum(len(s.text) for s in transcript.segments[:keep])
                        or (self.backend.is_hybrid
                            and sum(len(s.ids) for s in transcript.segments[:keep]) not in session.snapshots)):
            keep -= 1
        kept_text = "".join(s.text for s in transcript.segments[:keep])
        if not rendered.startswith(kept_text):
            keep, kept_text = 0, ""
        keep_tokens = sum(len(s.ids) for s in transcript.segments[:keep])
        dropped = transcript.segments[keep:]
        if alignment.reason:
            log.warning("session %s: %s; keeping %d of %d cached tokens", session.session_id, alignment.reason,
                        keep_tokens, transcript.tokens)
        self.mover.cut(session, keep)
        session.last_answer = None
        return Alignment(keep, keep_tokens, rendered[len(kept_text):], reason=alignment.reason), dropped

    # ------------------------------------------------------------------ end of turn

    def _finish_turn(self, session: Session, turn: TurnState, picked: list[int], finish: FinishReason,
                     before: Counters, started: float) -> TurnResult:
        pager = session.pager
        content, calls = parse_tool_calls(session.transcript.segments[-1].text)
        if calls and pager.pages:
            pager.mark_ledger(pager.pages[-1].index)
        self.mover.snapshot_recurrent(session)
        after = self.backend.counters
        self.tally.count(session, **{name: getattr(after, name) - getattr(before, name) for name in (
            "model_forward_tokens", "new_prefill_tokens", "decoded_tokens", "blend_forward_tokens",
            "historical_forward_during_restore", "reanchored_keys", "compactions")})
        persisting = time.perf_counter()
        self.mover.persist(session, lambda: self._record(session))
        session.timed("persist", persisting)
        elapsed_ms = (time.perf_counter() - started) * 1e3 - turn.paused_ms
        session.last_turn = TurnTimings(total_ms=elapsed_ms + session.phase_ms["receive"],
                                        forward_ms=(after.forward_ns - before.forward_ns) / 1e6,
                                        phases=dict(session.phase_ms))
        return TurnResult(content=content, tool_calls=calls, finish_reason=FinishReason.TOOL_CALLS if calls else finish,
                          prompt_tokens=0, prefilled_tokens=0, completion_tokens=len(picked),
                          counters=SessionCounters.from_dict(session.counters.as_dict()))

    def _record(self, session: Session) -> pb.SessionRecord:
        fingerprint = session.transcript.fingerprint
        return pb.SessionRecord(
            turn=session.pager.turn, attention_tokens=self.backend.attention_tokens,
            fingerprint=fingerprint.combined(),
            fingerprint_parts=[fingerprint.tokenizer, fingerprint.template, fingerprint.tools, fingerprint.thinking],
            message_hashes=session.transcript.message_hashes,
            ledger_pages=session.pager.ledger, counters=session.counters.as_dict(),
            resident_pages=list(session.persisted.resident_positions),
            resident_positions=list(session.persisted.resident_positions.values()))

    def forget(self, session_id: str) -> None:
        """After a failed turn of `session_id` its cache's state is unknown: empty that cache (no
        other session's) and drop the session from memory; its next turn reloads from contextd.
        A cache that cannot be emptied is not kept as a spare (a fork replaces it when needed)."""
        cache = self.sessions.drop(session_id)
        if cache is not None:
            self._use(cache)
            self.mover.empty()
            self.sessions.give_back(cache)
