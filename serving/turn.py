"""What a turn takes and gives: the request the server parsed, and the events and result the
engine's turn streams back (serving.engine.Engine.chat).

Depends on backends (DecodeStep), controller.pager (Plan) and serving.session (SessionCounters).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from backends import DecodeStep
from controller.pager import Plan
from serving.session import SessionCounters


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
    received_ms: float = 0.0   # reading and parsing the request body (counted in the turn's overhead)


@dataclass(frozen=True)
class Prepared:
    """The prompt is in: how much was prefilled, and why cached state was not reused ("" if it was)."""

    prefilled_tokens: int
    rebuilt: str


class FinishReason(StrEnum):
    """Why an answer ended, as the OpenAI API names it (`finish_reason`)."""

    STOP = "stop"              # the model's end-of-turn token
    LENGTH = "length"          # max_tokens
    TOOL_CALLS = "tool_calls"  # the answer calls tools
    CANCELLED = "cancelled"    # the client went away; the cache holds what was picked


@dataclass
class TurnResult:
    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: FinishReason
    prompt_tokens: int           # tokens of the whole transcript as rendered
    prefilled_tokens: int        # tokens that went through the model for the prompt this turn
    completion_tokens: int
    counters: SessionCounters
    rebuilt: str = ""            # why cached state was not reused ("" when it was)
    sampled: str = ""            # why this turn was sampled instead of greedy


@dataclass(frozen=True)
class TurnEvent:
    """Streamed out of `Engine.chat`: one `prepared` once the prompt is in, text deltas, one `final`.
    An empty one (`pause`) comes between prefill chunks and before each decoded token: a point
    where another session's turn may run. One before a token carries the `decode` step it waits
    for: a caller may run it, together with other sessions' (`Engine.decode_batch`), and send the
    token in; one that sends nothing (plain iteration) has the turn run it itself."""

    delta: str = ""
    prepared: Prepared | None = None
    final: TurnResult | None = None
    decode: DecodeStep | None = None

    @property
    def pause(self) -> bool:
        return not (self.delta or self.prepared or self.final)
