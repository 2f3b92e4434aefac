"""The re-ranking policy: of the pages the hybrid chose, keep those under which the turn's own
words are likely.

Query likelihood (UPR, Sachan et al. 2022): a page that holds what the turn is about makes the
turn's tokens more likely when it is the context. The host scores each candidate page on its own
(`SelectionContext.scorer`: the serving model reads the page's stored K/V, or a separate
controller model the page's text, then the turn's last `question_tokens` words, all candidates in
one forward) and this module decides from the scores:

  question   the turn's newest ids without the chat template's own (they follow any page alike),
             the last `question_tokens` of them;
  score      the mean log-probability of the question's tokens read as the next user turn after
             the page (the host puts the chat template's user opening between them; straight after
             the page, a 135M model continues the page's last line, and seed 109's near-duplicate
             question went to a page ending with the same sentence about another service), each
             token's counted at no less than -`floor` nats: one word a page makes very likely or very
             unlikely does not outweigh the rest. Without it the near-duplicate miss of seed 103
             (an English question, the fact written in Spanish) went to the page that shared the
             question's wording ("connection timeout", -8.7 and -17.0 nats on the fact's page)
             over the page that continued it with the name (-0.1 against -3.9);
  margin     keep every candidate whose score is within `margin` nats a token of the best: how many
             pages come back follows the scores, not a fixed count. The floor narrows the scores'
             spread, so the margin is 1.0 with it (2.0 gave back all the precision it gained on
             tuning seeds 1 and 2);
  lead       a scored candidate whose BM25 is at least `lead` times every other scored one's is
             kept whatever its likelihood: the model breaks lexical ties, it does not overrule a
             decisive match, where its disagreement is more likely a small model's bias (it
             continues the line it has just read: seed 109's near-duplicate miss, a page ending
             with the question's own wording about another service) than evidence. A guard: on
             278 questions of the tuning seeds (and four shapes of seed 109) the re-ranker never
             dropped a candidate that led by 2x, and that miss (a lead of 1.45x) is not fixed by it;
  unscored   the hybrid's groups past the first `candidates` are not scored and come back as the
             hybrid chose them: a re-ranker drops only what it read. Dropping them lost the needed
             page on the config shape, where a worker's config file is often the hybrid's fifth
             group (tuning seed 1, budget 2,048: 8 of 10 hits against the hybrid's 10, and 10 of
             10 with them kept; docs/controller.md).

The figures behind each default are in docs/controller.md (benchmarks.selectors).
Depends on numpy only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RerankConfig:
    candidates: int = 2           # the hybrid's first page groups that are scored (the rest come back unscored)
    question_tokens: int = 12     # the turn's newest non-template tokens that are scored
    margin: float = 1.0           # nats a token below the best score that a candidate may be and still come back
    floor: float = 4.0            # nats: a question token's log p counts as no less than -floor (inf: no floor)
    lead: float = 2.0             # BM25 this many times every other scored candidate's keeps one (inf: never)

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {self.candidates}")
        if self.question_tokens < 2:
            raise ValueError(f"question_tokens must be >= 2, got {self.question_tokens}")
        if not self.margin >= 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        if not self.floor > 0:
            raise ValueError(f"floor must be > 0 (inf for none), got {self.floor}")
        if not self.lead > 1:
            raise ValueError(f"lead must be > 1 (inf for none), got {self.lead}")


def question_ids(incoming: Sequence[int], template_ids: Collection[int], tokens: int) -> list[int]:
    """The last `tokens` of the turn's ids that are not the chat template's."""
    template = set(template_ids)
    return [int(t) for t in incoming if int(t) not in template][-tokens:]


def keep_by_margin(scores: dict[int, float], margin: float) -> list[int]:
    """The candidates within `margin` of the best score, best first (ties: as given)."""
    if not scores:
        return []
    best = max(scores.values())
    kept = [page for page, score in scores.items() if score >= best - margin]
    return sorted(kept, key=lambda page: -scores[page])


def lexical_leader(bm25: dict[int, float], lead: float) -> int | None:
    """The candidate whose BM25 is positive and at least `lead` times every other candidate's, if
    one is (of candidates that all matched nothing, none leads)."""
    if len(bm25) < 2:
        return None
    best = max(bm25, key=lambda page: bm25[page])
    rest = max(score for page, score in bm25.items() if page != best)
    return best if bm25[best] > 0 and bm25[best] >= lead * rest else None


def mean_logprob(per_token: np.ndarray, floor: float = float("inf")) -> float:
    """The mean of the tokens' log-probabilities, each counted as no less than -`floor`."""
    return float(np.mean(np.maximum(per_token, -floor)))
