"""Selectors: who advises the pager which cold pages to restore.

  recency     no advice: the pager's default retention (oldest unpinned first) alone.
  hybrid      the default: lexical rarity over the tokenizer's ids (controller.lexical, BM25 with
              the chat template's own ids left out), a coverage order over the best-scoring pages,
              a cutoff where the evidence falls off, and the neighbour a match leans on
              (controller.hybrid), then the cold pages those point to (controller.links).
              Optionally the key index's evidence beside it.
  rerank      the hybrid's choice re-ranked by query likelihood: the serving model reads each
              candidate's stored K/V (or a separate controller model its text) and then the
              turn's own words, all candidates in one forward (the host's
              `SelectionContext.scorer`); the candidates within a margin of the best come back,
              and one that leads the others lexically by a wide factor (controller.rerank).
  attention   model-native, no second model: the turn's new tokens are matched against every cold
              page in the serving model's own key space (controller.keyindex); the best pages
              that fit the room come back.

Whatever a selector says goes through the pager's rules (`Pager.validate`). No selector, and
nothing in the host, looks at the words of the transcript: they read token ids and stored K/V (a
controller model reads text, but only to score it; no rule matches words).
Depends on numpy, contextd.wire (PageState), controller.pager, controller.keyindex,
controller.lexical, controller.links, controller.hybrid and controller.rerank.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from contextd.wire import PageState
from controller.hybrid import HybridConfig, choose_groups, match_edges
from controller.keyindex import KeyIndex
from controller.lexical import LexicalIndex
from controller.links import LinkConfig, follow
from controller.pager import PAGE_TOKENS, Pager, Plan
from controller.rerank import RerankConfig, keep_by_margin, lexical_leader, mean_logprob, question_ids

log = logging.getLogger("kv_elision.selectors")


# The host's query likelihood: for cold pages and token ids, each page's float64 log p(ids[j] | page,
# the template's user opening, ids[:j]) for every j (j >= 1 for a template without one), read over
# the page's stored K/V (no forward over history). A page that cannot be scored (its payload failed
# its checks) is left out of the answer.
PageScorer = Callable[[list[int], list[int]], dict[int, np.ndarray]]


@dataclass
class SelectionContext:
    session_id: str
    pager: Pager
    incoming_keys: np.ndarray | None = None  # Block keys [layers, kv_heads, tokens, head_dim] of the new tokens
    key_index: KeyIndex | None = None        # the session's model-native page index
    room_tokens: int = 0                   # what restores may fill under the low watermark
    lexical_index: LexicalIndex | None = None  # the session's stored full pages as terms
    incoming_ids: Sequence[int] | None = None  # token ids of the turn's new tokens (aligned with incoming_keys)
    scorer: PageScorer | None = None       # the host's query likelihood over stored pages (rerank)
    page_ids: Callable[[int], Sequence[int]] | None = None   # a page in attention's token ids (links)


@dataclass
class Selection:
    plan: Plan | None
    decided_ms: float
    note: str = ""
    scores: dict[int, float] = field(default_factory=dict)  # page -> the score that chose it (shown to the user)


class Selector(Protocol):
    name: str
    uses_key_index: bool      # the engine keeps a KeyIndex per session and passes the new tokens' keys
    uses_lexical_index: bool  # the engine keeps a LexicalIndex per session and passes the new tokens' ids
    scores_pages: bool        # asks the host to score candidate pages apart (SelectionContext.scorer)

    def select(self, ctx: SelectionContext) -> Selection: ...


class RecencySelector:
    name = "recency"
    uses_key_index = False
    uses_lexical_index = False
    scores_pages = False

    def select(self, ctx: SelectionContext) -> Selection:
        return Selection(None, 0.0, "default retention")


class AttentionSelector:
    """Matches the turn's new tokens against cold pages in the model's own key space; restores the
    best pages. Pages, not whole units: the score is per page, and a page is what a fact lives in."""

    name = "attention"
    uses_key_index = True
    uses_lexical_index = False
    scores_pages = False

    def __init__(self, max_pages: int = 8) -> None:
        if max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {max_pages}")
        self.max_pages = max_pages

    def select(self, ctx: SelectionContext) -> Selection:
        started = time.perf_counter()
        index = ctx.key_index
        cold = [] if index is None else [
            p.index for p in ctx.pager.pages if p.state is PageState.COLD and p.index in index.pages]
        if index is None or ctx.incoming_keys is None or not cold:
            return Selection(None, _ms(started), "nothing to score")
        scores = index.scores(ctx.incoming_keys, cold)
        ranked = [(cold[k], float(scores[k])) for k in np.argsort(-scores, kind="stable")[:self.max_pages]]
        chosen = _fill_room(ranked, ctx)
        plan = Plan(restore=sorted(chosen))
        return Selection(plan, _ms(started), f"restore {len(chosen)} pages", chosen)


class HybridSelector:
    """Restores the cold pages that share the rarest terms with the incoming turn (controller.hybrid)."""

    uses_lexical_index = True
    scores_pages = False

    def __init__(self, config: HybridConfig | None = None, name: str = "hybrid") -> None:
        self.config = config or HybridConfig()
        self.name = name
        self.uses_key_index = self.config.key_weight > 0

    def select(self, ctx: SelectionContext) -> Selection:
        started = time.perf_counter()
        groups, bm25, unscored = hybrid_groups(ctx, self.config)
        if unscored:
            return Selection(None, _ms(started), unscored)
        return _restore_groups(groups, bm25, started)


def hybrid_groups(ctx: SelectionContext, config: HybridConfig) -> tuple[list[list[int]], dict[int, float], str]:
    """The hybrid's choice as page groups (controller.hybrid.choose_groups) and each page's BM25
    score; or, when there was nothing to score, why (else "")."""
    lexical, incoming = ctx.lexical_index, ctx.incoming_ids
    if lexical is None or incoming is None or len(incoming) == 0:
        return [], {}, "no lexical index or incoming ids"
    cold = [p.index for p in ctx.pager.pages if p.state is PageState.COLD and p.index in lexical.pages]
    if not cold:
        return [], {}, "nothing to score"
    ids = np.asarray(incoming, dtype=np.int64)[-config.incoming_tokens:]
    match = lexical.match(ids, cold)
    shortlist = lexical.top(match, config.shortlist_pages)
    evidence = lexical.evidence(match, shortlist)
    keys = ctx.key_index
    if config.key_weight > 0 and keys is not None and ctx.incoming_keys is not None and shortlist \
            and all(p in keys.pages for p in shortlist):
        by_key = keys.evidence(ctx.incoming_keys, shortlist, ~np.isin(ids, lexical.stop_ids))
        scale = evidence.sum(axis=1).max() / max(float(by_key.sum(axis=1).max()), 1e-9)
        evidence = np.concatenate([evidence, config.key_weight * scale * by_key], axis=1)
    room_pages = ctx.room_tokens // PAGE_TOKENS   # only full pages are indexed

    def edges(page: int) -> tuple[bool, bool]:
        return match_edges(lexical.profile(page, match), config.neighbour_tokens)

    groups = choose_groups(evidence, shortlist, room_pages, config, edges, set(cold))
    bm25 = dict(zip(shortlist, evidence.sum(axis=1).tolist(), strict=True))
    if config.follow.hops and ctx.page_ids is not None:
        # After the matches, while the limit and the room allow: the coverage order was chosen
        # on the shapes of benchmarks.selectors, where a link displacing a weaker match lost hits.
        groups += _linked(ctx, ids, groups, min(config.max_pages, room_pages), config)
    return groups, bm25, ""


def _linked(ctx: SelectionContext, ids: np.ndarray, groups: list[list[int]], limit: int,
            config: HybridConfig) -> list[list[int]]:
    """The cold pages that the pages the question found point to (controller.links), one group
    each, hop by hop, while fewer than `limit` pages (`groups`' included) are chosen."""
    assert ctx.lexical_index is not None and ctx.page_ids is not None
    pages = ctx.pager.pages
    total = pages[-1].token_end if pages else 0
    skip = {p.index for p in pages if p.token_end > total - len(ids)}
    taken = {page for group in groups for page in group}
    out: list[list[int]] = []
    for hop in follow(ctx.lexical_index, ids, pages, ctx.page_ids, skip, config.follow):
        for page in hop:
            if len(taken) >= limit:
                return out
            if page not in taken:
                taken.add(page)
                out.append([page])
    return out


def _restore_groups(groups: list[list[int]], bm25: dict[int, float], started: float, why: str = "") -> Selection:
    """Every page of the hybrid's groups, each shown with its BM25 score."""
    chosen = [page for group in groups for page in group]
    note = f"restore {len(chosen)} pages" + (f" ({why})" if why else "")
    return Selection(Plan(restore=sorted(chosen)), _ms(started), note, {p: bm25.get(p, 0.0) for p in chosen})


class RerankSelector:
    """The hybrid's choice, re-ranked by how likely the turn's own words are after each candidate,
    read over its stored K/V by the serving model (controller.rerank): the host scores the first
    candidates, this policy keeps those within a margin of the best, one whose BM25 leads every
    other's by `RerankConfig.lead`, and the groups it did not score. A choice of one candidate is
    not scored."""

    uses_key_index = False
    uses_lexical_index = True
    scores_pages = True

    def __init__(self, config: RerankConfig | None = None, hybrid: HybridConfig | None = None,
                 name: str = "rerank") -> None:
        self.config = config or RerankConfig()
        self.hybrid = hybrid or HybridConfig()
        self.name = name

    def select(self, ctx: SelectionContext) -> Selection:
        started = time.perf_counter()
        groups, bm25, unscored = hybrid_groups(ctx, self.hybrid)
        if unscored:
            return Selection(None, _ms(started), unscored)
        if len(groups) < 2:
            return _restore_groups(groups, bm25, started, "one candidate, not scored" if groups else "")
        assert ctx.lexical_index is not None and ctx.incoming_ids is not None
        question = question_ids(ctx.incoming_ids, ctx.lexical_index.stop_ids.tolist(), self.config.question_tokens)
        if ctx.scorer is None or len(question) < 2:
            return _restore_groups(groups, bm25, started,
                                   "unscored: " + ("no scorer" if ctx.scorer is None else "no words to score"))
        scored = groups[:self.config.candidates]
        per_token = ctx.scorer([group[0] for group in scored], question)
        if not per_token:
            return _restore_groups(groups, bm25, started, "unscored: none could be scored")
        scores = {page: mean_logprob(lp, self.config.floor) for page, lp in per_token.items()}
        kept = set(keep_by_margin(scores, self.config.margin))
        leader = lexical_leader({group[0]: max(bm25.get(page, 0.0) for page in group)
                                 for group in scored if group[0] in scores}, self.config.lead)
        by_lead = leader is not None and leader not in kept
        if leader is not None:
            kept.add(leader)
        likely = {page: scores[group[0]] for group in scored if group[0] in kept for page in group}
        rest = groups[self.config.candidates:]
        likely.update({page: bm25.get(page, 0.0) for group in rest for page in group})
        return Selection(Plan(restore=sorted(likely)), _ms(started),
                         f"restore {len(likely)} pages, {len(kept)} of {len(scored)} candidates kept"
                         + (", 1 by its lexical lead" if by_lead else "")
                         + (f", {len(rest)} more groups unscored" if rest else ""), likely)


class LikelihoodSelector:
    """Query likelihood alone: the re-ranker's score without the lexical choice, the ablation that
    says what the hybrid's shortlist gives the re-ranker (`benchmarks.selectors --selectors
    likelihood`). Every stored cold page is scored by the host (forwards of `chunk` pages), the
    pages within the margin of the best come back best first, as many as fit the room, up to
    `max_pages`. It forwards the question once per cold page, far slower a turn than the hybrid
    on a CPU (docs/results/selectors.md): a measurement, not a server option."""

    name = "likelihood"
    uses_key_index = False
    uses_lexical_index = True   # for its stored pages and the template's ids, not for a match
    scores_pages = True

    def __init__(self, config: RerankConfig | None = None, max_pages: int = 8, chunk: int = 16) -> None:
        if max_pages < 1 or chunk < 1:
            raise ValueError(f"max_pages and chunk must be >= 1, got {max_pages} and {chunk}")
        self.config = config or RerankConfig()
        self.max_pages = max_pages
        self.chunk = chunk

    def select(self, ctx: SelectionContext) -> Selection:
        started = time.perf_counter()
        lexical = ctx.lexical_index
        if lexical is None or ctx.incoming_ids is None or ctx.scorer is None:
            return Selection(None, _ms(started), "unscored: no scorer or no stored pages")
        cold = [p.index for p in ctx.pager.pages if p.state is PageState.COLD and p.index in lexical.pages]
        question = question_ids(ctx.incoming_ids, lexical.stop_ids.tolist(), self.config.question_tokens)
        if not cold or len(question) < 2:
            return Selection(None, _ms(started), "nothing to score")
        scores: dict[int, float] = {}
        for start in range(0, len(cold), self.chunk):
            per_token = ctx.scorer(cold[start:start + self.chunk], question)
            scores.update({page: mean_logprob(lp, self.config.floor) for page, lp in per_token.items()})
        likeliest = keep_by_margin(scores, self.config.margin)[:self.max_pages]
        chosen = _fill_room([(page, scores[page]) for page in likeliest], ctx)
        return Selection(Plan(restore=sorted(chosen)), _ms(started),
                         f"restore {len(chosen)} of {len(scores)} scored pages", chosen)


def _fill_room(ranked: list[tuple[int, float]], ctx: SelectionContext) -> dict[int, float]:
    """Of pages ranked best first (with their scores), those that fit the room in that order; a page
    too large for what is left is passed over, a smaller one after it may still fit."""
    chosen: dict[int, float] = {}
    used = 0
    for index, score in ranked:
        tokens = ctx.pager.pages[index].tokens
        if used + tokens <= ctx.room_tokens:
            chosen[index] = score
            used += tokens
    return chosen


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000


SELECTORS = ("hybrid", "rerank", "attention", "recency")


def make_selector(name: str, max_pages: int = 8, follow_hops: int = LinkConfig.hops) -> Selector:
    """The selector `name` with its defaults; `max_pages`: the most cold pages it brings back in a
    turn (`--restore-pages`; recency restores none); `follow_hops`: the hops the hybrid and the
    re-ranker follow from what the question found (`--follow-hops`, controller.links)."""
    if name == "recency":
        return RecencySelector()
    hybrid = HybridConfig(max_pages=max_pages, follow=LinkConfig(hops=follow_hops))
    if name == "hybrid":
        return HybridSelector(hybrid)
    if name == "rerank":
        return RerankSelector(hybrid=hybrid)
    if name == "attention":
        return AttentionSelector(max_pages=max_pages)
    raise ValueError(f"unknown selector {name!r}: use one of {', '.join(SELECTORS)}")
