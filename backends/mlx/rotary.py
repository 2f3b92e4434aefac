"""The model's own rotary embedding, checked and used for re-anchoring.

`rope_of` finds the rotary module of a set of attention layers (mlx-lm's `attn.rope`: `mx.fast.rope`
with the model's base and scaling, YaRN, proportional, ...) and checks that it rotates its first
dims in the half-split ("neox") layout and leaves the rest alone; `rotate_keys` calls it on
canonical keys with the target positions as offsets, so a re-anchored key is bit for bit the key
the model computes at that position.

Dependency rules: mlx, numpy and backends.errors.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..errors import UnsupportedModelError

__all__ = ["position_runs", "rope_of", "rotate_keys"]


def position_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """[(i0, i1)] index ranges over which `positions` step by exactly 1."""
    n = int(positions.shape[0])
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    edges = [0, *breaks.tolist(), n]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


def rope_of(family: str, what: str, attns: list[Any], head_dim: int) -> tuple[Any, int, bool]:
    """The rotary module shared by `attns` (None: NoPE), its rotary dims, and whether per-token
    offset arrays match its scalar offsets bit for bit. Checks that it rotates its first dims in the
    half-split layout and leaves the rest alone, and that every layer's rope does the same."""
    ropes: list[Any] = [getattr(a, "rope", None) for a in attns]
    if all(r is None for r in ropes):
        return None, 0, False
    if any(r is None for r in ropes):
        raise UnsupportedModelError(f"{family}: some {what} layers have a rotary embedding and some do not")
    rope_mod: Any = ropes[0]
    r = int(getattr(rope_mod, "dims", getattr(rope_mod, "dim", 0)) or 0)
    if r % 2 or not 0 < r <= head_dim:
        raise UnsupportedModelError(f"{family}: rotary dims {r} of mlx-lm's rope do not fit head dim {head_dim}")
    gen = np.random.default_rng(0)
    x = mx.array(gen.standard_normal((1, 2, 6, head_dim)).astype(np.float32))
    reference = rope_mod(x, offset=1000)
    for other in ropes[1:]:
        if not bool(mx.array_equal(other(x, offset=1000), reference)):
            raise UnsupportedModelError(f"{family}: the {what} layers rotate their keys differently")
    # Half-split layout: basis vectors e_i and e_{i+r/2} rotate within their pair.
    h = r // 2
    basis = mx.eye(r, dtype=mx.float32).reshape(r, 1, 1, r)
    out = np.array(rope_mod(basis, offset=1)).reshape(r, r)
    cos, sin = np.diagonal(out)[:h], out[np.arange(h), np.arange(h) + h]
    expected = np.zeros_like(out)
    idx = np.arange(h)
    expected[idx, idx], expected[idx, idx + h] = cos, sin
    expected[idx + h, idx + h], expected[idx + h, idx] = cos, -sin
    if not float(np.abs(out - expected).max()) <= 1e-5 * max(float(np.abs(out).max()), 1.0):
        raise UnsupportedModelError(f"{family}: the {what} layers' rotary embedding is not the half-split ('neox') "
                                    f"layout on its first {r} dims; a layout adapter is missing")
    part = rope_mod(x[..., :r], offset=1000)
    if not (bool(mx.array_equal(reference[..., :r], part)) and bool(mx.array_equal(reference[..., r:], x[..., r:]))):
        raise UnsupportedModelError(f"{family}: rotating the first {r} dims alone differs from the model's rotation")
    per_token = rope_mod(x[..., :r].transpose(2, 1, 0, 3), offset=mx.arange(1000, 1006)).transpose(2, 1, 0, 3)
    return rope_mod, r, bool(mx.array_equal(per_token, part))


def rotate_keys(rope_mod: Any, exact_offsets: bool, x: mx.array, positions: np.ndarray) -> mx.array:
    """The model's own rotary embedding of canonical keys x [1, H, n, r] at `positions` [n]."""
    runs = position_runs(positions)
    out: mx.array
    if len(runs) == 1:
        out = rope_mod(x, offset=int(positions[0]))
    elif exact_offsets and len(runs) > 8:
        out = rope_mod(x.transpose(2, 1, 0, 3), offset=mx.array(positions.astype(np.int32))).transpose(2, 1, 0, 3)
    else:
        out = mx.concatenate([rope_mod(x[:, :, i0:i1], offset=int(positions[i0])) for i0, i1 in runs], axis=2)
    return out
