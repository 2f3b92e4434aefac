"""Measurement hooks a turn calls at fixed points, for what reads a turn from the inside
(serving.watch, benchmarks.blend): `Engine.observers`.

The turn does not depend on what an observer does: it calls the hooks and goes on. An observer
must not change the backend it is shown (it works on a fork) nor the session; `before_turn` may
run turns of other sessions (branches) through the engine.

Depends on backends (the protocol) and serving.session / turn.
"""

from __future__ import annotations

from backends import Backend
from serving.session import Session
from serving.turn import ChatRequest


class TurnObserver:
    """Every hook does nothing here: an observer overrides the ones it needs."""

    def before_turn(self, request: ChatRequest) -> None:
        """The request is parsed and its turn not started (its session not yet marked busy)."""

    def view_planned(self, session: Session, backend: Backend, restored: list[int], new_tokens: int,
                     opener: list[int]) -> None:
        """The turn's restores are in and placed, its answer's opening (`opener`, token ids) not yet
        prefilled, and nothing recomputed: the exact view the answer will be read from. `new_tokens`:
        the tokens this turn prefilled, the last held ones."""

    def answer_view(self, session: Session, backend: Backend, restored: list[int]) -> None:
        """The answer's opening is in (and the view recomputed as the blend chose): the cache the
        answer is decoded from. `restored`: the pages this turn brought back."""

    def answered(self, session: Session) -> None:
        """The answer is out (its final event sent); the turn may still read ahead."""
