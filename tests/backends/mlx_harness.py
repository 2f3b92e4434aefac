"""The suite's harness for the MLX runtime: access to the mlx-lm model itself (see conftest.py).

Imported by conftest.py on every machine; mlx is imported inside the methods only, so a machine
without MLX still collects the suite (the "mlx" parameter then skips with its reason).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from backends import Backend


def _structure(be: Backend) -> Any:
    return be._rt.structure  # type: ignore[attr-defined]


def _rope_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    edges = [0, *breaks.tolist(), int(positions.shape[0])]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1) if edges[i] < edges[i + 1]]


class MlxHarness:
    def supports_device(self, device: str) -> str | None:
        import mlx.core as mx

        if device == "cpu":
            return None
        if device == "cuda" and getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
            return None
        return f"this MLX build has no {device} backend"

    @contextlib.contextmanager
    def capture_prerope_keys(self, be: Backend, role: str = "paged") -> Iterator[list[list[np.ndarray]]]:
        import mlx.core as mx
        import mlx.nn as nn

        structure = _structure(be)
        layers = list(structure.roles.paged if role == "paged" else structure.roles.window)
        attns = [structure.attention[i] for i in layers]
        captured: list[list[np.ndarray]] = [[] for _ in attns]
        pending: list[list[mx.array]] = [[] for _ in attns]
        tokens = {"n": 0}

        class Capture(nn.Module):
            """Where the model computes the key before rotating it: the per-head k_norm when the
            attention has one, else the k_proj output split into heads."""

            def __init__(self, inner: Any, slot: int, heads: int) -> None:
                super().__init__()
                self.inner = inner
                self._slot, self._heads = slot, heads

            def __call__(self, x: mx.array) -> mx.array:
                out = self.inner(x)
                n = tokens["n"]
                if out.ndim == 3:
                    k = out.reshape(1, n, self._heads, -1)
                else:
                    k = out if out.shape[1] == n else out.transpose(0, 2, 1, 3)  # -> [B, S, H, D]
                pending[self._slot].append(k[0].astype(mx.float32))
                return out

            def as_linear(self, x: mx.array) -> mx.array:
                return self.inner.as_linear(x)

        class Count(Capture):
            def __call__(self, x: mx.array) -> mx.array:
                tokens["n"] = int(x.shape[-1])
                return self.inner(x)

        decoder = structure.decoder
        embed = "embed_tokens" if "embed_tokens" in decoder else "embeddings"
        swapped: list[tuple[Any, str, Any]] = [(decoder, embed, getattr(decoder, embed))]
        setattr(decoder, embed, Count(getattr(decoder, embed), -1, 0))
        heads = be.layer_view.num_kv_heads if role == "paged" else be._rt.window.num_kv_heads  # type: ignore[attr-defined]
        for slot, attn in enumerate(attns):
            name = "k_norm" if "k_norm" in attn else "k_proj"
            original = getattr(attn, name)
            setattr(attn, name, Capture(original, slot, heads))
            swapped.append((attn, name, original))
        # A step dispatched ahead (see MlxBackend.decode) may be dropped: capture only steps taken.
        lookahead = be.lookahead  # type: ignore[attr-defined]
        be.lookahead = False  # type: ignore[attr-defined]
        be._settle()  # type: ignore[attr-defined]
        try:
            yield captured
        finally:
            be.lookahead = lookahead  # type: ignore[attr-defined]
            for owner, name, original in swapped:
                setattr(owner, name, original)
            for slot, arrays in enumerate(pending):
                captured[slot].extend(np.array(a) for a in arrays)

    def model_rotate(self, be: Backend, keys: np.ndarray, positions: np.ndarray,
                     layer_type: str = "full_attention") -> np.ndarray:
        """The model's rotary module exactly as its attention calls it: on [1, heads, n, dim] with the
        scalar offset of the first position, once per run of consecutive positions; keys unchanged
        without rotary (NoPE)."""
        import mlx.core as mx

        structure = _structure(be)
        layers = structure.roles.paged if layer_type == "full_attention" else structure.roles.window
        rope = getattr(structure.attention[layers[0]], "rope", None)
        if rope is None:
            return np.asarray(keys, dtype=np.float32)
        L, H, n, D = keys.shape
        x = mx.array(np.ascontiguousarray(keys, dtype=np.float32)).reshape(1, L * H, n, D)
        parts = [rope(x[:, :, i0:i1], offset=int(positions[i0])) for i0, i1 in _rope_runs(positions)]
        return np.array(mx.concatenate(parts, axis=2)).reshape(L, H, n, D)

    def stock_recurrent_after_naive_removal(self, be: Backend, token_ids: list[int], start: int,
                                            end: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        import mlx.core as mx
        from mlx_lm.models.cache import ArraysCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        model = be.mlx_model  # type: ignore[attr-defined]
        owners = _structure(be).cache_layers
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([token_ids]), cache=cache))

        def states(c: list[Any]) -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for j, layer in enumerate(c):
                if isinstance(layer, ArraysCache):
                    conv, recurrent = layer[0], layer[1]
                    assert conv is not None and recurrent is not None
                    out[f"conv/{owners[j]}"] = np.array(conv.astype(mx.float32))
                    out[f"recurrent/{owners[j]}"] = np.array(recurrent.astype(mx.float32))
            return out

        before = states(cache)
        # mlx-lm has no range removal: KVCache trims from the tail only and ArraysCache not at all,
        # so the prompt cache refuses a trim; removing [start, end) from the whole cache means a
        # fresh prompt cache, whose recurrent layers start from zero state (mlx-lm's None).
        assert not can_trim_prompt_cache(cache)
        assert trim_prompt_cache(cache, end - start) == 0
        fresh = make_prompt_cache(model)
        after: dict[str, np.ndarray] = {}
        for j, layer in enumerate(fresh):
            if isinstance(layer, ArraysCache):
                assert layer[0] is None and layer[1] is None
                after[f"conv/{owners[j]}"] = np.zeros_like(before[f"conv/{owners[j]}"])
                after[f"recurrent/{owners[j]}"] = np.zeros_like(before[f"recurrent/{owners[j]}"])
        return before, after

    def stock_logits(self, be: Backend, token_ids: list[int]) -> np.ndarray:
        """The unmodified model with mlx-lm's own prompt cache (KVCache / RotatingKVCache / ArraysCache)."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        model = be.mlx_model  # type: ignore[attr-defined]
        return np.array(model(mx.array([token_ids]), cache=make_prompt_cache(model))[0, -1].astype(mx.float32))

    @contextlib.contextmanager
    def fail_next_forward(self, be: Backend) -> Iterator[None]:
        import mlx.nn as nn

        layers = _structure(be).decoder.layers
        i = len(layers) // 2
        original = layers[i]

        class Boom(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                # What the models' own loops read from a layer before calling it.
                for attr in ("is_linear", "use_sliding", "layer_type", "block_type"):
                    if hasattr(original, attr):
                        setattr(self, attr, getattr(original, attr))

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                raise RuntimeError("injected failure in the middle of a forward pass")

        # After the first layers have already updated their state.
        layers[i] = Boom()
        try:
            yield
        finally:
            layers[i] = original
