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


def _attention_modules(be: Backend) -> list[Any]:
    model = be.mlx_model  # type: ignore[attr-defined]
    return [layer.self_attn for layer in model.model.layers if "self_attn" in layer]


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
    def capture_prerope_keys(self, be: Backend) -> Iterator[list[list[np.ndarray]]]:
        import mlx.core as mx
        import mlx.nn as nn

        attns = _attention_modules(be)
        captured: list[list[np.ndarray]] = [[] for _ in attns]
        pending: list[list[mx.array]] = [[] for _ in attns]

        class Capture(nn.Module):
            """Where the model computes the key before rotating it: the per-head k_norm when the
            family has one, else the k_proj output split into heads."""

            def __init__(self, inner: Any, slot: int, split: int | None) -> None:
                super().__init__()
                self.inner = inner
                self._slot, self._split = slot, split

            def __call__(self, x: mx.array) -> mx.array:
                out = self.inner(x)
                k = out.reshape(*out.shape[:2], -1, self._split) if self._split else out
                pending[self._slot].append(k[0].astype(mx.float32))
                return out

        swapped: list[tuple[Any, str, Any]] = []
        for slot, attn in enumerate(attns):
            name = "k_norm" if "k_norm" in attn else "k_proj"
            head_dim = int(be.layer_view.head_dim)
            original = getattr(attn, name)
            setattr(attn, name, Capture(original, slot, None if name == "k_norm" else head_dim))
            swapped.append((attn, name, original))
        try:
            yield captured
        finally:
            for attn, name, original in swapped:
                setattr(attn, name, original)
            for slot, arrays in enumerate(pending):
                captured[slot].extend(np.array(a) for a in arrays)

    def model_rotate(self, be: Backend, keys: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The model's rotary module exactly as its attention calls it: on [1, heads, n, dim] with the
        scalar offset of the first position, once per run of consecutive positions."""
        import mlx.core as mx

        rope = _attention_modules(be)[0].rope
        L, H, n, D = keys.shape
        x = mx.array(np.ascontiguousarray(keys, dtype=np.float32)).reshape(1, L * H, n, D)
        parts = [rope(x[:, :, i0:i1], offset=int(positions[i0])) for i0, i1 in _rope_runs(positions)]
        return np.array(mx.concatenate(parts, axis=2)).reshape(L, H, n, D)

    def _stock_hidden(self, be: Backend, token_ids: list[int], cache: Any) -> Any:
        import mlx.core as mx

        model = be.mlx_model  # type: ignore[attr-defined]
        return model.model(mx.array([token_ids]), cache=cache)

    def stock_recurrent_after_naive_removal(self, be: Backend, token_ids: list[int], start: int,
                                            end: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        import mlx.core as mx
        from mlx_lm.models.cache import ArraysCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        model = be.mlx_model  # type: ignore[attr-defined]
        cache = make_prompt_cache(model)
        mx.eval(self._stock_hidden(be, token_ids, cache))

        def states(c: list[Any]) -> dict[str, np.ndarray]:
            out: dict[str, np.ndarray] = {}
            for i, layer in enumerate(c):
                if isinstance(layer, ArraysCache):
                    conv, recurrent = layer[0], layer[1]
                    assert conv is not None and recurrent is not None
                    out[f"conv/{i}"] = np.array(conv.astype(mx.float32))
                    out[f"recurrent/{i}"] = np.array(recurrent.astype(mx.float32))
            return out

        before = states(cache)
        # mlx-lm has no range removal: KVCache trims from the tail only and ArraysCache not at all,
        # so the prompt cache refuses a trim; removing [start, end) from the whole cache means a
        # fresh prompt cache, whose recurrent layers start from zero state (mlx-lm's None).
        assert not can_trim_prompt_cache(cache)
        assert trim_prompt_cache(cache, end - start) == 0
        fresh = make_prompt_cache(model)
        after: dict[str, np.ndarray] = {}
        for i, layer in enumerate(fresh):
            if isinstance(layer, ArraysCache):
                assert layer[0] is None and layer[1] is None
                after[f"conv/{i}"] = np.zeros_like(before[f"conv/{i}"])
                after[f"recurrent/{i}"] = np.zeros_like(before[f"recurrent/{i}"])
        return before, after

    def stock_logits(self, be: Backend, token_ids: list[int]) -> np.ndarray:
        import mlx.core as mx

        model = be.mlx_model  # type: ignore[attr-defined]
        hidden = self._stock_hidden(be, token_ids, None)[:, -1:, :]
        head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
        return np.array(head(hidden)[0, -1].astype(mx.float32))

    @contextlib.contextmanager
    def fail_next_forward(self, be: Backend) -> Iterator[None]:
        import mlx.nn as nn

        layers = be.mlx_model.model.layers  # type: ignore[attr-defined]
        i = len(layers) // 2
        original = layers[i]

        class Boom(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                # What the model's own loop reads from a layer before calling it.
                for attr in ("is_linear", "use_sliding"):
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

