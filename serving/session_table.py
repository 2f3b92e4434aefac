"""What the server holds of its sessions in memory, and for how long: one owner for each
session's life in this process.

A session the server has served has here its `Session` (transcript, pager, page indexes: what a
turn needs to start without asking contextd), maybe a cache of its own (a fork of the backend
holding its hot pages: a resident session) and, while a turn of it runs, a `TurnState`. contextd
holds the truth: whatever this table lets go comes back from there (serving.recovery) as after a
restart, with copies of stored pages and never a forward pass over history.

Two bounds keep the process's memory flat however many sessions it serves:
- at most `resident` caches (each a budget's worth of K/V), the least recently used first out
  (its session stays in memory, cacheless, and its next turn fills a cache from the store);
- at most `in_memory` sessions; beyond it the least recently used session that has no turn
  running and no cache leaves memory, and the listeners (`on_drop`) forget what they keep of it.

Which session's cache the backend is now (`active`) is kept here too; the page mover holds that
cache (serving.paging.PageMover.backend), the engine points it (serving.engine.Engine._use).

Depends on backends (Backend) and serving.session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum

from backends import Backend
from serving.session import Session


class TurnPhase(StrEnum):
    """Where a turn in progress is (`/v1/kv/stats?session=ID` says it as `turn_phase`, for a
    status line and for a client that must act at a given point of a turn)."""

    PREPARE = "prepare"        # the prompt: rendering, prefill, the plan, restores, the blend
    DECODE = "decode"          # the answer, token by token
    READ_AHEAD = "read_ahead"  # answered; the controller model reads the pages the turn stored


@dataclass
class TurnState:
    """One turn in progress, as the engine's turn generator and its caller share it."""

    paused_ms: float = 0.0          # time other sessions' turns ran between its steps
    held_at: float | None = None    # when its lease was last taken or renewed (the engine's clock)
    phase: TurnPhase = TurnPhase.PREPARE


class SessionTable(Mapping[str, Session]):
    """The sessions in memory (a read-only mapping, least recently used first), their caches and
    their turns in progress. Not thread-safe: the engine's worker thread is its only user."""

    def __init__(self, first_cache: Backend, resident: int, in_memory: int, fork: Callable[[], Backend]) -> None:
        """`fork`: a new empty cache sharing the weights, made while fewer than `resident` exist."""
        if resident < 1:
            raise ValueError(f"resident sessions must be >= 1, got {resident}")
        if in_memory < resident:
            raise ValueError(f"sessions in memory ({in_memory}) must be at least the resident sessions ({resident})")
        self.resident = resident
        self.in_memory = in_memory
        self.active: str | None = None     # the session whose cache the backend is now
        self._fork = fork
        self._sessions: OrderedDict[str, Session] = OrderedDict()   # oldest use first
        self._caches: OrderedDict[str, Backend] = OrderedDict()     # resident session -> its cache, oldest first
        self._spare: list[Backend] = [first_cache]                  # empty caches no session holds
        self._turns: dict[str, TurnState] = {}
        self._listeners: list[Callable[[str], None]] = []
        self.dropped = 0   # sessions let go by the in-memory bound since the start

    # ------------------------------------------------------------------ the mapping

    def __getitem__(self, session_id: str) -> Session:
        return self._sessions[session_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def on_drop(self, listener: Callable[[str], None]) -> None:
        """Call `listener(session_id)` whenever a session leaves memory (the bound, or `drop`),
        until `off_drop(listener)`."""
        self._listeners.append(listener)

    def off_drop(self, listener: Callable[[str], None]) -> None:
        """Stop calling `listener` (ValueError if it was not listening)."""
        self._listeners.remove(listener)

    # ------------------------------------------------------------------ sessions

    def add(self, session: Session) -> list[str]:
        """Keep `session` in memory as the most recently used; let go of the least recently used
        idle ones beyond the bound. Returns the ids let go."""
        self._sessions[session.session_id] = session
        self._sessions.move_to_end(session.session_id)
        let_go: list[str] = []
        for session_id in list(self._sessions):
            if len(self._sessions) <= self.in_memory:
                break
            if session_id != session.session_id and session_id not in self._turns and session_id not in self._caches:
                del self._sessions[session_id]
                self._notify(session_id)
                let_go.append(session_id)
        self.dropped += len(let_go)
        return let_go

    def touch(self, session_id: str) -> None:
        """`session_id` is being served: the most recently used."""
        if session_id in self._sessions:
            self._sessions.move_to_end(session_id)

    def drop(self, session_id: str) -> Backend | None:
        """Let go of `session_id` (its state is unknown after a failed turn, or another server
        took it): out of memory, and its cache out of its hands, returned for the caller to
        empty and `give_back`."""
        self._sessions.pop(session_id, None)
        cache = self._caches.pop(session_id, None)
        if self.active == session_id or cache is not None:
            self.active = None
        self._notify(session_id)
        return cache

    def _notify(self, session_id: str) -> None:
        for listener in self._listeners:
            listener(session_id)

    # ------------------------------------------------------------------ caches

    def cache_of(self, session_id: str) -> Backend | None:
        return self._caches.get(session_id)

    @property
    def residents(self) -> list[str]:
        """Sessions that hold a cache (and are in memory), the least recently used first."""
        return [s for s in self._caches if s in self._sessions]

    def take_cache(self, session_id: str) -> Backend:
        """A cache for `session_id`: its own, else a spare, a new fork while fewer than `resident`
        exist, or the least recently used idle session's (that session keeps its state in memory
        and its pages in the store; the caller empties and fills the cache)."""
        cache = self._caches.get(session_id)
        if cache is not None:
            self._caches.move_to_end(session_id)
            return cache
        if self._spare:
            cache = self._spare.pop()
        elif len(self._caches) < self.resident:
            cache = self._fork()
        else:
            oldest = next((s for s in self._caches if s not in self._turns), None)
            if oldest is None:
                raise RuntimeError(f"all {len(self._caches)} caches hold a turn in progress")
            cache = self._caches.pop(oldest)
        self._caches[session_id] = cache
        return cache

    def give_back(self, cache: Backend) -> None:
        """An emptied cache no session holds, for the next session that needs one."""
        self._spare.append(cache)

    # ------------------------------------------------------------------ turns

    def begin_turn(self, session_id: str) -> TurnState:
        if session_id in self._turns:
            raise RuntimeError(f"session {session_id} already has a turn in progress")
        turn = self._turns[session_id] = TurnState()
        return turn

    def end_turn(self, session_id: str) -> TurnState | None:
        return self._turns.pop(session_id, None)

    def turn(self, session_id: str) -> TurnState | None:
        return self._turns.get(session_id)

    @property
    def turning(self) -> frozenset[str]:
        """Sessions with a turn in progress (their caches and their state stay)."""
        return frozenset(self._turns)
