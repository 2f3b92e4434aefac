"""The cache objects transformers' attention sees: windows onto sessions' slot stores.

`SlotCache` is one session's transformers `Cache`: its paged layers write the forward's rotated
keys and values into the slots the backend allocated for this forward and hand attention the
buffers up to the high-water slot; its window layers append to their windows; its linear-attention
layers are transformers' stock `LinearAttentionLayer` (so hybrid recurrent state follows
transformers exactly); kv-shared and MLP / MoE layers get `DummyLayer`. `BatchCache` does the same
for one batched decode over several sessions (`BatchRows`): each row's token goes to its own
session's slots, and what each row's attention reads is left for the attention function
(attention.py), so no session's K/V is copied or padded.

Dependency rules: torch, transformers' cache classes, backends.protocol and this package's model
and slot store modules.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DummyLayer, LinearAttentionLayer

from ..errors import BackendError
from .model import TorchModel
from .slot_store import TorchSlotStore

__all__ = ["BatchCache", "BatchRows", "SlotCache", "clone_linear_layer"]


# transformers' cache classes are untyped; subclassing them is the one place we accept that.
class _SlotAttentionLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """Cache layer of one paged attention layer: a window onto the session's shared slot buffers."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: SlotCache, attention_index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        # A weak reference: the cache owns its layers, and a cycle back to it kept every forked
        # session's slot buffers alive until a full garbage collection (a benchmark scoring views
        # on forks of an 8k-token cache grew to 17 GB and was killed).
        self.owner: SlotCache = weakref.proxy(owner)
        self.attention_index = attention_index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.store.write_layer(self.attention_index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.store.fwd_high_water, 0

    def get_seq_length(self) -> int:
        return int(self.owner.store.order.shape[0])

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise BackendError("slot attention layers are reset through TorchBackend.reset()")

    def crop(self, tokens_to_remove: int) -> None:
        raise BackendError("slot attention layers are edited through the backend's page operations")


class _WindowLayer(_SlotAttentionLayer):  # type: ignore[no-untyped-call]
    """Cache layer of one sliding-window layer: its own window of the newest stream tokens."""

    is_sliding = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.store.append_window(self.attention_index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.store.win_len + query_length, 0


class SlotCache(Cache):
    """transformers `Cache` whose paged layers are slot windows, whose window layers keep their own
    windows, whose linear-attention layers are the stock ones (so hybrid recurrent state follows
    transformers exactly) and whose other layers hold nothing."""

    def __init__(self, store: TorchSlotStore, rt: TorchModel, linear_states: int) -> None:
        self.store = store
        paged, window, roles = rt.paged_index, rt.window_index, rt.roles
        layers: list[Any] = []
        for layer in range(roles.n_layers):
            if layer in paged:
                layers.append(_SlotAttentionLayer(self, paged[layer]))
            elif layer in window:
                layers.append(_WindowLayer(self, window[layer]))
            elif layer in roles.recurrent:
                layers.append(LinearAttentionLayer(number_of_states=linear_states))
            else:
                layers.append(DummyLayer())  # type: ignore[no-untyped-call]
        super().__init__(layers=layers)


class BatchRows:
    """The sessions of one batched decode forward, row b being `stores[b]`'s one token: what the
    model's hooks (`rt.active`) and the batch cache's layers dispatch to, row by row. Each row's
    attention runs over its own session's slots with its own mask, so no session's K/V is copied
    or padded; only the projections and MLPs see the batch."""

    def __init__(self, stores: list[TorchSlotStore], masks: list[dict[str, torch.Tensor | None]]) -> None:
        self.stores = stores
        self.masks = masks
        # Per row, what the attention about to run reads: (keys, values, mask), set by a layer's update.
        self.reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def observe_key(self, layer: int, out: torch.Tensor) -> None:
        for b, st in enumerate(self.stores):
            st.observe_key(layer, out[b:b + 1])

    def count_entered(self, n: int) -> None:
        assert n % len(self.stores) == 0
        for st in self.stores:
            st.count_entered(n // len(self.stores))


class _BatchLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """A paged or window layer of a batched decode: each row's token goes to its own session's
    slots (or window), and what each row's attention reads is left in `rows.reads`."""

    is_compileable = False
    is_croppable = False

    def __init__(self, rows: BatchRows, index: int, sliding: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rows, self.index, self.is_sliding = rows, index, sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kind = "sliding_attention" if self.is_sliding else "full_attention"
        reads = []
        for b, st in enumerate(self.rows.stores):
            k, v = key_states[b:b + 1], value_states[b:b + 1]
            keys, values = st.append_window(self.index, k, v) if self.is_sliding else st.write_layer(self.index, k, v)
            reads.append((keys, values, self.rows.masks[b][kind]))
        self.rows.reads = reads
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return 1, 0

    def get_seq_length(self) -> int:
        return max(int(st.order.shape[0]) for st in self.rows.stores)

    def get_max_length(self) -> int:
        return -1


class BatchCache(Cache):
    """transformers `Cache` of one batched decode over sessions whose layers are all paged,
    window or cache-free (`TorchBackend.batches_decode`)."""

    def __init__(self, rows: BatchRows, rt: TorchModel) -> None:
        paged, window = rt.paged_index, rt.window_index
        layers: list[Any] = []
        for layer in range(rt.roles.n_layers):
            if layer in paged:
                layers.append(_BatchLayer(rows, paged[layer], sliding=False))
            elif layer in window:
                layers.append(_BatchLayer(rows, window[layer], sliding=True))
            else:
                layers.append(DummyLayer())  # type: ignore[no-untyped-call]
        super().__init__(layers=layers)


def clone_linear_layer(layer: LinearAttentionLayer) -> LinearAttentionLayer:
    """An independent copy of a linear-attention layer's states and flags, for a fork."""
    out = LinearAttentionLayer(number_of_states=layer.number_of_states)
    for i in range(layer.number_of_states):
        conv, rec = layer.conv_states[i], layer.recurrent_states[i]
        out.conv_states[i] = conv.clone() if conv is not None else None
        out.recurrent_states[i] = rec.clone() if rec is not None else None
    out.is_conv_states_initialized = dict(layer.is_conv_states_initialized)
    out.is_recurrent_states_initialized = dict(layer.is_recurrent_states_initialized)
    out.has_previous_state = dict(layer.has_previous_state)
    out.conv_kernel_size = dict(layer.conv_kernel_size)
    out.device, out.dtype = layer.device, layer.dtype
    return out
