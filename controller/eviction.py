"""Eviction order advised by the model: of the pages the pager would evict next, those least related
to what the user asked last leave first.

The pager's own retention evicts the oldest unprotected pages first. In an agent's session the
user's last message states the task, and the turns after it are mostly tool results: the file the
task is about was often read early and is the first to go while the agent reads on. With this
advice the pager keeps the order it has for everything else, but among its `window` oldest
evictable pages the ones under which the task's own words are least likely go first (query
likelihood, the re-ranker's score: controller.rerank), so a page the task is about stays while
pages that have nothing to do with it leave in its place.

  focus     the last user message's newest non-template ids (`question_tokens` of them); a turn
            with no user message in it (tool results), or one whose user message has fewer than
            two such tokens, keeps the focus it had. A session without one (new, restarted,
            adopted, branched, or rebuilt after a failed turn) takes it from the last user
            message its request carries. No focus, no advice.
  window    the `window` oldest pages the pager may evict now (pins, the ledger, the tail and
            leases excluded: the host's rules decide what is evictable, this only orders it).
            When no more of them are evictable than must go, there is nothing to choose and
            nothing is scored.
  scores    each page's mean log-probability of the focus as the next user turn after the page on
            its own (the re-ranker's score: the template's user opening between them), read by the
            host (`HeldScorer`: over the page's K/V in attention, or by a separate controller
            model from its text; one forward of at most `window` pages: the window's unscored
            ones, then the pages that may become evictable next; counted as controller forward
            tokens, never a forward over history). A page the scorer could not score leaves the
            window unordered (no advice). Scores are kept until the
            focus changes or the transcript is cut at or before the page: between turns a held
            page's K/V are the stored ones (a turn's blend is undone before it ends).
  order     the window, least likely first (ties: older first); the pager then evicts in that
            order until it is under its low watermark, and past the window in its own.

The attention order (`--evict-order attention`) asks the serving model's own attention instead,
read off the forwards a turn makes anyway (`AttentionOrder`; H2O's accumulation, SnapKV's
observation window, at page granularity):

  watch     the last `queries` tokens of every prefill chunk that votes (below) report their
            softmax weights over the held tokens at `layers` paged layers spread over the middle
            of the stack, head by head (`Backend.observe_attention`): no forward of its own, a
            few score rows per layer; the other chunks run unwatched.
  vote      a user message's chunks, and the answer's opening after one, vote on each unpinned
            held page from before the message: its vote is the weight the page's tokens got from
            the head of each watched layer that read it most, averaged over the layers
            (`page_votes`; at six task questions of tuning sessions the best head ranked the page
            the question asks about first of 7-14 five times, the mean over heads three times).
            The vote is added to the page's score, and the message's own pages get its
            largest vote (the message is the observation window, kept as SnapKV keeps it). A
            tool result does not vote: what a file's lines put on the text before them is mostly
            nearness (every file would vote for the one read before it).
  decay     every score halves each `half_life_tokens` new tokens, so the file the task's
            question read stays ahead of files read after it for a while, and a page no user
            message has read for long falls behind. A cut forgets the scores of the pages it
            rewrites.
  order     the `window` oldest pages the pager may evict now, least attended first (ties:
            older first); past the window the pager's own order. The host's rules decide what
            is evictable, as for the advice above.

Depends on numpy, controller.pager and controller.rerank.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from controller.pager import PAGE_TOKENS, Pager
from controller.rerank import mean_logprob, question_ids

# The host's query likelihood over pages in attention: for held page indices and token ids, every
# page's float64 log p(ids[j] | page, the template's user opening, ids[:j]) (as PageScorer; read
# over the page's K/V where it is held, or by a separate controller model from the page's text, in
# its own tokens).
HeldScorer = Callable[[list[int], list[int]], dict[int, np.ndarray]]

EVICTION_ORDERS = ("recency", "model", "attention")
SCORE_FLOOR = 1e-6   # an attention score below this is dropped (see AttentionOrder.observe)


@dataclass(frozen=True)
class EvictionAdviceConfig:
    window: int = 8            # the oldest evictable pages that are scored and ordered
    question_tokens: int = 12  # the last user message's newest non-template tokens that are scored

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be >= 2 (one page leaves no choice), got {self.window}")
        if self.question_tokens < 2:
            raise ValueError(f"question_tokens must be >= 2, got {self.question_tokens}")


class EvictionAdvisor:
    """One session's focus and the scores of its held pages under it."""

    def __init__(self, config: EvictionAdviceConfig, template_ids: Collection[int]) -> None:
        self.config = config
        self._template = frozenset(int(t) for t in template_ids)
        self.focus: list[int] = []
        self.scores: dict[int, float] = {}

    def set_focus(self, user_message_ids: Sequence[int]) -> None:
        """A new user message: its words are the focus from now on; scores under the old one go."""
        focus = question_ids(user_message_ids, self._template, self.config.question_tokens)
        if len(focus) >= 2 and focus != self.focus:
            self.focus = focus
            self.scores = {}

    def forget_scores(self, pages: Iterable[int]) -> None:
        """These pages now hold other K/V than they were scored for (cut and written again, or
        prefilled again in place)."""
        for page in pages:
            self.scores.pop(page, None)

    def order(self, pager: Pager, incoming_tokens: int, scorer: HeldScorer,
              cheap: Callable[[list[int]], list[int]] | None = None) -> list[int]:
        """The pages to evict first for `incoming_tokens` more, least related to the focus first;
        [] when there is no focus, no choice, or nothing could be scored. `cheap`: of the pages
        that may fill a forward up, those the scorer reads without reading the page first (for a
        controller model, reading a page it has not read yet costs a prefill of that page:
        docs/journal/2026-12-04-controller-model.md, "What it costs on this machine"); None: all."""
        if not self.focus:
            return []
        window = pager.evictable()[:self.config.window]
        need = pager.pages_to_free(incoming_tokens, window)
        if need == 0 or len(window) <= need:
            return []
        unscored = [page for page in window if page not in self.scores]
        if unscored:
            # Filled up to `window` with the pages that come next (the ledger's, leased, the tail's):
            # most of a forward's cost on the CPU is fixed, whatever it holds, and each eviction frees
            # a page or two, so scoring only what entered the window would run one forward per
            # prefill chunk (benchmarks.eviction: docs/journal/2026-12-04-eviction-advice.md).
            coming = [page for page in pager.unpinned_full() if page not in self.scores and page not in unscored]
            if cheap is not None:
                coming = cheap(coming)
            per_token = scorer(unscored + coming[:max(0, self.config.window - len(unscored))], self.focus)
            self.scores.update({page: mean_logprob(lp) for page, lp in per_token.items()})
            if any(page not in self.scores for page in window):
                return []   # nothing to order by (the focus had no words the scorer could read)
        # Stable: of two pages that score alike, the older goes first, as the pager would have it.
        return sorted(window, key=lambda page: self.scores[page])


@dataclass(frozen=True)
class AttentionOrderConfig:
    window: int = 8                  # the oldest evictable pages that are ordered
    queries: int = 32                # the newest tokens of each prefill chunk whose attention is read
    layers: int = 4                  # paged layers read, spread over the middle of the stack
    half_life_tokens: int = 2048     # new tokens after which a page's score counts half

    def __post_init__(self) -> None:
        if self.window < 2:
            raise ValueError(f"window must be >= 2 (one page leaves no choice), got {self.window}")
        if self.queries < 1 or self.layers < 1:
            raise ValueError(f"queries and layers must be >= 1, got {self.queries} and {self.layers}")
        if self.half_life_tokens < 1:
            raise ValueError(f"half_life_tokens must be >= 1, got {self.half_life_tokens}")

    def watched_layers(self, paged: int) -> list[int]:
        """`layers` positions among `paged` paged layers, evenly spaced strictly inside the stack
        (the first layer's attention is mostly positional, the last one's mostly about the next
        token); all of them when there are no more."""
        if paged <= self.layers:
            return list(range(paged))
        return sorted({round((i + 1) * (paged - 1) / (self.layers + 1)) for i in range(self.layers)})


def page_votes(weights: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """Each span's vote from weights [layers, heads, tokens] (`Backend.attention_weights`): the
    weight its tokens got from the head of each layer that read it most, averaged over layers."""
    if not spans:
        return np.zeros(0)
    mass = np.stack([weights[..., start:end].sum(axis=-1) for start, end in spans], axis=-1)
    votes: np.ndarray = mass.max(axis=1).mean(axis=0)
    return votes


class AttentionOrder:
    """One session's held pages scored by the attention the model paid them."""

    def __init__(self, config: AttentionOrderConfig) -> None:
        self.config = config
        self.scores: dict[int, float] = {}
        self._own_first_page: int | None = None   # the first page the message being read writes to
        self._voting = False                       # whether the message being read is the user's

    def begin_message(self, from_user: bool) -> None:
        """A message starts; it votes if the user wrote it. Its pages are known at its first forward."""
        self._own_first_page, self._voting = None, from_user

    @property
    def voting(self) -> bool:
        """Whether the message being read votes (the host reads its chunks' weights only then)."""
        return self._voting

    def begin_opening(self) -> None:
        """The answer's opening starts: it votes as the message before it did, on that message too."""
        self._own_first_page = None

    def observe(self, pager: Pager, weights: np.ndarray | None, new_tokens: int) -> None:
        """A forward over `new_tokens` new tokens, which the pager now holds last, reported
        `weights` over the held tokens ([layers, heads, tokens], tokens in held order: resident
        pages in order, all full but the last; None: it reported none). Every score decays; a
        user message's forward (and the opening after it) adds its votes to the unpinned pages
        from before it, and the top vote to its own pages. A tool result does not vote: what a
        file's lines put on the text before them is mostly nearness, so every file would vote
        for the one read just before it, the task's no more than any."""
        if self._own_first_page is None:
            self._own_first_page = (pager.total_tokens - new_tokens) // PAGE_TOKENS
        keep = 0.5 ** (new_tokens / self.config.half_life_tokens)
        # A vote is at most 1: below SCORE_FLOOR (20 half-lives on) a score orders nothing an
        # unscored page would not, and dropping it keeps the table to the recently read pages.
        self.scores = {page: score * keep for page, score in self.scores.items() if score * keep >= SCORE_FLOOR}
        if not self._voting or weights is None:
            return
        own: list[int] = []
        voted: list[int] = []
        spans: list[tuple[int, int]] = []
        pinned = pager.pins   # never leave; the opening's pages hold the attention sink
        for k, page in enumerate(pager.resident):
            start = k * PAGE_TOKENS
            end = start + pager.pages[page].tokens
            if end > weights.shape[-1]:
                break
            if page >= self._own_first_page:
                own.append(page)
            elif page not in pinned:
                voted.append(page)
                spans.append((start, end))
        votes = dict(zip(voted, page_votes(weights, spans).tolist(), strict=True))
        # The message itself is kept as SnapKV keeps its observation window: its pages rank with
        # the page it read most.
        top = max(votes.values(), default=0.0)
        for page, vote in [*votes.items(), *((page, top) for page in own)]:
            if vote >= SCORE_FLOOR:
                self.scores[page] = self.scores.get(page, 0.0) + vote

    def forget_scores(self, pages: Iterable[int]) -> None:
        """These pages now hold other tokens than they were scored for (a cut)."""
        for page in pages:
            self.scores.pop(page, None)

    def order(self, pager: Pager, incoming_tokens: int) -> list[int]:
        """The pages to evict first for `incoming_tokens` more, least attended first; [] when there
        is no choice."""
        window = pager.evictable()[:self.config.window]
        need = pager.pages_to_free(incoming_tokens, window)
        if need == 0 or len(window) <= need:
            return []
        # Stable: of two pages that score alike, the older goes first, as the pager would have it.
        return sorted(window, key=lambda page: self.scores.get(page, 0.0))
