"""Rotary position embedding math for re-anchoring keys, in the model's own layout and scaling.

A cached key is `rope(k, p)`: the canonical (pre-rotary) key `k` rotated to position `p`. Moving a
key to position `q` is *always* computed as `rope(k, q)` from the stored canonical `k`, never as a
rotation of the rotated key by `q - p`: rotating a rotated key accumulates rounding every time,
rotating the canonical key once has the error of a single rotation no matter how often it moves.

Layout ("neox", the half-split layout Hugging Face Llama / Qwen code uses): with `r` rotary dims,
frequency `i` (0 <= i < r/2) rotates the pair (x[i], x[i + r/2]); dims >= r pass through unrotated
(partial rotary, e.g. Qwen3-Next rotates 64 of 256). For position p:

    theta_i = p * inv_freq[i]                         (float32, like the model)
    cos = concat(cos(theta), cos(theta)) * s,  sin likewise        (s: attention scaling, e.g. YaRN)
    rope(x)[:r] = x[:r] * cos + rotate_half(x[:r]) * sin,  rotate_half(y) = concat(-y[r/2:], y[:r/2])
    rope(x)[r:] = x[r:]

The products and sums run in the key dtype with cos / sin cast to it, as the model's own code does,
so a re-anchored key equals the key the model itself computes at that position bit for bit (float32
arithmetic for float32 models). There is exactly one rounding step per key, whatever its history.

`inv_freq` and `s` are taken from the model's own rotary module, so any static scaling (linear,
YaRN, llama3, ...) matches the model bit for bit in how cos/sin are formed. "Proportional" rotary
(Gemma 4's global layers) is the half-split layout over the whole head with zero frequencies for
the unrotated pairs, which rotate by exactly 0. A model without rotary embedding (NoPE, e.g.
Nemotron-H's attention) has `r = 0`: its cached key is its canonical key and re-anchoring is a copy.

Dependency rules: numpy only at import time. The torch variants import torch lazily so that this
module stays usable by runtimes without torch; backends know nothing about contextd or policy.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

__all__ = ["RopeSpec", "cos_sin_np", "apply_np", "cos_sin_torch", "apply_torch", "rotate_half_np"]

# Rope types whose frequencies depend on the current sequence length: a key rotated at one length
# is not the key the model would compute at another, so no cache of rotated keys can be exact.
DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Everything needed to rotate a key exactly as the model does."""

    inv_freq: np.ndarray  # float32 [rotary_dim // 2]
    attention_scaling: float
    head_dim: int
    layout: str = "neox"

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.shape[0])

    def __post_init__(self) -> None:
        if self.layout != "neox":
            raise ValueError(f"rotary layout {self.layout!r} is not supported (only 'neox' half-split)")
        if self.inv_freq.dtype != np.float32 or self.inv_freq.ndim != 1:
            raise ValueError("inv_freq must be a 1-D float32 array")
        if not 0 <= self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim {self.rotary_dim} does not fit head_dim {self.head_dim}")


def rotate_half_np(x: np.ndarray) -> np.ndarray:
    h = x.shape[-1] // 2
    return np.concatenate((-x[..., h:], x[..., :h]), axis=-1)


def cos_sin_np(spec: RopeSpec, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 cos, sin of shape [n, rotary_dim] for integer positions [n]."""
    freqs = positions.astype(np.float32)[:, None] * spec.inv_freq[None, :]
    emb = np.concatenate((freqs, freqs), axis=-1)
    scale = np.float32(spec.attention_scaling)
    return np.cos(emb) * scale, np.sin(emb) * scale


def apply_np(keys: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate canonical keys [..., n, head_dim] to the positions cos/sin [n, r] were built for.

    Only the first r dims rotate; the rest are returned unchanged. Arithmetic is float32.
    """
    r = cos.shape[-1]
    k = keys.astype(np.float32, copy=False)
    rot = k[..., :r] * cos + rotate_half_np(k[..., :r]) * sin
    return np.concatenate((rot, k[..., r:]), axis=-1) if r < k.shape[-1] else rot


def cos_sin_torch(inv_freq: torch.Tensor, positions: torch.Tensor,
                  attention_scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos, sin [n, rotary_dim] on `inv_freq`'s device, formed exactly like HF rotary modules."""
    import torch

    freqs = positions.to(device=inv_freq.device).float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_scaling, emb.sin() * attention_scaling


def apply_torch(rot_part: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the rotary part [..., n, r] of canonical keys with the model's own arithmetic.

    cos / sin (float32, from `cos_sin_torch`) are cast to the key dtype and every product and sum
    runs in that dtype, exactly as HF `apply_rotary_pos_emb` does: a re-anchored key is then
    bit-identical to the key the model computes at that position, in float32 and in bf16 / fp16.
    It is written per half, into `out`, instead of with a concatenated rotate_half (four fewer
    temporaries); negation is exact, so `x1*c - x2*s` equals the model's `x1*c + (-x2)*s` bit for
    bit. `out` (may be a strided view, must not overlap `rot_part`) receives the result.
    """
    import torch

    dt = rot_part.dtype
    c, s = cos.to(dt), sin.to(dt)
    h = rot_part.shape[-1] // 2
    x1, x2 = rot_part[..., :h], rot_part[..., h:]
    if out is None:
        out = torch.empty_like(rot_part)
    o1, o2 = out[..., :h], out[..., h:]
    # Each product is rounded on its own before the sum, as in the model (no fused multiply-add).
    torch.mul(x1, c[..., :h], out=o1)
    o1.sub_(x2 * s[..., :h])
    torch.mul(x2, c[..., h:], out=o2)
    o2.add_(x1 * s[..., h:])
    return out
