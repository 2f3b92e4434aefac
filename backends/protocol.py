"""The backend protocol, defined once: `Backend`, with the request and accounting types only it uses.

A backend runs one model over one session's token stream and exposes exact, attention-only page
operations on its cache: save a logical range of attention K/V as a canonical `Block`, remove a
range from the attention layers only, insert a block back (from memory or streamed from its
stored file), and snapshot the recurrent state of hybrid models. Everything here is
runtime-neutral: tensors cross the protocol as numpy arrays. The forms that cross it live below
it, so the runtimes and the store's readers use them without the protocol: the blocks and
snapshots in backends/blocks.py, a stored block being inserted in backends/block_stream.py, the
errors in backends/errors.py.

Index convention: `start`, `end` and `at` address the *logical order of the tokens held in
attention*, 0 .. `attention_tokens`, i.e. the order of the session text among the hot tokens. They
are not slot numbers and not RoPE positions; a backend maps them to both.

Dependency rules: numpy and backends.blocks / block_stream / errors only. Backends know nothing
about contextd, the controller or any paging policy; those layers call this protocol, never the
reverse.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .block_stream import StoredBlock
from .blocks import Block, LayerView, RecurrentSnapshot
from .errors import BlockFormatError

__all__ = ["Backend", "Counters", "DecodeStep", "Tokenizer"]


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    """One session's next decode, as `Backend.decode` takes it, for `Backend.decode_batch`:
    `backend` is that session's cache (this backend or one of its forks)."""

    backend: Backend
    token: int | None
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclasses.dataclass
class Counters:
    """Forward-token accounting, kept by the backend itself.

    Every token fed by `prefill` or `decode` is counted once, as `new_prefill_tokens` or
    `decoded_tokens`, and every held token recomputed in place (`recompute`, the blend) as
    `blend_forward_tokens`. `model_forward_tokens` is counted separately, where tokens enter the
    model (the torch backend uses a pre-hook on the embedding), so `model_forward_tokens ==
    new_prefill_tokens + decoded_tokens + blend_forward_tokens` is a real check, not an identity.
    `historical_forward_during_restore` counts tokens entering the model while a page operation
    is in progress; no page operation runs the model, so it stays 0, but it is measured, so a
    regression shows up as a number instead of a silent slowdown.
    `reanchored_keys` counts token keys (each across all attention layers and heads) rotated to a
    new position from their canonical form, including the keys of a restored page.
    """

    model_forward_tokens: int = 0
    new_prefill_tokens: int = 0
    decoded_tokens: int = 0
    historical_forward_during_restore: int = 0
    restored_tokens: int = 0
    evicted_tokens: int = 0
    reanchored_keys: int = 0
    compactions: int = 0
    blend_forward_tokens: int = 0
    forward_ns: int = 0  # wall time spent in the model's forward passes (page operations excluded)

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def copy(self) -> Counters:
        return dataclasses.replace(self)


@runtime_checkable
class Tokenizer(Protocol):
    """The part of a tokenizer the protocol relies on (Hugging Face and mlx-lm wrappers both fit)."""

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], *args: Any, **kwargs: Any) -> str: ...


@runtime_checkable
class Backend(Protocol):
    """One model, one session: a hot attention cache with exact page operations.

    Positions: each held token carries a RoPE position; positions increase along the logical order
    but may leave gaps (an eviction leaves one; nothing is re-anchored until `compact_positions`,
    which runs when asked or when the next position would leave the configured range). Inserting a
    block re-uses its saved positions when they still fit, otherwise it takes the positions after
    its left neighbour and shifts later tokens up only as far as the next gap.
    """

    name: str
    """Runtime name, e.g. "torch"."""
    device: str
    model_name: str

    @property
    def model_id(self) -> str: ...

    @property
    def layer_view(self) -> LayerView: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def is_hybrid(self) -> bool:
        """True when the model keeps per-stream state outside the paged layers: recurrent (linear
        attention, Mamba) layers or sliding-window caches. `snapshot_recurrent` covers it, and a cut
        back must restore it from a snapshot."""
        ...

    @property
    def attention_tokens(self) -> int:
        """Tokens now held by the attention layers."""
        ...

    @property
    def stream_tokens(self) -> int:
        """Tokens the model has consumed in this session (what the recurrent state covers)."""
        ...

    @property
    def pending_token(self) -> int | None:
        """The token `decode` returned last, not yet fed to the model (None after prefill)."""
        ...

    @property
    def counters(self) -> Counters:
        """A copy of the session's forward-token accounting."""
        ...

    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        """Append exactly `token_ids` to the cache; return float32 logits of the last position.

        A pending token from `decode` is dropped: callers include it in `token_ids` when it belongs
        to the transcript.
        """
        ...

    def extend(self, token_ids: Sequence[int]) -> None:
        """`prefill` without logits: for tokens the caller follows with more before it reads any
        (a turn's messages before the answer's opening). Counted as prefill; the cache and states
        are bit for bit those `prefill` leaves. Afterwards `last_logits` and a `decode` without a
        token refuse until a forward with logits. On MLX the lazy graph then never runs the last
        layer past its keys and values, as mlx-lm's own prefill does: on the tiny Qwen3-Next
        hybrid (4 layers) a quarter of the forward."""
        ...

    def prefill_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """`prefill`, returning the float32 logits after every token, [len(token_ids), vocab]: what
        teacher-forced scoring reads (serving.likelihood), one forward per chunk instead of one per
        token. Counted as prefill."""
        ...

    def decode(self, token: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> int:
        """One step: feed `token` (default: the pending token, if any), then pick the next token.

        Right after `prefill` nothing is fed and the token is picked from the prefill logits. The
        returned token becomes pending. `seed` reseeds the backend's sampler before sampling.
        """
        ...

    @property
    def batches_decode(self) -> bool:
        """Whether `decode_batch` runs several sessions' steps as one forward (else one by one)."""
        ...

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[int]:
        """`decode` in each of several sessions that share this backend's weights (it and its
        forks, one step each), as one forward where the runtime batches them, else one after the
        other. Each session's counters, sampler and pending token move exactly as its own `decode`
        would move them. A batched row's logits equal its own decode's to float rounding, not bit
        for bit (other matrix kernels). A failed batched forward fails every session in it.
        """
        ...

    def last_logits(self) -> np.ndarray:
        """float32 logits the next `decode` picks from."""
        ...

    def save_block(self, start: int, end: int) -> Block:
        """Canonical K/V of every paged layer for held tokens [start, end) (logical order)."""
        ...

    def remove_attention_range(self, start: int, end: int) -> None:
        """Drop held tokens [start, end) from the attention layers only; recurrent state untouched."""
        ...

    def insert_block(self, blk: Block, at: int, *, position: int | None = None) -> None:
        """Put `blk`'s tokens logically before the held token now at index `at` (`at` may equal
        `attention_tokens`). Raises BlockMismatchError for a block of another model or layout.
        With `position`, its tokens take the positions from there on exactly (ValueError when
        they do not fit between the neighbours)."""
        ...

    def insert_block_file(self, path: str | os.PathLike[str], at: int, *, checksum: str, size: int,
                          token_ids: np.ndarray | None = None, position: int | None = None) -> None:
        """`insert_block(Block.read(path, checksum, size), at)` with the disk read overlapped: layers
        are re-anchored as they arrive (read straight into the slots where the runtime allows).
        With `token_ids`, a block holding other tokens is refused (CorruptPayloadError, as is a
        file failing its size or checksum) before anything is copied. Nothing becomes visible
        unless the whole file verifies."""
        ...

    def insert_block_files(self, files: Sequence[StoredBlock],
                           opened: Callable[[], object] | None = None) -> list[BlockFormatError | None]:
        """Insert several stored blocks in one page operation (`at` in ascending order, each counted
        in the held order before the call; blocks at the same place go in list order), with every
        file read ahead and in parallel and every held key re-anchored at most once. A block that
        fails its checks is left out and its error returned in its place (the others are placed
        as if it had never been asked for); a block of another model raises BlockMismatchError
        before anything is copied. Returns, per file, None (it went in) or its error. What went in
        is in the slots only: a caller wanting a block's keys reads them (Block.read_layer_keys).

        `opened`, if given, is called once, as soon as the first files are open and their first
        reads asked for (before anything is placed), even when none could be opened: what the
        caller does then overlaps the disk's first answer."""
        ...

    def score_after_blocks(self, blocks: Sequence[Block], token_ids: Sequence[int],
                           sink: Block | None = None) -> tuple[np.ndarray, int]:
        """How likely `token_ids` are right after each block, each block on its own: float64
        log p(token_ids[j] | block, token_ids[:j]) for j >= 1, [len(blocks), len(token_ids) - 1],
        and the tokens the scoring forward took. The blocks' exact K/V are the context (re-anchored
        right before their copy of the tokens; no forward over their tokens), with `sink`, if
        given, right before each block, and all copies run in one forward whose mask keeps each
        copy to its own sink and block. This session's cache, counters
        and logits are untouched. Raises UnsupportedModelError for a model with sliding-window or
        recurrent layers (their state is a stream, not separable per block), BlockMismatchError
        for a block of another model, ValueError for fewer than two tokens or no block."""
        ...

    def prefill_alone(self, token_ids: Sequence[int]) -> Block:
        """The K/V `token_ids` get when prefilled on their own from position 0, as a block
        (positions 0..n-1). This session's cache, counters and logits are untouched (a scratch
        session sharing the weights does the forward). ValueError for no tokens."""
        ...

    def recompute(self, indices: Sequence[int] | np.ndarray) -> int:
        """Recompute the K/V of the held tokens at logical `indices` in place, in the current view:
        one forward over them at their positions, each attending to the view at positions up to
        its own, their K/V written back layer by layer (the blend). Their exact K/V are kept:
        `save_block` returns those, `drop_recomputed` puts them back. Counted as
        `blend_forward_tokens`; afterwards a forward with logits must come before `decode`
        without a token. Returns the tokens recomputed. UnsupportedModelError on a model with
        recurrent layers; IndexError for an index outside the held tokens."""
        ...

    @property
    def recompute_refusal(self) -> str | None:
        """Why `recompute` refuses this model (it has recurrent layers), or None where it runs."""
        ...

    @property
    def recomputed_tokens(self) -> int:
        """Held tokens that hold recomputed K/V now."""
        ...

    def drop_recomputed(self) -> int:
        """Put back the exact K/V of every recomputed held token; return how many."""
        ...

    def observe_attention(self, queries: int, layers: Sequence[int]) -> None:
        """From now on the last forward of every `prefill` / `extend` reports the softmax weights
        its last `queries` tokens put on each held token at the paged layers `layers` (positions
        in `layer_view.attention_layers`), from the attention that forward computes anyway: no forward of
        its own. 0 queries or no layers: stop. ValueError for a layer the model does not page."""
        ...

    def attention_weights(self) -> np.ndarray | None:
        """The last forward's reported weights, float64 [watched layers, query heads,
        attention_tokens], tokens in held order: the weight each watched layer's head put on each
        held token, averaged over the watched queries (the rest of a query's weight is on
        sliding-window keys or a sink; heads are kept apart because a page one head reads hard
        is read, where the mean over heads blurs it with pages many heads touch lightly). None
        when that forward was not watched, or a forward or page operation came after it."""
        ...

    def compact_positions(self) -> int:
        """Renumber held tokens densely from 0; re-anchor only keys whose position changed.
        Returns the number of token keys re-anchored."""
        ...

    def reposition(self, positions: np.ndarray) -> int:
        """Give the held tokens (in logical order) these RoPE positions: distinct, non-negative,
        below the position limit, the last held token keeping the highest (new tokens follow it).
        Only keys whose position changes are re-anchored (arithmetic, no forward pass). Returns
        how many were. The logical order, and so every page's place, stays as it is."""
        ...

    def positions(self) -> np.ndarray:
        """int64 RoPE positions of the held tokens, in logical order."""
        ...

    def held_token_ids(self) -> np.ndarray:
        """int32 ids of the held tokens, in logical order."""
        ...

    def rotated_keys(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """float32 keys as attention sees them (rotated at their positions): [layers, heads, n, dim]."""
        ...

    def snapshot_recurrent(self) -> RecurrentSnapshot | None:
        """Copy of the conv + recurrent states and of the sliding-window caches; None for models
        with neither."""
        ...

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        """Overwrite the recurrent states and window caches with `snap` (the caller keeps attention
        consistent).

        Clears the last logits and the pending token: the next step must feed a token."""
        ...

    def synchronize(self) -> None:
        """Wait until queued device work is done (for timing; a no-op on synchronous devices)."""
        ...

    def fork(self) -> Backend:
        """An independent session sharing the model weights, with a copy of this cache and counters."""
        ...

    def reset(self) -> None:
        """Empty the session (cache, recurrent state, pending token); counters are kept."""
        ...
