"""Lexical rarity over the serving tokenizer's ids: BM25 on token n-grams and byte n-grams, by page.

Why: on sessions unlike the demo workload the key index (controller.keyindex) misses most facts:
near-identical boilerplate, many near-duplicate facts, a question that shares only the name of the
thing with the fact, a fact whose two halves sit in two files. Most of the miss is the chat
template: every question starts with `<|im_start|>user` and ends with `<|im_start|>assistant`,
and those tokens (with the question's function words) match every page that holds a message
boundary. Exact rarity over the ids themselves, with the template's own ids left out, finds the
page that shares the question's rare terms (figures in docs/controller.md; the policy on top is
controller.hybrid).

  terms     token-id 1- and 2-grams, and byte 6-grams over the tokens' bytes (the vocabulary's byte
            strings, `vocabulary_bytes`): a name spelt " Alder" in the question and "Al"+"der" at
            the start of a line still shares "Alder". A term that covers one of `stop_ids` (the
            chat template's own ids: role markers, <|im_start|>, the newline after a role) is
            dropped, in the pages and in the query. Terms are 64-bit FNV-1a hashes.
  weight    idf(t) ** idf_power, idf(t) = log(1 + (N - df + 0.5) / (df + 0.5)), N and df counted
            over the candidate (cold) pages; the power (3 by default) lets the rarest shared
            term, usually a name, outweigh a handful of common words.
  score     BM25 (k1 = 1.2): sum over the query's terms of weight * tf (k1 + 1) / (tf + k1).
            Stored pages are all 128 tokens, so there is no length normalisation.
  common    a term found in more than `max_df_pages` (512) indexed pages is skipped: past 64k
            tokens such a term is a common word of the session, its idf**3 weighs a few percent
            of a name's, and its postings are what a query would otherwise spend its time on.
            Below 512 pages nothing is skipped, so every figure measured at those sizes holds.
  profile   per token of a page, the weight of the query terms that cover it: where the match is.

Layout, for sessions of a million tokens: the postings are numpy arrays (term, page, tf) sorted by
term, in a few segments of doubling size (a new page lands in a small segment; equal-sized
segments merge), so adding a page costs its own terms plus an amortised merge, and a query costs
a binary search per term and segment plus the postings it touches, never a walk over every page.
About 13 bytes a posting, ~700 postings a 128-token page: ~9 KiB a page, ~70 MB at a million
tokens (benchmarks.scale measures it).

Nothing here knows a language: ids, bytes, counts and positions only (the host rule of
tests/unit/test_selectors.py). Depends on numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_SEGMENT_PAGES = 16   # pages gathered before they become a segment of their own


@dataclass(frozen=True)
class LexicalConfig:
    token_ngrams: tuple[int, ...] = (1, 2)   # lengths of token-id n-grams used as terms
    byte_ngrams: tuple[int, ...] = ()        # lengths of byte n-grams (needs the vocabulary's bytes)
    k1: float = 1.2                          # BM25 term-frequency saturation
    idf_power: float = 1.0                   # > 1 lets the rarest shared term dominate the sum
    idf_over: str = "candidates"             # "candidates" (the pages scored) or "all" (every indexed page)
    max_df_pages: int = 512                  # a term in more pages than this is skipped (see below)

    def __post_init__(self) -> None:
        if not self.token_ngrams and not self.byte_ngrams:
            raise ValueError("a lexical index needs token or byte n-grams")
        if any(n < 1 for n in (*self.token_ngrams, *self.byte_ngrams)):
            raise ValueError("n-gram lengths must be >= 1")
        if self.k1 <= 0 or self.idf_power <= 0:
            raise ValueError("k1 and idf_power must be positive")
        if self.max_df_pages < 1:
            raise ValueError(f"max_df_pages must be >= 1, got {self.max_df_pages}")
        if self.idf_over not in ("candidates", "all"):
            raise ValueError(f"idf_over must be 'candidates' or 'all', got {self.idf_over!r}")


def _ngrams(units: np.ndarray, n: int, blocked: np.ndarray, salt: int) -> np.ndarray:
    """FNV-1a hashes of the n-grams of `units` by start position; 0 where an n-gram is blocked."""
    if len(units) < n:
        return np.zeros(0, dtype=np.uint64)
    m = len(units) - n + 1
    h = np.full(m, _FNV_OFFSET ^ np.uint64(salt), dtype=np.uint64)
    bad = np.zeros(m, dtype=bool)
    for k in range(n):
        h = (h ^ units[k:k + m]) * _FNV_PRIME
        bad |= blocked[k:k + m]
    h = (h ^ np.uint64(n)) * _FNV_PRIME
    h[bad | (h == 0)] = 0
    return h


@dataclass(frozen=True)
class Terms:
    """A run of tokens as terms: hashes, the token each term starts at and the tokens it covers."""

    hashes: np.ndarray   # uint64, 0 = no term
    start: np.ndarray    # int64 token index
    span: np.ndarray     # int64 tokens covered


@dataclass(frozen=True)
class _Postings:
    """(term, page, tf) triples sorted by term."""

    terms: np.ndarray   # uint64
    pages: np.ndarray   # int32
    tf: np.ndarray      # uint8 (a term more often than 255 times in a page is saturated long before)

    @staticmethod
    def of(parts: Sequence[_Postings]) -> _Postings:
        terms = np.concatenate([p.terms for p in parts])
        order = np.argsort(terms, kind="stable")
        return _Postings(terms[order], np.concatenate([p.pages for p in parts])[order],
                         np.concatenate([p.tf for p in parts])[order])

    def below(self, pages: int) -> _Postings:
        keep = self.pages < pages
        return _Postings(self.terms[keep], self.pages[keep], self.tf[keep])

    def bounds(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For sorted unique `query` terms: where each one's postings start and end."""
        return np.searchsorted(self.terms, query, side="left"), np.searchsorted(self.terms, query, side="right")

    @staticmethod
    def expand(lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(query index, posting index) of every posting in the ranges [lo, hi)."""
        counts = hi - lo
        which = np.repeat(np.arange(len(lo), dtype=np.int64), counts)
        firsts = np.repeat(lo - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        return which, firsts + np.arange(int(counts.sum()), dtype=np.int64)

    @property
    def nbytes(self) -> int:
        return int(self.terms.nbytes + self.pages.nbytes + self.tf.nbytes)


@dataclass(frozen=True)
class Match:
    """A query's terms that occur in some candidate page, their weights, and where they occur."""

    terms: np.ndarray     # uint64 sorted unique query terms with df > 0 among the candidates
    weights: np.ndarray   # float64, idf ** idf_power per term
    term: np.ndarray      # int64 per posting: index into `terms`
    page: np.ndarray      # int64 per posting: a candidate page
    tf: np.ndarray        # float64 per posting


class LexicalIndex:
    """Terms of a session's stored full pages, by page number, for BM25 scoring."""

    def __init__(self, config: LexicalConfig | None = None, stop_ids: Sequence[int] = (),
                 token_bytes: Sequence[bytes] | None = None) -> None:
        self.config = config or LexicalConfig()
        if self.config.byte_ngrams and token_bytes is None:
            raise ValueError("byte n-grams need token_bytes (the vocabulary's byte strings)")
        # Ids of the chat template's own framing (role markers): no term covers one.
        self.stop_ids = np.unique(np.asarray(list(stop_ids), dtype=np.int64))
        self.token_bytes = list(token_bytes) if token_bytes is not None else None
        self.pages: dict[int, np.ndarray] = {}   # page -> its token ids
        self._segments: list[_Postings] = []     # sizes roughly halve from first to last
        self._fresh: dict[int, _Postings] = {}   # pages not yet in a segment

    # ---------------------------------------------------------------------------------- terms

    def terms(self, token_ids: Sequence[int] | np.ndarray) -> Terms:
        ids = np.asarray(token_ids, dtype=np.int64)
        stop = np.isin(ids, self.stop_ids) if len(self.stop_ids) else np.zeros(len(ids), dtype=bool)
        hashes, starts, spans = [], [], []
        units = ids.astype(np.uint64)
        for n in self.config.token_ngrams:
            h = _ngrams(units, n, stop, salt=0)
            hashes.append(h)
            starts.append(np.arange(len(h), dtype=np.int64))
            spans.append(np.full(len(h), n, dtype=np.int64))
        if self.config.byte_ngrams and self.token_bytes is not None:
            table = self.token_bytes
            pieces = [table[i] if 0 <= i < len(table) else b"" for i in ids.tolist()]
            lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
            raw = np.frombuffer(b"".join(pieces), dtype=np.uint8).astype(np.uint64)
            owner = np.repeat(np.arange(len(ids), dtype=np.int64), lengths)   # byte -> token
            blocked = np.repeat(stop, lengths)
            for n in self.config.byte_ngrams:
                h = _ngrams(raw, n, blocked, salt=1 << 40)
                first = owner[: len(h)]
                last = owner[n - 1: n - 1 + len(h)]
                hashes.append(h)
                starts.append(first)
                spans.append(last - first + 1)
        return Terms(np.concatenate(hashes), np.concatenate(starts), np.concatenate(spans))

    def _unique_terms(self, token_ids: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hashes = self.terms(token_ids).hashes
        uniq, counts = np.unique(hashes[hashes != 0], return_counts=True)
        return uniq, counts

    # ---------------------------------------------------------------------------------- pages

    def add(self, page: int, token_ids: Sequence[int] | np.ndarray) -> None:
        """Index a stored page. Pages are immutable: adding one already indexed changes nothing
        (a cut history is taken out with `truncate` first)."""
        if page in self.pages:
            return
        ids = np.asarray(token_ids, dtype=np.int32)
        self.pages[page] = ids
        uniq, counts = self._unique_terms(ids)
        self._fresh[page] = _Postings(uniq, np.full(len(uniq), page, dtype=np.int32),
                                      np.minimum(counts, 255).astype(np.uint8))
        if len(self._fresh) >= _SEGMENT_PAGES:
            self._segments.append(_Postings.of(list(self._fresh.values())))
            self._fresh = {}
            while len(self._segments) > 1 and 2 * len(self._segments[-1].terms) >= len(self._segments[-2].terms):
                newest = self._segments.pop()
                self._segments[-1] = _Postings.of([self._segments[-1], newest])

    def truncate(self, pages: int) -> None:
        """Forget every page numbered `pages` or later (the history after a cut)."""
        if all(p < pages for p in self.pages):
            return
        self.pages = {p: ids for p, ids in self.pages.items() if p < pages}
        self._segments = [s for s in (s.below(pages) for s in self._segments) if len(s.terms)]
        self._fresh = {p: f for p, f in self._fresh.items() if p < pages}

    def clear(self) -> None:
        self.pages.clear()
        self._segments.clear()
        self._fresh.clear()

    @property
    def nbytes(self) -> int:
        postings = sum(s.nbytes for s in (*self._segments, *self._fresh.values()))
        return postings + sum(ids.nbytes for ids in self.pages.values())

    # ---------------------------------------------------------------------------------- scoring

    def pages_with(self, terms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For sorted unique term hashes: (index into `terms`, page) of every indexed page that
        holds one, a pair per page and term."""
        which_all, page_all = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
        for postings in (*self._segments, *self._fresh.values()):
            which, where = _Postings.expand(*postings.bounds(terms))
            which_all.append(which)
            page_all.append(postings.pages[where].astype(np.int64))
        return np.concatenate(which_all), np.concatenate(page_all)

    def match(self, query_ids: Sequence[int] | np.ndarray, candidates: Sequence[int]) -> Match:
        """The query's terms in the candidate pages (indexed pages only), weighted by their rarity."""
        config = self.config
        query = np.unique(self._unique_terms(query_ids)[0])
        segments = (*self._segments, *self._fresh.values())
        bounds = [postings.bounds(query) for postings in segments]
        df_all = sum((hi - lo for lo, hi in bounds), np.zeros(len(query), dtype=np.int64))
        keep = df_all <= config.max_df_pages
        query = query[keep]
        hit_term, hit_page, hit_tf = [], [], []
        for postings, (lo, hi) in zip(segments, bounds, strict=True):
            which, where = _Postings.expand(lo[keep], hi[keep])
            hit_term.append(which)
            hit_page.append(postings.pages[where].astype(np.int64))
            hit_tf.append(postings.tf[where].astype(np.float64))
        term = np.concatenate([np.zeros(0, dtype=np.int64), *hit_term])
        page = np.concatenate([np.zeros(0, dtype=np.int64), *hit_page])
        tf = np.concatenate([np.zeros(0, dtype=np.float64), *hit_tf])
        wanted = np.zeros(max(self.pages, default=0) + 1, dtype=bool)   # by page number
        wanted[[p for p in candidates if p in self.pages]] = True
        chosen = wanted[page]
        df_candidates = np.bincount(term[chosen], minlength=len(query))
        if config.idf_over == "candidates":
            n_docs, df = int(wanted.sum()), df_candidates
        else:
            n_docs, df = len(self.pages), np.bincount(term, minlength=len(query))
        present = df_candidates > 0
        weights = np.log(1.0 + (n_docs - df[present] + 0.5) / (df[present] + 0.5)) ** config.idf_power
        renumber = np.cumsum(present) - 1
        term, page, tf = term[chosen], page[chosen], tf[chosen]
        return Match(query[present], weights.astype(np.float64), renumber[term], page, tf)

    def evidence(self, match: Match, pages: Sequence[int]) -> np.ndarray:
        """BM25 term by term: [pages, match.terms]; rows sum to each page's BM25 score."""
        out = np.zeros((len(pages), len(match.terms)), dtype=np.float64)
        if not len(pages):
            return out
        row = {p: i for i, p in enumerate(pages)}
        keep = np.isin(match.page, np.asarray(pages, dtype=np.int64))
        rows = np.fromiter((row[p] for p in match.page[keep].tolist()), dtype=np.int64, count=int(keep.sum()))
        out[rows, match.term[keep]] = self._gain(match)[keep]
        return out

    def _gain(self, match: Match) -> np.ndarray:
        """Each posting's BM25 share. No length normalisation: stored pages are all 128 tokens."""
        k1 = self.config.k1
        gain: np.ndarray = match.weights[match.term] * match.tf * (k1 + 1) / (match.tf + k1)
        return gain

    def scores(self, match: Match, pages: Sequence[int]) -> np.ndarray:
        """BM25 of each of `pages` for the matched query."""
        total: np.ndarray = self.evidence(match, pages).sum(axis=1)
        return total

    def top(self, match: Match, count: int) -> list[int]:
        """The `count` candidate pages with the highest BM25, best first (ties: lower page first)."""
        if not len(match.page):
            return []
        totals = np.bincount(match.page, weights=self._gain(match))   # by page number
        pages = np.flatnonzero(totals > 0)
        if len(pages) > count:
            pages = pages[np.argpartition(-totals[pages], count - 1)[:count]]
        order = np.lexsort((pages, -totals[pages]))
        return [int(p) for p in pages[order]]

    def profile(self, page: int, match: Match) -> np.ndarray:
        """Per token of `page`: the weight of the query terms that cover it (where the match is)."""
        ids = self.pages[page]
        out = np.zeros(len(ids), dtype=np.float64)
        if not len(match.terms):
            return out
        terms = self.terms(ids)
        slot = np.searchsorted(match.terms, terms.hashes)
        slot = np.minimum(slot, len(match.terms) - 1)
        found = match.terms[slot] == terms.hashes
        for s, n, w in zip(terms.start[found].tolist(), terms.span[found].tolist(),
                           match.weights[slot[found]].tolist(), strict=True):
            out[s:s + n] += w / n
        return out


def vocabulary_bytes(pieces: Sequence[str], byte_level: bool) -> list[bytes]:
    """Byte strings of a vocabulary given as its token strings, in id order.

    byte_level: GPT-2 style byte-level BPE (SmolLM2, Qwen, Llama 3), whose token strings spell
    bytes with printable stand-ins; they are mapped back. Otherwise SentencePiece conventions:
    the word-start mark U+2581 is a space and `<0xNN>` pieces are single bytes; the rest is UTF-8.
    """
    if not byte_level:
        mark = chr(0x2581)
        out = []
        for piece in pieces:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    out.append(bytes([int(piece[3:5], 16)]))
                    continue
                except ValueError:
                    pass
            out.append(piece.replace(mark, " ").encode())
        return out
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    stand_in = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            stand_in[chr(256 + extra)] = b
            extra += 1
    return [bytes(stand_in[c] for c in p if c in stand_in) for p in pieces]


# The tuned default (see docs/controller.md): token 1- and 2-grams and byte 6-grams, IDF cubed.
DEFAULT_LEXICAL = LexicalConfig(token_ngrams=(1, 2), byte_ngrams=(6,), idf_power=3.0)
