"""What a transformers model is to paging: each decoder layer's role and the attention shapes.

Layer roles come from the model itself: transformers' own per-layer cache kinds
(`get_layer_types_and_kwargs`, what its DynamicCache is built from) and the decoder's modules. Global
attention layers are paged; sliding-window layers keep a window cache of their own; linear-attention
and Mamba layers keep transformers' stock recurrent cache layers; kv-shared attention (Gemma 4) and
MLP / MoE blocks keep nothing. A model that fits none of these, or whose attention has no per-head
pre-rotary key (fused QKV, latent attention, absolute position embeddings) is refused, naming why.
`classify` reads modules only, so the loader runs it on the model built on the meta device first
and refuses before any weight is read.

Dependency rules: torch, transformers' cache kinds and backends.loaded_model / protocol.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from ..errors import UnsupportedModelError
from ..loaded_model import LayerRoles

__all__ = ["Classified", "classify", "kv_shape"]


@dataclasses.dataclass(frozen=True)
class Classified:
    """A transformers model as the backend sees it."""

    family: str
    roles: LayerRoles
    decoder: Any                           # the module holding `layers` (model.model, or its language_model)
    attention: dict[int, Any]              # paged and window layers -> their attention module
    key_modules: dict[int, str]            # paged and window layers -> "k_norm" or "k_proj"
    mask_types: tuple[str, ...]            # the config's layer types (keys of a mask dict)
    mask_dict: bool                        # the decoder takes masks as a dict by layer type


def _decoder(model: Any, family: str) -> Any:
    inner = getattr(model, "model", None)
    for candidate in (inner, getattr(inner, "language_model", None)):
        if isinstance(candidate, torch.nn.Module) and isinstance(getattr(candidate, "layers", None),
                                                                 torch.nn.ModuleList):
            return candidate
    raise UnsupportedModelError(f"{family}: {type(model).__name__} has no decoder with a `layers` list "
                                "(model.model.layers): no adapter knows where its attention layers are")


def _attention_module(layer: Any) -> Any:
    for name in ("self_attn", "mixer", "attention", "attn"):
        mod = getattr(layer, name, None)
        if isinstance(mod, torch.nn.Module) and hasattr(mod, "q_proj"):
            return mod
    return None


def _takes_mask_dict(decoder: Any) -> bool:
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    return "isinstance(causal_mask_mapping := attention_mask, dict)" in source


def classify(model: Any) -> Classified:
    """Roles of every decoder layer (see module docstring); UnsupportedModelError names what is missing."""
    config = model.config.get_text_config()
    family = str(getattr(config, "model_type", type(model).__name__))
    decoder = _decoder(model, family)
    for absolute in ("embed_positions", "wpe", "position_embeddings"):
        if isinstance(getattr(decoder, absolute, None), torch.nn.Module):
            raise UnsupportedModelError(f"{family}: learned absolute position embeddings ({absolute}): keys depend "
                                        "on absolute positions and cannot be re-anchored")
    layers = decoder.layers
    kinds, kwargs = get_layer_types_and_kwargs(config)
    if len(kinds) != len(layers):
        raise UnsupportedModelError(f"{family}: {len(kinds)} layer types for {len(layers)} layers")
    paged: list[int] = []
    window: list[int] = []
    recurrent: list[int] = []
    shared: list[int] = []
    stateless: list[int] = []
    windows: set[int] = set()
    attention: dict[int, Any] = {}
    key_modules: dict[int, str] = {}
    for i, (layer, kind, kw) in enumerate(zip(layers, kinds, kwargs, strict=True)):
        attn = _attention_module(layer)
        if kind in ("full_attention", "sliding_attention") or (kind == "dummy" and attn is not None):
            if attn is None:
                raise UnsupportedModelError(f"{family}: layer {i} ({kind}) has no attention module with q_proj / "
                                            "k_proj: no per-head pre-rotary key to page (fused QKV?)")
            if getattr(attn, "is_kv_shared_layer", False):
                shared.append(i)
                continue
            if kind == "dummy":
                raise UnsupportedModelError(f"{family}: layer {i} has attention without a cache of its own")
            if isinstance(getattr(attn, "k_norm", None), torch.nn.Module):
                key_modules[i] = "k_norm"
            elif isinstance(getattr(attn, "k_proj", None), torch.nn.Module):
                key_modules[i] = "k_proj"
            else:
                raise UnsupportedModelError(f"{family}: attention module {type(attn).__name__} of layer {i} has no "
                                            "k_proj: no per-head pre-rotary key to page")
            if getattr(config, "attn_logit_softcapping", None) is not None and "softcap" in inspect.getsource(
                    type(attn).forward):
                raise UnsupportedModelError(f"{family}: attention logit softcapping (attn_logit_softcapping) needs an "
                                            "attention kernel that applies it")
            attention[i] = attn
            if kind == "full_attention":
                paged.append(i)
            else:
                window.append(i)
                windows.add(int(kw["sliding_window"]))
        elif kind == "linear_attention":
            recurrent.append(i)
        elif kind == "dummy":
            stateless.append(i)
        else:
            raise UnsupportedModelError(f"{family}: layer {i} is {kind!r}, which the slot cache cannot page exactly")
    if len(windows) > 1:
        raise UnsupportedModelError(f"{family}: sliding windows of different sizes {sorted(windows)}")
    roles = LayerRoles(n_layers=len(layers), paged=tuple(paged), window=tuple(window), recurrent=tuple(recurrent),
                       shared=tuple(shared), stateless=tuple(stateless), window_size=windows.pop() if windows else 0)
    roles.check(family)
    mask_types = tuple(dict.fromkeys(str(k) for k in (getattr(config, "layer_types", None) or kinds)))
    return Classified(family=family, roles=roles, decoder=decoder, attention=attention, key_modules=key_modules,
                      mask_types=mask_types, mask_dict=_takes_mask_dict(decoder))


def kv_shape(family: str, what: str, layers: Sequence[int], attention: dict[int, Any]) -> tuple[int, int, int]:
    """(kv heads, head dim, value dim), the same for every layer of `layers`."""
    shapes = set()
    for i in layers:
        attn: Any = attention[i]
        head_dim = int(attn.head_dim)
        heads = int(attn.k_proj.out_features) // head_dim
        v_proj: Any = getattr(attn, "v_proj", None)
        value_dim = int(v_proj.out_features) // heads if v_proj is not None else head_dim
        shapes.add((heads, head_dim, value_dim))
    if len(shapes) != 1:
        raise UnsupportedModelError(f"{family}: the {what} layers differ in their K/V shapes {sorted(shapes)}")
    return shapes.pop()
