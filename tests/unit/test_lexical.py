"""Lexical rarity over token ids and the hybrid selector's policy: no model, no text."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from contextd.wire import PageState, PinKind
from controller.hybrid import (
    HybridConfig,
    choose_groups,
    coverage_order,
    match_edges,
)
from controller.keyindex import KeyIndex, KeyIndexConfig
from controller.lexical import LexicalConfig, LexicalIndex, vocabulary_bytes
from controller.pager import PAGE_TOKENS, Pager, PagerConfig, Plan
from controller.selectors import HybridSelector, SelectionContext

STOP = (1, 2)  # the chat template's own ids in these tests


def _page(rng: np.random.Generator, planted: list[int] | None = None, at: int = 40) -> list[int]:
    """A page of common ids (10 .. 60, shared by every page) with `planted` ids written at `at`."""
    ids = rng.integers(10, 60, size=PAGE_TOKENS).tolist()
    for k, t in enumerate(planted or []):
        ids[at + k] = t
    return ids


def _index(pages: list[list[int]], config: LexicalConfig | None = None, **kw: object) -> LexicalIndex:
    index = LexicalIndex(config, stop_ids=STOP, **kw)  # type: ignore[arg-type]
    for p, ids in enumerate(pages):
        index.add(p, ids)
    return index


def _scores(index: LexicalIndex, query: list[int], candidates: list[int]) -> np.ndarray:
    return index.scores(index.match(query, candidates), candidates)


def test_the_page_sharing_the_rare_ids_ranks_first() -> None:
    rng = np.random.default_rng(0)
    pages = [_page(rng) for _ in range(30)]
    pages[17] = _page(rng, [900, 901, 902])
    index = _index(pages)
    query = [1, 20, 30, 900, 901, 902, 2]
    scores = _scores(index, query, list(range(30)))
    assert int(np.argmax(scores)) == 17
    assert index.top(index.match(query, list(range(30))), 1) == [17]
    assert scores[17] > 2 * np.sort(scores)[-2]


def test_template_ids_count_for_nothing() -> None:
    rng = np.random.default_rng(1)
    pages = [_page(rng) for _ in range(20)]
    pages[3] = _page(rng, [1, 700, 2, 1, 701, 2])   # a page full of message boundaries
    pages[11] = _page(rng, [800, 801])
    index = _index(pages)
    assert len(index.match([1, 2, 1, 2], list(range(20))).terms) == 0
    scores = _scores(index, [1, 800, 801, 2, 1], list(range(20)))
    assert int(np.argmax(scores)) == 11 and scores[3] == 0


def test_bigrams_prefer_the_exact_sequence() -> None:
    rng = np.random.default_rng(2)
    pages = [_page(rng) for _ in range(12)]
    pages[2] = _page(rng, [500, 77, 600])   # orders-api
    pages[5] = _page(rng, [500, 77, 601])   # orders-cache: the one asked about
    pages[8] = _page(rng, [502, 77, 601])   # payments-cache
    unigram = _index(pages, LexicalConfig(token_ngrams=(1,)))
    bigram = _index(pages, LexicalConfig(token_ngrams=(1, 2)))
    query = [500, 77, 601]
    u, b = _scores(unigram, query, list(range(12))), _scores(bigram, query, list(range(12)))
    assert int(np.argmax(b)) == 5
    assert b[5] - max(b[2], b[8]) > u[5] - max(u[2], u[8])


def test_idf_over_candidates_or_all_pages() -> None:
    rng = np.random.default_rng(3)
    pages = [_page(rng, [400]) if p < 6 else _page(rng) for p in range(12)]
    local = _index(pages, LexicalConfig(idf_over="candidates"))
    every = _index(pages, LexicalConfig(idf_over="all"))
    cold = [0, 6, 7, 8, 9, 10, 11]  # 400 is common overall but rare among the cold pages
    assert local.match([400], cold).weights[0] > every.match([400], cold).weights[0]


def test_byte_ngrams_match_across_token_boundaries() -> None:
    # " Alder" as one token in the question, "Al" + "der" in the page: no shared id, shared bytes.
    table = [b""] * 16
    table[3], table[4], table[5], table[6], table[7] = b" Alder", b"Al", b"der", b" rejects", b" x"
    pages = [[4, 5, 6] + [7] * 10, [7] * 13, [6, 7, 7] + [7] * 10]
    ids_only = _index(pages, LexicalConfig(token_ngrams=(1, 2)))
    with_bytes = _index(pages, LexicalConfig(token_ngrams=(1, 2), byte_ngrams=(4,)), token_bytes=table)
    assert _scores(ids_only, [3], [0, 1, 2]).max() == 0
    scores = _scores(with_bytes, [3], [0, 1, 2])
    assert int(np.argmax(scores)) == 0 and scores[1] == scores[2] == 0
    profile = with_bytes.profile(0, with_bytes.match([3], [0, 1, 2]))
    assert profile[0] > 0 and profile[1] > 0 and profile[3:].sum() == 0
    with pytest.raises(ValueError):
        LexicalIndex(LexicalConfig(byte_ngrams=(4,)))


def test_vocabulary_bytes_undoes_the_byte_level_stand_ins() -> None:
    pieces = ["\u0120Hello", "\u00e3\u0123", "\u010a", "abc"]   # " Hello", bytes e3 81 (half a kana), "\n"
    assert vocabulary_bytes(pieces, byte_level=True) == [b" Hello", b"\xe3\x81", b"\n", b"abc"]
    sentencepiece = [chr(0x2581) + "Hello", "<0x0A>", "abc", "<0xZZ>"]
    assert vocabulary_bytes(sentencepiece, byte_level=False) == [b" Hello", b"\n", b"abc", b"<0xZZ>"]


def test_truncation_forgets_the_cut_pages_in_every_segment() -> None:
    rng = np.random.default_rng(4)
    pages = [_page(rng, [900 + p % 7]) for p in range(70)]   # several merged segments and fresh pages
    index = _index(pages)
    assert index.top(index.match([905], list(range(70))), 20) == [p for p in range(70) if p % 7 == 5]
    index.truncate(33)
    assert sorted(index.pages) == list(range(33))
    assert index.top(index.match([905], list(range(70))), 20) == [p for p in range(33) if p % 7 == 5]
    index.add(33, _page(rng, [905]))            # the page after the cut, with other text
    index.add(5, _page(rng))                    # stored pages are immutable: a second add changes nothing
    assert index.top(index.match([905], list(range(70))), 20) == [5, 12, 19, 26, 33]
    rebuilt = _index(pages[:33])
    rebuilt.add(33, index.pages[33].tolist())
    assert np.allclose(_scores(index, [905, 30], list(range(34))), _scores(rebuilt, [905, 30], list(range(34))))
    index.clear()
    assert not index.pages and index.nbytes == 0


def test_profile_says_where_the_match_is() -> None:
    rng = np.random.default_rng(5)
    pages = [_page(rng) for _ in range(10)]
    pages[4] = _page(rng, [900, 901], at=PAGE_TOKENS - 3)
    index = _index(pages)
    profile = index.profile(4, index.match([900, 901], list(range(10))))
    assert profile[-3:-1].min() > 0 and profile[:-4].sum() == 0
    assert match_edges(profile, 16) == (False, True)
    assert match_edges(profile, 0) == (False, False)
    assert match_edges(np.zeros(PAGE_TOKENS), 16) == (False, False)


def test_coverage_prefers_a_page_that_adds_what_the_first_lacks() -> None:
    # Terms: 0-1 the attribute (in pages 0, 1, 2), 2 the name (page 3 only, weaker on its own).
    evidence = np.array([[3.0, 3.0, 0.0], [3.0, 3.0, 0.0], [3.0, 2.9, 0.0], [0.0, 0.0, 4.0]])
    plain = np.argsort(-evidence.sum(axis=1), kind="stable").tolist()
    assert plain[:2] == [0, 1]
    order, gains = coverage_order(evidence, 0.3, 4)
    assert order[:2] == [0, 3] and gains[0] == 6.0
    assert coverage_order(evidence, 1.0, 4)[0][:3] == [0, 1, 2]


def choose_pages(evidence: np.ndarray, candidates: list[int], room_pages: int, config: HybridConfig,
                 edges: Callable[[int], tuple[bool, bool]] | None = None) -> list[int]:
    """The hybrid's groups, one page after another (what the selector restores)."""
    return [page for group in choose_groups(evidence, candidates, room_pages, config, edges) for page in group]


def test_choose_pages_cuts_adds_neighbours_and_respects_room() -> None:
    evidence = np.array([[5.0], [0.2], [4.0], [0.0]])
    candidates = [10, 20, 30, 40]
    config = HybridConfig(max_pages=8, coverage_decay=1.0, cutoff=0.1)
    assert choose_pages(evidence, candidates, 8, config) == [10, 30]
    assert choose_pages(evidence, candidates, 1, config) == [10]
    lean = {10: (False, True), 30: (True, False)}
    with_edges = choose_pages(evidence, [10, 11, 30, 29], 8, config, lambda p: lean.get(p, (False, False)))
    assert with_edges == [10, 11, 30, 29]
    assert choose_pages(np.zeros((2, 1)), [1, 2], 8, config) == []
    assert choose_pages(evidence, candidates, 0, config) == []
    with pytest.raises(ValueError):
        HybridConfig(coverage_decay=1.5)


def test_key_evidence_rows_sum_to_the_key_index_scores() -> None:
    rng = np.random.default_rng(6)
    vocabulary = rng.normal(size=(300, 32)).astype(np.float32)
    index = KeyIndex(KeyIndexConfig(), attention_layers=4)
    for p in range(12):
        tokens = vocabulary[rng.integers(0, 300, size=PAGE_TOKENS)]
        index.add(p, np.repeat(tokens.reshape(PAGE_TOKENS, 2, 16).transpose(1, 0, 2)[None], 4, axis=0))
    incoming = vocabulary[rng.integers(0, 300, size=20)]
    keys = np.repeat(incoming.reshape(20, 2, 16).transpose(1, 0, 2)[None], 4, axis=0)
    evidence = index.evidence(keys, list(range(12)))
    assert evidence.shape == (12, 20)
    assert np.allclose(evidence.sum(axis=1), index.scores(keys, list(range(12))), atol=1e-4)
    keep = np.zeros(20, dtype=bool)
    keep[:5] = True
    assert index.evidence(keys, list(range(12)), keep).shape == (12, 5)


def _pager(pages: int, budget: int = 2048) -> Pager:
    pager = Pager(PagerConfig(budget_tokens=budget))
    pager.append(list(range(256)), pin=PinKind.SYSTEM)
    pager.append(list(range(pages * PAGE_TOKENS - 256)))
    for page in pager.pages[2:-8]:
        page.state, page.stored = PageState.COLD, True
    return pager


def test_hybrid_selector_restores_the_fact_page_and_its_neighbour() -> None:
    rng = np.random.default_rng(7)
    pager = _pager(40)
    pages = [_page(rng) for _ in range(40)]
    pages[12] = _page(rng, [900, 901], at=PAGE_TOKENS - 4)   # the name, at the end of page 12
    lexical = LexicalIndex(stop_ids=STOP)
    for p, ids in enumerate(pages):
        lexical.add(p, ids)
    ctx = SelectionContext("s", pager, room_tokens=4 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, 30, 900, 901, 2])
    selection = HybridSelector().select(ctx)
    assert selection.plan is not None
    assert 12 in selection.plan.restore and 13 in selection.plan.restore
    assert len(selection.plan.restore) <= 4
    bare = SelectionContext("s", pager, room_tokens=4 * PAGE_TOKENS)
    assert HybridSelector().select(bare).plan is None  # no lexical index: no advice, no failure


def test_hybrid_selector_with_keys_reads_the_key_index_too() -> None:
    rng = np.random.default_rng(8)
    pager = _pager(30)
    vocabulary = rng.normal(size=(200, 32)).astype(np.float32)
    lexical = LexicalIndex(stop_ids=STOP)
    keys = KeyIndex(KeyIndexConfig(), attention_layers=4)
    for page in range(30):
        ids = rng.integers(10, 60, size=PAGE_TOKENS)
        if page == 9:
            ids[50:53] = [150, 151, 152]
        lexical.add(page, ids.tolist())
        vectors = vocabulary[ids]
        keys.add(page, np.repeat(vectors.reshape(PAGE_TOKENS, 2, 16).transpose(1, 0, 2)[None], 4, axis=0))
    incoming = np.array([1, 150, 151, 152, 2])
    ctx = SelectionContext("s", pager, room_tokens=6 * PAGE_TOKENS, key_index=keys,
                           incoming_keys=np.repeat(vocabulary[incoming].reshape(5, 2, 16).transpose(1, 0, 2)[None],
                                                   4, axis=0),
                           lexical_index=lexical, incoming_ids=incoming.tolist())
    selector = HybridSelector(HybridConfig(key_weight=0.5))
    assert selector.uses_key_index and not HybridSelector().uses_key_index
    selection = selector.select(ctx)
    assert selection.plan is not None and 9 in selection.plan.restore
    with pytest.raises(ValueError):
        HybridConfig(incoming_tokens=0)


def test_scores_equal_bm25_written_out_term_by_term() -> None:
    # Enough pages for merged segments and fresh pages; a small vocabulary so terms repeat.
    rng = np.random.default_rng(9)
    pages = [rng.integers(3, 40, size=PAGE_TOKENS).tolist() for _ in range(45)]
    config = LexicalConfig(token_ngrams=(1, 2), idf_power=2.0)
    index = _index(pages, config)
    query = rng.integers(3, 40, size=12).tolist()
    candidates = list(range(0, 45, 2))
    k1 = config.k1

    def terms_of(ids: list[int]) -> list[tuple[int, ...]]:
        return [(t,) for t in ids] + [tuple(ids[i:i + 2]) for i in range(len(ids) - 1)]

    wanted = set(terms_of(query))
    expected = []
    for p in candidates:
        total = 0.0
        for term in wanted:
            df = sum(1 for c in candidates if term in terms_of(pages[c]))
            tf = terms_of(pages[p]).count(term)
            if tf and df:
                idf = np.log(1.0 + (len(candidates) - df + 0.5) / (df + 0.5)) ** config.idf_power
                total += idf * tf * (k1 + 1) / (tf + k1)
        expected.append(total)
    match = index.match(query, candidates)
    assert np.allclose(index.scores(match, candidates), expected)
    best = sorted(candidates, key=lambda c: (-expected[candidates.index(c)], c))[:5]
    assert index.top(match, 5) == best


def test_a_term_in_more_pages_than_the_cap_is_skipped() -> None:
    rng = np.random.default_rng(10)
    pages = [_page(rng, [700] if p < 30 else [701]) for p in range(40)]   # 700 in 30 pages, 701 in 10
    capped = _index(pages, LexicalConfig(max_df_pages=20))
    match = capped.match([700, 701], list(range(40)))
    assert match.terms.tolist() == capped.match([701], list(range(40))).terms.tolist()
    assert set(capped.top(match, 40)) == set(range(30, 40))
    uncapped = _index(pages)
    assert set(uncapped.top(uncapped.match([700, 701], list(range(40))), 40)) >= set(range(40))
    with pytest.raises(ValueError):
        LexicalConfig(max_df_pages=0)


def test_hybrid_selector_brings_nothing_back_when_every_shared_term_is_a_common_word() -> None:
    """A question that shares only the session's common words with the cold pages (the end of a
    long message of filler, the question's own terms found nowhere) gets no restore: under the
    floor every match is noise. With the floor at 0 the same question brings filler back."""
    rng = np.random.default_rng(9)
    pager = _pager(40)
    lexical = LexicalIndex(LexicalConfig(idf_power=3.0), stop_ids=STOP)   # the served power (DEFAULT_LEXICAL)
    for p in range(40):   # filler of six ids: every id and every pair of them is in every page
        lexical.add(p, rng.integers(10, 16, size=PAGE_TOKENS).tolist())
    ctx = SelectionContext("s", pager, room_tokens=4 * PAGE_TOKENS, lexical_index=lexical,
                           incoming_ids=[1, *rng.integers(10, 16, size=40).tolist(), 700, 701, 2])
    assert HybridSelector().select(ctx).plan == Plan(restore=[])
    unfloored = HybridSelector(HybridConfig(min_gain=0.0)).select(ctx)
    assert unfloored.plan is not None and unfloored.plan.restore
    with pytest.raises(ValueError):
        HybridConfig(min_gain=-1.0)
