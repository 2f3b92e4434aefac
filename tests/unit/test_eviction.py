"""The eviction advice's policy (controller.eviction) on a real pager, tensor-free: what it scores,
in what order pages leave, what it never touches. The scorer is the host's input to the policy;
here a table of per-page log-probabilities stands for it (the engine tests score real K/V)."""

from __future__ import annotations

import numpy as np
import pytest

from contextd.wire import PinKind
from controller.eviction import (
    AttentionOrder,
    AttentionOrderConfig,
    EvictionAdviceConfig,
    EvictionAdvisor,
    page_votes,
)
from controller.pager import PAGE_TOKENS, Decision, Pager, PagerConfig, Plan

TEMPLATE = (1, 2)
FOCUS = [1, 50, 51, 2, 52, 53, 54]   # 1 and 2 are the template's


class Table:
    """A scorer from a table of mean log-probabilities; records what it was asked."""

    def __init__(self, scores: dict[int, float]) -> None:
        self.scores = scores
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, pages: list[int], ids: list[int]) -> dict[int, np.ndarray]:
        self.calls.append((list(pages), list(ids)))
        return {p: np.full(len(ids) - 1, self.scores.get(p, -5.0)) for p in pages}


def full_pager(pages: int, budget: int = 2048, tail: int = 256, system_pages: int = 1) -> Pager:
    """A pager whose attention sits exactly at its budget: `system_pages` pinned, then plain pages."""
    pager = Pager(PagerConfig(budget_tokens=budget, tail_tokens=tail))
    pager.append(list(range(system_pages * PAGE_TOKENS)), pin=PinKind.SYSTEM)
    pager.append(list(range((pages - system_pages) * PAGE_TOKENS)))
    for page in pager.pages:
        page.stored = True
    return pager


def advisor(window: int = 8) -> EvictionAdvisor:
    advice = EvictionAdvisor(EvictionAdviceConfig(window=window), TEMPLATE)
    advice.set_focus(FOCUS)
    return advice


def test_the_config_is_validated() -> None:
    with pytest.raises(ValueError, match="window"):
        EvictionAdviceConfig(window=1)
    with pytest.raises(ValueError, match="question_tokens"):
        EvictionAdviceConfig(question_tokens=1)


def test_the_focus_is_the_user_messages_own_words_and_a_new_one_drops_the_old_scores() -> None:
    advice = advisor()
    assert advice.focus == [50, 51, 52, 53, 54]
    advice.scores = {3: -1.0}
    advice.set_focus([1, 50, 2, 51, 52, 53, 54])      # the same words: the scores stand
    assert advice.scores == {3: -1.0}
    advice.set_focus([1, 2, 60])                      # one word is not a focus: nothing changes
    assert advice.focus == [50, 51, 52, 53, 54] and advice.scores == {3: -1.0}
    advice.set_focus([60, 61])
    assert advice.focus == [60, 61] and advice.scores == {}
    advice.scores = {2: -1.0, 3: -1.0, 4: -1.0}
    advice.forget_scores([3, 4, 9])                   # a page never scored is no error
    assert advice.scores == {2: -1.0}


def test_of_the_oldest_evictable_pages_the_least_likely_leave_first() -> None:
    pager = full_pager(16)
    evictable = pager.evictable()
    assert evictable[0] == 1 and 0 not in evictable   # the system page is pinned
    table = Table({1: -1.0, 2: -6.0, 3: -2.0, 4: -6.0, 5: -0.5})
    order = advisor(window=5).order(pager, 256, table)
    assert order == [2, 4, 3, 1, 5]                   # ties (2 and 4): the older first
    decision = pager.decide(Plan(evict_first=order), incoming_tokens=256)
    assert decision.evict == [2, 4, 3, 1]             # what the low watermark needs, in that order
    assert pager.pages_to_free(256, evictable) == 4


def test_an_eviction_order_alone_asks_for_no_room_and_is_not_rejected() -> None:
    pager = full_pager(16, tail=512)
    pager.apply(Decision(evict=[1], restore=[], plan_used=False))
    assert pager.incoming_for(Plan(restore=[1])) == PAGE_TOKENS
    for page in range(2, 12):
        pager.lease(page, pager.turn + 2)             # protections now hold more than the low watermark
    assert pager.validate(Plan(restore=[1]))[1] != "" and pager.incoming_for(Plan(restore=[1])) == 0
    cleaned, rejected = pager.validate(Plan(evict_first=[11, 2]))
    assert rejected == "" and cleaned.evict_first == [11, 2]


def test_nothing_is_scored_without_a_focus_or_without_a_choice() -> None:
    pager = full_pager(16)
    table = Table({})
    assert EvictionAdvisor(EvictionAdviceConfig(), TEMPLATE).order(pager, 256, table) == []
    assert advisor(window=4).order(pager, 256, table) == []   # 4 must go out of 4: no choice
    assert advisor().order(pager, 0, table) == []             # nothing must go
    assert table.calls == []


def test_pins_the_tail_the_ledger_and_leases_are_never_in_the_order() -> None:
    pager = full_pager(16, tail=512)
    pager.mark_ledger(3)
    pager.lease(5, pager.turn + 2)
    table = Table({})
    order = advisor(window=16).order(pager, 256, table)
    protected = {0, 3, 5} | {12, 13, 14, 15}       # pinned, ledger, leased, the tail's four pages
    assert order and not set(order) & protected
    assert set(order) == set(pager.evictable())


def test_scores_are_kept_under_one_focus_and_a_forward_fills_up_with_the_pages_that_come_next() -> None:
    pager = full_pager(16, tail=512)
    pager.lease(2, pager.turn + 2)
    table = Table({})
    advice = advisor(window=4)
    first = advice.order(pager, 128, table)           # 3 of the window's 4 must go
    assert table.calls == [([1, 3, 4, 5], [50, 51, 52, 53, 54])]
    assert first == [1, 3, 4, 5] and advice.order(pager, 128, table) == first and len(table.calls) == 1
    advice.scores = {1: -1.0, 3: -1.0, 4: -1.0}
    advice.order(pager, 128, table)
    # the window's one unscored page, then the oldest that may become evictable: 2 (leased), 6, 7
    assert table.calls[-1][0] == [5, 2, 6, 7]


def test_a_forward_fills_up_only_with_pages_the_scorer_reads_cheaply() -> None:
    """A controller model reads a page it has not read yet at a page's prefill: the fill-up takes
    only the pages `cheap` names; the window's own pages are scored whatever they cost."""
    pager = full_pager(16, tail=512)
    table = Table({})
    advice = advisor(window=4)
    advice.scores = {1: -1.0, 2: -1.0, 3: -1.0}
    advice.order(pager, 128, table, cheap=lambda pages: [p for p in pages if p % 2 == 0])
    assert table.calls == [([4, 6, 8, 10], [50, 51, 52, 53, 54])]   # 4 unscored in the window; then cheap ones


def test_a_window_the_scorer_could_not_score_is_not_ordered() -> None:
    pager = full_pager(16)
    advice = advisor(window=4)
    assert advice.order(pager, 128, lambda pages, ids: {}) == []


# ---------------------------------------------------------------- the attention order

def weights_on(pager: Pager, per_page: dict[int, float]) -> np.ndarray:
    """Weights of one layer's one head over the held tokens (held order) that put `per_page[p]`
    on page p, spread evenly: [1, 1, tokens] as `Backend.attention_weights` has them."""
    weights = np.zeros((1, 1, pager.hot_tokens))
    for k, page in enumerate(pager.resident):
        weights[..., k * PAGE_TOKENS:(k + 1) * PAGE_TOKENS] = per_page.get(page, 0.0) / PAGE_TOKENS
    return weights


def test_a_pages_vote_is_what_the_head_that_read_it_most_gave_it_averaged_over_layers() -> None:
    """One head reading a page hard is a read; many heads touching every page lightly are not:
    the mean over heads would rank the two pages alike."""
    weights = np.zeros((2, 3, 4))          # 2 layers, 3 heads, 4 tokens: pages [0, 2) and [2, 4)
    weights[0, 0] = [0.05, 0.05, 0.45, 0.45]   # layer 0: head 0 reads the second page
    weights[0, 1:] = [0.4, 0.4, 0.1, 0.1]      # its other heads lean on the first one
    weights[1, :] = [0.25, 0.25, 0.25, 0.25]   # layer 1: every head alike
    votes = page_votes(weights, [(0, 2), (2, 4)])
    np.testing.assert_allclose(votes, [(0.8 + 0.5) / 2, (0.9 + 0.5) / 2])
    over_heads = weights.mean(axis=1)          # the mean over heads ranks them the other way round
    assert over_heads[:, :2].sum() > over_heads[:, 2:].sum()
    assert page_votes(weights, []).shape == (0,)


def test_the_attention_config_is_validated_and_reads_layers_inside_the_stack() -> None:
    for bad in (dict(window=1), dict(queries=0), dict(layers=0), dict(half_life_tokens=0)):
        with pytest.raises(ValueError):
            AttentionOrderConfig(**bad)  # type: ignore[arg-type]
    config = AttentionOrderConfig(layers=4)
    assert config.watched_layers(30) == [6, 12, 17, 23]
    assert config.watched_layers(3) == [0, 1, 2]
    assert AttentionOrderConfig(layers=1).watched_layers(30) == [14]


def test_the_least_attended_of_the_oldest_evictable_pages_leave_first() -> None:
    pager = full_pager(16)
    order = AttentionOrder(AttentionOrderConfig(window=4))
    order.begin_message(from_user=True)
    order.observe(pager, weights_on(pager, {0: 9.0, 1: 0.5, 2: 0.01, 3: 0.2, 4: 0.0, 5: 0.9}), new_tokens=0)
    # The pinned page 0, where the attention sink is, never leaves and is not scored. The window
    # is the four oldest evictable pages (1-4); page 5's weight does not matter yet.
    assert 0 not in order.scores
    assert order.order(pager, incoming_tokens=PAGE_TOKENS) == [4, 2, 3, 1]
    decision = pager.decide(Plan(evict_first=order.order(pager, PAGE_TOKENS)), incoming_tokens=PAGE_TOKENS)
    assert decision.evict[:2] == [4, 2] and 1 not in decision.evict
    # No choice (nothing needs to leave) -> no order.
    assert order.order(pager, incoming_tokens=0) == []


def test_scores_add_up_over_forwards_and_fade_by_half_each_half_life() -> None:
    pager = full_pager(16)
    order = AttentionOrder(AttentionOrderConfig(half_life_tokens=1000))
    order.begin_message(from_user=True)
    order.observe(pager, weights_on(pager, {1: 0.4}), new_tokens=0)
    order.observe(pager, weights_on(pager, {2: 0.3}), new_tokens=1000)
    assert order.scores[1] == pytest.approx(0.2) and order.scores[2] == pytest.approx(0.3)
    order.observe(pager, weights_on(pager, {1: 0.3}), new_tokens=2000)
    assert order.scores[1] == pytest.approx(0.05 + 0.3) and order.scores[2] == pytest.approx(0.075)
    order.forget_scores([1])
    assert 1 not in order.scores and order.order(pager, PAGE_TOKENS)[0] == 1   # unscored: least attended


def test_weights_of_a_shorter_view_score_only_the_pages_they_cover() -> None:
    """Weights read before the pager took the newest chunk cover fewer tokens: pages past them are
    not scored (nothing is read out of bounds)."""
    pager = full_pager(6)
    order = AttentionOrder(AttentionOrderConfig())
    order.begin_message(from_user=True)
    order.observe(pager, np.full((1, 1, 3 * PAGE_TOKENS), 1 / (3 * PAGE_TOKENS)), new_tokens=0)
    assert set(order.scores) == {1, 2}   # page 0 is pinned


def test_a_user_message_votes_on_the_pages_before_it_and_a_tool_result_does_not() -> None:
    """What a file's lines put on the text before them is nearness: a tool result does not vote. A
    user message does, on the pages before it, and its own pages rank with the page it read most
    (SnapKV keeps its observation window); the answer's opening votes as the message before it."""
    pager = full_pager(16)
    order = AttentionOrder(AttentionOrderConfig(half_life_tokens=1 << 30))
    order.begin_message(from_user=False)                # a tool result: pages 16 and 17
    pager.append(list(range(2 * PAGE_TOKENS)))
    order.observe(pager, weights_on(pager, {3: 0.2, 15: 0.5}), new_tokens=2 * PAGE_TOKENS)
    assert order.scores == {}
    order.begin_message(from_user=True)                 # the user's question: page 18
    pager.append(list(range(PAGE_TOKENS)))
    order.observe(pager, weights_on(pager, {3: 0.1, 17: 0.4, 18: 0.5}), new_tokens=PAGE_TOKENS)
    assert order.scores[3] == pytest.approx(0.1) and order.scores[17] == pytest.approx(0.4)
    assert order.scores[18] == pytest.approx(0.4)       # its own weight on itself is not counted
    order.begin_opening()                               # the answer's opening reads the question too
    pager.append(list(range(PAGE_TOKENS)))
    order.observe(pager, weights_on(pager, {18: 0.3, 19: 0.6}), new_tokens=PAGE_TOKENS)
    assert order.scores[18] == pytest.approx(0.7) and order.scores[19] == pytest.approx(0.3)
    before = dict(order.scores)
    order.begin_message(from_user=False)                # the next tool result votes for nothing
    pager.append(list(range(PAGE_TOKENS)))
    order.observe(pager, weights_on(pager, {19: 0.9}), new_tokens=PAGE_TOKENS)
    assert order.scores == pytest.approx(before)


def test_a_score_nothing_has_renewed_for_twenty_half_lives_is_dropped() -> None:
    pager = full_pager(16)
    order = AttentionOrder(AttentionOrderConfig(half_life_tokens=100))
    order.begin_message(from_user=True)
    order.observe(pager, weights_on(pager, {2: 1.0}), new_tokens=0)
    order.begin_message(from_user=False)
    order.observe(pager, weights_on(pager, {}), new_tokens=1900)
    assert order.scores[2] == pytest.approx(2.0 ** -19)
    order.observe(pager, weights_on(pager, {}), new_tokens=200)
    assert 2 not in order.scores
