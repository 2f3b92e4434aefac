"""Shared by the engine tests: one turn run to its end (every event consumed, so a watched turn's
scoring runs too), one eviction checked against the eviction advice, and the store as a restarted
server finds it."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

from serving.engine import Engine
from serving.launcher import ContextdProcess
from serving.session import Session
from serving.turn import ChatRequest, TurnResult


def turn(engine: Engine, session: str, messages: list[dict[str, Any]]) -> TurnResult:
    final = None
    for event in engine.chat(ChatRequest(session, list(messages))):
        final = event.final or final
    assert final is not None
    return final


AGENT_SYSTEM = {"role": "system", "content": "You are a coding agent. Be brief."}


def file_turn(n: int) -> list[dict[str, object]]:
    """A tool loop's turn: the assistant reads a file, the tool answers (no user message)."""
    call = {"id": f"call_{n}", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "f{n}.py"}}'}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": f"# f{n}.py\n" + f"value_{n} = {n * 7}\n" * 40}]


def evicts_the_least_scored_of_the_window(engine: Engine, session: Session) -> None:
    """One eviction, made the way a prefill chunk makes room: of the session's eviction order's
    window (the likelihood advice's or the attention order's), exactly the least scored pages
    leave, and not the ones the pager's own order would have taken."""
    order = session.eviction or session.attention
    assert order is not None
    pager = session.pager
    incoming = pager.config.high_tokens - pager.hot_tokens + 1
    window = pager.evictable()[:order.config.window]
    need = pager.pages_to_free(incoming, window)
    assert 0 < need < len(window)
    engine.mover.make_room(session, incoming)
    evicted = [p for p in window if not pager.pages[p].resident]
    # The advice orders only a window it scored whole; the attention order reads unscored as 0.
    least = sorted(window, key=lambda p: order.scores[p] if session.eviction else order.scores.get(p, 0.0))[:need]
    assert set(evicted) == set(least)
    assert evicted != window[:need], "the scores happened to agree with the pager's own order"


@contextlib.contextmanager
def restarted_copy(contextd: ContextdProcess) -> Iterator[ContextdProcess]:
    """A copy of the daemon's root, served by a second daemon; the first runs on beside it."""
    contextd.stop()
    copy = ContextdProcess(contextd.root.parent / "copy", contextd.root.parent / "copy.sock",
                           extra=["--reserve-bytes", "0"])
    shutil.copytree(contextd.root, copy.root)
    contextd.start()
    copy.start()
    try:
        yield copy
    finally:
        copy.stop()
