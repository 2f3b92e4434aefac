"""The torch slot store: a session's slot buffers in torch tensors, and its window caches.

The paged layers share one set of preallocated slot buffers, stacked over those layers so a page
operation is one tensor op for all of them:

    k_rot   [layers, 1, kv_heads, capacity, head_dim]   keys as attention uses them (rotated)
    k_canon [layers, 1, kv_heads, capacity, rotary_dim] pre-rotary keys, rotary dims only (the
                                                        pass-through dims are equal in k_rot)
    v       [layers, 1, kv_heads, capacity, value_dim]

The host-side table (a RoPE position and an occupied flag per slot, the logical order of the held
tokens as slot numbers) is the base's (backends/slot_store.py). Because a key carries its position
in its rotation and the mask is built from positions (`occupied & slot_pos <= query_pos`),
attention does not depend on slot order: new tokens take the lowest free slots, eviction only
clears flags, and a restored page lands in whatever slots are free. Re-anchoring always recomputes
`rope(k_canon, new_pos)`. A window layer holds its newest W - 1 tokens as canonical keys, rotated
keys and values (see backends/runtime.py).

Dependency rules: torch, numpy, backends.rope / slot_store / slots and this package's host, model
and rotary modules.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import rope
from ..slot_store import Landing, SlotStore
from ..slots import runs_of
from .host import from_numpy, to_numpy
from .model import TorchModel
from .rotary import rotate_into

__all__ = ["TorchSlotStore"]

# Slots in up to this many runs are written run by run with slice copies; more, with index copies.
MOST_RUNS = 4


def _byte_runs(buf: torch.Tensor, pieces: list[tuple[int, int, int]]) -> list[memoryview]:
    """buf[a, 0, h, first:end] as bytes for every layer a, head h and run (first, end, _) of
    `pieces`, in that order: where a block's [layers, heads, tokens, dim] section lands. Sliced
    out of one flat view of the (contiguous) buffer: a numpy view per run, for a SmolLM2 page's
    180 runs, was a sizeable share of its warm restore (docs/journal/2026-11-29-restore-path.md)."""
    assert buf.is_contiguous() and buf.shape[1] == 1
    layers, _, heads, capacity, dim = buf.shape
    flat = buf.view(torch.uint8).numpy().data.cast("B")
    row = dim * buf.element_size()
    spans = [(first * row, end * row) for first, end, _ in pieces]
    return [flat[base + a:base + b] for base in range(0, layers * heads * capacity * row, capacity * row)
            for a, b in spans]


class TorchSlotStore(SlotStore):
    """Slot buffers of one session, stacked over the paged layers, and the window caches (see the
    module docstring)."""

    group_elements = 1 << 18  # a layer group's slice of a page: about a megabyte
    rt: TorchModel

    def __init__(self, rt: TorchModel, capacity: int) -> None:
        L, H = len(rt.attention_layers), rt.num_kv_heads
        self.k_rot = torch.zeros((L, 1, H, 0, rt.head_dim), dtype=rt.dtype, device=rt.device)
        self.k_canon = torch.zeros((L, 1, H, 0, rt.rotary_dim), dtype=rt.dtype, device=rt.device)
        self.v = torch.zeros((L, 1, H, 0, rt.value_head_dim), dtype=rt.dtype, device=rt.device)
        self._tables: tuple[np.ndarray, torch.Tensor, torch.Tensor] | None = None
        super().__init__(rt, capacity)
        self.write_window(None)

    def _cos_sin(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at `positions`, kept for the last positions asked: a page's layer groups are
        rotated to the same positions one after another, and forming the tables for each group
        slowed `write_keys` (docs/journal/2026-11-29-restore-path.md, "Figures moved out of code
        comments")."""
        held = self._tables
        if held is None or not np.array_equal(held[0], positions):
            rt = self.rt
            cos, sin = rope.cos_sin_torch(rt.inv_freq, torch.from_numpy(positions), rt.attention_scaling)
            held = self._tables = (positions.copy(), cos, sin)
        return held[1], held[2]

    def _grow_buffers(self, capacity: int) -> None:
        old = self.capacity

        def bigger(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            shape[3] = capacity
            out = torch.zeros(shape, dtype=t.dtype, device=t.device)
            out[:, :, :, :old] = t
            return out

        self.k_rot, self.k_canon, self.v = bigger(self.k_rot), bigger(self.k_canon), bigger(self.v)

    def _copy_buffers(self) -> None:
        self.k_rot, self.k_canon, self.v = self.k_rot.clone(), self.k_canon.clone(), self.v.clone()
        self.win_canon = [t.clone() for t in self.win_canon]
        self.win_rot = [t.clone() for t in self.win_rot]
        self.win_v = [t.clone() for t in self.win_v]
        self.fwd_win_canon = [None] * len(self.win_canon)

    @staticmethod
    def _cat(a: Any, b: Any) -> Any:
        return torch.cat([a, b], dim=2)

    def index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.rt.device)

    def put(self, buf: torch.Tensor, slots: np.ndarray, src: torch.Tensor) -> None:
        """buf[:, :, slots] = src for a [layers, heads, capacity, d] view; slots in a few runs (the
        usual case: a restored page lands in slots evictions freed) are slice copies."""
        pieces = runs_of(slots, MOST_RUNS)
        if pieces is None:
            buf.index_copy_(2, self.index(slots), src)
            return
        for first, end, at in pieces:
            buf[:, :, first:end].copy_(src[:, :, at:at + end - first])

    def take(self, buf: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        """buf[:, :, slots] as a new tensor [layers, heads, n, d]."""
        pieces = runs_of(slots, MOST_RUNS)
        if pieces is None:
            return buf.index_select(2, self.index(slots))
        if len(pieces) == 1:
            return buf[:, :, pieces[0][0]:pieces[0][1]].clone()
        return torch.cat([buf[:, :, first:end] for first, end, _ in pieces], dim=2)

    def _rotate(self, a0: int, a1: int, slots: np.ndarray, positions: np.ndarray,
                canon: torch.Tensor | None = None) -> None:
        """k_rot[a0:a1, slots, :r] = rope(canonical keys, positions), run by run straight into
        place or by an index copy. `canon` [a1 - a0, heads, n, r]: the keys, when they are not
        (yet) the ones held in k_canon at `slots`."""
        cos, sin = self._cos_sin(positions)
        r = self.rt.rotary_dim
        pieces = runs_of(slots, MOST_RUNS)
        if pieces is None:
            idx = self.index(slots)
            src = canon if canon is not None else self.k_canon[a0:a1, 0].index_select(2, idx)
            self.k_rot[a0:a1, 0, :, :, :r].index_copy_(2, idx, rope.apply_torch(src, cos, sin))
            return
        for first, end, at in pieces:
            stop = at + end - first
            src = canon[:, :, at:stop] if canon is not None else self.k_canon[a0:a1, 0, :, first:end]
            rope.apply_torch(src, cos[at:stop], sin[at:stop], out=self.k_rot[a0:a1, 0, :, first:end, :r])

    # -- called from inside the model's forward ------------------------------------------------
    def write_layer(self, a: int, k_rot: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's rotated keys / values of paged layer `a`; return what attention reads."""
        assert self.fwd_slots is not None
        self.put(self.k_rot[a], self.fwd_slots, k_rot)
        self.put(self.v[a], self.fwd_slots, v)
        hw = self.fwd_high_water
        return self.k_rot[a, :, :, :hw], self.v[a, :, :, :hw]

    def write_canon(self, a: int, k_pre: torch.Tensor) -> None:
        """Store the exact pre-rotary keys [1, heads, n, head_dim] of paged layer `a`."""
        assert self.fwd_slots is not None
        self.put(self.k_canon[a], self.fwd_slots, k_pre[..., : self.rt.rotary_dim])

    # -- page operations ---------------------------------------------------------------------
    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """k_rot[slots] = rope(k_canon[slots], positions), for every paged layer."""
        if slots.shape[0] == 0:
            return
        if self.rt.rotary_dim:
            for a0, a1 in self.layer_groups(int(slots.shape[0])):
                self._rotate(a0, a1, slots, positions)
        self.pos[slots] = positions

    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rt = self.rt
        canon = self.take(self.k_canon[:, 0], slots)
        if rt.rotary_dim < rt.head_dim:
            canon = torch.cat([canon, self.take(self.k_rot[:, 0, :, :, rt.rotary_dim:], slots)], dim=-1)
        return to_numpy(canon, copy=False), to_numpy(self.take(self.v[:, 0], slots), copy=False)

    def rotated(self, slots: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.take(self.k_rot[:, 0], slots).float().cpu().numpy()

    def write_keys(self, slots: np.ndarray, a0: int, a1: int, keys: np.ndarray, positions: np.ndarray | None) -> None:
        """Canonical keys [a1 - a0, heads, n, head_dim] of paged layers [a0, a1) into `slots` and,
        given positions, their rotation there. The keys are read a second time for the rotation
        while still in cache."""
        rt = self.rt
        r = rt.rotary_dim
        k = from_numpy(keys, rt.dtype, rt.device)
        self.put(self.k_canon[a0:a1, 0], slots, k[..., :r])
        if r < rt.head_dim:
            self.put(self.k_rot[a0:a1, 0, :, :, r:], slots, k[..., r:])
        if positions is None or not r:
            return
        self._rotate(a0, a1, slots, positions, k[..., :r])

    def write_values(self, slots: np.ndarray, a0: int, a1: int, values: np.ndarray) -> None:
        self.put(self.v[a0:a1, 0], slots, from_numpy(values, self.rt.dtype, self.rt.device))

    def landing(self, slots: np.ndarray) -> Landing | None:
        """The slots' memory when the buffers are on the CPU, `slots` lie in a few runs, and a key's
        dims all go to one buffer (all rotary: k_canon; none: k_rot); else None."""
        rt = self.rt
        r = rt.rotary_dim
        pieces = runs_of(slots, MOST_RUNS)
        if rt.device.type != "cpu" or pieces is None or r not in (0, rt.head_dim):
            return None

        def rotate(a0: int, a1: int, positions: np.ndarray) -> None:
            if r:
                self._rotate(a0, a1, slots, positions)

        return Landing(_byte_runs(self.k_canon if r else self.k_rot, pieces), _byte_runs(self.v, pieces), rotate)

    def clear(self, slots: np.ndarray) -> None:
        for buf in (self.k_rot, self.k_canon, self.v):
            self.put(buf[:, 0], slots, torch.zeros_like(self.take(buf[:, 0], slots)))

    # -- window caches ---------------------------------------------------------------------------
    def reanchor_window(self, positions: np.ndarray) -> None:
        rt = self.rt
        r = rt.window.rotary_dim if rt.window else 0
        for w, canon in enumerate(self.win_canon):
            rot = canon.clone()
            rotate_into(canon[..., :r], rot[..., :r], rt.win_inv_freq, rt.win_scaling, positions)
            self.win_rot[w] = rot

    def _to_host(self, t: Any) -> np.ndarray:
        return to_numpy(t)

    def _weights_to_host(self, t: Any) -> np.ndarray:
        weights: np.ndarray = t.double().cpu().numpy()
        return weights

    def _from_host(self, a: np.ndarray) -> Any:
        return from_numpy(a, self.rt.dtype, self.rt.device).clone()

    def rotated_window(self) -> list[np.ndarray]:
        with torch.no_grad():
            return [k.float().cpu().numpy() for k in self.win_rot]
