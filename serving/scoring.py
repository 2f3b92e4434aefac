"""Query likelihood read by a separate controller model instead of the serving model.

The serving model scores a page over the K/V it stored for it (`PageMover.score_pages`,
`PageMover.score_held`): no forward over the page, but a forward of the serving model, and only
when every layer is full attention (a sliding-window or recurrent layer's state is a stream that
cannot be split per page). A controller model (`kv-elision serve --controller-model NAME`) lifts
both limits: a small full-attention model reads each page's text on its own and scores the turn's
words after it, whatever the serving model is (so the re-ranker and the eviction advice also run
for hybrid and sliding-window models), at the controller's size instead of the serving model's.

What it reads: a page's ids as the serving model holds them (the transcript's), decoded to text
without special tokens and encoded by the controller's own tokenizer (its BOS where it adds one),
cut at `max_page_tokens`; the question (the serving ids the policy chose) the same way, without
special tokens, read after the controller's own template's user opening (`score_as_a_turn`). The
controller prefills each page alone from position 0 (`Backend.prefill_alone`) and keeps its K/V
in memory by content (an LRU over the serving ids, up to `cache_bytes`), so a page costs one
prefill the first time and each later scoring only the opening's and the question's tokens, in
one forward over all candidates. The server has the controller read each full page once when it
is stored, at the end of its turn (`ControllerScorer.read_next`), so the advice and the re-ranker rarely
wait for a page's read. Every token it forwards is counted as
`controller_forward_tokens`; the serving model's cache, counters and transcript are never
touched, so `historical_forward == 0` and the forward invariant stay the serving model's own.

Dependency rules: backends, numpy and xxhash; serving.session for the session it reads,
serving.chat_format and serving.transcript for the controller's user opening.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from backends import Backend, Block, Tokenizer, UnsupportedModelError
from serving.chat_format import ChatFormat
from serving.session import Session
from serving.transcript import TranscriptError


@dataclass(frozen=True)
class ControllerConfig:
    cache_bytes: int = 512 << 20   # controller K/V kept for pages already read (SmolLM2 float32: 5.9 MB a page)
    max_page_tokens: int = 512     # a page's text in the controller's tokens is cut here

    def __post_init__(self) -> None:
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")
        if self.max_page_tokens < 1:
            raise ValueError(f"max_page_tokens must be >= 1, got {self.max_page_tokens}")


class ControllerScorer:
    """One controller model shared by every session of a server; not thread-safe (the engine's
    worker thread is its only caller)."""

    def __init__(self, controller: Backend, serving_tokenizer: Tokenizer,
                 config: ControllerConfig | None = None) -> None:
        if controller.is_hybrid:
            raise UnsupportedModelError(
                f"the controller model {controller.model_name} has sliding-window or recurrent layers; it scores "
                "pages apart in one forward, which needs every layer to be full attention")
        self.controller = controller
        self.serving_tokenizer = serving_tokenizer
        self.config = config or ControllerConfig()
        try:
            self.opening = ChatFormat(controller.tokenizer).user_opening
        except TranscriptError:   # no chat template: the question straight after the page
            self.opening = []
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()
        self._bytes = 0

    @property
    def cached_pages(self) -> int:
        return len(self._blocks)

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def score(self, session: Session, indices: list[int], token_ids: list[int]) -> tuple[dict[int, np.ndarray], int]:
        """Per page index, log p of the question's tokens after the page and the controller's user
        opening (float64, one per question token, one fewer for a controller without a chat template;
        `score_as_a_turn`), and the tokens the controller forwarded. A question of
        fewer than two controller tokens scores nothing; a page with no text is left out."""
        question = [t for t in self._encode(token_ids, special=False) if t < self.controller.vocab_size]
        if len(question) < 2 or not indices:
            return {}, 0
        contents = {index: _page_ids(session, index) for index in indices}
        keys = {index: _key(page_ids) for index, page_ids in contents.items()}
        forwarded = 0
        blocks: dict[int, Block] = {}
        # The pages it holds first: reading the others could push them out of its memory.
        for index in sorted(indices, key=lambda i: keys[i] not in self._blocks):
            blk, prefilled = self._page_block(contents[index], keys[index])
            forwarded += prefilled
            if blk is not None:
                blocks[index] = blk
        if not blocks:
            return {}, forwarded
        scores, scored = score_as_a_turn(self.controller, list(blocks.values()), self.opening, question)
        return dict(zip(blocks, scores, strict=True)), forwarded + scored

    def holding(self, session: Session, indices: list[int]) -> list[int]:
        """Of these pages, those whose K/V the controller holds (scored without reading the page first)."""
        return [i for i in indices if _key(_page_ids(session, i)) in self._blocks]

    def read_next(self, session: Session) -> int:
        """Read the next full page this turn stored (`Session.unread_pages`, lowest first) into the
        controller's memory (nothing without memory for it); the tokens it prefilled. Each page is
        read once, after the answer of the turn that wrote it, so the eviction advice and the
        re-ranker later forward only the opening's and the question's tokens over it (a page the
        memory let go is read again when scored)."""
        # Full pages when stored (a page stored again is listed again); a cut drops those it rewrites.
        page = min(session.unread_pages)
        session.unread_pages = [i for i in session.unread_pages if i != page]
        if self.config.cache_bytes == 0:
            return 0
        page_ids = _page_ids(session, page)
        return self._page_block(page_ids, _key(page_ids))[1]

    def _page_block(self, serving_ids: Sequence[int], key: bytes) -> tuple[Block | None, int]:
        """The controller's K/V for a page's text (`key`: its `_key`), and the tokens prefilled to
        get it (0 when kept); None for a page with no text the controller's tokenizer reads."""
        kept = self._blocks.get(key)
        if kept is not None:
            self._blocks.move_to_end(key)
            return kept, 0
        # The page's text with its special tokens when it has no other.
        ids = (self._encode(serving_ids, special=True)
               or self._encode_text(self.serving_tokenizer.decode([int(t) for t in serving_ids]), special=True))
        ids = [t for t in ids if t < self.controller.vocab_size][:self.config.max_page_tokens]
        if not ids:
            return None, 0
        blk = self.controller.prefill_alone(ids)
        self._keep(key, blk)
        return blk, len(ids)

    def _keep(self, key: bytes, blk: Block) -> None:
        self._blocks[key] = blk
        self._bytes += blk.nbytes
        while self._bytes > self.config.cache_bytes and self._blocks:
            _, dropped = self._blocks.popitem(last=False)
            self._bytes -= dropped.nbytes

    def _encode(self, serving_ids: Sequence[int], special: bool) -> list[int]:
        """Serving ids as the controller's tokens, through their text without special tokens (the
        tokenizers may differ); [] when there is no such text."""
        return self._encode_text(self.serving_tokenizer.decode([int(t) for t in serving_ids], skip_special_tokens=True),
                                 special)

    def _encode_text(self, text: str, special: bool) -> list[int]:
        if not text:
            return []
        return [int(t) for t in self.controller.tokenizer.encode(text, add_special_tokens=special)]


def score_as_a_turn(backend: Backend, blocks: Sequence[Block], opening: Sequence[int], question: Sequence[int],
                    sink: Block | None = None) -> tuple[np.ndarray, int]:
    """log p of each of the question's tokens after each block, the question read as the next user
    turn: `opening` (the chat template's ids between an answer and a user message,
    `ChatFormat.user_opening`) between the block and the question, its own tokens not counted
    (`Backend.score_after_blocks`: [len(blocks), len(question)], or one fewer without an opening),
    and the tokens forwarded. Straight after the page, a small model continues the page's last
    line: seed 109's near-duplicate question went to a page ending with the same sentence about
    another service (docs/controller.md)."""
    if any(not 0 <= t < backend.vocab_size for t in opening):
        opening = []   # special ids past the model's vocabulary: no opening it could read
    scores, forwarded = backend.score_after_blocks(blocks, [*opening, *question], sink)
    return scores[:, max(len(opening) - 1, 0):], forwarded


def _page_ids(session: Session, index: int) -> Sequence[int]:
    """The serving ids a page holds (the transcript's)."""
    page = session.pager.pages[index]
    return session.transcript.ids[page.token_start:page.token_end]


def _key(serving_ids: Sequence[int]) -> bytes:
    """A page's content as the controller's memory knows it."""
    return xxhash.xxh3_128_digest(np.asarray(serving_ids, dtype=np.int32).tobytes())
