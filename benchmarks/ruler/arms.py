"""The arms a sample is played against, each a real server process, and what one answer read.

  kv-elision B      `kv-elision serve --budget B` as shipped (B = 2048, 4096): attention holds B
                    tokens whatever the sample's length; the rest is paged out and back
  full context      the same server and runtime with a budget above the sample (the model's trained
                    window), so nothing is ever evicted; samples past the window are not run
  llama.cpp         `llama-server -c WINDOW` (benchmarks.llamacpp, when it is built), the prompt
                    sent as the token ids our chat template renders, so it reads exactly what the
                    other arms read; samples past the window are not run

Per answer (`Reading`): the greedy answer and its time to first token (streamed), and for the
kv-elision servers (the full-context arm included) the likelihood of every candidate answer over
the exact cache the answer was read from (`POST /v1/kv/score` before the question's turn, `GET
/v1/kv/score` after it, as benchmarks.demo does) and whether each needle's tokens were in that
view (the reading's `view_spans`, transcript ranges in attention when the answer started).

Each sample is a session of its own, deleted from contextd once read (a 128k-token session holds
gigabytes of K/V on disk).

Depends on serving.launcher, serving.chat_format, contextd's client, benchmarks.llamacpp,
benchmarks.answers (token spans) and the generator's forms.
"""

from __future__ import annotations

import http.client
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import answers, llamacpp
from benchmarks.ruler.forms import (
    THINKING,
    TOOLS,
    Splitter,
    agent_opening,
    agent_question,
    agent_read,
    ruler_messages,
)
from benchmarks.ruler.tasks import Needle, Sample
from contextd.client import Client
from controller.links import FOLLOW_HOPS
from serving.chat_format import ChatFormat
from serving.launcher import ServerProcess

PAGE_TOKENS = 128
FULL = "full context"
LLAMA = "llama.cpp full context"
# Trained context per model (GGUF `*.context_length`): the full-context arms stop there.
WINDOWS = {"smollm2-135m": 8192, "gemma3-270m": 32768}
GGUF = {"smollm2-135m": "smollm2_gguf_path", "gemma3-270m": "gemma3_gguf_path"}
# What the server says when a reply the client left out is text that comes again in the new
# messages (a reply "The" before a file that holds "The"): serving.transcript's recomputed_tokens
# matches dropped segments by text, so a one-token reply can count as prefilled again. The agent's
# form checks instead that no more tokens than those replies were prefilled twice.
DROPPED_REPLY = "answers the client did not replay were dropped; the state before them was prefilled again"


@dataclass
class Reading:
    """What one answer read and said."""

    answer: str
    ttft_ms: float
    prompt_tokens: int
    logprobs: list[float] | None = None          # per candidate, over the answer's own cache
    in_view: list[bool] | None = None            # per listed needle
    counters: dict[str, int] = field(default_factory=dict)


def listed_needles(sample: Sample) -> list[Needle]:
    """The needles reported one by one: those asked for, and the distractors whose values are
    scored (a haystack made of needles holds thousands)."""
    scored = set(sample.candidates)
    return [n for n in sample.needles if n.target or n.value in scored]


def needle_spans(ids: list[int], texts: list[str], decode: Any) -> list[tuple[int, int] | None]:
    """[start, end) in `ids` of each text's first occurrence: every window of two pages decoded once
    (a needle is shorter than a page, so one window holds it whole), then the span found in it."""
    spans: list[tuple[int, int] | None] = [None] * len(texts)
    for start in range(0, max(len(ids) - PAGE_TOKENS, 1), PAGE_TOKENS):
        window = ids[start:start + 2 * PAGE_TOKENS]
        text = decode(window)
        for i, needle in enumerate(texts):
            if spans[i] is None and needle in text:
                found = answers.find_span(window, needle, decode)
                if found is not None:
                    spans[i] = (start + found[0], start + found[1])
        if all(s is not None for s in spans):
            break
    return spans


def covered(span: tuple[int, int] | None, view: list[list[int]]) -> bool:
    """Whether every token of `span` is in one of the view's transcript ranges."""
    if span is None:
        return False
    held = sorted((a, b) for a, b in view)
    at = span[0]
    for a, b in held:
        if a <= at < b:
            at = b
        if at >= span[1]:
            return True
    return False


def read_stream(conn: http.client.HTTPConnection, response: http.client.HTTPResponse, sent: float,
                text_of: Any) -> tuple[str, float, dict[str, Any]]:
    """(answer, ms to its first text, the last event) of a server-sent event stream."""
    answer, first, last = "", None, {}
    try:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"the answer failed: {event['error']}")
            piece = text_of(event)
            if piece and first is None:
                first = time.perf_counter()
            answer += piece
            last = event
    finally:
        conn.close()
    return answer, ((first or time.perf_counter()) - sent) * 1e3, last


class Arm:
    """One arm on one model: `start`, `play` each sample in each form, `stop`."""

    key = ""
    window: int | None = None   # the longest sample the arm runs (None: any)

    def start(self) -> None: ...
    def stop(self) -> None: ...

    def runs(self, length: int) -> bool:
        return self.window is None or length <= self.window

    def play(self, sample: Sample, form: str, session: str) -> Reading:
        raise NotImplementedError


class KvArm(Arm):
    """`kv-elision serve` with `budget`: as shipped, or (`full`) a budget the sample never fills."""

    def __init__(self, model: str, budget: int, work: Path, chat_format: ChatFormat, splitter: Splitter,
                 full: bool = False, links: bool = False) -> None:
        self.model = model
        self.budget = budget
        self.key = FULL if full else f"kv-elision {budget}" + (" + links" if links else "")
        self.extra = ("--follow-hops", str(FOLLOW_HOPS)) if links else ()
        self.window = WINDOWS[model] if full else None
        self.root = work / f"{model}-{'full' if full else budget}{'-links' if links else ''}"
        self.format = chat_format
        self.splitter = splitter
        self.server: ServerProcess | None = None

    def start(self) -> None:
        self.server = ServerProcess(root=self.root, model=self.model, budget=self.budget,
                                    extra=self.extra).start(timeout=900)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _turn(self, messages: list[dict[str, Any]], session: str, max_tokens: int, agent: bool
              ) -> tuple[str, float, dict[str, Any]]:
        """One streamed turn: (answer, ms to its first text, the last event, with the counters)."""
        assert self.server is not None
        tools = {"tools": TOOLS} if agent else {}
        sent = time.perf_counter()
        streamed = self.server.stream(messages, session=session, max_tokens=max_tokens, **tools)
        if streamed.status != 200:
            streamed.conn.close()
            raise RuntimeError(f"session {session}: {streamed.status} {streamed.error}")
        rebuilt = streamed.headers.get("x-kv-rebuilt")
        if rebuilt is not None and not (agent and rebuilt == DROPPED_REPLY):
            streamed.conn.close()
            raise RuntimeError(f"session {session} was rebuilt: {rebuilt}")
        return read_stream(streamed.conn, streamed.response, sent,
                           lambda e: "".join(c["delta"].get("content") or "" for c in e.get("choices", [])))

    def play(self, sample: Sample, form: str, session: str) -> Reading:
        assert self.server is not None
        agent = form == "agent"
        replies = 0
        if agent:   # one turn per file; the model's one-token reply is left out of the next request
            files = self.splitter.files(sample)
            replies = len(files)
            messages = agent_opening(sample, len(files))
            for n, text in enumerate(files):
                messages += agent_read(n, text)
                self._turn(messages, session, 1, agent)
            messages.append(agent_question(sample))
        else:
            messages = ruler_messages(sample)
        watch = self.server.request("POST", "/v1/kv/score", {"session": session, "candidates": [
            sample.scored(v) for v in sample.candidates]}, timeout=60.0)
        if watch.status != 202:
            raise RuntimeError(f"the server would not score the answer: {watch.status} {watch.body}")
        answer, ttft, last = self._turn(messages, session, sample.max_tokens, agent)
        reading = self.server.request("GET", f"/v1/kv/score?session={session}", timeout=600.0)
        if reading.status != 200:
            raise RuntimeError(f"no reading of the answer: {reading.status} {reading.body}")
        body: dict[str, Any] = reading.body
        spans = needle_spans(body["transcript_ids"], [n.text for n in listed_needles(sample)], self.format.decode)
        counters = last.get("kv", {})
        if counters.get("reprefilled_tokens", 0) > replies:
            raise RuntimeError(f"session {session} prefilled {counters['reprefilled_tokens']} tokens again "
                               f"(only the {replies} one-token replies left out may count)")
        with Client(self.server.socket) as client:
            client.delete_session(session)
        return Reading(answer, ttft, len(body["transcript_ids"]), body["logprobs"],
                       [covered(s, body["view_spans"]) for s in spans],
                       {k: counters[k] for k in ("restored_pages", "evicted_pages", "rebuilds", "tail_drops",
                                                 "reprefilled_tokens", "new_prefill_tokens", "model_forward_tokens")
                        if k in counters})


class LlamaArm(Arm):
    """llama.cpp's server holding the model's whole window; prompts go to `/completion` as the
    token ids our chat template renders (the same text every arm reads; the GGUF of Gemma 3 270M
    carries no chat template for llama.cpp to apply)."""

    key = LLAMA

    def __init__(self, model: str, binary: Path, work: Path, chat_format: ChatFormat, splitter: Splitter) -> None:
        from backends import models

        self.model = model
        self.ctx = self.window = WINDOWS[model]
        self.gguf = Path(getattr(models, GGUF[model])())
        self.binary = binary
        self.root = work / f"{model}-llama"
        self.format = chat_format
        self.splitter = splitter
        self.server: llamacpp.LlamaServer | None = None

    def start(self) -> None:
        self.server = llamacpp.LlamaServer(self.binary, self.gguf, self.ctx, self.root, alias=self.model).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def _complete(self, ids: list[int], max_tokens: int) -> tuple[str, float]:
        assert self.server is not None
        conn = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=3600)
        sent = time.perf_counter()
        conn.request("POST", "/completion", json.dumps({
            "prompt": ids, "n_predict": max_tokens, "stream": True, "cache_prompt": True, "temperature": 0,
            "top_k": 1}), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            body = response.read().decode(errors="replace")
            conn.close()
            raise RuntimeError(f"llama-server answered {response.status}: {body[:500]}")
        answer, ttft, _ = read_stream(conn, response, sent, lambda e: str(e.get("content") or ""))
        return answer, ttft

    def _ids(self, messages: list[dict[str, Any]], agent: bool) -> list[int]:
        return self.format.encode(self.format.render(messages, TOOLS if agent else None, THINKING, {}).text)

    def play(self, sample: Sample, form: str, session: str) -> Reading:
        agent = form == "agent"
        if agent:
            files = self.splitter.files(sample)
            messages = agent_opening(sample, len(files))
            for n, text in enumerate(files):
                messages += agent_read(n, text)
                self._complete(self._ids(messages, agent), 1)
            messages.append(agent_question(sample))
        else:
            messages = ruler_messages(sample)
        ids = self._ids(messages, agent)
        answer, ttft = self._complete(ids, sample.max_tokens)
        return Reading(answer, ttft, len(ids))
