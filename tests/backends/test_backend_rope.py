"""Re-anchoring math (backends.rope), runtime-free: the numpy reference, the torch path, partial
rotary, and why keys are always re-rotated from their canonical form."""

from __future__ import annotations

import numpy as np
import pytest

from backends import rope


def spec(head_dim: int = 64, rotary_dim: int = 64, theta: float = 10000.0, scaling: float = 1.0) -> rope.RopeSpec:
    inv_freq = (1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)).astype(np.float32)
    return rope.RopeSpec(inv_freq=inv_freq, attention_scaling=scaling, head_dim=head_dim)


def test_spec_validates_layout_and_dims() -> None:
    with pytest.raises(ValueError, match="layout"):
        rope.RopeSpec(inv_freq=np.ones(4, np.float32), attention_scaling=1.0, head_dim=8, layout="interleaved")
    with pytest.raises(ValueError, match="rotary_dim"):
        rope.RopeSpec(inv_freq=np.ones(8, np.float32), attention_scaling=1.0, head_dim=8)
    assert spec(256, 64).rotary_dim == 64


def test_rotation_is_norm_preserving_relative_and_partial() -> None:
    s = spec(head_dim=32, rotary_dim=8)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 1, 32)).astype(np.float32)
    pos = np.array([5, 905])
    cos, sin = rope.cos_sin_np(s, pos)
    rotated = rope.apply_np(np.stack([k[0], k[0]])[None], cos, sin)[0]
    # Only the first rotary_dim dims move; the norm of the rotated part is kept.
    np.testing.assert_array_equal(rotated[:, 8:], np.stack([k[0, 8:], k[0, 8:]]))
    np.testing.assert_allclose(np.linalg.norm(rotated[:, :8], axis=-1), np.linalg.norm(k[0, :8]), rtol=1e-6)
    # Attention scores depend on relative positions only: q at p+d against k at p.
    def score(pq: int, pk: int) -> float:
        cq, sq = rope.cos_sin_np(s, np.array([pq]))
        ck, sk = rope.cos_sin_np(s, np.array([pk]))
        return float(rope.apply_np(q, cq, sq)[0] @ rope.apply_np(k, ck, sk)[0])
    assert score(110, 100) == pytest.approx(score(1010, 1000), rel=1e-4)


def test_torch_path_matches_numpy_reference() -> None:
    """Same angles (float32 p * inv_freq); cos / sin agree to libm rounding, and given the same
    cos / sin the torch rotation equals the reference bit for bit."""
    torch = pytest.importorskip("torch")
    s = spec(head_dim=64, rotary_dim=64, theta=100000.0)
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((3, 2, 50, 64)).astype(np.float32) * 8
    pos = np.arange(4000, 4050)
    cos, sin = rope.cos_sin_np(s, pos)
    ct, st = rope.cos_sin_torch(torch.from_numpy(s.inv_freq), torch.from_numpy(pos), s.attention_scaling)
    np.testing.assert_allclose(ct.numpy(), cos, rtol=0, atol=1e-6)
    np.testing.assert_allclose(st.numpy(), sin, rtol=0, atol=1e-6)
    ours = rope.apply_torch(torch.from_numpy(keys), torch.from_numpy(cos), torch.from_numpy(sin)).numpy()
    np.testing.assert_array_equal(ours, rope.apply_np(keys, cos, sin))


def test_rerotating_from_canonical_does_not_drift_but_rotating_rotated_keys_does() -> None:
    """The design choice in numbers: 1,000 moves computed from the canonical key carry one
    rotation's rounding; the same moves applied to the already-rotated key accumulate."""
    s = spec(head_dim=64, rotary_dim=64)
    rng = np.random.default_rng(2)
    canon = (rng.standard_normal((1, 64)) * 10).astype(np.float16).astype(np.float32)
    moves = rng.integers(0, 8000, 1001)
    incremental = rope.apply_np(canon, *rope.cos_sin_np(s, moves[:1]))
    for prev, nxt in zip(moves[:-1], moves[1:], strict=True):
        # Rotate by the difference, rounded to fp16 after each step like an fp16 cache would be.
        c, si = rope.cos_sin_np(s, np.array([nxt - prev]))
        incremental = rope.apply_np(incremental, c, si).astype(np.float16).astype(np.float32)
    theta = float(moves[-1]) * s.inv_freq.astype(np.float64)
    c64, s64 = np.cos(np.concatenate([theta, theta])), np.sin(np.concatenate([theta, theta]))
    x = canon.astype(np.float64)
    exact = x * c64 + np.concatenate([-x[..., 32:], x[..., :32]], axis=-1) * s64
    from_canonical = rope.apply_np(canon, *rope.cos_sin_np(s, moves[-1:]))
    # One float32 rotation (angle rounding included) vs the fp16 cache after 1,000 relative moves.
    assert float(np.abs(from_canonical - exact).max()) < 1e-3
    assert float(np.abs(incremental - exact).max()) > 10 * float(np.abs(from_canonical - exact).max())
