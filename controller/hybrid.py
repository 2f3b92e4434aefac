"""The hybrid selector's policy: which cold pages to restore, given each page's evidence.

Evidence is a matrix [candidate pages, query terms]: each term's BM25 share in each page
(controller.lexical), optionally followed by the key index's per-token matches (`KeyIndex.evidence`).

  shortlist  only the `shortlist_pages` pages with the highest BM25 are weighed further: the rest
             could not be chosen before them (a page's coverage gain never exceeds its score) and
             a decision stays a few milliseconds however long the session.
  coverage   greedy: each next page is the one that adds the most evidence, a term already covered
             by k chosen pages counting decay**k: after the page naming the service, the next pick
             is the page that holds what the first lacks (the port after the host), not a second
             copy of the same boilerplate.
  cutoff     stop when a page would add under `cutoff` of the first page's gain: how many pages
             come back depends on the evidence, not on a fixed count (at most `max_pages`, and
             never more than the room under the low watermark).
  floor      nothing comes back when the first page adds under `min_gain`: every term it shares
             with the question is then held by most candidate pages (a common word of the
             session: with idf cubed, a term in half the candidates weighs log(2)^3 = 0.33, one
             in all of them next to nothing; the served index's power, DEFAULT_LEXICAL), and the
             pages it would bring are noise.
  neighbours a page whose match touches its first or last `neighbour_tokens` tokens brings the
             page across that edge: a sentence cut by a page boundary comes back whole.
  links      after the coverage order's pages, the cold pages that what the question found points
             to (controller.links), hop by hop, while the page limit and the room allow.

The figures behind each default are in docs/controller.md (benchmarks.selectors, ablation rows).
Depends on numpy and controller.links (its config).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from controller.links import LinkConfig


@dataclass(frozen=True)
class HybridConfig:
    max_pages: int = 8               # pages restored per decision at most, neighbours included
    shortlist_pages: int = 64        # pages with the best BM25 that the coverage order weighs
    coverage_decay: float = 0.7      # a query term already covered by k chosen pages counts decay**k again
    neighbour_tokens: int = 16       # a match this close to a page edge brings the page across the edge
    cutoff: float = 0.1              # stop when a page would add under this share of the first page's gain
    min_gain: float = 0.1            # the first page must add at least this much evidence (see floor)
    neighbour_share: float = 0.0     # a page brings a neighbour only if it adds this share of the first gain
    key_weight: float = 0.0          # weight of the key-match evidence next to the lexical evidence
    incoming_tokens: int = 256       # newest tokens of the turn that make the query (as the key index)
    follow: LinkConfig = field(default_factory=LinkConfig)   # following what found pages point to

    def __post_init__(self) -> None:
        if self.max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {self.max_pages}")
        if self.shortlist_pages < self.max_pages:
            raise ValueError(f"shortlist_pages must be >= max_pages, got {self.shortlist_pages}")
        if not 0.0 <= self.coverage_decay <= 1.0:
            raise ValueError(f"coverage_decay must be in [0, 1], got {self.coverage_decay}")
        if self.neighbour_tokens < 0:
            raise ValueError(f"neighbour_tokens must be >= 0, got {self.neighbour_tokens}")
        if not 0.0 <= self.cutoff < 1.0:
            raise ValueError(f"cutoff must be in [0, 1), got {self.cutoff}")
        if self.min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {self.min_gain}")
        if not 0.0 <= self.neighbour_share <= 1.0:
            raise ValueError(f"neighbour_share must be in [0, 1], got {self.neighbour_share}")
        if self.key_weight < 0:
            raise ValueError(f"key_weight must be >= 0, got {self.key_weight}")
        if self.incoming_tokens < 1:
            raise ValueError(f"incoming_tokens must be >= 1, got {self.incoming_tokens}")


DEFAULT_CONFIG = HybridConfig()


def coverage_order(evidence: np.ndarray, decay: float, count: int) -> tuple[list[int], list[float]]:
    """Greedy order of rows (pages) by the evidence they add over the columns (query terms): a
    column already covered by k chosen rows counts decay**k. Returns the first `count` rows and
    the gain of each when it was chosen."""
    rows = evidence.shape[0]
    covered = np.zeros(evidence.shape[1], dtype=np.float64)
    left = np.ones(rows, dtype=bool)
    order: list[int] = []
    gains: list[float] = []
    for _ in range(min(count, rows)):
        gain = (evidence * decay ** covered).sum(axis=1)
        gain[~left] = -1.0
        best = int(np.argmax(gain))
        order.append(best)
        gains.append(float(gain[best]))
        left[best] = False
        covered += evidence[best] > 0
    return order, gains


def choose_groups(evidence: np.ndarray, candidates: list[int], room_pages: int, config: HybridConfig,
                  edges: Callable[[int], tuple[bool, bool]] | None = None,
                  cold: Collection[int] | None = None) -> list[list[int]]:
    """Pages to restore, best first, in groups: a page of the coverage order (cut where the gain
    falls under `cutoff` of the first), then the neighbours its match leans on (`edges(page)` ->
    (before, after)) when they are cold (`cold`: every cold page; the candidates by default).
    At most `min(max_pages, room_pages)` pages in all."""
    limit = min(config.max_pages, room_pages)
    if limit < 1 or not candidates or evidence.size == 0:
        return []
    cold = set(candidates) if cold is None else cold
    order, gains = coverage_order(evidence, config.coverage_decay, limit)
    if not gains or gains[0] <= config.min_gain:
        return []
    groups: list[list[int]] = []
    taken: set[int] = set()
    for row, gain in zip(order, gains, strict=True):
        if len(taken) >= limit or gain <= 0 or (groups and gain < config.cutoff * gains[0]):
            break
        page = candidates[row]
        group = [] if page in taken else [page]
        taken.update(group)
        if edges is not None and gain >= config.neighbour_share * gains[0]:
            before, after = edges(page)
            for flag, other in ((after, page + 1), (before, page - 1)):
                if flag and other in cold and other not in taken and len(taken) < limit:
                    group.append(other)
                    taken.add(other)
        if group:
            groups.append(group)
    return groups


def match_edges(profile: np.ndarray, neighbour_tokens: int) -> tuple[bool, bool]:
    """Does the strong part of a page's match (at least half its peak) touch the first or the last
    `neighbour_tokens` tokens?"""
    if neighbour_tokens <= 0 or profile.size == 0 or profile.max() <= 0:
        return False, False
    strong = np.nonzero(profile >= 0.5 * profile.max())[0]
    return bool(strong.min() < neighbour_tokens), bool(strong.max() >= len(profile) - neighbour_tokens)
