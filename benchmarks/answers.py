"""Answers measured by likelihood: reference views, one scorer for every arm, and the statistics.

A question's answer is scored over a view: the token ids the model attends to when it starts the
answer. For kv-elision that is the server's own cache after the turn's restores (the server
scores it, `POST /v1/kv/score`, serving.likelihood); every other view is prefilled afresh here
by the same runtime and the same weights, and scored by the same function
(`serving.likelihood.continuation_logprobs`). Per question: the teacher-forced log-probability
of the right value, and its rank among every value planted in the session (a tie counts against
it); `recall_at_1` is the share ranked first. Greedy exact match is kept beside it.

Reference views, derived from the served session's own transcript at each question (so every
arm reads the same history, answers included, and differences are the view's alone):
  full      everything up to the answer (the whole session in attention)
  fresh     the served view's tokens, in its position order, prefilled afresh at contiguous
            positions: what a perfect restore would give
  recency   the pinned pages plus the most recent tokens, as many as the served view holds:
            what the server holds with no relevance restores
  removed   the served view without the pages that hold the fact: what the model can guess

Intervals are 95 % percentile bootstraps over sessions (a session's questions share its
history, so they are not independent draws).

Depends on backends, serving.likelihood and serving.transcript.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from statistics import fmean
from typing import Any

import torch

from backends import Backend, load_backend
from serving.chat_format import ChatFormat
from serving.likelihood import continuation_logprobs
from serving.paging import rewind

PAGE_TOKENS = 128
BOOTSTRAP_DRAWS = 2000


@dataclass(frozen=True)
class Scored:
    """One question of one session in one arm."""

    arm: str
    role: str
    seed: int
    session: str
    question: int
    code: str
    logprob: float
    rank: int
    candidates: int
    correct: bool
    view_tokens: int


def rank_of(logprobs: list[float], right: int) -> int:
    """1 + the candidates at least as likely as the right one (ties count against it)."""
    return 1 + sum(1 for i, lp in enumerate(logprobs) if i != right and lp >= logprobs[right])


def find_span(ids: list[int], needle: str, decode: Any) -> tuple[int, int] | None:
    """[start, end) of the shortest token run holding the first occurrence of `needle`."""
    if needle not in decode(ids):
        return None
    lo, hi = 1, len(ids)
    while lo < hi:                        # the shortest prefix whose text holds it
        mid = (lo + hi) // 2
        if needle in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    start = lo - 1
    while start > 0 and needle not in decode(ids[start:lo]):
        start -= 1
    return start, lo


def fact_pages(span: tuple[int, int]) -> set[int]:
    return set(range(span[0] // PAGE_TOKENS, (span[1] - 1) // PAGE_TOKENS + 1))


def reference_views(reading: dict[str, Any], fact_span: tuple[int, int] | None) -> dict[str, list[int]]:
    """The four reference views of one served question (module docstring)."""
    ids: list[int] = reading["transcript_ids"]
    order = [t for start, end in reading["view_spans"] for t in range(start, end)]
    pages = fact_pages(fact_span) if fact_span is not None else set()
    removed = [ids[t] for t in order if t // PAGE_TOKENS not in pages]
    pinned = {t for start, end in reading["pinned_spans"] for t in range(start, end)}
    room = max(0, len(order) - len(pinned))
    recent = {t for t in range(max(0, len(ids) - room), len(ids))}
    recency = [ids[t] for t in sorted(pinned | recent)]
    return {"full": list(ids), "fresh": list(reading["view_ids"]), "recency": recency, "removed": removed}


class ViewScorer:
    """Prefills views afresh and scores candidates over them. Consecutive views that share a
    prefix reuse it (attention-only models): the full-context view of question k extends that
    of question k-1, and every view starts with the pinned system prompt."""

    def __init__(self, model: str, chat_format: ChatFormat | None = None, capacity: int = 8448,
                 backend: Backend | None = None) -> None:
        # One thread: the scorer runs beside other processes (Pi, a finished arm's servers going
        # down), and two torch threads on two shared cores waited on each other up to 5x longer
        # than one thread took alone (a 1,000-token prefill: 21.6 s against 4.4 s).
        torch.set_num_threads(1)
        self.backend = backend or load_backend("torch", model, capacity=capacity)
        self.format = chat_format or ChatFormat(self.backend.tokenizer)
        self.held: list[int] = []
        self.prefilled_tokens = 0

    def sibling(self) -> ViewScorer:
        """Another scorer on the same weights with a view of its own: one per kind of view, so
        each keeps the prefix its next view extends (a full context of 6,000 tokens re-prefilled
        for every question took most of a first run's time)."""
        backend = self.backend.fork()
        rewind(backend, 0)
        return ViewScorer("", self.format, backend=backend)

    def _view(self, ids: list[int]) -> None:
        """Make the backend hold exactly `ids` at positions 0..n-1, with the last token's logits."""
        b = self.backend
        keep = 0
        if not b.is_hybrid:
            limit = min(len(self.held), len(ids) - 1)
            while keep < limit and self.held[keep] == ids[keep]:
                keep += 1
        if keep < b.attention_tokens:
            rewind(b, keep)
        b.prefill(ids[keep:])
        self.prefilled_tokens += len(ids) - keep
        self.held = list(ids)

    def score(self, ids: list[int], candidates: list[list[int]]) -> list[float]:
        self._view(ids)
        logprobs, _ = continuation_logprobs(self.backend, candidates)
        return logprobs

    def greedy(self, ids: list[int], max_new: int) -> str:
        """The greedy answer from the view; the view is held again afterwards, minus its last
        token (so the next view re-prefills at least one token and has fresh logits)."""
        self._view(ids)
        b = self.backend
        out: list[int] = []
        token = b.decode()
        while token not in self.format.stop_ids and len(out) < max_new:
            out.append(token)
            token = b.decode(token)
        if b.is_hybrid:
            self.held = []
        else:
            rewind(b, len(ids) - 1)
            self.held = ids[:-1]
        return self.format.decode(out)


def bootstrap_ci(by_session: dict[str, list[float]], seed: int = 0) -> list[float] | None:
    """95 % percentile interval of the mean over questions, resampling whole sessions."""
    groups = [v for v in by_session.values() if v]
    if not groups:
        return None
    rng = random.Random(seed)
    means = []
    for _ in range(BOOTSTRAP_DRAWS):
        draw = [x for _ in groups for x in rng.choice(groups)]
        means.append(fmean(draw))
    means.sort()
    return [round(means[int(0.025 * (len(means) - 1))], 4), round(means[int(0.975 * (len(means) - 1))], 4)]


def summarize(scored: list[Scored]) -> dict[str, Any]:
    """recall_at_1, answer log-probability, greedy correct count, with 95 % intervals."""
    if not scored:
        return {"questions": 0, "sessions": 0, "seeds": []}
    hits: dict[str, list[float]] = {}
    logps: dict[str, list[float]] = {}
    for s in scored:
        key = f"{s.seed}/{s.session}"
        hits.setdefault(key, []).append(float(s.rank == 1))
        logps.setdefault(key, []).append(s.logprob)
    return {"recall_at_1": round(fmean(float(s.rank == 1) for s in scored), 4), "recall_ci95": bootstrap_ci(hits),
            "answer_logprob_mean": round(fmean(s.logprob for s in scored), 4), "logprob_ci95": bootstrap_ci(logps),
            "mean_rank": round(fmean(s.rank for s in scored), 3),
            "correct": sum(s.correct for s in scored), "questions": len(scored), "sessions": len(hits),
            "seeds": sorted({s.seed for s in scored}),
            "view_tokens_mean": round(fmean(s.view_tokens for s in scored), 1)}


def paired(scored: list[Scored], base: str, other: str, tuning_seeds: set[int]) -> dict[str, Any]:
    """`other` minus `base` on the same held-out questions: recall@1 and answer log p, with 95 %
    intervals from resampling whole sessions, and the questions each ranks first alone."""
    mine = {(s.seed, s.session, s.question): s for s in scored if s.arm == base and s.seed not in tuning_seeds}
    pairs = [(mine[k], s) for s in scored if s.arm == other and (k := (s.seed, s.session, s.question)) in mine]
    if not pairs:
        return {"questions": 0}
    hits: dict[str, list[float]] = {}
    logps: dict[str, list[float]] = {}
    for a, b in pairs:
        key = f"{a.seed}/{a.session}"
        hits.setdefault(key, []).append(float(b.rank == 1) - float(a.rank == 1))
        logps.setdefault(key, []).append(b.logprob - a.logprob)
    return {"questions": len(pairs), "sessions": len(hits),
            "recall_at_1_diff": round(fmean(x for v in hits.values() for x in v), 4),
            "recall_diff_ci95": bootstrap_ci(hits),
            "logprob_diff": round(fmean(x for v in logps.values() for x in v), 4),
            "logprob_diff_ci95": bootstrap_ci(logps),
            "gained": sum(b.rank == 1 and a.rank != 1 for a, b in pairs),
            "lost": sum(a.rank == 1 and b.rank != 1 for a, b in pairs)}


def arm_summaries(scored: list[Scored], tuning_seeds: set[int]) -> dict[str, dict[str, Any]]:
    """Per arm: its role, and the held-out and tuning seeds apart."""
    out: dict[str, dict[str, Any]] = {}
    for arm in dict.fromkeys(s.arm for s in scored):
        mine = [s for s in scored if s.arm == arm]
        out[arm] = {"role": mine[0].role,
                    "held_out": summarize([s for s in mine if s.seed not in tuning_seeds]),
                    "tuning": summarize([s for s in mine if s.seed in tuning_seeds])}
    return out
