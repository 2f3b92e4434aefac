"""The cache objects mlx-lm's attention sees: windows onto a session's slot store.

A paged layer's `SlotLayer.update_and_fetch` writes the forward's rotated keys and values into the
slots the backend allocated and returns the slots up to the high-water mark; its `make_mask`
returns the backend's mask (built from positions: `occupied & slot_pos <= query_pos`, or mlx's own
"causal" / none when the slots hold no gap). A sliding-window layer's `WindowLayer` appends to its
window. Recurrent layers keep mlx-lm's own ArraysCache.

Dependency rules: mlx, mlx-lm's cache classes, backends.errors and this package's slot store.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Iterable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from ..errors import BackendError, UnsupportedModelError
from .slot_store import MlxSlotStore

__all__ = ["SlotLayer", "WindowLayer", "copy_arrays_cache", "watch_attention", "window_mask"]


class SlotLayer:
    """What mlx-lm's attention sees as the cache of a paged layer: a window onto the slot buffers."""

    def __init__(self, store: MlxSlotStore, index: int) -> None:
        self.store = store
        self.index = index

    @property
    def offset(self) -> int:
        """RoPE position of this forward's first token (positions within a forward are consecutive)."""
        return self.store.fwd_offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.store.write_layer(self.index, keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        if window_size is not None:
            raise BackendError("a sliding-window mask was asked of a global-attention layer's cache")
        if self.store.fwd_slots is None or int(self.store.fwd_slots.shape[0]) != n:
            raise BackendError("slot attention needs the backend's slot mask; run the model through MlxBackend")
        mask = self.store.fwd_mask
        if return_array and isinstance(mask, str) or (return_array and mask is None):
            return self._array_mask(n)
        return mask

    def _array_mask(self, n: int) -> mx.array:
        st = self.store
        assert st.fwd_slots is not None
        return mx.array(st.slot_mask(st.fwd_slots, st.fwd_high_water))

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise BackendError("slot attention layers are edited through the backend's page operations")

    def size(self) -> int:
        return int(self.store.order.shape[0])

    def empty(self) -> bool:
        return self.size() == 0


class WindowLayer(SlotLayer):
    """The cache of a sliding-window layer: its own window of the newest stream tokens."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.store.append_window(self.index, keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        st = self.store
        if st.fwd_slots is None or int(st.fwd_slots.shape[0]) != n:
            raise BackendError("window attention needs the backend's mask; run the model through MlxBackend")
        mask = st.fwd_win_mask
        if return_array and not isinstance(mask, mx.array):
            return window_mask(st.win_len, n, self.store.rt.roles.window_size)
        return mask

    def size(self) -> int:
        return self.store.win_len


def window_mask(n_win: int, s: int, window: int) -> mx.array:
    """Query i (stream index n_win + i) sees key j (window, then this forward) within W."""
    query = np.arange(n_win, n_win + s)[:, None]
    key = np.arange(n_win + s)[None, :]
    return mx.array((key <= query) & (query - key < window))


def copy_arrays_cache(c: ArraysCache) -> ArraysCache:
    out = copy.copy(c)
    out.cache = list(c.cache)  # the layers rebind entries, never write into them
    return out


def watch_attention(family: str, attention: Iterable[Any]) -> None:
    """Make the SDPA that these attention modules call report the weights of a watched forward
    (`MlxSlotStore.watch`): mlx-lm's attention modules call `scaled_dot_product_attention` of
    their own module, whose name is wrapped in place, once; the wrapper passes every call through
    and reads only calls whose cache is a watched layer's `SlotLayer`."""
    for module in {sys.modules[type(attn).__module__] for attn in attention}:
        inner = getattr(module, "scaled_dot_product_attention", None)
        if inner is None:
            raise UnsupportedModelError(f"{family}: its attention ({module.__name__}) does not call mlx-lm's "
                                        "scaled_dot_product_attention, so its weights cannot be observed")
        if not getattr(inner, "watches", False):
            module.scaled_dot_product_attention = _watching(inner)  # type: ignore[attr-defined]


def _watching(inner: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                                     scale: float, mask: mx.array | str | None,
                                     sinks: mx.array | None = None) -> mx.array:
        if type(cache) is SlotLayer:   # not a WindowLayer: window layers are never watched
            watch = cache.store.watch
            if watch is not None and cache.index in watch.layers:
                cache.store.add_watched(queries, keys, mask, scale, sinks)
        return inner(queries, keys, values, cache, scale, mask, sinks)

    scaled_dot_product_attention.watches = True  # type: ignore[attr-defined]
    return scaled_dot_product_attention
