"""The model's own rotary tables, and the rotation of canonical keys with them.

`rope_of` reads the inverse frequencies and attention scaling the model's rotary module uses for a
layer type (per-layer-type buffers as in Gemma 3 / 4), so that a re-anchored key is rotated with
exactly the model's tables; `rotate_into` applies them at given positions with backends/rope.py's
torch form.

Dependency rules: torch, numpy and backends.rope.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import rope

__all__ = ["rope_of", "rotate_into"]


def rope_of(decoder: Any, layer_type: str, device: torch.device) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling the model's rotary module uses for `layer_type` (per-layer-type
    buffers as in Gemma 3 / 4, else the single ones); empty without a rotary module (NoPE)."""
    rot = getattr(decoder, "rotary_emb", None)
    if rot is None:
        return torch.zeros(0, dtype=torch.float32, device=device), 1.0
    inv_freq = getattr(rot, f"{layer_type}_inv_freq", None)
    scaling = getattr(rot, f"{layer_type}_attention_scaling", None)
    if inv_freq is None:
        inv_freq, scaling = rot.inv_freq, getattr(rot, "attention_scaling", 1.0)
    return inv_freq.detach().to(device=device, dtype=torch.float32), float(1.0 if scaling is None else scaling)


def rotate_into(canon: torch.Tensor, out: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                positions: np.ndarray) -> None:
    """out[..., :r] = rope(canon[..., :r]) at `positions` (r = 2 * len(inv_freq); nothing when 0)."""
    if inv_freq.shape[0] == 0:
        return
    cos, sin = rope.cos_sin_torch(inv_freq, torch.from_numpy(positions), scaling)
    rope.apply_torch(canon, cos, sin, out=out)
