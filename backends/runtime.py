"""What the torch and MLX runtimes share: everything of a backend session that is not tensor work.

A runtime supplies a loaded model (`LoadedModel` plus its own fields), a slot store (`SlotStore`:
buffers, gathers, writes and re-anchoring in its tensor library) and a handful of hooks (one
forward pass, the cache object its model code sees, the recurrent states). This base turns them
into the `Backend` protocol: identity, the prefill / decode loop, sampling, slot bookkeeping for
evict / insert / compaction, the streaming, verified insert of a stored block, recurrent
snapshots, fork and reset. The two runtimes therefore count, position and check the same way by
construction, not by copying.

Dependency rules: numpy and backends.protocol / slots / models; never a tensor library.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from .models import ModelSource, load_tokenizer, resolve
from .protocol import (
    ROPE_LAYOUT_NEOX,
    STORAGE_DTYPES,
    BackendError,
    Block,
    BlockMismatchError,
    BlockStream,
    Counters,
    LayerView,
    RecurrentSnapshot,
    Tokenizer,
    UnsupportedModelError,
)
from .slots import InsertPlan, checked_token_ids, pick_token, plan_insert

__all__ = ["LoadedModel", "SlotBackend", "SlotStore", "check_layer_split"]


@dataclasses.dataclass(kw_only=True)
class LoadedModel:
    """One loaded model, shared by a backend session and its forks; runtimes add their own fields."""

    source: ModelSource
    family: str
    attention_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    rotary_dim: int
    max_position_embeddings: int
    vocab_size: int
    model_id: str      # content hash of config and weights (slots.model_identity)
    dtype_name: str    # "float32", "float16" or "bfloat16"
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    # The store of the session whose forward is running (the model's hooks write there) and the
    # session running a page operation (a token entering the model meanwhile is counted as a
    # historical forward: there must be none).
    active: Any = None
    page_op: Any = None
    tokenizer: Tokenizer | None = None

    @property
    def view(self) -> LayerView:
        """What a block of this model means; both runtimes lay keys out in the "neox" half-split
        form (each checks its model's rotary module against that at load)."""
        return LayerView(model_id=self.model_id, family=self.family, attention_layers=self.attention_layers,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, value_head_dim=self.value_head_dim,
                         rotary_dim=self.rotary_dim, rope_layout=ROPE_LAYOUT_NEOX, dtype=self.dtype_name)


class SlotStore:
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
        # The counters of the session owning this store; the embedding hook adds forward tokens here.
        self.owner_counters: Counters | None = None
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
        """The `n` lowest free slots (growing the buffers if needed); keeps the high-water mark low."""
        free = np.flatnonzero(~self.occupied)
        if free.shape[0] < n:
            self.grow(max(2 * self.capacity, self.capacity + n - free.shape[0]))
            free = np.flatnonzero(~self.occupied)
        return free[:n].astype(np.int64)

    def high_water(self) -> int:
        occ = np.flatnonzero(self.occupied)
        return int(occ[-1]) + 1 if occ.shape[0] else 0

    def clone(self: S) -> S:
        """An independent copy, buffers included, owned by no session yet."""
        other = copy.copy(self)
        other.pos, other.occupied = self.pos.copy(), self.occupied.copy()
        other.tokens, other.order = self.tokens.copy(), self.order.copy()
        other.fwd_slots, other.fwd_high_water = None, 0
        other.owner_counters = None
        other._copy_buffers()
        return other

    # -- the runtime's tensors ---------------------------------------------------------------
    def _grow_buffers(self, capacity: int) -> None:
        """Grow every buffer to `capacity` slots; new slots are zeros (masked slots still take part
        in the weights @ values product, where 0 times uninitialised NaN bits would be NaN)."""
        raise NotImplementedError

    def _copy_buffers(self) -> None:
        """Replace this (shallow) copy's buffers with copies of their own."""
        raise NotImplementedError

    def layer_groups(self, n_tokens: int) -> Iterator[tuple[int, int]]:
        """Ranges of attention layers whose slice of `n_tokens` keys is about `group_elements`:
        whole-cache temporaries made compaction several times slower, and one step per layer made
        a page restore pay per-op overhead thirty times over."""
        rt = self.rt
        n_layers = len(rt.attention_layers)
        group = max(1, self.group_elements // max(1, rt.num_kv_heads * n_tokens * rt.head_dim))
        for a0 in range(0, n_layers, group):
            yield a0, min(n_layers, a0 + group)

    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        raise NotImplementedError

    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Canonical keys (pass-through dims included) and values of `slots`."""
        raise NotImplementedError

    def rotated(self, slots: np.ndarray) -> np.ndarray:
        """float32 keys as attention reads them."""
        raise NotImplementedError

    def write_keys(self, slots: np.ndarray, a0: int, a1: int, keys: np.ndarray, positions: np.ndarray | None) -> None:
        """Canonical keys of attention layers [a0, a1) into `slots`, rotated to `positions` (None:
        left for a compaction to rotate). The slots' metadata is the caller's to set."""
        raise NotImplementedError

    def write_values(self, slots: np.ndarray, a0: int, a1: int, values: np.ndarray) -> None:
        raise NotImplementedError

    def clear(self, slots: np.ndarray) -> None:
        """Zero `slots` after an aborted write: free slots must hold finite numbers."""
        raise NotImplementedError


def check_layer_split(family: str, n_layers: int, attention_layers: tuple[int, ...],
                      linear_layers: tuple[int, ...], layer_types: Sequence[str] | None) -> None:
    """A model is served when every layer is attention (paged) or linear attention (left alone)."""
    if not attention_layers:
        raise UnsupportedModelError(f"{family}: the model has no attention layers to page")
    if len(attention_layers) + len(linear_layers) != n_layers:
        raise UnsupportedModelError(f"{family}: some layers are neither attention nor linear attention")
    if layer_types and tuple(i for i, t in enumerate(layer_types) if t == "full_attention") != attention_layers:
        raise UnsupportedModelError(f"{family}: the attention layers {attention_layers} differ from the config's "
                                    "layer types")


B = TypeVar("B", bound="SlotBackend")
S = TypeVar("S", bound="SlotStore")


def _wanted_positions(saved: np.ndarray, position: int | None) -> np.ndarray:
    """The block's own saved positions, or the run starting at `position`."""
    if position is None:
        return saved
    return np.arange(position, position + int(saved.shape[0]), dtype=np.int64)


class SlotBackend:
    """The `Backend` protocol over a runtime's slot store. Subclasses implement the hooks below."""

    name: ClassVar[str]
    _rt: LoadedModel
    _store: SlotStore

    def __init__(self, rt: LoadedModel, model_name: str, *, capacity: int = 4096, prefill_chunk: int = 512,
                 position_limit: int | None = None, seed: int = 0) -> None:
        self._rt = rt
        self.model_name = model_name
        self.device = self._device_name()
        self.prefill_chunk = int(prefill_chunk)
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        # Compaction runs when a token would get a position >= position_limit.
        self.position_limit = int(position_limit or rt.max_position_embeddings)
        self._counters = Counters()
        self._rng = np.random.default_rng(seed)
        self._store = self._new_store(max(1, int(capacity)))
        self._store.owner_counters = self._counters
        self._cache = self._new_cache()
        self._stream_tokens = 0
        self._pending: int | None = None
        self._last_logits: np.ndarray | None = None
        self._broken: str | None = None

    @classmethod
    def load(cls: type[B], model: str, device: str = "cpu", dtype: str = "float32", *, capacity: int = 4096,
             prefill_chunk: int = 512, position_limit: int | None = None, seed: int = 0,
             model_id: str | None = None) -> B:
        """Load `model` (name or path, see backends.models) into a new session.

        capacity: initial slots per attention layer (grows by doubling). prefill_chunk: tokens per
        forward during prefill. position_limit: positions at or above it trigger compaction
        (default: the model's max_position_embeddings). model_id: skip hashing the weights and use
        this identity.
        """
        source = resolve(model)
        rt = cls._load_model(source, device, dtype, model_id)
        return cls(rt, source.name, capacity=capacity, prefill_chunk=prefill_chunk, position_limit=position_limit,
                   seed=seed)

    # -- hooks a runtime implements ------------------------------------------------------------
    # source, device, dtype, model_id -> the loaded model (the runtime's `_make_runtime`)
    _load_model: ClassVar[Callable[[ModelSource, str, str, str | None], LoadedModel]]

    def _device_name(self) -> str:
        raise NotImplementedError

    def _new_store(self, capacity: int) -> SlotStore:
        raise NotImplementedError

    def _new_cache(self) -> Any:
        """The cache object the model code sees, over this session's store (recurrent layers empty)."""
        raise NotImplementedError

    def _forward(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, high_water: int) -> np.ndarray:
        """Run the model over `ids` (already placed in `slots` at `positions`); float32 last logits."""
        raise NotImplementedError

    def _page_op(self) -> contextlib.AbstractContextManager[None]:
        """How the runtime runs a page operation (locks, device streams; synchronous on return)."""
        raise NotImplementedError

    def _read_recurrent(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Host copies of the recurrent states in the Hugging Face layout, and their dtype names."""
        raise NotImplementedError

    def _write_recurrent(self, snap: RecurrentSnapshot) -> None:
        """Overwrite the recurrent states from `snap` (validated first: nothing half-written)."""
        raise NotImplementedError

    def _copy_recurrent_to(self, other: SlotBackend) -> None:
        """Give a fork's fresh cache copies of this session's recurrent states."""
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    # -- identity ------------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self._rt.view.model_id

    @property
    def layer_view(self) -> LayerView:
        return self._rt.view

    @property
    def tokenizer(self) -> Tokenizer:
        with self._rt.lock:
            if self._rt.tokenizer is None:
                self._rt.tokenizer = load_tokenizer(self._rt.source)
            return self._rt.tokenizer

    @property
    def vocab_size(self) -> int:
        return self._rt.vocab_size

    @property
    def is_hybrid(self) -> bool:
        return bool(self._rt.linear_layers)

    # -- state ---------------------------------------------------------------------------------
    @property
    def attention_tokens(self) -> int:
        return int(self._store.order.shape[0])

    @property
    def stream_tokens(self) -> int:
        return self._stream_tokens

    @property
    def pending_token(self) -> int | None:
        return self._pending

    @property
    def counters(self) -> dict[str, int]:
        return self._counters.as_dict()

    @property
    def capacity(self) -> int:
        return self._store.capacity

    def positions(self) -> np.ndarray:
        held: np.ndarray = self._store.pos[self._store.order].copy()
        return held

    def held_token_ids(self) -> np.ndarray:
        held: np.ndarray = self._store.tokens[self._store.order].copy()
        return held

    def last_logits(self) -> np.ndarray:
        if self._last_logits is None:
            raise BackendError("no logits yet: prefill first")
        return self._last_logits.copy()

    def rotated_keys(self, start: int = 0, end: int | None = None) -> np.ndarray:
        end = self.attention_tokens if end is None else end
        self._check_range(start, end)
        with self._rt.lock:
            return self._store.rotated(self._store.order[start:end])

    # -- running the model ---------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = checked_token_ids(token_ids, self._rt.vocab_size)
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._pending = None
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            self._run_model(chunk)
            self._counters.new_prefill_tokens += len(chunk)
        return self.last_logits()

    def decode(self, token: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> int:
        feed = token if token is not None else self._pending
        if feed is not None:
            self._run_model(checked_token_ids([feed], self._rt.vocab_size))
            self._counters.decoded_tokens += 1
        elif self._last_logits is None:
            raise BackendError("decode needs a prefill (or an explicit token) first")
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        assert self._last_logits is not None
        nxt = pick_token(self._last_logits, greedy, temperature, top_k, top_p, self._rng)
        self._pending = nxt
        return nxt

    def _run_model(self, ids: list[int]) -> None:
        """The one place that runs the model: allocate slots, place the tokens, forward."""
        self._check_usable()
        st = self._store
        n = len(ids)
        positions = self._next_positions(n)
        slots = st.allocate(n)
        st.pos[slots] = positions
        st.occupied[slots] = True
        st.tokens[slots] = ids
        st.order = np.concatenate([st.order, slots])
        try:
            logits = self._forward(ids, positions, slots, st.high_water())
        except BaseException as e:
            # Linear-attention layers before the failure may already have advanced their state, so
            # the session no longer describes any prefix of the stream.
            self._broken = f"a forward pass failed ({type(e).__name__}: {e})"
            raise
        self._stream_tokens += n
        self._last_logits = logits

    # -- page operations -----------------------------------------------------------------------
    def save_block(self, start: int, end: int) -> Block:
        self._check_range(start, end, nonempty=True)
        st = self._store
        with self._page_op():
            slots = st.order[start:end]
            keys, values = st.gather(slots)
            return Block(view=self._rt.view, keys=keys, values=values, positions=st.pos[slots].copy(),
                         token_ids=st.tokens[slots].copy(), model_name=self.model_name)

    def remove_attention_range(self, start: int, end: int) -> None:
        self._check_range(start, end, nonempty=True)
        st = self._store
        with self._page_op():
            # Only flags change: the freed slots keep stale data that the mask hides, no buffer
            # moves, and later tokens keep their positions (the gap is compacted lazily).
            st.occupied[st.order[start:end]] = False
            st.order = np.concatenate([st.order[:start], st.order[end:]])
            self._counters.evicted_tokens += end - start

    def insert_block(self, blk: Block, at: int, *, position: int | None = None) -> None:
        self._rt.view.require_same(blk.view)
        self._check_insert_at(at)
        with self._page_op():
            self._insert(at, _wanted_positions(blk.positions, position), position is not None, blk.token_ids,
                         lambda a0, a1: blk.keys[a0:a1], lambda a0, a1: blk.values[a0:a1], None)

    def insert_block_file(self, path: str | os.PathLike[str], at: int, *, checksum: str, size: int,
                          token_ids: np.ndarray | None = None, position: int | None = None) -> Block:
        self._check_insert_at(at)
        with BlockStream(path, checksum, size, expect=self._rt.view) as rd, self._page_op():
            rd.wait("token_ids")
            if token_ids is not None and not np.array_equal(rd.arrays["token_ids"], token_ids):
                raise BlockMismatchError(f"{os.fspath(path)} holds other tokens than the transcript at that place")

            def keys(a0: int, a1: int) -> np.ndarray:
                rd.wait("keys", rows=a1)
                return rd.arrays["keys"][a0:a1]

            def values(a0: int, a1: int) -> np.ndarray:
                rd.wait("values", rows=a1)
                return rd.arrays["values"][a0:a1]

            verified: list[Block] = []
            self._insert(at, _wanted_positions(rd.arrays["positions"], position), position is not None,
                         rd.arrays["token_ids"], keys, values, lambda: verified.append(rd.finish()))
            return verified[0]

    def _insert(self, at: int, saved_positions: np.ndarray, exact: bool, token_ids: np.ndarray,
                keys: Callable[[int, int], np.ndarray], values: Callable[[int, int], np.ndarray],
                verify: Callable[[], None] | None) -> None:
        """Copy a block into free slots layer group by layer group, then (verified) make it visible.

        Keys first, then values, so a streamed file is consumed in its on-disk order. Until the
        commit the slots stay free, so a failure leaves no trace beyond zeroed free slots. With
        `exact`, the block must take `saved_positions` as they are (a recovery puts each page back
        where it was, so attention sees the same relative distances as before)."""
        st = self._store
        n = int(saved_positions.shape[0])
        plan = self._plan_insert(at, saved_positions)
        if exact and (plan.compact or not np.array_equal(plan.block_pos, saved_positions)):
            raise ValueError(f"positions {int(saved_positions[0])}..{int(saved_positions[-1])} do not fit at {at} "
                             "between the held neighbours")
        slots = st.allocate(n)
        positions = None if plan.compact else plan.block_pos
        try:
            groups = list(st.layer_groups(n))
            for a0, a1 in groups:
                st.write_keys(slots, a0, a1, keys(a0, a1), positions)
            for a0, a1 in groups:
                st.write_values(slots, a0, a1, values(a0, a1))
            if verify is not None:
                verify()
        except BaseException:
            st.clear(slots)
            raise
        self._commit_insert(at, plan, slots, token_ids)

    def compact_positions(self) -> int:
        with self._page_op():
            return self._compact()

    def _next_positions(self, n: int) -> np.ndarray:
        st = self._store
        last = int(st.pos[st.order[-1]]) if st.order.shape[0] else -1
        if last + n >= self.position_limit and last + 1 > st.order.shape[0]:
            self.compact_positions()
            last = int(st.order.shape[0]) - 1
        return np.arange(last + 1, last + 1 + n, dtype=np.int64)

    def _plan_insert(self, at: int, saved_positions: np.ndarray) -> InsertPlan:
        return plan_insert(self._store.pos, self._store.order, at, saved_positions, self.position_limit)

    def _commit_insert(self, at: int, plan: InsertPlan, slots: np.ndarray, token_ids: np.ndarray) -> None:
        st = self._store
        n = int(slots.shape[0])
        st.occupied[slots] = True
        st.tokens[slots] = token_ids
        st.order = np.concatenate([st.order[:at], slots, plan.later])
        self._counters.restored_tokens += n
        if plan.compact:
            # Positions would leave the allowed range: renumber everything densely instead. The
            # sentinel marks the block's keys as changed so compaction rotates them too.
            st.pos[slots] = -1
            self._compact()
        else:
            st.pos[slots] = plan.block_pos
            moved = plan.later_new != plan.later_old
            st.reanchor(plan.later[moved], plan.later_new[moved])
            self._counters.reanchored_keys += n + int(moved.sum())

    def _compact(self) -> int:
        st = self._store
        dense = np.arange(st.order.shape[0], dtype=np.int64)
        changed = st.pos[st.order] != dense
        count = int(changed.sum())
        if count:
            st.reanchor(st.order[changed], dense[changed])
            self._counters.reanchored_keys += count
            self._counters.compactions += 1
        return count

    # -- recurrent state -----------------------------------------------------------------------
    def snapshot_recurrent(self) -> RecurrentSnapshot | None:
        if not self.is_hybrid:
            return None
        with self._page_op():
            states, dtypes = self._read_recurrent()
        return RecurrentSnapshot(model_id=self.model_id, stream_tokens=self._stream_tokens, states=states,
                                 dtypes=dtypes)

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        if not self.is_hybrid:
            raise BackendError("this model has no recurrent layers")
        if snap.model_id != self.model_id:
            raise BlockMismatchError(
                f"recurrent snapshot belongs to model_id {snap.model_id}, this backend is {self.model_id}")
        unknown = sorted({name for name in snap.dtypes.values()} - set(STORAGE_DTYPES))
        if unknown:
            raise BlockMismatchError(f"recurrent snapshot states have unsupported dtypes {unknown}")
        with self._page_op():
            self._write_recurrent(snap)
            self._stream_tokens = snap.stream_tokens
            # Logits and the pending token belong to the stream point being left.
            self._last_logits = None
            self._pending = None

    # -- session -------------------------------------------------------------------------------
    def fork(self: B) -> B:
        other = type(self).__new__(type(self))
        other._rt = self._rt
        other.model_name = self.model_name
        other.device = self.device
        other.prefill_chunk = self.prefill_chunk
        other.position_limit = self.position_limit
        other._counters = self._counters.copy()
        other._rng = np.random.default_rng()
        other._rng.bit_generator.state = self._rng.bit_generator.state
        with self._rt.lock:
            other._store = self._store.clone()
        other._store.owner_counters = other._counters
        other._cache = other._new_cache()
        self._copy_recurrent_to(other)
        other._stream_tokens = self._stream_tokens
        other._pending = self._pending
        other._last_logits = None if self._last_logits is None else self._last_logits.copy()
        other._broken = self._broken
        return other

    def reset(self) -> None:
        st = self._store
        st.occupied[:] = False
        st.order = np.zeros(0, dtype=np.int64)
        self._cache = self._new_cache()
        self._stream_tokens = 0
        self._pending = None
        self._last_logits = None
        self._broken = None

    # -- checks --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _marked_page_op(self) -> Iterator[None]:
        """For runtimes' `_page_op`: refuse a broken session and mark the operation, so a token
        entering the model meanwhile is counted as a historical forward."""
        self._check_usable()
        self._rt.page_op = self
        try:
            yield
        finally:
            self._rt.page_op = None

    def _check_insert_at(self, at: int) -> None:
        if not 0 <= at <= self.attention_tokens:
            raise IndexError(f"insert position {at} is outside 0..{self.attention_tokens}")

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise BackendError(f"session state is undefined: {self._broken}; reset() the session")

    def _check_range(self, start: int, end: int, nonempty: bool = False) -> None:
        n = self.attention_tokens
        if not (0 <= start <= end <= n) or (nonempty and start == end):
            raise IndexError(f"range [{start}, {end}) is not a {'non-empty ' if nonempty else ''}range of 0..{n}")
