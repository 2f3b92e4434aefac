"""What the torch and MLX runtimes share: everything of a backend session that is not tensor work.

A runtime supplies a loaded model (`LoadedModel` plus its own fields, with the `LayerRoles` it
found in its model), a slot store (`SlotStore`: buffers, gathers, writes and re-anchoring in its
tensor library, and the window caches of sliding-window layers) and a handful of hooks (one
forward pass, the cache object its model code sees, the recurrent states). This base turns them
into the `Backend` protocol: identity, the prefill / decode loop, sampling, slot bookkeeping for
evict / insert / compaction, the streaming, verified insert of a stored block, the window caches'
positions, recurrent snapshots (windows included), fork and reset. The two runtimes therefore
count, position and check the same way by construction, not by copying.

Sliding-window layers are never paged. Each keeps the newest W - 1 tokens the model consumed (W
the window), as canonical keys, rotated keys and values; a forward appends its tokens and attends
to those plus its own, within W of each other in the stream. Page operations never touch a
window: the window always holds the last tokens of the stream, whatever attention holds. Its keys
sit at the positions just before the next forward's first position (the stream distances the
model was trained on); a compaction or an insert that moves that position re-rotates them from
their canonical form before the next forward.

Dependency rules: numpy and backends.protocol / slots / models; never a tensor library.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np

from .models import ModelSource, load_tokenizer, resolve
from .protocol import (
    ROPE_LAYOUT_NEOX,
    ROPE_LAYOUT_NONE,
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
    storage_dtype,
)
from .slots import InsertPlan, checked_token_ids, pick_token, plan_insert

__all__ = ["LayerRoles", "LoadedModel", "SlotBackend", "SlotStore", "WindowShape", "keep_torch_out"]


def keep_torch_out(model: str) -> bool:
    """For a process that will run `model` on MLX and nothing on torch: when `model` is a folder
    (Hugging Face or mlx-lm) and neither torch nor transformers is imported yet, mark torch as not
    importable, so transformers (imported for configs and tokenizers, and by mlx-lm) leaves it
    alone; it would import it merely because it is installed (transformers 5 has no switch for
    this: `USE_TORCH` is gone). A served chat turn on the 4-bit SmolLM2 folder then peaks at 591 MB
    instead of 830 MB (of which ~300 MB is the float32 slot cache of the default 4,096-token
    budget). Not for GGUF files or MLX copies of the built-in models: reading a GGUF and making an
    MLX copy need torch. Returns whether torch was kept out."""
    if resolve(model).kind != "hf_dir" or "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError; find_spec is None
    return True


@dataclasses.dataclass(frozen=True)
class LayerRoles:
    """What each decoder layer is to paging, found by a runtime in its model's modules and cache kinds."""

    n_layers: int
    paged: tuple[int, ...]           # global attention with its own K/V: the layers a block holds
    window: tuple[int, ...] = ()     # sliding-window attention with its own K/V: a window cache, never paged
    recurrent: tuple[int, ...] = ()  # linear attention / Mamba: conv + recurrent state, snapshotted
    shared: tuple[int, ...] = ()     # attention on another layer's K/V (Gemma 4 kv sharing): nothing of its own
    stateless: tuple[int, ...] = ()  # MLP / MoE blocks: no cache at all
    window_size: int = 0             # W: a query sees the keys of the W newest tokens, itself included

    def check(self, family: str) -> None:
        """Every layer has exactly one role, and there is something to page."""
        roles = [self.paged, self.window, self.recurrent, self.shared, self.stateless]
        seen = sorted(i for r in roles for i in r)
        if seen != list(range(self.n_layers)):
            missing = sorted(set(range(self.n_layers)) - set(seen))
            raise UnsupportedModelError(f"{family}: layers {missing or 'some'} are neither global attention, "
                                        "sliding-window attention, kv-shared attention, recurrent nor cache-free")
        if not self.paged:
            raise UnsupportedModelError(f"{family}: no global-attention layer to page"
                                        + (" (every attention layer is a sliding window)" if self.window else ""))
        if self.window and self.window_size < 2:
            raise UnsupportedModelError(f"{family}: sliding-window layers without a window size")


@dataclasses.dataclass(frozen=True)
class WindowShape:
    """The K/V shape of the sliding-window layers (all alike) and their rotary dims."""

    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    rotary_dim: int


@dataclasses.dataclass(kw_only=True)
class LoadedModel:
    """One loaded model, shared by a backend session and its forks; runtimes add their own fields."""

    source: ModelSource
    family: str
    roles: LayerRoles
    num_kv_heads: int      # of the paged layers, as are the dims below
    head_dim: int
    value_head_dim: int
    rotary_dim: int        # 0: no rotary embedding (NoPE)
    max_position_embeddings: int
    vocab_size: int
    model_id: str      # content hash of config and weights (slots.model_identity / folder_identity)
    dtype_name: str    # "float32", "float16" or "bfloat16"
    window: WindowShape | None = None
    key_layouts: dict[int, str] = dataclasses.field(default_factory=dict)
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    # The store of the session whose forward is running (the model's hooks write there) and the
    # session running a page operation (a token entering the model meanwhile is counted as a
    # historical forward: there must be none).
    active: Any = None
    page_op: Any = None
    tokenizer: Tokenizer | None = None

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The paged layers (global attention); blocks hold exactly these."""
        return self.roles.paged

    @functools.cached_property
    def paged_index(self) -> dict[int, int]:
        """Layer -> its index among the paged layers."""
        return {layer: a for a, layer in enumerate(self.roles.paged)}

    @functools.cached_property
    def window_index(self) -> dict[int, int]:
        """Layer -> its index among the window layers."""
        return {layer: w for w, layer in enumerate(self.roles.window)}

    def key_heads(self, layer: int) -> tuple[int, int]:
        """(kv heads, head dim) of a paged or window layer."""
        if layer in self.paged_index:
            return self.num_kv_heads, self.head_dim
        assert self.window is not None
        return self.window.num_kv_heads, self.window.head_dim

    def key_layout(self, layer: int, shape: tuple[int, ...], n: int) -> str:
        """How `layer`'s key module lays out a forward of `n` tokens: "proj" ([B, S, H * D]), "bshd"
        or "bhsd" (Gemma 3's k_norm). Read off the first forward whose length is not the head count
        (the load-time check is one) and kept."""
        layout = self.key_layouts.get(layer)
        if layout is None:
            heads = self.key_heads(layer)[0]
            if len(shape) == 3:
                layout = "proj"
            elif n != heads and tuple(shape[1:3]) == (n, heads):
                layout = "bshd"
            elif n != heads and tuple(shape[1:3]) == (heads, n):
                layout = "bhsd"
            else:
                raise BackendError(f"layer {layer}: cannot tell the key layout of {shape} yet")
            self.key_layouts[layer] = layout
        return layout

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return self.roles.recurrent

    @property
    def view(self) -> LayerView:
        """What a block of this model means; both runtimes lay keys out in the "neox" half-split
        form (each checks its model's rotary module against that at load), or "none" without rotary."""
        return LayerView(model_id=self.model_id, family=self.family, attention_layers=self.attention_layers,
                         num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, value_head_dim=self.value_head_dim,
                         rotary_dim=self.rotary_dim,
                         rope_layout=ROPE_LAYOUT_NEOX if self.rotary_dim else ROPE_LAYOUT_NONE, dtype=self.dtype_name)


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

    # -- called from inside the model's forward ------------------------------------------------
    def observe_key(self, layer: int, out: Any) -> None:
        """What the key module of a paged or window layer returned in this forward (a torch tensor or
        an mlx array, in the module's own layout): its pre-rotary key, kept as [1, heads, n, head_dim]."""
        assert self.fwd_slots is not None
        n = int(self.fwd_slots.shape[0])
        layout = self.rt.key_layout(layer, tuple(out.shape), n)
        if layout == "proj":
            out = out.reshape(1, n, *self.rt.key_heads(layer))
        key = out if layout == "bhsd" else out.swapaxes(1, 2)
        paged, window = self.rt.paged_index, self.rt.window_index
        if layer in paged:
            self.write_canon(paged[layer], key)
        else:
            self.fwd_win_canon[window[layer]] = key

    def append_window(self, w: int, k_rot: Any, v: Any) -> tuple[Any, Any]:
        """Window layer `w`: attention reads its window plus this forward's tokens (rotated keys and
        values); afterwards the window keeps the newest W - 1 of them, canonical keys included."""
        canon = self.fwd_win_canon[w]
        assert canon is not None
        keys, values = self._cat(self.win_rot[w], k_rot), self._cat(self.win_v[w], v)
        keep = self.rt.roles.window_size - 1
        self.win_rot[w] = keys[:, :, -keep:]
        self.win_v[w] = values[:, :, -keep:]
        self.win_canon[w] = self._cat(self.win_canon[w], canon)[:, :, -keep:]
        self.fwd_win_canon[w] = None
        return keys, values

    def window_positions(self, first: int) -> np.ndarray:
        """Where the window keys go for a forward starting at position `first`: right before it."""
        return np.arange(first - self.win_len, first, dtype=np.int64)

    # -- the runtime's tensors ---------------------------------------------------------------
    def write_canon(self, a: int, key: Any) -> None:
        """Store the exact pre-rotary keys [1, heads, n, head_dim] of paged layer `a` in this forward's slots."""
        raise NotImplementedError

    @staticmethod
    def _cat(a: Any, b: Any) -> Any:
        """a and b joined along the token axis (2)."""
        raise NotImplementedError

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

    # -- the window caches of sliding-window layers (runtimes with window layers implement these) --
    def reanchor_window(self, positions: np.ndarray) -> None:
        """Rotate every window layer's canonical keys to `positions` [win_len]."""
        raise NotImplementedError

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

    def _to_host(self, t: Any) -> np.ndarray:
        """A copy of runtime tensor `t` as a numpy array in storage dtype (bf16 bits as uint16)."""
        raise NotImplementedError

    def _from_host(self, a: np.ndarray) -> Any:
        """A new runtime tensor of the model dtype from a storage-dtype array."""
        raise NotImplementedError

    def rotated_window(self) -> list[np.ndarray]:
        """Per window layer: float32 keys as the window layers read them [1, heads, win_len, head_dim]."""
        raise NotImplementedError


B = TypeVar("B", bound="SlotBackend")
S = TypeVar("S", bound="SlotStore")


def _wanted_positions(saved: np.ndarray, position: int | None) -> np.ndarray:
    """The block's own saved positions, or the run starting at `position`."""
    if position is None:
        return saved
    return np.arange(position, position + int(saved.shape[0]), dtype=np.int64)


class SlotBackend:
    """The `Backend` protocol over a runtime's slot store. Subclasses implement the hooks below."""

    name: str
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
        cls(rt, source.name, capacity=16, position_limit=position_limit)._check_rotation()
        return cls(rt, source.name, capacity=capacity, prefill_chunk=prefill_chunk, position_limit=position_limit,
                   seed=seed)

    def _check_rotation(self) -> None:
        """At load, on a throwaway session: one short forward far from position 0. The keys the model
        rotated itself must equal our re-anchoring of the canonical keys it computed, in the paged
        and in the window layers; a layout, frequency or scaling we do not reproduce is refused here
        instead of drifting later. The forward's length differs from every head count, so it also
        fixes the layout of each key module's output."""
        rt = self._rt
        heads = {rt.num_kv_heads} | ({rt.window.num_kv_heads} if rt.window else set())
        n = next(k for k in range(5, 64) if k not in heads)
        first = max(0, min(1000, self.position_limit - 2 * n))
        positions = np.arange(first, first + n, dtype=np.int64)
        self._run_model([(7 + 131 * i) % rt.vocab_size for i in range(n)], positions)
        st = self._store
        slots = st.order.copy()
        checks: list[tuple[str, np.ndarray, Callable[[], None], Callable[[], np.ndarray]]] = [
            ("paged", st.rotated(slots), lambda: st.reanchor(slots, positions), lambda: st.rotated(slots))]
        if rt.roles.window:
            checks.append(("window", np.stack(st.rotated_window()),
                           lambda: st.reanchor_window(st.window_positions(first + n)),
                           lambda: np.stack(st.rotated_window())))
        for what, model_keys, reanchor, ours in checks:
            with self._page_op():
                reanchor()
            err = float(np.abs(ours() - model_keys).max())
            if not err <= 1e-5 * max(1.0, float(np.abs(model_keys).max())):
                raise UnsupportedModelError(
                    f"{rt.family}: the model's rotary embedding of its {what} layers differs from re-anchoring "
                    f"(half-split layout, the rotary module's frequencies and scaling) by {err:.3g}; an adapter for "
                    "its rotary layout is missing")

    # -- hooks a runtime implements ------------------------------------------------------------
    @staticmethod
    def _load_model(source: ModelSource, device: str, dtype: str, model_id: str | None) -> LoadedModel:
        """The loaded model for `source` (the runtime's `_make_runtime`)."""
        raise NotImplementedError

    def _device_name(self) -> str:
        raise NotImplementedError

    def _new_store(self, capacity: int) -> SlotStore:
        raise NotImplementedError

    def _new_cache(self) -> Any:
        """The cache object the model code sees, over this session's store (recurrent layers empty)."""
        raise NotImplementedError

    def _forward(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, high_water: int,
                 every: bool = False) -> np.ndarray:
        """Run the model over `ids` (already placed in `slots` at `positions`); float32 last logits,
        or with `every` the logits after each token, [len(ids), vocab]."""
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
    def layer_roles(self) -> LayerRoles:
        """What each decoder layer is to paging (not part of the protocol; for diagnostics and tests)."""
        return self._rt.roles

    @property
    def is_hybrid(self) -> bool:
        """The model keeps per-stream state outside the paged layers (recurrent layers, sliding-window
        caches): `snapshot_recurrent` covers it, and a cut must restore it."""
        return bool(self._rt.roles.recurrent or self._rt.roles.window)

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

    def window_state(self) -> tuple[np.ndarray | None, list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
        """Diagnostics (not part of the protocol): the positions the window keys are rotated at now
        (None before the first forward after a snapshot restore), per window layer the rotated keys
        (float32 [1, heads, n, head_dim]) and the canonical keys and values (storage dtype)."""
        st = self._store
        with self._rt.lock:
            if not st.win_len:
                return np.zeros(0, dtype=np.int64), [], []
            if st.win_last_pos is None:
                return None, [], st.read_window()
            return st.window_positions(st.win_last_pos + 1), st.rotated_window(), st.read_window()

    # -- running the model ---------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        self._prefill_chunks(token_ids, every=False)
        return self.last_logits()

    def prefill_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        return np.concatenate(self._prefill_chunks(token_ids, every=True))

    def _prefill_chunks(self, token_ids: Sequence[int], every: bool) -> list[np.ndarray]:
        """Append `token_ids` chunk by chunk; each chunk's logits (`_forward`'s, with `every`)."""
        ids = checked_token_ids(token_ids, self._rt.vocab_size)
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._pending = None
        out = []
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            out.append(self._run_model(chunk, every=every))
            self._counters.new_prefill_tokens += len(chunk)
        return out

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

    def _run_model(self, ids: list[int], positions: np.ndarray | None = None, every: bool = False) -> np.ndarray:
        """The one place that runs the model: allocate slots, place the tokens, forward; returns the
        logits (`_forward`'s). `positions` (consecutive, past every held one) only for the load-time
        rotation check."""
        slots, positions = self._place(ids, positions)
        started = time.perf_counter_ns()
        try:
            logits = self._forward(ids, positions, slots, self._store.high_water(), every)
        except BaseException as e:
            self._forward_failed(e)
            raise
        self._counters.forward_ns += time.perf_counter_ns() - started
        self._advance(positions)
        self._last_logits = logits[-1] if every else logits
        return logits

    def _place(self, ids: list[int], positions: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Slots and positions for `ids` about to enter the model, entered in the slot table."""
        self._check_usable()
        st = self._store
        n = len(ids)
        if positions is None:
            positions = self._next_positions(n)
        first = int(positions[0])
        if st.win_len and st.win_last_pos != first - 1:
            # A compaction, an insert or a restored snapshot moved the stream's head: the window keys
            # go right before the new tokens again, rotated from their canonical form.
            with self._page_op():
                st.reanchor_window(st.window_positions(first))
            st.win_last_pos = first - 1
        slots = st.allocate(n)
        st.pos[slots] = positions
        st.occupied[slots] = True
        st.tokens[slots] = ids
        st.order = np.concatenate([st.order, slots])
        return slots, positions

    def _forward_failed(self, e: BaseException) -> None:
        # Linear-attention layers before the failure may already have advanced their state, so
        # the session no longer describes any prefix of the stream.
        self._broken = f"a forward pass failed ({type(e).__name__}: {e})"

    def _advance(self, positions: np.ndarray) -> None:
        """The stream after a forward over `positions` (placed by `_place`)."""
        n = int(positions.shape[0])
        self._stream_tokens += n
        if self._rt.roles.window:
            st = self._store
            st.win_len = min(self._rt.roles.window_size - 1, st.win_len + n)
            st.win_last_pos = int(positions[-1])

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
            held = rd.small("token_ids")
            if token_ids is not None and not np.array_equal(held, token_ids):
                raise BlockMismatchError(f"{os.fspath(path)} holds other tokens than the transcript at that place")
            verified: list[Block] = []
            self._insert(at, _wanted_positions(rd.small("positions"), position), position is not None, held,
                         lambda a0, a1: rd.rows("keys", a0, a1), lambda a0, a1: rd.rows("values", a0, a1),
                         lambda: verified.append(rd.finish()))
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

    def reposition(self, positions: np.ndarray) -> int:
        st = self._store
        wanted = np.asarray(positions, dtype=np.int64)
        if wanted.shape != st.order.shape:
            raise ValueError(f"{wanted.shape[0]} positions for {st.order.shape[0]} held tokens")
        if wanted.size and (int(wanted.min()) < 0 or int(wanted.max()) >= self.position_limit
                            or np.unique(wanted).shape[0] != wanted.shape[0] or int(wanted[-1]) != int(wanted.max())):
            raise ValueError(f"positions must be distinct, in 0..{self.position_limit - 1}, and highest for the last "
                             "held token")
        with self._page_op():
            changed = st.pos[st.order] != wanted
            count = int(changed.sum())
            if count:
                st.reanchor(st.order[changed], wanted[changed])
                self._counters.reanchored_keys += count
            return count

    def _next_positions(self, n: int) -> np.ndarray:
        st = self._store
        last = int(st.pos[st.order[-1]]) if st.order.shape[0] else -1
        if last + n >= self.position_limit and last + 1 > st.order.shape[0]:
            self.compact_positions()
            last = int(st.order.shape[0]) - 1
        # Window keys sit right before the new tokens: leave them room at non-negative positions.
        first = max(last + 1, st.win_len)
        return np.arange(first, first + n, dtype=np.int64)

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
        """Recurrent states ("conv/<layer>/<i>", "recurrent/<layer>/<i>", in the Hugging Face layout)
        and the window caches ("window/<layer>/keys": canonical keys [1, heads, n, head_dim], and
        "window/<layer>/values"): everything a cut or a recovery must put back besides the pages."""
        if not self.is_hybrid:
            return None
        with self._page_op():
            states, dtypes = self._read_recurrent() if self._rt.roles.recurrent else ({}, {})
            if self._store.win_len:
                for layer, (keys, values) in zip(self._rt.roles.window, self._store.read_window(), strict=True):
                    for kind, arr in (("keys", keys), ("values", values)):
                        states[f"window/{layer}/{kind}"] = arr
                        dtypes[f"window/{layer}/{kind}"] = self._rt.dtype_name
        return RecurrentSnapshot(model_id=self.model_id, stream_tokens=self._stream_tokens, states=states,
                                 dtypes=dtypes)

    def _window_from_snapshot(self, snap: RecurrentSnapshot) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """The snapshot's window caches, checked against this model (BlockMismatchError otherwise)."""
        roles, shape = self._rt.roles, self._rt.window
        if not roles.window:
            return None
        present = [layer for layer in roles.window if f"window/{layer}/keys" in snap.states]
        if not present:
            if snap.stream_tokens:
                raise BlockMismatchError(f"recurrent snapshot of {snap.stream_tokens} tokens has no sliding-window "
                                         "state for this model's window layers")
            return None
        if present != list(roles.window):
            raise BlockMismatchError(f"recurrent snapshot has window state for layers {present}, this model's window "
                                     f"layers are {list(roles.window)}")
        assert shape is not None
        out: list[tuple[np.ndarray, np.ndarray]] = []
        lengths = set()
        for layer in roles.window:
            keys, values = snap.states[f"window/{layer}/keys"], snap.states[f"window/{layer}/values"]
            n = int(keys.shape[2]) if keys.ndim == 4 else -1
            lengths.add(n)
            want_k = (1, shape.num_kv_heads, n, shape.head_dim)
            want_v = (1, shape.num_kv_heads, n, shape.value_head_dim)
            dtypes = {snap.dtypes[f"window/{layer}/keys"], snap.dtypes[f"window/{layer}/values"]}
            if tuple(keys.shape) != want_k or tuple(values.shape) != want_v or dtypes != {self._rt.dtype_name}:
                raise BlockMismatchError(
                    f"recurrent snapshot window layer {layer} has keys {tuple(keys.shape)} / values "
                    f"{tuple(values.shape)} in {sorted(dtypes)}, this model needs {want_k} / {want_v} in "
                    f"{self._rt.dtype_name}")
            out.append((keys, values))
        if len(lengths) != 1 or not 0 < lengths.pop() < roles.window_size:
            raise BlockMismatchError("recurrent snapshot window layers differ in length or exceed the window")
        return out

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        if not self.is_hybrid:
            raise BackendError("this model has no recurrent layers")
        if snap.model_id != self.model_id:
            raise BlockMismatchError(
                f"recurrent snapshot belongs to model_id {snap.model_id}, this backend is {self.model_id}")
        unknown = sorted({name for name in snap.dtypes.values()} - set(STORAGE_DTYPES))
        if unknown:
            raise BlockMismatchError(f"recurrent snapshot states have unsupported dtypes {unknown}")
        window = self._window_from_snapshot(snap)
        with self._page_op():
            if self._rt.roles.recurrent:
                self._write_recurrent(snap)
            if self._rt.roles.window:
                self._store.write_window(window)
                self._store.win_len = 0 if window is None else int(window[0][0].shape[2])
                self._store.win_last_pos = None
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
        if self._rt.roles.window:
            st.write_window(None)
        st.win_len, st.win_last_pos = 0, None
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
