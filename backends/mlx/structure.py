"""What an mlx-lm model is to paging: each decoder layer's role and the attention shapes.

Layer roles come from mlx-lm's own cache list (`model.make_cache()`: KVCache -> paged,
RotatingKVCache -> a window cache of our own, ArraysCache -> recurrent, left as is) and the layers'
modules (attention without k_proj reads another layer's K/V; MLP / MoE blocks have no cache entry).
A model whose cache entries cannot be matched to its layers, or whose attention has no separate
pre-rotary key, is refused, naming why.

Dependency rules: mlx-lm's cache classes and backends.errors / loaded_model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mlx.nn.layers.base import Module
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from ..errors import UnsupportedModelError
from ..loaded_model import LayerRoles

__all__ = ["Structure", "classify", "kv_shape"]


@dataclasses.dataclass(frozen=True)
class Structure:
    family: str
    roles: LayerRoles
    decoder: Module
    attention: dict[int, Any]      # paged and window layers -> attention module
    cache_layers: tuple[int, ...]  # layer index of each entry of the model's cache list


def _attention(layer: Any) -> Any:
    for name in ("self_attn", "mixer", "attention"):
        if name in layer and "q_proj" in layer[name]:
            return layer[name]
    return None


def _decoder(model: Any, family: str) -> Any:
    for path in (("model",), ("language_model", "model"), ("backbone",), ("language_model",), ("model", "model")):
        mod = model
        for name in path:
            mod = mod.get(name) if isinstance(mod, dict) else getattr(mod, name, None)
            if mod is None:
                break
        if mod is not None and isinstance(getattr(mod, "layers", None), list) and (
                "embed_tokens" in mod or "embeddings" in mod):
            return mod
    raise UnsupportedModelError(f"{family}: no decoder with layers and an embedding found in mlx-lm's model")


def classify(model: Any, family: str) -> Structure:
    decoder = _decoder(model, family)
    layers = decoder.layers
    template = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in layers]  # type: ignore
    owners: list[int] = []
    for i, layer in enumerate(layers):
        attn = _attention(layer)
        recurrent = attn is None and ("linear_attn" in layer or ("mixer" in layer and "conv1d" in layer["mixer"]))
        if (attn is not None and "k_proj" in attn) or recurrent:
            owners.append(i)
    if len(owners) != len(template):
        for layer in layers:
            for name in ("self_attn", "attn", "attention", "mixer"):
                mod = layer.get(name) if isinstance(layer, dict) else None
                if mod is not None and "linear_attn" not in layer and "conv1d" not in mod and "k_proj" not in mod:
                    raise UnsupportedModelError(
                        f"{family}: attention module {type(mod).__name__} has no q_proj / k_proj: no per-head "
                        "pre-rotary key to page (fused QKV?)")
        raise UnsupportedModelError(f"{family}: {len(template)} cache entries for {len(owners)} layers with state; "
                                    "cannot tell which layer owns which")
    paged: list[int] = []
    window: list[int] = []
    recurrent_layers: list[int] = []
    sizes: set[int] = set()
    attention: dict[int, Any] = {}
    for i, entry in zip(owners, template, strict=True):
        if isinstance(entry, RotatingKVCache):
            window.append(i)
            sizes.add(int(entry.max_size))
            attention[i] = _attention(layers[i])
        elif type(entry) is KVCache:
            paged.append(i)
            attention[i] = _attention(layers[i])
        elif isinstance(entry, ArraysCache):
            recurrent_layers.append(i)
        else:
            raise UnsupportedModelError(f"{family}: layer {i} keeps a {type(entry).__name__}, which the slot cache "
                                        "cannot page exactly")
        if i in attention and attention[i] is None:
            raise UnsupportedModelError(f"{family}: layer {i} has a K/V cache but no attention module with k_proj")
    stateful = set(owners)
    shared = [i for i, layer in enumerate(layers) if i not in stateful and _attention(layer) is not None]
    stateless = [i for i in range(len(layers)) if i not in stateful and i not in shared]
    if len(sizes) > 1:
        raise UnsupportedModelError(f"{family}: sliding windows of different sizes {sorted(sizes)}")
    roles = LayerRoles(n_layers=len(layers), paged=tuple(paged), window=tuple(window),
                       recurrent=tuple(recurrent_layers), shared=tuple(shared), stateless=tuple(stateless),
                       window_size=sizes.pop() if sizes else 0)
    roles.check(family)
    return Structure(family=family, roles=roles, decoder=decoder, attention=attention, cache_layers=tuple(owners))


def kv_shape(family: str, what: str, attns: list[Any]) -> tuple[int, int, int]:
    shapes = set()
    for attn in attns:
        heads = next((int(getattr(attn, n)) for n in ("n_kv_heads", "num_key_value_heads", "num_kv_heads")
                      if isinstance(getattr(attn, n, None), int)), None)
        if heads is None:
            raise UnsupportedModelError(f"{family}: cannot tell the number of K/V heads of {type(attn).__name__}")
        out = int(attn.k_proj.weight.shape[0])
        value_out = int(attn.v_proj.weight.shape[0]) if "v_proj" in attn else out
        shapes.add((heads, out // heads, value_out // heads))
    if len(shapes) != 1:
        raise UnsupportedModelError(f"{family}: the {what} layers differ in their K/V shapes {sorted(shapes)}")
    return shapes.pop()
