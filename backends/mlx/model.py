"""One loaded mlx-lm model, shared by a backend session and its forks, with its hooks installed.

`load_model` reads the weights (a folder, a GGUF or an MLX-quantized copy), classifies the layers,
checks the rotary embedding, and wraps modules of the shared model: the module that produces the
pre-rotary key (`k_norm` where the attention has one, else `k_proj`) so its output is also written
into the running session's store, the embedding to count every token that enters the model, and
the final norm to hand only the last position to the output head (the model's own head, tied or
not, with its own softcapping). The wrappers dispatch to whichever session runs a forward
(`MlxModel.active`).

Dependency rules: mlx, backends.errors / loaded_model / model_config / models / slots and this
package's host, loading, gguf, quantized, structure and rotary modules.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module

from ..errors import BackendUnavailableError, UnsupportedModelError
from ..loaded_model import LoadedModel, WindowShape
from ..model_config import check_supported, read_config
from ..models import ModelSource, SourceKind
from ..slots import folder_identity, model_identity
from .gguf import load_gguf
from .host import DTYPES, to_numpy
from .loading import load_folder, unloaded_model
from .quantized import quantized_copy
from .rotary import rope_of, rotate_keys
from .structure import Structure, classify, kv_shape

__all__ = ["MlxModel", "load_model"]


class _Tap(Module):
    """Wraps a module of the shared model and passes its output to `observe` on the way out."""

    def __init__(self, inner: Module, observe: Callable[[mx.array, mx.array], None]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.inner: Any = inner
        self._observe = observe

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.inner(x)
        self._observe(x, out)
        return out

    def as_linear(self, x: mx.array) -> mx.array:  # the tied output head of an embedding
        out: mx.array = self.inner.as_linear(x)
        return out


class _LastPosition(Module):
    """The decoder's final norm on the last position only, unless `all_positions()` says this
    forward wants every position's logits (`prefill_logits`, scoring): the output head then runs
    once per forward, whatever head (tied, softcapped, ...) the model has."""

    def __init__(self, inner: Module, all_positions: Callable[[], bool]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.inner: Any = inner
        self._all_positions = all_positions

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.inner(x if self._all_positions() else x[:, -1:, :])
        return out


@dataclasses.dataclass(kw_only=True)
class MlxModel(LoadedModel):
    """One loaded mlx-lm model, shared by a backend and its forks."""

    model: Module
    structure: Structure
    device: mx.Device
    dtype: mx.Dtype
    rope: Any
    array_offsets_exact: bool
    win_rope: Any = None
    all_positions: bool = False  # the running forward returns every position's logits

    def rotate(self, x: mx.array, positions: np.ndarray) -> mx.array:
        return rotate_keys(self.rope, self.array_offsets_exact, x, positions)


def _device(device: str) -> mx.Device:
    if device == "cpu":
        return mx.Device(mx.cpu)
    if device in ("gpu", "metal", "cuda"):
        metal = bool(mx.metal.is_available())
        cuda = bool(getattr(mx, "cuda", None) is not None and mx.cuda.is_available())
        if (device == "metal" and metal) or (device == "cuda" and cuda) or (device == "gpu" and (metal or cuda)):
            return mx.Device(mx.gpu)
        raise BackendUnavailableError(f"device {device!r} was requested but this MLX build has no such GPU backend")
    raise BackendUnavailableError(f"device {device!r} is not supported by the MLX backend (cpu, gpu, metal, cuda)")


def load_model(source: ModelSource, device: str, dtype: str, model_id: str | None) -> MlxModel:
    """`source` on `device` in `dtype` ("auto": the folder's own), classified, its rotary embedding
    checked and its hooks installed; `model_id` skips hashing the weights."""
    if dtype not in DTYPES and dtype != "auto":
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)} or 'auto'")
    dev = _device(device)
    with mx.stream(dev):
        if source.kind is SourceKind.GGUF:
            model, cfg, params = load_gguf(source, dtype)
            dtype_name = "float32" if dtype == "auto" else dtype
            identity = model_id or model_identity(cfg, [(n, to_numpy(w), f"torch.{dtype_name}") for n, w in params])
            del params
        else:
            assert source.path is not None
            folder = quantized_copy(source) if source.kind is SourceKind.MLX_QUANT else source.path
            raw = read_config(folder)
            check_supported(raw, source.name)
            # mlx-lm's model classes may edit the dicts of a config they are given: hash a pristine one.
            identity = model_id or folder_identity(folder, raw)
            # The modules decide, before any weight is read.
            classify(unloaded_model(copy.deepcopy(raw), folder), str(raw.get("model_type")))
            model, cfg, dtype_name = load_folder(folder, dtype)
    family = str(cfg.get("model_type"))
    structure = classify(model, family)
    roles = structure.roles
    paged = [structure.attention[i] for i in roles.paged]
    heads, head_dim, value_dim = kv_shape(family, "global-attention", paged)
    with mx.stream(dev):
        rope_mod, rotary_dim, exact = rope_of(family, "global-attention", paged, head_dim)
        window: WindowShape | None = None
        win_rope = None
        if roles.window:
            attns = [structure.attention[i] for i in roles.window]
            w_heads, w_dim, w_value = kv_shape(family, "sliding-window", attns)
            win_rope, w_rotary, _ = rope_of(family, "sliding-window", attns, w_dim)
            window = WindowShape(w_heads, w_dim, w_value, w_rotary)
    text: dict[str, Any] = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    rt = MlxModel(
        source=source, model=model, structure=structure, family=family, roles=roles, device=dev,
        dtype=DTYPES[dtype_name], num_kv_heads=heads, head_dim=head_dim, value_head_dim=value_dim,
        rotary_dim=rotary_dim, rope=rope_mod, array_offsets_exact=exact, window=window, win_rope=win_rope,
        max_position_embeddings=int(text.get("max_position_embeddings") or cfg["max_position_embeddings"]),
        vocab_size=int(text.get("vocab_size") or cfg["vocab_size"]), model_id=identity, dtype_name=dtype_name,
    )
    _install_taps(rt)
    return rt


def _install_taps(rt: MlxModel) -> None:
    """Wrappers on the shared model dispatch to whichever session is running a forward (`rt.active`)."""
    structure = rt.structure

    def key_tap(layer: int) -> Callable[[mx.array, mx.array], None]:
        def observe(x: mx.array, out: mx.array) -> None:
            if rt.active is not None:
                rt.active.observe_key(layer, out)
        return observe

    for layer, attn in structure.attention.items():
        name = "k_norm" if "k_norm" in attn else "k_proj"
        setattr(attn, name, _Tap(getattr(attn, name), key_tap(layer)))

    def count_tokens(x: mx.array, out: mx.array) -> None:
        rt.tokens_entered(int(x.size))

    decoder = structure.decoder
    embed = "embed_tokens" if "embed_tokens" in decoder else "embeddings"
    setattr(decoder, embed, _Tap(getattr(decoder, embed), count_tokens))
    norm = next((n for n in ("norm", "norm_f", "final_norm") if n in decoder), None)
    if norm is None:
        raise UnsupportedModelError(f"{rt.family}: no final norm found in the decoder")
    setattr(decoder, norm, _LastPosition(getattr(decoder, norm), lambda: rt.all_positions))
