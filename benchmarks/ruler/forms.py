"""The two deliveries of a sample, and its length in the served model's tokens.

RULER's form: one user message, the instruction, the text and the question at its end, as the
paper prompts a chat model. The agent's form: what a coding agent reading the text as files sends
a server: a system prompt and the schema of its `read` tool (harness.workload's), the
instruction as the first user message, then one turn per file (the agent's `read` call and the
file back as a tool result, about FILE_TOKENS tokens each), then the question as a user message.

A sample's length is its agent form rendered with the served model's chat template (the server's
own renderer, serving.chat_format) plus its answer cap, the longer of the two forms: the number of
filler units is fitted to it, so both forms fit the length (RULER's form is shorter by the files'
tool-call wrapping and the tool schemas, a few per cent).

Depends on serving.chat_format, harness.workload and the generator (tasks).
"""

from __future__ import annotations

import json
from typing import Any

from benchmarks.ruler.tasks import TASKS, Sample, make_sample
from harness.workload import TOOLS as AGENT_TOOLS
from serving.chat_format import ChatFormat

FILE_TOKENS = 1024
AGENT_SYSTEM = ("You are a careful coding agent. Read the files the user points you to with the read tool, then "
                "answer the user's questions about them exactly.")
THINKING = "default"
FORMS = ("ruler", "agent")
TOOLS = [t for t in AGENT_TOOLS if t["function"]["name"] == "read"]   # the one tool the agent uses


def ruler_messages(sample: Sample) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"{sample.instruction}\n\n{sample.context}\n\n{sample.question}"}]


class Splitter:
    """Cuts a sample's units into files of about FILE_TOKENS tokens, at unit boundaries (a needle
    is never cut), counting each distinct unit's tokens once."""

    def __init__(self, chat_format: ChatFormat) -> None:
        self.format = chat_format
        self.counted: dict[str, int] = {}

    def tokens(self, unit: str) -> int:
        if unit not in self.counted:
            self.counted[unit] = len(self.format.encode(unit))
        return self.counted[unit]

    def files(self, sample: Sample) -> list[str]:
        files: list[list[str]] = [[]]
        held = 0
        for unit in sample.units:
            if held >= FILE_TOKENS:
                files.append([])
                held = 0
            files[-1].append(unit)
            held += self.tokens(unit) + 1
        return [sample.separator.join(units) for units in files if units]


def file_path(n: int) -> str:
    return f"notes/part-{n + 1:03d}.txt"


def agent_opening(sample: Sample, files: int) -> list[dict[str, Any]]:
    where = f"{file_path(0)}" if files == 1 else f"{file_path(0)} to {file_path(files - 1)}"
    return [{"role": "system", "content": AGENT_SYSTEM},
            {"role": "user", "content": f"{sample.agent_instruction} The text is in {where}; read them in order."}]


def agent_read(n: int, text: str) -> list[dict[str, Any]]:
    """The messages one file adds: the agent's `read` call and the file as its result."""
    call = {"id": f"call_{n:03d}", "type": "function",
            "function": {"name": "read", "arguments": json.dumps({"path": file_path(n)})}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": text}]


def agent_question(sample: Sample) -> dict[str, Any]:
    return {"role": "user", "content": sample.question}


def agent_messages(sample: Sample, files: list[str]) -> list[dict[str, Any]]:
    """The agent's whole transcript up to the question."""
    out = agent_opening(sample, len(files))
    for n, text in enumerate(files):
        out += agent_read(n, text)
    return [*out, agent_question(sample)]


class Fitter:
    """Samples fitted to a length in one model's tokens."""

    def __init__(self, chat_format: ChatFormat, words: tuple[str, ...], seed: int) -> None:
        self.format = chat_format
        self.splitter = Splitter(chat_format)
        self.words = words
        self.seed = seed

    def prompt_tokens(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
        return len(self.format.encode(self.format.render(messages, tools, THINKING, {}).text))

    def agent_tokens(self, sample: Sample) -> int:
        return self.prompt_tokens(agent_messages(sample, self.splitter.files(sample)), TOOLS)

    def ruler_tokens(self, sample: Sample) -> int:
        return self.prompt_tokens(ruler_messages(sample), None)

    def fit(self, task: str, length: int, index: int) -> Sample:
        """The sample with the most filler whose agent form plus its answer cap is at most `length`
        tokens: a line through two measured sizes, then steps down."""
        target = length - TASKS[task].max_tokens

        def measure(count: int) -> tuple[Sample, int]:
            sample = make_sample(task, length, index, self.seed, self.words, count)
            return sample, self.agent_tokens(sample)

        low, high = 64, 256
        (_, a), (_, b) = measure(low), measure(high)
        per_unit = max((b - a) / (high - low), 0.5)
        count = max(1, int(low + (target - a) / per_unit))
        sample, tokens = measure(count)
        for _ in range(3):   # correct for the line's error, then step down until it fits
            if tokens <= target and target - tokens < 2 * per_unit + 16:
                break
            count = max(1, count + int((target - tokens) / per_unit) - 1)
            sample, tokens = measure(count)
        while tokens > target and count > 1:
            count = max(1, count - max(1, int((tokens - target) / per_unit)))
            sample, tokens = measure(count)
        if tokens > target:
            raise ValueError(f"{task} does not fit {length} tokens even with one filler unit ({tokens} tokens)")
        return sample
