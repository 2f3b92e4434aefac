"""The campaign's sessions: each scenario's user turns (the last one is the probe), its engine
knobs and its tiny random-weight model, an edit of the client's own history if it has one, and
the client's request number i built from them.

The zygote's children look scenarios up by name, so every scenario is registered here at import.
Depends on serving.engine (EngineConfig).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serving.engine import EngineConfig

SYSTEM = "You are a coding agent. Be brief."
CRASH_ENV = "KV_ELISION_CRASH_AT"
IO_FAULT_ENV = "KV_ELISION_IO_FAULT"


def _user_turns(n: int, repeat: int) -> tuple[str, ...]:
    first = "Read the repository and take notes on every handler."
    files = tuple(f"File {i}: " + f"the handler {i} retries {i * 7} times and logs to queue {i % 3}. " * repeat
                  for i in range(n - 1))
    return (first, *files, "Which handler retries 7 times, and where does it log?")


@dataclass(frozen=True)
class Edit:
    """From request `at` on, the client sends user turn `turn` as `text` (the rest as it was): the
    session is cut back to that turn and everything after it is prefilled again."""

    at: int
    turn: int
    text: str


@dataclass(frozen=True)
class Scenario:
    """One session: the user's turns (the last is the probe), the engine's knobs, the model, and
    an edit of the client's history, if any."""

    name: str
    model: str
    users: tuple[str, ...]
    budget: int = 768
    tail: int = 128
    max_new: int = 6
    chunk: int = 128
    edit: Edit | None = None

    def engine_config(self) -> EngineConfig:
        return EngineConfig(budget_tokens=self.budget, tail_tokens=self.tail, max_new_tokens=self.max_new,
                            prefill_chunk=self.chunk)

    def users_at(self, request: int) -> tuple[str, ...]:
        """The user turns as request number `request` sends them."""
        edit = self.edit
        if edit is None or request < edit.at:
            return self.users
        return (*self.users[:edit.turn], edit.text, *self.users[edit.turn + 1:])


SCENARIOS = {
    # 7 requests; evictions from the third, restores chosen by the attention selector
    "llama": Scenario("llama", "tiny-llama", _user_turns(6, 14)),
    # the hybrid: recurrent snapshots written through and restored
    "hybrid": Scenario("hybrid", "tiny-qwen3-next", _user_turns(5, 14)),
}


# The llama session whose client edits its first message before the sixth request, keeping its
# token count: the session is cut back to its start and four files are prefilled again, the same
# tokens after another one, evicting regrown pages on the way (the history crash points).
SCENARIOS["llama-edit"] = Scenario("llama-edit", "tiny-llama", SCENARIOS["llama"].users, edit=Edit(
    5, 0, SCENARIOS["llama"].users[0].replace("notes", "Notes")))

for _n in range(4):  # module level: the zygote's children look scenarios up by name
    SCENARIOS[f"llama-s{_n}"] = Scenario(f"llama-s{_n}", "tiny-llama", tuple(
        f"Project {_n} ({'abcd'[_n] * (_n + 1)}): {u}" for u in SCENARIOS["llama"].users[:5]))


def session_scenarios(k: int) -> list[Scenario]:
    """`k` sessions of the llama scenario with their own text (a main agent and its subagents)."""
    return [SCENARIOS[f"llama-s{n}"] for n in range(k)]


def messages_for(users: Sequence[str], answers: dict[int, str], i: int) -> list[dict[str, Any]]:
    """The client's request number `i`: the system prompt, every user turn up to i, and the answer
    it kept for each earlier one."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for j in range(i):
        messages += [{"role": "user", "content": users[j]}, {"role": "assistant", "content": answers[j]}]
    return [*messages, {"role": "user", "content": users[i]}]
