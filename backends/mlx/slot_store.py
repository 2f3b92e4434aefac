"""The MLX slot store: a session's slot buffers in mlx arrays, and its window caches.

Each paged layer owns three preallocated slot buffers, as mlx-lm's own KVCache lays them out
(batch 1, heads, slots, dims), so attention reads them without a copy:

    k_rot[a]   [1, kv_heads, capacity, head_dim]    keys as attention uses them (rotated)
    k_canon[a] [1, kv_heads, capacity, rotary_dim]  pre-rotary keys, rotary dims only (the
                                                    pass-through dims are equal in k_rot)
    v[a]       [1, kv_heads, capacity, value_dim]

The host-side table (positions, occupied flags, the logical order) is the base's
(backends/slot_store.py). A window layer holds its newest W - 1 tokens as canonical keys, rotated
keys and values.

MLX arrays are values. Every buffer update is functional (`mx.slice_update` / `mx.put_along_axis`)
and rebinds the list entry; with no other reference alive MLX donates the old buffer, so an update
costs the size of the update, not of the buffer. A fork copies its buffers up front so its page
operations donate too.

Dependency rules: mlx, numpy, backends.slot_store / slots and this package's host, rotary and
model modules.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..slot_store import SlotStore
from ..slots import as_run
from .host import from_numpy, to_numpy
from .model import MlxModel
from .rotary import rotate_keys

__all__ = ["MlxSlotStore"]


def _put(buf: mx.array, slots: np.ndarray, src: mx.array) -> mx.array:
    """buf with buf[:, :, slots, :d] = src (src [1, H, n, d], d <= buf's last dim)."""
    run = as_run(slots)
    if run is not None:
        return mx.slice_update(buf, src, mx.array([0, 0, run[0], 0]), axes=(0, 1, 2, 3))
    idx = mx.array(slots.astype(np.int32)).reshape(1, 1, -1, 1)
    d = src.shape[-1]
    if d < buf.shape[-1]:
        src = mx.concatenate([src, mx.take(buf, idx.reshape(-1), axis=2)[..., d:]], axis=-1)
    return mx.put_along_axis(buf, idx, src, axis=2)


def _take(buf: mx.array, slots: np.ndarray) -> mx.array:
    """buf[:, :, slots] -> [1, H, n, d]."""
    run = as_run(slots)
    if run is not None:
        return buf[:, :, run[0]:run[1]]
    return mx.take(buf, mx.array(slots.astype(np.int32)), axis=2)


class MlxSlotStore(SlotStore):
    """Slot buffers of one session, one set per paged layer, and the window caches (see the module
    docstring)."""

    # One `mx.fast.rope` call per layer group of about four megabytes: per-call overhead made 30
    # per-layer calls several times slower than one call over all layers of a page
    # (docs/journal/2026-11-29-mlx-backend.md).
    group_elements = 1 << 20
    rt: MlxModel

    def __init__(self, rt: MlxModel, capacity: int) -> None:
        L = len(rt.attention_layers)
        H = rt.num_kv_heads
        with mx.stream(rt.device):
            self.k_rot = [mx.zeros((1, H, 0, rt.head_dim), dtype=rt.dtype) for _ in range(L)]
            # Without rotary embedding the rotated key is the canonical key: nothing to keep twice.
            self.k_canon = [mx.zeros((1, H, 0, rt.rotary_dim), dtype=rt.dtype) for _ in range(L if rt.rotary_dim
                                                                                               else 0)]
            self.v = [mx.zeros((1, H, 0, rt.value_head_dim), dtype=rt.dtype) for _ in range(L)]
        # Set for the duration of one forward besides the slots: its first position and its masks.
        self.fwd_offset = 0
        self.fwd_mask: mx.array | str | None = None
        self.fwd_win_mask: mx.array | str | None = None
        super().__init__(rt, capacity)
        self.write_window(None)

    def buffers(self) -> list[mx.array]:
        return [*self.k_rot, *self.k_canon, *self.v, *self.win_canon, *self.win_rot, *self.win_v]

    @staticmethod
    def _cat(a: Any, b: Any) -> Any:
        return mx.concatenate([a, b], axis=2)

    def _grow_buffers(self, capacity: int) -> None:
        extra = capacity - self.capacity

        def bigger(bufs: list[mx.array]) -> None:
            for a in range(len(bufs)):
                pad = mx.zeros((*bufs[a].shape[:2], extra, bufs[a].shape[3]), dtype=bufs[a].dtype)
                bufs[a] = mx.concatenate([bufs[a], pad], axis=2)

        with mx.stream(self.rt.device):
            bigger(self.k_rot)
            bigger(self.k_canon)
            bigger(self.v)
            mx.eval(self.buffers())

    def _copy_buffers(self) -> None:
        # Copied now (mx.array(x) copies), like torch's clone: sharing the buffers would be correct
        # too (MLX copies a shared buffer on its first write instead of donating it), but the first
        # page operation after a fork would then pay a copy of the whole cache.
        with mx.stream(self.rt.device):
            self.k_rot = [mx.array(x) for x in self.k_rot]
            self.k_canon = [mx.array(x) for x in self.k_canon]
            self.v = [mx.array(x) for x in self.v]
            self.win_canon = [mx.array(x) for x in self.win_canon]
            self.win_rot = [mx.array(x) for x in self.win_rot]
            self.win_v = [mx.array(x) for x in self.win_v]
            mx.eval(self.buffers())
        self.fwd_win_canon = [None] * len(self.win_canon)
        self.fwd_offset, self.fwd_mask, self.fwd_win_mask = 0, None, None

    # -- called from inside the model's forward ------------------------------------------------
    def write_layer(self, a: int, k_rot: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store this forward's rotated keys / values of paged layer `a`; return what attention reads."""
        assert self.fwd_slots is not None
        self.k_rot[a] = _put(self.k_rot[a], self.fwd_slots, k_rot)
        self.v[a] = _put(self.v[a], self.fwd_slots, v)
        hw = self.fwd_high_water
        return self.k_rot[a][:, :, :hw], self.v[a][:, :, :hw]

    def write_canon(self, a: int, k_pre: mx.array) -> None:
        """Store the exact pre-rotary keys [1, heads, n, head_dim] of paged layer `a`."""
        assert self.fwd_slots is not None
        if self.k_canon:
            self.k_canon[a] = _put(self.k_canon[a], self.fwd_slots, k_pre[..., : self.rt.rotary_dim])

    # -- page operations (callers evaluate the buffers when done) ------------------------------
    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """k_rot[slots, :r] = rope(k_canon[slots], positions), for every paged layer."""
        if slots.shape[0] == 0:
            return
        H = self.rt.num_kv_heads
        if self.k_canon:
            for a0, a1 in self.layer_groups(int(slots.shape[0])):
                canon = mx.concatenate([_take(self.k_canon[a], slots) for a in range(a0, a1)], axis=1)
                rot = self.rt.rotate(canon, positions)  # [1, group * H, n, r]
                for a in range(a0, a1):
                    j = (a - a0) * H
                    self.k_rot[a] = _put(self.k_rot[a], slots, rot[:, j:j + H])
        self.pos[slots] = positions

    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rt = self.rt
        if not self.k_canon:
            canon = mx.stack([_take(k, slots)[0] for k in self.k_rot])
        else:
            canon = mx.stack([_take(k, slots)[0] for k in self.k_canon])
            if rt.rotary_dim < rt.head_dim:
                passthrough = mx.stack([_take(k, slots)[0, :, :, rt.rotary_dim:] for k in self.k_rot])
                canon = mx.concatenate([canon, passthrough], axis=-1)
        return to_numpy(canon), to_numpy(mx.stack([_take(v, slots)[0] for v in self.v]))

    def rotated(self, slots: np.ndarray) -> np.ndarray:
        with mx.stream(self.rt.device):
            return np.array(mx.stack([_take(k, slots)[0] for k in self.k_rot]).astype(mx.float32))

    def write_keys(self, slots: np.ndarray, a0: int, a1: int, keys: np.ndarray, positions: np.ndarray | None) -> None:
        """Canonical keys [a1 - a0, H, n, D] of paged layers [a0, a1) into `slots` and, with
        `positions`, their rotation there (without, the keys are placed unrotated for a compaction
        to rotate). Evaluated before returning, so a streamed insert overlaps the next read."""
        r, d, H = self.rt.rotary_dim, self.rt.head_dim, self.rt.num_kv_heads
        n = int(slots.shape[0])
        k = from_numpy(keys, self.rt.dtype).reshape(1, (a1 - a0) * H, n, d)
        canon = k if r == d else mx.contiguous(k[..., :r])
        rows = k
        if positions is not None and r:
            rot = self.rt.rotate(canon, positions)
            rows = mx.concatenate([rot, k[..., r:]], axis=-1) if r < d else rot
        for a in range(a0, a1):
            j = (a - a0) * H
            if self.k_canon:
                self.k_canon[a] = _put(self.k_canon[a], slots, canon[:, j:j + H])
            self.k_rot[a] = _put(self.k_rot[a], slots, rows[:, j:j + H])
        mx.eval(self.buffers())

    def write_values(self, slots: np.ndarray, a0: int, a1: int, values: np.ndarray) -> None:
        v = from_numpy(values, self.rt.dtype)
        for a in range(a0, a1):
            self.v[a] = _put(self.v[a], slots, v[a - a0][None])

    def clear(self, slots: np.ndarray) -> None:
        for bufs in (self.k_rot, self.k_canon, self.v):
            for a in range(len(bufs)):
                bufs[a] = _put(bufs[a], slots, mx.zeros_like(_take(bufs[a], slots)))
        mx.eval(self.buffers())

    # -- window caches ---------------------------------------------------------------------------
    def reanchor_window(self, positions: np.ndarray) -> None:
        shape = self.rt.window
        assert shape is not None
        r = shape.rotary_dim
        if not r:
            return
        for w, canon in enumerate(self.win_canon):
            rot = rotate_keys(self.rt.win_rope, False, canon[..., :r], positions)
            self.win_rot[w] = mx.concatenate([rot, canon[..., r:]], axis=-1) if r < shape.head_dim else rot

    def _to_host(self, t: Any) -> np.ndarray:
        with mx.stream(self.rt.device):
            return to_numpy(t)

    def _weights_to_host(self, t: Any) -> np.ndarray:
        with mx.stream(self.rt.device):
            return np.array(t.astype(mx.float32)).astype(np.float64)

    def add_watched(self, queries: mx.array, keys: mx.array, mask: mx.array | str | None, scale: float,
                    sinks: mx.array | None) -> None:
        """Add one watched layer's softmax weights of the last watched queries, per head and summed
        over queries, to the per-slot accumulator: the scores mlx-lm's SDPA computes (`mask` as it
        takes it: None, "causal" or an array, boolean or additive), for those queries only."""
        assert self.watch is not None
        n = min(self.watch.queries, int(queries.shape[2]))
        q = queries[:, :, -n:].astype(mx.float32)
        k = keys.astype(mx.float32)
        if q.shape[1] != k.shape[1]:
            k = mx.repeat(k, q.shape[1] // k.shape[1], axis=1)
        logits = (q @ k.swapaxes(-1, -2)) * scale
        s = int(k.shape[2])
        if isinstance(mask, str):   # causal: the forward's queries are the last keys
            logits = mx.where(mx.arange(s)[None, :] <= (s - n + mx.arange(n))[:, None], logits, -mx.inf)
        elif mask is not None:
            rows = mask[..., -n:, :]
            logits = mx.where(rows, logits, -mx.inf) if rows.dtype == mx.bool_ else logits + rows.astype(mx.float32)
        if sinks is not None:
            sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, -1, 1, 1), (*logits.shape[:3], 1))
            weights = mx.softmax(mx.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
        else:
            weights = mx.softmax(logits, axis=-1)
        self.accumulate_weights(weights.sum(axis=(0, 2)), int(weights.shape[0] * n))

    def _from_host(self, a: np.ndarray) -> Any:
        with mx.stream(self.rt.device):
            return from_numpy(a, self.rt.dtype)

    def rotated_window(self) -> list[np.ndarray]:
        with mx.stream(self.rt.device):
            return [np.array(k.astype(mx.float32)) for k in self.win_rot]
