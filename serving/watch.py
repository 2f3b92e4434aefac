"""Which sessions' next answers are to be read, and what the last watched answers read: the
measurement that benchmarks.answers and the `/v1/kv/score` route ask of a turn.

A caller names the candidate answers (and, optionally, selectors to answer in branches) before a
session's turn; the turn takes them once its answer's view is in (serving.likelihood) and
publishes the reading after the answer is out. One owner for all of it; a session that leaves
the server's memory (serving.session_table) is forgotten here too.

Depends on controller.selectors and serving.likelihood.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from controller.selectors import Selector
from serving.likelihood import ViewReading

# The most candidate answers one watched turn scores (each costs a few one-token forwards).
MAX_WATCHED_CANDIDATES = 64


@dataclass
class _Watched:
    candidates: list[str] | None = None      # to score at the session's next turn
    branches: list[Selector] = field(default_factory=list)   # selectors to answer in branches first
    reading: ViewReading | None = None       # what the last watched turn's answer read
    branch_readings: dict[str, ViewReading] = field(default_factory=dict)   # selector -> its branch's


class AnswerWatch:
    """Per session: what to read at its next turn, and what its last watched turn read."""

    def __init__(self) -> None:
        self._sessions: dict[str, _Watched] = {}

    def watch(self, session_id: str, candidates: list[str], branches: Sequence[Selector] = ()) -> None:
        if not 0 < len(candidates) <= MAX_WATCHED_CANDIDATES or not all(c.strip() for c in candidates):
            raise ValueError(f"give 1 to {MAX_WATCHED_CANDIDATES} non-blank candidate answers")
        watched = self._sessions.setdefault(session_id, _Watched())
        watched.candidates, watched.branches = list(candidates), list(branches)

    def candidates(self, session_id: str) -> list[str] | None:
        """The candidates asked for at `session_id`'s next turn (None: not watched)."""
        watched = self._sessions.get(session_id)
        return watched.candidates if watched is not None else None

    def take_branches(self, session_id: str) -> list[Selector]:
        """The selectors to answer in branches before this turn, asked once."""
        watched = self._sessions.get(session_id)
        if watched is None:
            return []
        branches, watched.branches = watched.branches, []
        return branches

    def take_candidates(self, session_id: str) -> list[str] | None:
        """The candidates to score in this turn's answer view, asked once; the last reading goes."""
        watched = self._sessions.get(session_id)
        if watched is None or watched.candidates is None:
            return None
        candidates, watched.candidates, watched.reading = watched.candidates, None, None
        return candidates

    def publish(self, session_id: str, reading: ViewReading, branch_readings: dict[str, ViewReading]) -> None:
        watched = self._sessions.setdefault(session_id, _Watched())
        watched.reading, watched.branch_readings = reading, dict(branch_readings)

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

    def forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
