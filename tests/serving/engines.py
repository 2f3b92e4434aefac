"""Shared by the engine tests: one turn run to its end (every event consumed, so a watched turn's
scoring runs too), and the store as a restarted server finds it."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from typing import Any

from serving.engine import ChatRequest, Engine, TurnResult
from serving.launcher import ContextdProcess


def turn(engine: Engine, session: str, messages: list[dict[str, Any]]) -> TurnResult:
    final = None
    for event in engine.chat(ChatRequest(session, list(messages))):
        final = event.final or final
    assert final is not None
    return final


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
