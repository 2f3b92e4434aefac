"""The re-ranking policy (controller.rerank) and the rerank selector's use of the host's scorer.

The scorer here is a table of log-probabilities written per page: the policy is what is under test
(the real scorer, the serving model over stored K/V, is tested in tests/backends and
tests/server/test_selectors.py)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from contextd.wire import PageState, PinKind
from controller.lexical import LexicalIndex
from controller.pager import PAGE_TOKENS, Pager, PagerConfig
from controller.rerank import RerankConfig, keep_by_margin, lexical_leader, mean_logprob, question_ids
from controller.selectors import HybridSelector, LikelihoodSelector, RerankSelector, SelectionContext

STOP = (1, 2)  # the chat template's own ids in these tests


def test_the_question_is_the_newest_ids_without_the_template() -> None:
    assert question_ids([1, 5, 6, 2, 7, 1, 8, 2], STOP, 3) == [6, 7, 8]
    assert question_ids([1, 2, 1], STOP, 4) == []


def test_candidates_within_the_margin_of_the_best_are_kept_best_first() -> None:
    assert keep_by_margin({3: -2.0, 5: -1.2, 9: -1.6, 11: -1.75}, 0.5) == [5, 9]
    assert keep_by_margin({3: -2.0, 5: -1.2}, 0.0) == [5]
    assert keep_by_margin({}, 1.0) == []


def test_a_floor_keeps_one_unlikely_word_from_outweighing_the_rest() -> None:
    """Seed 103's near-duplicate miss in small: the page that continues the question has one word
    the question shares with another page at -17 nats; without a floor the other page wins."""
    continues = np.array([-0.1, -0.2, -17.0, -0.1])
    shares_wording = np.array([-1.5, -1.5, -1.5, -1.5])
    assert mean_logprob(continues) < mean_logprob(shares_wording)
    assert mean_logprob(continues, 4.0) == pytest.approx(-1.1)
    assert mean_logprob(continues, 4.0) > mean_logprob(shares_wording, 4.0)
    assert keep_by_margin({1: mean_logprob(continues, 4.0), 2: mean_logprob(shares_wording, 4.0)}, 0.3) == [1]


def test_a_leader_leads_every_other_candidate_by_the_factor() -> None:
    assert lexical_leader({62: 1515.0, 15: 1047.0}, 2.0) is None   # seed 109's miss: 1.45x
    assert lexical_leader({62: 2100.0, 15: 1047.0}, 2.0) == 62
    assert lexical_leader({62: 2100.0, 15: 1047.0, 9: 1100.0}, 2.0) is None
    assert lexical_leader({62: 10.0, 15: 5.0}, 2.0) == 62
    assert lexical_leader({62: 9.9, 15: 5.0}, 2.0) is None
    assert lexical_leader({62: 2100.0, 15: 1047.0}, float("inf")) is None
    assert lexical_leader({62: 2100.0}, 2.0) is None
    assert lexical_leader({62: 0.0, 15: 0.0}, 2.0) is None   # nothing matched: nothing leads
    assert RerankConfig(lead=float("inf")).lead == float("inf")


@pytest.mark.parametrize("bad", [{"candidates": 0}, {"question_tokens": 1}, {"margin": -0.1},
                                 {"margin": float("nan")}, {"floor": 0.0}, {"floor": float("nan")},
                                 {"lead": 1.0}, {"lead": float("nan")}])
def test_config_is_checked(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RerankConfig(**bad)  # type: ignore[arg-type]


def _session(planted: dict[int, list[int]]) -> tuple[Pager, LexicalIndex]:
    """40 pages of common ids (10..60), `planted` ids written into some, pages 2..31 cold."""
    rng = np.random.default_rng(3)
    pager = Pager(PagerConfig(budget_tokens=4096))
    pager.append(list(range(256)), pin=PinKind.SYSTEM)
    pager.append(list(range(40 * PAGE_TOKENS - 256)))
    lexical = LexicalIndex(stop_ids=STOP)
    for p in range(40):
        ids = rng.integers(10, 60, size=PAGE_TOKENS).tolist()
        for k, t in enumerate(planted.get(p, [])):
            ids[50 + k] = t
        lexical.add(p, ids)
    for page in pager.pages[2:-8]:
        page.state, page.stored = PageState.COLD, True
    return pager, lexical


def _scorer(table: dict[int, float], asked: list[tuple[list[int], list[int]]]
            ) -> Callable[[list[int], list[int]], dict[int, np.ndarray]]:
    def score(pages: list[int], ids: list[int]) -> dict[int, np.ndarray]:
        asked.append((list(pages), list(ids)))
        return {p: np.full(len(ids) - 1, table[p]) for p in pages if p in table}
    return score


def test_rerank_keeps_the_likely_candidates_and_the_groups_it_did_not_score() -> None:
    """Of the scored candidates those within the margin come back; a group past the scored ones
    comes back as the hybrid chose it (the config shape's miss: dropping it lost the page a
    question needed)."""
    pager, lexical = _session({5: [900, 901], 12: [900, 902], 20: [900, 903], 25: [900, 904], 28: [900]})
    asked: list[tuple[list[int], list[int]]] = []
    scorer = _scorer({5: -3.0, 12: -1.0, 20: -1.3, 25: -2.5, 28: -2.0}, asked)
    ctx = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, 30, 900, 901, 902, 903, 904, 2], scorer=scorer)
    selection = RerankSelector(RerankConfig(candidates=4, margin=0.5, question_tokens=16)).select(ctx)
    assert len(asked) == 1
    pages, ids = asked[0]
    assert sorted(pages) == [5, 12, 20, 25] and ids == [30, 900, 901, 902, 903, 904]
    assert selection.plan is not None and selection.plan.restore == [12, 20]
    assert selection.scores[12] == -1.0
    asked.clear()
    selection = RerankSelector(RerankConfig(candidates=3, margin=0.5, question_tokens=16)).select(ctx)
    (pages, _), = asked
    unscored = sorted({5, 12, 20, 25} - set(pages))
    assert len(pages) == 3 and len(unscored) == 1 and "1 more groups unscored" in selection.note
    assert selection.plan is not None
    assert selection.plan.restore == sorted({12, 20} & set(pages) | set(unscored))


def test_rerank_without_a_scorer_restores_the_hybrids_choice_and_one_candidate_is_not_scored() -> None:
    pager, lexical = _session({12: [900, 901], 20: [900, 901]})
    ctx = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, 900, 901, 2])
    hybrid = HybridSelector().select(ctx).plan
    selection = RerankSelector().select(ctx)
    assert hybrid is not None and selection.plan is not None and selection.plan.restore == hybrid.restore == [12, 20]
    assert "no scorer" in selection.note
    pager, lexical = _session({12: [900, 901]})
    asked: list[tuple[list[int], list[int]]] = []
    ctx = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, 900, 901, 2], scorer=_scorer({12: -9.0}, asked))
    selection = RerankSelector().select(ctx)
    assert selection.plan is not None and selection.plan.restore == [12] and not asked


def test_a_candidate_the_host_could_not_score_stays_cold() -> None:
    pager, lexical = _session({12: [900, 901], 20: [900, 901]})
    asked: list[tuple[list[int], list[int]]] = []
    ctx = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, 900, 901, 2], scorer=_scorer({20: -2.0}, asked))
    selection = RerankSelector().select(ctx)
    assert selection.plan is not None and selection.plan.restore == [20]


def test_when_no_candidate_could_be_scored_the_hybrids_choice_comes_back() -> None:
    """A model that cannot score blocks apart, or payloads that all failed their checks: the host's
    scorer answers nothing, and the turn gets what the hybrid chose, not an empty restore."""
    pager, lexical = _session({12: [900, 901], 20: [900, 901]})
    asked: list[tuple[list[int], list[int]]] = []
    ctx = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, 900, 901, 2], scorer=_scorer({}, asked))
    selection = RerankSelector().select(ctx)
    assert asked and selection.plan is not None and selection.plan.restore == [12, 20]
    assert "none could be scored" in selection.note


def test_a_decisive_lexical_match_is_kept_however_its_words_read() -> None:
    """The page that shares all of the question's rare terms reads less likely than one that
    shares a single term (as a page whose last line the question's wording continues does): the
    model breaks lexical ties, it does not overrule a match that leads by `lead`."""
    pager, lexical = _session({5: [900, 901, 902], 12: [903]})
    scorer = _scorer({5: -3.0, 12: -1.0}, [])
    ctx = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, 30, 900, 901, 902, 903, 2], scorer=scorer)
    hybrid = HybridSelector().select(ctx)
    assert hybrid.plan is not None and {5, 12} <= set(hybrid.plan.restore)
    assert hybrid.scores[5] >= 2 * hybrid.scores[12]
    kept = RerankSelector(RerankConfig(margin=0.5)).select(ctx)
    assert kept.plan is not None and {5, 12} <= set(kept.plan.restore)
    assert "1 by its lexical lead" in kept.note
    unscoreable = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                                   incoming_ids=ctx.incoming_ids, scorer=_scorer({12: -1.0}, []))
    alone = RerankSelector(RerankConfig(margin=0.5)).select(unscoreable)   # the leader's payload failed
    assert alone.plan is not None and 5 not in alone.plan.restore and 12 in alone.plan.restore
    overruled = RerankSelector(RerankConfig(margin=0.5, lead=float("inf"))).select(ctx)
    assert overruled.plan is not None and 12 in overruled.plan.restore and 5 not in overruled.plan.restore


def test_likelihood_alone_scores_every_stored_cold_page_and_keeps_what_fits_by_margin() -> None:
    """The ablation without the lexical choice: no page matches the question's words, and every
    stored cold page is still scored (in chunks); the likeliest within the margin come back, best
    first, as many as the room and `max_pages` allow."""
    pager, lexical = _session({})
    cold = [p.index for p in pager.pages if p.state is PageState.COLD]
    table = {page: -5.0 for page in cold} | {7: -1.0, 9: -1.2, 30: -1.4, 11: -3.0}
    asked: list[tuple[list[int], list[int]]] = []
    ctx = SelectionContext("s", pager, room_tokens=2 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, 900, 901, 2], scorer=_scorer(table, asked))
    selection = LikelihoodSelector(RerankConfig(margin=0.5), chunk=8).select(ctx)
    assert sorted(page for pages, _ in asked for page in pages) == cold and all(len(p) <= 8 for p, _ in asked)
    assert selection.plan is not None and selection.plan.restore == [7, 9]   # 30 is within the margin: no room
    roomy = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                             incoming_ids=[1, 900, 901, 2], scorer=_scorer(table, []))
    kept = LikelihoodSelector(RerankConfig(margin=0.5), max_pages=2).select(roomy)
    assert kept.plan is not None and kept.plan.restore == [7, 9]
    bare = SelectionContext("s", pager, lexical_index=lexical, incoming_ids=[1, 900, 2])
    unscored = LikelihoodSelector().select(bare)
    assert unscored.plan is None and "no scorer" in unscored.note
