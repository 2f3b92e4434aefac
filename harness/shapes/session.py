"""What a shape's generator returns: the session's files and questions, and how it reads as chat.

A `Workload` is a coding agent's session: an opening (system prompt, tool schemas, objective),
then one turn per file (the assistant calls `read`, the tool answers with the file's text, the
user asks for a note), and the questions about facts planted in files read long before. A
`Question` carries its text, the expected answer (exact value or code, checkable by substring)
and the evidence: exact substrings of the session whose pages hold the text the answer needs.
The benchmarks and tests that play a workload import these types, `approx_tokens` and
`DEFAULT_TOKENS` from here; none of them needs to know how a workload is built.

Dependency rules: the standard library and harness.workload (the tool schemas a session offers);
nothing else of harness.shapes, which all builds on this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from harness.workload import TOOLS

LANGUAGES = ("en", "es", "ja", "ar", "ru")
DEFAULT_TOKENS = 16000

SYSTEM_PROMPT = ("You are a careful coding agent working in a repository. Read the files the user points you to, "
                 "remember what they state, and answer questions about them exactly.")
OBJECTIVE = ("Objective: read the files I point you to one by one and note what matters. At the end I will ask "
             "about specific settings, values and code from them; answer with the exact value.")


@dataclass(frozen=True)
class Question:
    """A question about planted facts, with what answers it and where the answer lives."""

    text: str
    answer: str                      # the expected answer (exact value or code; substring-checkable)
    evidence: tuple[str, ...]        # exact substrings of the session whose pages hold what is needed
    answer_parts: tuple[str, ...]    # what must appear in a reply; answer_parts[i] is inside evidence[i]
    language: str                    # language of the fact (the first evidence's, for split)
    kind: str                        # what is asked: "passphrase", "constant", "behaviour", ...


@dataclass(frozen=True)
class SourceFile:
    path: str
    text: str
    language: str


@dataclass(frozen=True)
class Workload:
    shape: str
    seed: int
    files: tuple[SourceFile, ...]
    questions: tuple[Question, ...]
    objective: str = OBJECTIVE
    system: str = SYSTEM_PROMPT
    tools: list[dict[str, Any]] = field(default_factory=lambda: TOOLS)

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.objective}]

    def turns(self) -> list[list[dict[str, Any]]]:
        """The messages each turn adds: a `read` tool call, its result, a short request."""
        out: list[list[dict[str, Any]]] = []
        for n, file in enumerate(self.files):
            call: dict[str, Any] = {"id": f"call_{n:03d}", "type": "function",
                    "function": {"name": "read", "arguments": json.dumps({"path": file.path})}}
            out.append([{"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": file.text},
                        {"role": "user", "content": f"Note what matters in {file.path} in one sentence."}])
        return out

    def messages(self) -> list[dict[str, Any]]:
        return [*self.opening(), *(m for turn in self.turns() for m in turn)]

    def question_message(self, question: Question) -> dict[str, Any]:
        return {"role": "user", "content": question.text}

    def text(self) -> str:
        """Every message's content and tool call, joined: what evidence strings are substrings of."""
        parts = [self.system, json.dumps(self.tools), self.objective]
        for m in self.messages()[2:]:
            parts.append(str(m.get("content") or ""))
            parts.extend(json.dumps(c) for c in m.get("tool_calls", []))
        return "\n".join(parts)


def approx_tokens(text: str) -> int:
    """SmolLM2 tokens, roughly: ~4 characters a token for Latin script, ~1.2 tokens a character
    for Cyrillic and Arabic, ~1.8 for Japanese."""
    n = 0.0
    for ch in text:
        o = ord(ch)
        if o < 0x250:
            n += 0.26
        elif 0x400 <= o < 0x530:
            n += 0.8
        elif 0x600 <= o < 0x700:
            n += 0.85
        elif o >= 0x3000:
            n += 1.8
        else:
            n += 1.0
    return int(n) + 1

