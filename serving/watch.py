"""Reading what a turn's answer reads: an observer of the engine (serving.observe), not part of
the turn. benchmarks.answers, benchmarks.eviction, benchmarks.selectors and the server's
`/v1/kv/score` route use it; a turn nobody watches runs no line of it.

A caller names the candidate answers of a session's next turn (and, optionally, selectors to
answer it in branches first). Once that turn's answer opening is in, the exact cache the answer is
decoded from is captured on a fork (serving.likelihood) and, after the answer is out, scored: the
reading. With branches, before the turn itself, the same request is answered once per selector in
a branch of the session as its last turn left it (`answer_in_branches`). One owner for all of it;
a session that leaves the server's memory (serving.session_table) is forgotten here too.

Depends on controller.selectors and serving.engine / likelihood / observe / session.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from backends import Backend
from controller.selectors import Selector
from serving.engine import Engine
from serving.likelihood import ViewCapture, ViewReading, capture_view
from serving.observe import TurnObserver
from serving.session import Session
from serving.turn import ChatRequest, TurnResult

log = logging.getLogger("kv_elision.watch")

# The most candidate answers one watched turn scores (each costs a few one-token forwards).
MAX_WATCHED_CANDIDATES = 64


@dataclass
class _Watched:
    candidates: list[str] | None = None      # to score at the session's next turn
    branches: list[Selector] = field(default_factory=list)   # selectors to answer in branches first
    capture: ViewCapture | None = None       # the turn in progress's answer view, read once it is out
    pending_branches: dict[str, ViewReading] = field(default_factory=dict)   # that turn's branches
    reading: ViewReading | None = None       # what the last watched turn's answer read
    branch_readings: dict[str, ViewReading] = field(default_factory=dict)   # selector -> its branch's


class AnswerWatch(TurnObserver):
    """Per session: what to read at its next turn, and what its last watched turn read. Made on an
    engine, it observes that engine's turns until `close`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions: dict[str, _Watched] = {}
        engine.observers.append(self)
        engine.sessions.on_drop(self.forget)

    def close(self) -> None:
        """Stop observing the engine's turns and its sessions leaving memory (what it read stays readable)."""
        self.engine.observers.remove(self)
        self.engine.sessions.off_drop(self.forget)

    # ------------------------------------------------------------------ asking

    def watch(self, session_id: str, candidates: list[str], branches: Sequence[Selector] = ()) -> None:
        """At `session_id`'s next turn, score each candidate answer over the exact cache the answer
        is decoded from; `reading` then gives the result. The turn answers as it would unwatched.
        With `branches`, the same request is first answered once per selector in a branch of the
        session (`answer_in_branches`), before the turn itself; `branch_readings` gives those."""
        if not 0 < len(candidates) <= MAX_WATCHED_CANDIDATES or not all(c.strip() for c in candidates):
            raise ValueError(f"give 1 to {MAX_WATCHED_CANDIDATES} non-blank candidate answers")
        self._check_branches(branches)
        watched = self._sessions.setdefault(session_id, _Watched())
        watched.candidates, watched.branches = list(candidates), list(branches)

    def _check_branches(self, selectors: Sequence[Selector]) -> None:
        names = [selector.name for selector in selectors]
        if len(set(names)) < len(names):
            raise ValueError(f"each selector answers in one branch: {', '.join(names)} names one twice")
        for selector in selectors:
            self.engine.check_scoring(selector)

    # ------------------------------------------------------------------ what was read

    def reading(self, session_id: str) -> ViewReading | None:
        watched = self._sessions.get(session_id)
        return watched.reading if watched is not None else None

    def branch_readings(self, session_id: str) -> dict[str, ViewReading]:
        watched = self._sessions.get(session_id)
        return dict(watched.branch_readings) if watched is not None else {}

    def take_reading(self, session_id: str) -> ViewReading | None:
        """The last reading, handed over once (a benchmark that reads every turn)."""
        watched = self._sessions.get(session_id)
        if watched is None or watched.reading is None:
            return None
        reading, watched.reading = watched.reading, None
        return reading

    def watching(self, session_id: str) -> bool:
        """Whether `session_id`'s next turn will be read."""
        watched = self._sessions.get(session_id)
        return watched is not None and watched.candidates is not None

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    # ------------------------------------------------------------------ the engine's hooks

    def before_turn(self, request: ChatRequest) -> None:
        """A watched turn with branches is first answered in them. It only measures: a branch that
        fails is logged, the turn then has no branch readings, and it runs as it would have."""
        watched = self._sessions.get(request.session_id)
        if watched is None or watched.candidates is None or not watched.branches:
            return
        selectors, watched.branches = watched.branches, []
        try:
            readings = self.answer_in_branches(request, watched.candidates, selectors)
            watched.pending_branches = {name: reading for name, (reading, _) in readings.items()}
        except Exception:  # noqa: BLE001 - a measurement never fails the turn it measures
            log.warning("session %s: its turn was not answered in branches", request.session_id, exc_info=True)

    def answer_view(self, session: Session, backend: Backend, restored: list[int]) -> None:
        watched = self._sessions.get(session.session_id)
        if watched is None or watched.candidates is None:
            return
        candidates, watched.candidates, watched.reading = watched.candidates, None, None
        encode = self.engine.format.encode
        watched.capture = capture_view(backend, session.pager, session.transcript.ids, candidates,
                                       [encode(c) for c in candidates], restored)

    def answered(self, session: Session) -> None:
        """After the answer is out: the worker still holds its lock, so a reader of the reading
        waits for it, and the answer did not wait for the scoring."""
        watched = self._sessions.get(session.session_id)
        if watched is None or watched.capture is None:
            return
        capture, watched.capture = watched.capture, None
        watched.reading = capture.read()
        watched.branch_readings, watched.pending_branches = watched.pending_branches, {}

    # ------------------------------------------------------------------ branches

    def answer_in_branches(self, request: ChatRequest, candidates: list[str], selectors: Sequence[Selector]
                           ) -> dict[str, tuple[ViewReading, int]]:
        """`request` (a next turn of the stored session `request.session_id`) answered once per
        selector, each time in a new branch of that session as its last turn left it: contextd's
        copy of its record and pages, with the session's leases copied too (a branch starts
        without leases, and they decide what may leave), brought back as after a restart (no
        prefill of history). The answer is one token long, that selector chooses the restores
        (a plan the request carries is not used), and the answer's view is scored against
        `candidates`. Each branch is dropped from memory and from contextd before the next, so
        every selector starts from the same state; the branches' forwards and page moves are
        left out of the server's totals. Returns the reading and the tokens prefilled, per selector.

        Why: two sessions that each write their own answers part at the first answer that
        differs, and every later question then compares two histories; through Pi most of the
        difference between two selectors' answers came from that, not from their choices
        (docs/journal/2026-12-03-reranker-answers.md). With the session's own selector (built
        alike) a branch reads what the session's turn then reads, unless the eviction order is
        the model's: a branch's eviction focus starts from this request. With one resident
        session, each branch takes the session's cache, and its turn brings the session back
        from the store (exact, at the cost of those restores)."""
        self._check_branches(selectors)
        engine = self.engine
        serving, totals = engine.selector, copy.deepcopy(engine.tally.totals)
        out: dict[str, tuple[ViewReading, int]] = {}
        try:
            for selector in selectors:
                branch = f"{request.session_id}-branch-{uuid.uuid4().hex[:12]}"
                engine.contextd.branch_session(branch, request.session_id)
                try:
                    engine.contextd.set_leases(branch, add=engine.contextd.query_leases(request.session_id))
                    engine.selector = selector   # the engine's one selector, for this turn only
                    self.watch(branch, candidates)
                    final: TurnResult | None = None
                    for event in engine.chat(dataclasses.replace(request, session_id=branch, max_tokens=1,
                                                                 plan=None, cancelled=None)):
                        final = event.final or final
                    reading = self.reading(branch)
                    if final is None or reading is None:
                        raise RuntimeError(f"the branch of {request.session_id} answered nothing")
                    out[selector.name] = (reading, final.prefilled_tokens)
                finally:
                    self.forget(branch)
                    try:
                        engine.forget(branch)
                    finally:
                        engine.contextd.delete_session(branch)
        finally:
            engine.selector = serving
            engine.tally.totals = totals
        return out
