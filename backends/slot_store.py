"""The slot store both runtimes build on: a session's slot buffers and the host-side slot table.

The table (a RoPE position, a token and an occupied flag per slot, and the logical order of the
held tokens as slot numbers) and the window caches' bookkeeping are kept here the same way for
both runtimes; a runtime's store adds its tensors and implements every abstract method, the ones
that touch them. A store missing one cannot be instantiated.

Dependency rules: numpy and backends.blocks / loaded_model / slots; never a tensor library.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

import numpy as np

from .blocks import storage_dtype
from .loaded_model import KeyLayout, LoadedModel
from .slots import pick_free_slots

__all__ = ["Landing", "Redo", "SlotStore", "Watch"]

S = TypeVar("S", bound="SlotStore")


@dataclasses.dataclass(frozen=True)
class Landing:
    """Where a stored block's file can land directly: the slot buffers' own memory, as byte
    buffers in a block's order ([layers, kv_heads, tokens, dim]) for its keys and values, and what
    completes the keys once a layer group has landed (their rotation to the block's positions).
    Values land from any file; keys only from one read from the disk or by the inserting thread
    (BlockStream.keys_land).

    Why: the reader's copy out of the page cache is then the only copy; reading into a buffer
    and copying from there into the slots was a sizeable share of the restoring thread's time on
    a warm SmolLM2 page (docs/journal/2026-11-29-restore-path.md, "Where a restore's time went")."""

    keys: list[memoryview]
    values: list[memoryview]
    rotate: Callable[[int, int, np.ndarray], None]   # (a0, a1, positions) for attention layers [a0, a1)


@dataclasses.dataclass
class Redo:
    """A recompute in progress (`SlotBackend.recompute`), across the forwards it runs: the positions
    of the tokens recomputed so far, and per window layer their rotated keys and values. A
    recomputed token's sliding-window layers read these (within the window, by position), never
    the stream's window: the held tokens have no window-layer K/V of their own, and the stream's
    window, which holds its newest tokens, is left as it is."""

    positions: np.ndarray
    keys: list[Any]
    values: list[Any]


@dataclasses.dataclass(frozen=True)
class Watch:
    """What a watched forward reports (`SlotBackend.observe_attention`): the softmax weights of
    its last `queries` queries at the paged layers `layers` (positions in the paged layers' list)."""

    queries: int
    layers: frozenset[int]


class SlotStore(abc.ABC):
    """A session's slot buffers, with the host-side table both runtimes keep the same way: the RoPE
    position, the token and an occupied flag per slot, and the logical order of the held tokens
    as slot numbers. A runtime's store adds its tensors and implements the methods that touch them.

    `keys` and `values` cross this interface as numpy arrays in storage dtype (bf16 bits as
    uint16), laid out like a Block's: [layers, kv_heads, tokens, dim]."""

    # Key elements per step of page work (see layer_groups); a runtime's measured sweet spot.
    group_elements: ClassVar[int]

    def __init__(self, rt: LoadedModel, capacity: int) -> None:
        self.rt = rt
        self.capacity = 0
        self.pos = np.zeros(0, dtype=np.int64)       # the RoPE position each slot's key holds
        self.occupied = np.zeros(0, dtype=bool)
        self.tokens = np.zeros(0, dtype=np.int32)    # the token in each slot
        self.order = np.zeros(0, dtype=np.int64)     # the held tokens, in attention order
        # Set for the duration of one forward: where this forward's tokens go, how far attention reads.
        self.fwd_slots: np.ndarray | None = None
        self.fwd_high_water = 0
        # Set only in a scoring session (`SlotBackend.score_after_blocks`): each slot's group; a
        # query then attends only to keys of its own group.
        self.groups: np.ndarray | None = None
        # Tokens the model's embedding took in during the running forward: counted by the session
        # when the forward lands (`SlotSession._landed`), or dropped with a step that never does.
        self.entered = 0
        # Sliding-window layers: how many of the newest stream tokens each window cache holds, and
        # the position its newest key is rotated at (None: not rotated yet, after a snapshot restore).
        self.win_len = 0
        self.win_last_pos: int | None = None
        # Per window layer, in the runtime's tensors [1, heads, win_len, dim]: canonical keys, keys as
        # the layer reads them, values; and the canonical keys of the running forward's tokens.
        self.win_canon: list[Any] = []
        self.win_rot: list[Any] = []
        self.win_v: list[Any] = []
        self.fwd_win_canon: list[Any] = []
        # Set for the duration of a recompute (`SlotBackend.recompute`).
        self.redo: Redo | None = None
        # Held tokens whose K/V a recompute replaced: their slots (sorted) and the exact canonical
        # keys and values they held before, in storage dtype [layers, heads, n, dim]: what
        # `save_block` hands out for them and `drop_recomputed` puts back. Never written in place
        # (a fork's clone shares them).
        self.exact_slots = np.zeros(0, dtype=np.int64)
        self.exact_keys: np.ndarray | None = None
        self.exact_values: np.ndarray | None = None
        # Set for the duration of one watched forward (`SlotBackend.observe_attention`): which paged
        # layers, and how many of the forward's last queries, report their softmax weights. The
        # runtime's attention appends each watched layer's weights, per query head and slot and
        # summed over queries, to `watched` (in its tensors), and the rows it summed to `watched_rows`.
        self.watch: Watch | None = None
        self.watched: list[Any] = []
        self.watched_rows = 0
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        extra = capacity - self.capacity
        self._grow_buffers(capacity)
        self.pos = np.concatenate([self.pos, np.zeros(extra, dtype=np.int64)])
        self.occupied = np.concatenate([self.occupied, np.zeros(extra, dtype=bool)])
        self.tokens = np.concatenate([self.tokens, np.zeros(extra, dtype=np.int32)])
        self.capacity = capacity

    def allocate(self, n: int) -> np.ndarray:
        """`n` free slots (growing the buffers if needed), as `slots.pick_free_slots` chooses them."""
        free = np.flatnonzero(~self.occupied)
        if free.shape[0] < n:
            self.grow(max(2 * self.capacity, self.capacity + n - free.shape[0]))
            free = np.flatnonzero(~self.occupied)
        return pick_free_slots(free, n, self.high_water())

    def accumulate_weights(self, per_head: Any, rows: int) -> None:
        """Add one watched layer's weights (a runtime [heads, slots] array, summed over `rows`
        query rows: batch times queries) to the forward's accumulator."""
        self.watched.append(per_head)
        self.watched_rows = rows

    def take_watched(self) -> np.ndarray | None:
        """The watched forward's mean attention weights over its watched queries, float64
        [layers, heads, slots] (None when no watched layer ran), and the accumulator emptied."""
        watched, rows = self.watched, self.watched_rows
        self.watched, self.watched_rows = [], 0
        if not watched or rows == 0:
            return None
        return np.stack([self._weights_to_host(layer) for layer in watched]) / rows

    @abc.abstractmethod
    def _weights_to_host(self, t: Any) -> np.ndarray:
        """A runtime vector of attention weights as float64 numpy."""

    def take_entered(self) -> int:
        """The tokens the embedding saw since the last call (see `entered`)."""
        n, self.entered = self.entered, 0
        return n

    def slot_mask(self, slots: np.ndarray, high_water: int) -> np.ndarray:
        """[len(slots), high_water] bool: which slots the queries in `slots` attend to (occupied,
        at a position no later than the query's, and in the query's group when groups are set)."""
        seen: np.ndarray = self.occupied[None, :high_water] & (self.pos[None, :high_water] <= self.pos[slots][:, None])
        if self.groups is not None:
            seen &= self.groups[None, :high_water] == self.groups[slots][:, None]
        return seen

    def redo_window_mask(self, positions: np.ndarray) -> np.ndarray:
        """[len(positions), earlier + len(positions)] bool, during a recompute: which of the tokens
        recomputed so far, then this forward's, a window layer's query at each of `positions`
        reads (no later, and within the window, by position)."""
        assert self.redo is not None
        keys = np.concatenate([self.redo.positions, positions])
        query = positions[:, None]
        mask: np.ndarray = (keys[None, :] <= query) & (query - keys[None, :] < self.rt.roles.window_size)
        return mask

    def keep_exact(self, slots: np.ndarray) -> None:
        """Keep the K/V `slots` hold now, for those whose exact K/V are not kept yet."""
        new = np.setdiff1d(slots, self.exact_slots)
        if not new.shape[0]:
            return
        keys, values = self.gather(new)
        if self.exact_keys is None or self.exact_values is None:
            self.exact_slots, self.exact_keys, self.exact_values = new, np.array(keys), np.array(values)
            return
        merged = np.concatenate([self.exact_slots, new])
        order = np.argsort(merged, kind="stable")
        self.exact_slots = merged[order]
        self.exact_keys = np.concatenate([self.exact_keys, keys], axis=2)[:, :, order]
        self.exact_values = np.concatenate([self.exact_values, values], axis=2)[:, :, order]

    def forget_exact(self, slots: np.ndarray | None = None) -> None:
        """Stop keeping the exact K/V of `slots` (None: of every slot)."""
        if slots is None or self.exact_keys is None or self.exact_values is None:
            self.exact_slots, self.exact_keys, self.exact_values = np.zeros(0, dtype=np.int64), None, None
            return
        keep = ~np.isin(self.exact_slots, slots)
        if keep.all():
            return
        if not keep.any():
            self.forget_exact()
            return
        self.exact_slots = self.exact_slots[keep]
        self.exact_keys, self.exact_values = self.exact_keys[:, :, keep], self.exact_values[:, :, keep]

    def gather_exact(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`gather`, with the exact K/V kept for any recomputed slot in place of what it holds."""
        keys, values = self.gather(slots)
        if self.exact_keys is None or self.exact_values is None:
            return keys, values
        at = np.flatnonzero(np.isin(slots, self.exact_slots))
        if not at.shape[0]:
            return keys, values
        rows = np.searchsorted(self.exact_slots, slots[at])
        keys, values = np.array(keys), np.array(values)
        keys[:, :, at] = self.exact_keys[:, :, rows]
        values[:, :, at] = self.exact_values[:, :, rows]
        return keys, values

    def high_water(self) -> int:
        occ = np.flatnonzero(self.occupied)
        return int(occ[-1]) + 1 if occ.shape[0] else 0

    def clone(self: S) -> S:
        """An independent copy, buffers included, owned by no session yet."""
        other = copy.copy(self)
        other.pos, other.occupied = self.pos.copy(), self.occupied.copy()
        other.tokens, other.order = self.tokens.copy(), self.order.copy()
        other.fwd_slots, other.fwd_high_water, other.entered, other.redo = None, 0, 0, None
        other._copy_buffers()
        return other

    # -- called from inside the model's forward ------------------------------------------------
    def observe_key(self, layer: int, out: Any) -> None:
        """What the key module of a paged or window layer returned in this forward (a torch tensor or
        an mlx array, in the module's own layout): its pre-rotary key, kept as [1, heads, n, head_dim]."""
        assert self.fwd_slots is not None
        n = int(self.fwd_slots.shape[0])
        layout = self.rt.key_layout(layer, tuple(out.shape), n)
        if layout is KeyLayout.PROJ:
            out = out.reshape(1, n, *self.rt.key_heads(layer))
        key = out if layout is KeyLayout.BHSD else out.swapaxes(1, 2)
        paged, window = self.rt.paged_index, self.rt.window_index
        if layer in paged:
            self.write_canon(paged[layer], key)
        else:
            self.fwd_win_canon[window[layer]] = key

    def count_entered(self, n: int) -> None:
        """The model's embedding took in `n` tokens of this store's forward (see `entered`)."""
        self.entered += n

    def append_window(self, w: int, k_rot: Any, v: Any) -> tuple[Any, Any]:
        """Window layer `w`: attention reads its window plus this forward's tokens (rotated keys and
        values); afterwards the window keeps the newest W - 1 of them, canonical keys included.
        During a recompute it reads the tokens recomputed so far plus this forward's instead, and
        the window is left as it is (`Redo`)."""
        canon = self.fwd_win_canon[w]
        assert canon is not None
        self.fwd_win_canon[w] = None
        redo = self.redo
        if redo is not None:
            if redo.keys[w] is not None:
                k_rot, v = self._cat(redo.keys[w], k_rot), self._cat(redo.values[w], v)
            redo.keys[w], redo.values[w] = k_rot, v
            return k_rot, v
        keys, values = self._cat(self.win_rot[w], k_rot), self._cat(self.win_v[w], v)
        keep = self.rt.roles.window_size - 1
        self.win_rot[w] = keys[:, :, -keep:]
        self.win_v[w] = values[:, :, -keep:]
        self.win_canon[w] = self._cat(self.win_canon[w], canon)[:, :, -keep:]
        return keys, values

    def window_positions(self, first: int) -> np.ndarray:
        """Where the window keys go for a forward starting at position `first`: right before it."""
        return np.arange(first - self.win_len, first, dtype=np.int64)

    # -- the runtime's tensors ---------------------------------------------------------------
    @abc.abstractmethod
    def write_canon(self, a: int, key: Any) -> None:
        """Store the exact pre-rotary keys [1, heads, n, head_dim] of paged layer `a` in this forward's slots."""

    @staticmethod
    @abc.abstractmethod
    def _cat(a: Any, b: Any) -> Any:
        """a and b joined along the token axis (2)."""

    @abc.abstractmethod
    def _grow_buffers(self, capacity: int) -> None:
        """Grow every buffer to `capacity` slots; new slots are zeros (masked slots still take part
        in the weights @ values product, where 0 times uninitialised NaN bits would be NaN)."""

    @abc.abstractmethod
    def _copy_buffers(self) -> None:
        """Replace this (shallow) copy's buffers with copies of their own."""

    def layer_groups(self, n_tokens: int) -> Iterator[tuple[int, int]]:
        """Ranges of attention layers whose slice of `n_tokens` keys is about `group_elements`:
        whole-cache temporaries made compaction several times slower, and one step per layer made
        a page restore pay per-op overhead thirty times over."""
        rt = self.rt
        n_layers = len(rt.attention_layers)
        group = max(1, self.group_elements // max(1, rt.num_kv_heads * n_tokens * rt.head_dim))
        for a0 in range(0, n_layers, group):
            yield a0, min(n_layers, a0 + group)

    def landing(self, slots: np.ndarray) -> Landing | None:
        """Where a block going into `slots` can be read straight into, or None: then its keys and
        values go through `write_keys` and `write_values`. None unless a runtime's buffers are host
        memory a reader thread may write (not MLX arrays, not CUDA tensors)."""
        return None

    @abc.abstractmethod
    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """Rotate the canonical keys of `slots` to `positions` in every paged layer; records the positions."""

    @abc.abstractmethod
    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Canonical keys (pass-through dims included) and values of `slots`."""

    @abc.abstractmethod
    def rotated(self, slots: np.ndarray) -> np.ndarray:
        """float32 keys as attention reads them."""

    @abc.abstractmethod
    def write_keys(self, slots: np.ndarray, a0: int, a1: int, keys: np.ndarray, positions: np.ndarray | None) -> None:
        """Canonical keys of attention layers [a0, a1) into `slots`, rotated to `positions` (None:
        left for a compaction to rotate). The slots' metadata is the caller's to set."""

    @abc.abstractmethod
    def write_values(self, slots: np.ndarray, a0: int, a1: int, values: np.ndarray) -> None:
        """Values of attention layers [a0, a1) into `slots`."""

    @abc.abstractmethod
    def clear(self, slots: np.ndarray) -> None:
        """Zero `slots` after an aborted write: free slots must hold finite numbers."""

    # -- the window caches of sliding-window layers ------------------------------------------------
    @abc.abstractmethod
    def reanchor_window(self, positions: np.ndarray) -> None:
        """Rotate every window layer's canonical keys to `positions` [win_len]."""

    def read_window(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per window layer: canonical keys [1, heads, win_len, head_dim] and values, in storage dtype."""
        return [(self._to_host(k), self._to_host(v)) for k, v in zip(self.win_canon, self.win_v, strict=True)]

    def write_window(self, layers: list[tuple[np.ndarray, np.ndarray]] | None) -> None:
        """Replace every window layer's contents (None: empty them); keys are rotated before the next forward."""
        shape = self.rt.window
        if shape is None:
            return
        if layers is None:
            st = storage_dtype(self.rt.dtype_name)
            empty = (np.zeros((1, shape.num_kv_heads, 0, shape.head_dim), dtype=st),
                     np.zeros((1, shape.num_kv_heads, 0, shape.value_head_dim), dtype=st))
            layers = [empty] * len(self.rt.roles.window)
        self.win_canon = [self._from_host(k) for k, _ in layers]
        self.win_rot = [self._from_host(k) for k, _ in layers]  # rotated before the next forward
        self.win_v = [self._from_host(v) for _, v in layers]
        self.fwd_win_canon = [None] * len(layers)

    @abc.abstractmethod
    def _to_host(self, t: Any) -> np.ndarray:
        """A copy of runtime tensor `t` as a numpy array in storage dtype (bf16 bits as uint16)."""

    @abc.abstractmethod
    def _from_host(self, a: np.ndarray) -> Any:
        """A new runtime tensor of the model dtype from a storage-dtype array."""

    @abc.abstractmethod
    def rotated_window(self) -> list[np.ndarray]:
        """Per window layer: float32 keys as the window layers read them [1, heads, win_len, head_dim]."""
