"""Drive a scripted agent session through a running `kv-elision serve`, turn by turn.

`AgentRun` replays the workload of harness.workload over HTTP the way a coding agent would
(the server's replies go back into the transcript as the assistant's messages) and records the
server's per-turn figures from /v1/kv/stats. Used by `make demo`, the session benchmark and the
long-session test.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.workload import TOOLS, EvidenceFile, agent_turns, opening_messages
from serving.launcher import ServerProcess


@dataclass
class TurnRecord:
    turn: int
    session_tokens: int
    attention_tokens: int
    hot: int
    cold: int
    pinned: int
    prefilled: int
    restored_pages: int
    evicted_pages: int
    seconds: float
    answer: str
    counters: dict[str, int]


@dataclass
class AgentRun:
    server: ServerProcess
    session_id: str
    max_tokens: int = 16
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=opening_messages)
    tools: list[dict[str, Any]] | None = field(default_factory=lambda: TOOLS)  # None: a session without tools

    def ask(self, new_messages: list[dict[str, Any]], max_tokens: int | None = None) -> TurnRecord:
        self.messages.extend(new_messages)
        started = time.perf_counter()
        answer = self.server.chat(self.messages, session=self.session_id, tools=self.tools,
                                  max_tokens=max_tokens or self.max_tokens)
        elapsed = time.perf_counter() - started
        if answer.status != 200:
            raise RuntimeError(f"turn {len(self.turns)} failed with {answer.status}: {answer.body}")
        message = answer.body["choices"][0]["message"]
        reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        self.messages.append(reply)
        stats = self.server.stats(self.session_id)
        counters = stats["counters"]
        record = TurnRecord(turn=len(self.turns) + 1, session_tokens=stats["session_tokens"],
                            attention_tokens=stats["attention_tokens"], hot=stats["pages"]["hot"],
                            cold=stats["pages"]["cold"], pinned=stats["pages"]["pinned"],
                            prefilled=int(answer.headers["x-kv-prefilled-tokens"]),
                            restored_pages=counters["restored_pages_turn"],
                            evicted_pages=counters["evicted_pages_turn"], seconds=elapsed,
                            answer=str(reply["content"]), counters=counters)
        self.turns.append(record)
        return record

    def run(self, files: list[EvidenceFile], on_turn: Callable[[TurnRecord], None] | None = None,
            until_tokens: int | None = None) -> None:
        """The opening turn, then one turn per evidence file (until the session has `until_tokens`)."""
        first = self.ask([])
        if on_turn:
            on_turn(first)
        for added in agent_turns(files):
            record = self.ask(added)
            if on_turn:
                on_turn(record)
            if until_tokens and record.session_tokens >= until_tokens:
                return
