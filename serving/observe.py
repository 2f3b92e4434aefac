"""Measurement hooks a turn calls at fixed points, for benchmarks that read a turn from the inside.

The turn does not depend on what an observer does: it calls the hook and goes on. An observer must
not change the backend it is shown (it works on a fork) nor the session.

Depends on backends (the protocol) and serving.session.
"""

from __future__ import annotations

from typing import Protocol

from backends import Backend
from serving.session import Session


class TurnObserver(Protocol):
    def view_planned(self, session: Session, backend: Backend, restored: list[int], new_tokens: int,
                     opener: list[int]) -> None:
        """The turn's restores are in and placed, its answer's opening (`opener`, token ids) not yet
        prefilled, and nothing recomputed: the exact view the answer will be read from. `new_tokens`:
        the tokens this turn prefilled, the last held ones."""
