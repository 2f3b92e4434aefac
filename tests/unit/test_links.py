"""Following links (controller.links): a chain of pages, each naming the next, comes back from a
question that names only its first; token ids only, no model."""

from __future__ import annotations

import numpy as np
import pytest

from contextd.wire import PageState, PinKind
from controller.hybrid import HybridConfig
from controller.lexical import LexicalIndex
from controller.links import FOLLOW_HOPS, LinkConfig, follow
from controller.pager import PAGE_TOKENS, Pager, PagerConfig
from controller.selectors import HybridSelector, SelectionContext

STOP = (1, 2)
# A value and names are three tokens each, as a tokenizer splits a number or a made-up name.
VAR, EQUALS = 900, 901
VALUE = [1000, 1100, 1200]
NAMES = [[1001 + k, 1101 + k, 1201 + k] for k in range(5)]   # the chain's variables, in order
CHAIN_PAGES = [6, 11, 17, 23, 29]        # where each link is planted (cold but 23, held: see _session)
HELD_LINK = 23
ON = LinkConfig(hops=FOLLOW_HOPS)   # off by default (`--follow-hops`)


def _lines() -> list[list[int]]:
    """`VAR a = value`, then `VAR b = VAR a` for each next name."""
    first = [[VAR, *NAMES[0], EQUALS, *VALUE]]
    return first + [[VAR, *b, EQUALS, VAR, *a] for a, b in zip(NAMES, NAMES[1:], strict=False)]


def _session(pages: int = 40, seed: int = 3, held_from: int = 32
             ) -> tuple[Pager, dict[int, list[int]], LexicalIndex]:
    """Pages of common ids (10 .. 30: every pair of them is in many pages) with the chain planted;
    pages [2, held_from) are cold and indexed but HELD_LINK, which is held; pages from held_from
    on are held and not indexed yet (the turn's own pages: the question is in the last one)."""
    rng = np.random.default_rng(seed)
    ids = {p: rng.integers(10, 30, size=PAGE_TOKENS).tolist() for p in range(pages)}
    for page, line in zip(CHAIN_PAGES, _lines(), strict=True):
        ids[page][50:50 + len(line)] = line
    pager = Pager(PagerConfig(budget_tokens=2048))
    pager.append(list(range(256)), pin=PinKind.SYSTEM)
    pager.append(list(range(pages * PAGE_TOKENS - 256)))
    lexical = LexicalIndex(stop_ids=STOP)
    for page in pager.pages[2:held_from]:
        page.stored = True
        lexical.add(page.index, ids[page.index])
        if page.index != HELD_LINK:
            page.state = PageState.COLD
    question = [1, 70, 71, *VALUE, 72, 2]
    ids[pages - 1][-len(question):] = question
    return pager, ids, lexical


def test_each_hop_finds_the_page_the_last_one_names_and_reads_through_held_pages() -> None:
    pager, ids, lexical = _session()
    question = np.array(ids[len(pager.pages) - 1][-8:])
    hops = follow(lexical, question, pager.pages, ids.__getitem__, {len(pager.pages) - 1}, ON)
    # Hop 1: the page naming the first variable; hop 2 reads through the held page 23 (not found:
    # it is in attention) and finds 29; the chain ends there.
    assert [page for hop in hops for page in hop] == [11, 17, 29]
    assert all(pager.pages[p].state is PageState.COLD for hop in hops for p in hop)
    assert follow(lexical, question, pager.pages, ids.__getitem__, set(), LinkConfig(hops=0)) == []
    assert [p for hop in follow(lexical, question, pager.pages, ids.__getitem__, set(), LinkConfig(hops=1))
            for p in hop] == [11]


def test_a_term_many_pages_hold_is_no_link() -> None:
    pager, ids, lexical = _session()
    for page in (3, 4, 5, 7):   # the first variable now in five pages: common, not a link
        ids[page][90:93] = NAMES[0]
    lexical = LexicalIndex(stop_ids=STOP)
    for page in pager.pages[2:32]:
        lexical.add(page.index, ids[page.index])
    question = np.array(ids[len(pager.pages) - 1][-8:])
    hops = follow(lexical, question, pager.pages, ids.__getitem__, {len(pager.pages) - 1}, ON)
    assert [page for hop in hops for page in hop] == []


def test_the_question_own_pages_are_never_sources() -> None:
    pager, ids, lexical = _session()
    last = len(pager.pages) - 1
    ids[last][:9] = [VAR, 1099, 1199, 1299, EQUALS, VAR, *NAMES[-1]]  # the question's page names the chain's end
    question = np.array(ids[last][-8:])
    found = [p for hop in follow(lexical, question, pager.pages, ids.__getitem__, {last}, ON) for p in hop]
    assert found == [11, 17, 29]


def test_the_hybrid_selector_brings_the_chain_back_within_its_limit_and_the_room() -> None:
    pager, ids, lexical = _session()
    last = len(pager.pages) - 1
    question = ids[last][-8:]
    ctx = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=question, page_ids=ids.__getitem__)
    selection = HybridSelector(HybridConfig(follow=ON)).select(ctx)
    assert selection.plan is not None
    assert set(CHAIN_PAGES) - {HELD_LINK} <= set(selection.plan.restore)
    without = HybridSelector().select(ctx)   # the default: no links
    assert without.plan is not None and set(without.plan.restore) & {11, 17, 29} == set()
    tight = HybridSelector(HybridConfig(max_pages=2, follow=ON)).select(ctx)
    assert tight.plan is not None and len(tight.plan.restore) <= 2 and 6 in tight.plan.restore
    no_ids = SelectionContext("s", pager, room_tokens=8 * PAGE_TOKENS, lexical_index=lexical, incoming_ids=question)
    unlinked = HybridSelector(HybridConfig(follow=ON)).select(no_ids)   # no held pages' ids: nothing followed
    assert unlinked.plan is not None and set(unlinked.plan.restore) & {11, 17, 29} == set()


def test_link_config_is_checked() -> None:
    for bad in ({"hops": -1}, {"window_tokens": -1}, {"max_df_pages": 0}, {"per_hop": 0}, {"min_terms": 0},
                {"share": 1.5}):
        with pytest.raises(ValueError):
            LinkConfig(**bad)
