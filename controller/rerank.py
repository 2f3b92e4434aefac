"""The re-ranking policy: of the pages the hybrid chose, keep those under which the turn's own
words are likely.

Query likelihood (UPR, Sachan et al. 2022): a page that holds what the turn is about makes the
turn's tokens more likely when it is the context. The host scores each candidate page on its own
(`SelectionContext.scorer`: the serving model reads the page's stored K/V, or a separate
controller model the page's text, then the turn's last `question_tokens` words, all candidates in
one forward) and this module decides from the scores:

  question   the turn's newest ids without the chat template's own (they follow any page alike),
             the last `question_tokens` of them;
  score      the mean log-probability of the question's tokens after the page;
  margin     keep every candidate whose score is within `margin` nats a token of the best: how many
             pages come back follows the scores, not a fixed count;
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
    margin: float = 2.0           # nats a token below the best score that a candidate may be and still come back

    def __post_init__(self) -> None:
        if self.candidates < 1:
            raise ValueError(f"candidates must be >= 1, got {self.candidates}")
        if self.question_tokens < 2:
            raise ValueError(f"question_tokens must be >= 2, got {self.question_tokens}")
        if not self.margin >= 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")


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


def mean_logprob(per_token: np.ndarray) -> float:
    return float(np.mean(per_token))
