"""Following links: the cold pages that the pages a question finds point to.

Why: a question names what it asks about, and the answer may be a chain. In variable tracking
(`VAR B = VAR A.` somewhere after `VAR A = 12345.`, RULER's multi-hop task), or in code (a call
names a function, whose definition names a constant), the question shares a rare term with the
first link only; the first link names the second, the second the third. Lexical matching on the
question's words alone brings back the first link and nothing after it (docs/results/ruler.md).
Following is a selector capability, not a rule about any task: a page that the question (or an
earlier hop) found names, near where it was found, terms that few other pages hold; those pages
are the next hop.

  link      a term (controller.lexical: token n-grams and byte n-grams, as the index has them)
            found in at least one and at most `max_df_pages` pages of the session, counting the
            indexed (stored) pages and the pages held in attention alike: rarer than any common
            word, shared by a few places.
  sources   hop 0: the pages (held or cold) that hold at least `min_terms` link terms of the
            question; the pages the question itself lies in are never sources. One shared rare
            term is often chance (two common words side by side, a byte n-gram across a word
            boundary); a name shares several (its tokens, the pairs and the byte n-grams in it).
  near      in a source, the tokens within `window_tokens` of where the terms that led to it
            occur; the link terms among them that no earlier hop used lead on.
  hop       the pages holding at least `min_terms` of those terms, and at least `share` of the
            link weight (idf over the session's pages) the best new one holds, are the next
            sources (an earlier source holding them is read again: two links may share a page):
            a held page is read through (it needs no restore, what it names is followed), a
            cold page is found unless an earlier hop had it. Of each hop's new cold
            pages, the `per_hop` with the most link weight come back.
  edges     the window reads across a page's edges into the pages beside it (a line a page
            boundary cuts); a found page whose window reached a cold neighbour brings it too.
  stop      after `hops` hops, or when a hop finds no link term no earlier hop used.

The host decides the rest: the hybrid puts what is found after its own choice, within its page
limit and the room (controller.selectors.hybrid_groups). Nothing here knows a language: hashes,
counts and positions. Depends on numpy, contextd.wire (PageState), controller.pager (Page) and
controller.lexical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from contextd.wire import PageState
from controller.lexical import LexicalIndex
from controller.pager import Page


@dataclass(frozen=True)
class LinkConfig:
    """Off unless asked for (`--follow-hops`): on the agent sessions of benchmarks.selectors the
    pages it finds hold no evidence and cost precision (docs/journal/2026-12-07-links.md); it is for
    questions whose answer is a chain (docs/results/ruler.md, variable tracking)."""

    hops: int = 0               # hops followed past the question's own matches (0: off; FOLLOW_HOPS: on)
    window_tokens: int = 8      # tokens either side of a match whose link terms lead on
    max_df_pages: int = 3       # a term in more of the session's pages than this is not a link
    per_hop: int = 2            # new cold pages a hop brings at most
    min_terms: int = 3          # link terms a page must share to be led to
    share: float = 0.5          # a found page's link weight, at least this share of the hop's best

    def __post_init__(self) -> None:
        if self.hops < 0:
            raise ValueError(f"hops must be >= 0, got {self.hops}")
        if self.window_tokens < 0:
            raise ValueError(f"window_tokens must be >= 0, got {self.window_tokens}")
        if not 0.0 <= self.share <= 1.0:
            raise ValueError(f"share must be in [0, 1], got {self.share}")
        if min(self.max_df_pages, self.per_hop, self.min_terms) < 1:
            raise ValueError("max_df_pages, per_hop and min_terms must be >= 1, got "
                             f"{self.max_df_pages}, {self.per_hop} and {self.min_terms}")


FOLLOW_HOPS = 4   # what `--follow-hops` asks for to follow a chain of RULER's length (4 hops)


class _Session:
    """The session's pages as terms: the indexed pages through the index's postings, the held pages
    that are not indexed yet (a turn's own new pages) from their ids."""

    def __init__(self, lexical: LexicalIndex, pages: Sequence[Page], held_ids: Callable[[int], Sequence[int]],
                 skip: set[int]) -> None:
        self.lexical = lexical
        self.pages = pages
        self.held_ids = held_ids
        self.skip = skip
        self.unindexed = {p.index: np.unique(lexical.terms(list(held_ids(p.index))).hashes) for p in pages
                          if p.resident and p.index not in lexical.pages and p.index not in skip}

    def holders(self, terms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(index into sorted unique `terms`, page) for every page of the session that holds one;
        the question's own pages left out."""
        which, page = self.lexical.pages_with(terms)
        extra_which, extra_page = [which], [page]
        for index, held in self.unindexed.items():
            found = np.flatnonzero(np.isin(terms, held, assume_unique=True))
            extra_which.append(found)
            extra_page.append(np.full(len(found), index, dtype=np.int64))
        which, page = np.concatenate(extra_which), np.concatenate(extra_page)
        keep = ~np.isin(page, np.fromiter(self.skip, dtype=np.int64, count=len(self.skip)))
        return which[keep], page[keep]

    def links(self, terms: np.ndarray, max_df: int, min_terms: int
              ) -> tuple[np.ndarray, dict[int, set[int]], np.ndarray]:
        """Of sorted unique `terms`, the links (held by 1..max_df pages), the pages holding at
        least `min_terms` of them (page -> indices into the links) and each link's idf over the
        session's pages."""
        which, page = self.holders(terms)
        df = np.bincount(which, minlength=len(terms))
        is_link = (df >= 1) & (df <= max_df)
        renumber = np.cumsum(is_link) - 1
        by_page: dict[int, set[int]] = {}
        for w, p in zip(which.tolist(), page.tolist(), strict=True):
            if is_link[w]:
                by_page.setdefault(p, set()).add(int(renumber[w]))
        n_pages = len(self.lexical.pages) + len(self.unindexed)
        idf = np.log(1.0 + (n_pages - df[is_link] + 0.5) / (df[is_link] + 0.5))
        return terms[is_link], {p: found for p, found in by_page.items() if len(found) >= min_terms}, idf

    def ids(self, page: int) -> Sequence[int] | None:
        """A page's ids: indexed, or held; None for a page that is neither (or not there)."""
        if not 0 <= page < len(self.pages):
            return None
        ids = self.lexical.pages.get(page)
        if ids is not None:
            return [int(t) for t in ids]
        return list(self.held_ids(page)) if self.pages[page].resident else None

    def near(self, page: int, found_by: np.ndarray, window: int) -> tuple[np.ndarray, list[int]]:
        """The terms within `window` tokens of where the terms `found_by` occur in `page`, read
        across its edges into the pages beside it (a line a page boundary cuts); and those
        neighbours the window reached into."""
        own = self.ids(page) or []
        before = (self.ids(page - 1) or [])[-window:] if window else []
        after = (self.ids(page + 1) or [])[:window] if window else []
        terms = self.lexical.terms([*before, *own, *after])
        hit = np.isin(terms.hashes, found_by)
        if not hit.any():
            return np.zeros(0, dtype=np.uint64), []
        tokens = len(before) + len(own) + len(after)
        edges = np.zeros(tokens + 1, dtype=np.int64)
        np.add.at(edges, np.maximum(terms.start[hit] - window, 0), 1)
        np.add.at(edges, np.minimum(terms.start[hit] + terms.span[hit] + window, tokens), -1)
        inside = np.cumsum(edges)[:tokens] > 0
        starts_in = inside[terms.start]
        ends_in = inside[terms.start + terms.span - 1]
        out: np.ndarray = terms.hashes[starts_in & ends_in & (terms.hashes != 0)]
        reached = [n for n, part in ((page - 1, inside[:len(before)]), (page + 1, inside[len(before) + len(own):]))
                   if part.any()]
        return out, reached


def follow(lexical: LexicalIndex, query_ids: np.ndarray, pages: Sequence[Page],
           held_ids: Callable[[int], Sequence[int]], skip: set[int], config: LinkConfig) -> list[list[int]]:
    """The cold pages each hop finds, hop by hop (hop 1 first), none found twice. `skip`: the pages
    the question lies in (never sources); `held_ids(page)`: the ids of a page in attention."""
    if config.hops == 0:
        return []
    session = _Session(lexical, pages, held_ids, skip)
    query = np.unique(lexical.terms(query_ids).hashes)
    links, by_page, _ = session.links(query[query != 0], config.max_df_pages, config.min_terms)
    used = set(links.tolist())
    frontier = {page: links[sorted(found)] for page, found in by_page.items()}
    taken = set(frontier)
    hops: list[list[int]] = []
    reached: dict[int, list[int]] = {}   # a page -> the pages beside it its window read into
    for _ in range(config.hops):
        near: list[np.ndarray] = [np.zeros(0, dtype=np.uint64)]
        for page, found in frontier.items():
            terms, beside = session.near(page, found, config.window_tokens)
            near.append(terms)
            reached[page] = beside
        fresh = np.unique(np.concatenate(near))
        fresh = fresh[~np.isin(fresh, np.fromiter(used, dtype=np.uint64, count=len(used)))]
        if not len(fresh):
            break
        links, by_page, idf = session.links(fresh, config.max_df_pages, config.min_terms)
        if not len(links):
            break
        used.update(links.tolist())
        weight = {page: float(idf[sorted(found)].sum()) for page, found in by_page.items()}
        bar = config.share * max((w for p, w in weight.items() if p not in taken), default=0.0)
        frontier = {page: links[sorted(found)] for page, found in by_page.items()
                    if page in taken or weight[page] >= bar}
        new = sorted((p for p in frontier if pages[p].state is PageState.COLD and p not in taken),
                     key=lambda p: (-weight[p], p))[:config.per_hop]
        taken.update(frontier)
        hops.append(new)
    # A found page whose link sits at its edge brings the cold page across it: the link comes
    # back whole.
    for page, found in frontier.items():
        if page not in reached:
            reached[page] = session.near(page, found, config.window_tokens)[1]
    for hop in hops:
        for page in list(hop):
            for other in reached.get(page, []):
                if pages[other].state is PageState.COLD and other not in taken:
                    taken.add(other)
                    hop.append(other)
    return hops
