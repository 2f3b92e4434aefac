"""What the model reads at the start of an answer: teacher-forced log-probabilities of candidate
answers over the exact cache it attends to, and a description of that view.

Why: greedy exact match from a 135M model is too coarse and too noisy to rank a serving change
(docs/proof.md: one arm moved by five of eight answers when four tokens of Pi's system prompt
changed). The log-probability of the right value, and its rank among every value planted in the
session, move smoothly with what the view holds, and the same scorer runs on every arm: on the
server's live cache after a turn's restores (`Engine.watch_answer`), and on reference views
prefilled afresh (benchmarks.answers).

Scoring runs on a fork of the backend, so the caller's cache, counters, pending token and logits
are untouched: a turn that is scored answers exactly as one that is not, and the server scores
after the answer is out (the fork is taken where the answer starts). The candidates' common
lead-in runs once and each remainder in one forward that returns every position's logits, so N
candidates cost N + 1 forwards (one token at a time, twelve sentence-shaped answers took about 60
forwards, five times as long). The fork's forwards are reported as `scoring_forward_tokens`,
never as the session's model forward tokens.

Depends on backends (the protocol), controller.pager (resident pages) and serving.paging (rewind).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from backends import Backend
from controller.pager import Pager
from serving.paging import rewind


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max()
    out: np.ndarray = z - np.log(np.exp(z).sum())
    return out


def continuation_logprobs(backend: Backend, candidates: list[list[int]]) -> tuple[list[float], int]:
    """log p(candidate | the backend's current view) for each candidate (token ids, non-empty),
    teacher-forced; and the number of tokens the scoring forwards took. The backend itself is
    not changed: the work runs on a fork. The candidates' common prefix goes through the model
    once; each remainder in one forward (`prefill_logits`), taken back out after it."""
    if not candidates or any(not c for c in candidates):
        raise ValueError("every candidate needs at least one token")
    fork = backend.fork()
    before = fork.counters.model_forward_tokens
    common = 0
    while all(len(c) > common + 1 and c[common] == candidates[0][common] for c in candidates):
        common += 1
    logp = log_softmax(backend.last_logits())
    shared = 0.0
    if common:
        steps = fork.prefill_logits(candidates[0][:common])
        for i, token in enumerate(candidates[0][:common]):
            shared += float(logp[token])
            logp = log_softmax(steps[i])
    snap = fork.snapshot_recurrent()
    held = fork.attention_tokens
    scores = []
    for candidate in candidates:
        rest = candidate[common:]
        total = shared + float(logp[rest[0]])
        if len(rest) > 1:
            steps = fork.prefill_logits(rest[:-1])
            total += sum(float(log_softmax(steps[i])[token]) for i, token in enumerate(rest[1:]))
            rewind(fork, held, snap)
        scores.append(total)
    return scores, fork.counters.model_forward_tokens - before


@dataclass(frozen=True)
class ViewReading:
    """One answer's view and how likely each candidate answer was from it.

    `view_ids` are the attended token ids in position order (what a perfect restore would have
    prefilled afresh); `view_spans` the transcript ranges they come from, in the same order;
    `pinned_spans` the pinned pages' ranges; `restored_pages` the pages this turn brought back;
    `transcript_ids` the whole session up to the answer (everything a full context would hold)."""

    turn: int
    candidates: list[str]
    logprobs: list[float]
    view_ids: list[int]
    view_positions: list[int]
    view_spans: list[tuple[int, int]]
    pinned_spans: list[tuple[int, int]]
    restored_pages: list[int]
    resident_pages: list[int]
    transcript_ids: list[int]
    scoring_forward_tokens: int
    scoring_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {"turn": self.turn, "candidates": self.candidates, "logprobs": [round(x, 5) for x in self.logprobs],
                "view_ids": self.view_ids, "view_positions": self.view_positions,
                "view_spans": [list(s) for s in self.view_spans], "pinned_spans": [list(s) for s in self.pinned_spans],
                "restored_pages": self.restored_pages, "resident_pages": self.resident_pages,
                "transcript_ids": self.transcript_ids, "scoring_forward_tokens": self.scoring_forward_tokens,
                "scoring_ms": round(self.scoring_ms, 1)}


@dataclass(frozen=True)
class ViewCapture:
    """The cache an answer starts from, kept on a fork (a copy, taken in about the time of one
    small memcpy) so the scoring can wait until the answer is out: a watched turn's first token
    comes as soon as an unwatched one's."""

    fork: Backend
    candidates: list[str]
    candidate_ids: list[list[int]]
    described: dict[str, Any]

    def read(self) -> ViewReading:
        started = time.perf_counter()
        logprobs, forwarded = continuation_logprobs(self.fork, self.candidate_ids)
        return ViewReading(candidates=self.candidates, logprobs=logprobs, scoring_forward_tokens=forwarded,
                           scoring_ms=(time.perf_counter() - started) * 1e3, **self.described)


def capture_view(backend: Backend, pager: Pager, transcript_ids: list[int], candidates: list[str],
                 candidate_ids: list[list[int]], restored: list[int]) -> ViewCapture:
    """Fork the backend at the start of an answer and describe its cache in transcript terms."""
    if not candidates or len(candidates) != len(candidate_ids) or any(not c for c in candidate_ids):
        raise ValueError("every candidate needs at least one token")
    resident = list(pager.resident)
    source = np.concatenate([np.arange(pager.pages[i].token_start, pager.pages[i].token_start + pager.pages[i].tokens)
                             for i in resident]) if resident else np.zeros(0, dtype=np.int64)
    held = backend.held_token_ids()
    ids = np.asarray(transcript_ids, dtype=np.int64)
    assert source.shape == held.shape and np.array_equal(ids[source], held), "the pager and the cache disagree"
    positions = backend.positions()
    order = np.argsort(positions, kind="stable")
    in_position = source[order]
    spans: list[tuple[int, int]] = []
    for t in in_position.tolist():
        if spans and spans[-1][1] == t:
            spans[-1] = (spans[-1][0], t + 1)
        else:
            spans.append((t, t + 1))
    pinned = [(pager.pages[i].token_start, pager.pages[i].token_start + pager.pages[i].tokens)
              for i in sorted(pager.pins)]
    described = {"turn": pager.turn, "view_ids": ids[in_position].tolist(),
                 "view_positions": positions[order].tolist(), "view_spans": spans, "pinned_spans": pinned,
                 "restored_pages": sorted(restored), "resident_pages": resident,
                 "transcript_ids": list(transcript_ids)}
    return ViewCapture(backend.fork(), list(candidates), candidate_ids, described)
