"""Loading a model folder with mlx-lm: what transformers writes -> what mlx-lm reads.

A model folder (Hugging Face safetensors as transformers saves it, or an mlx-lm folder, 4-bit /
8-bit quantized as `mlx_lm.convert -q` writes it) goes through mlx-lm's own loader and model
classes (`mlx_lm.utils.load_model`): no torch, no dequantisation, quantized layers stay quantized.
The few keys a transformers-5 config.json lacks for mlx-lm (a nested `rope_theta`, Gemma's sliding
pattern, Gemma 4's global head dim, mlx-lm defaults that differ from transformers') are filled in
from the config itself (`mlx_config`), and two expert layouts transformers writes that mlx-lm's
`sanitize` does not read (per-expert Qwen3.5-MoE, bf16 gpt-oss) are put in the layout it does
(`fix_weights`).

Dependency rules: mlx, mlx-lm, backends.errors / model_config and this package's host module;
transformers for configs.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.nn.layers.base import Module

from ..errors import UnsupportedModelError
from ..model_config import read_config
from .host import DTYPE_NAMES, DTYPES

__all__ = ["fix_weights", "load_folder", "mlx_config", "unloaded_model"]

# model_type -> the mlx-lm module that runs it, beyond mlx-lm's own MODEL_REMAPPING.
_MLX_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe", "ministral": "llama"}
# Config keys mlx-lm's rope handling reads at top level; filled from rope_parameters, never from defaults.
_ROPE_KEYS = frozenset({"rope_theta", "rope_scaling", "partial_rotary_factor", "rope_local_base_freq",
                        "rope_parameters", "rope_traditional"})


def _periodic_interval(layer_types: list[str], kind: str) -> int | None:
    """k when the layers of `kind` are exactly every k-th layer (k-1, 2k-1, ...), else None."""
    at = [i for i, t in enumerate(layer_types) if t == kind]
    if not at:
        return None
    k = at[0] + 1
    return k if at == list(range(k - 1, len(layer_types), k)) else None


def _model_args_class(model_type: str) -> Any:
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes({"model_type": model_type})[1]
    except ValueError as e:
        raise UnsupportedModelError(f"{model_type}: mlx-lm has no model module for this family") from e


def _json_floats(value: Any) -> Any:
    """transformers writes non-finite floats as {"__float__": "Infinity"}; mlx-lm reads plain JSON."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        return float(value["__float__"])
    if isinstance(value, list):
        return [_json_floats(v) for v in value]
    return value


def mlx_config(raw: dict[str, Any], folder: Path | None = None) -> dict[str, Any]:
    """The entries to add to (or replace in) a config.json for mlx-lm to build the model transformers
    builds from it (`folder`: where the config lives, for transformers to read it). Keys the config
    already has are kept, except `model_type` where mlx-lm names the family differently and values
    transformers encoded for JSON. Composite (multimodal) configs are left to mlx-lm as they are."""
    if isinstance(raw.get("text_config"), dict):
        return {}
    over: dict[str, Any] = {k: _json_floats(v) for k, v in raw.items() if _json_floats(v) != v}
    family = str(raw.get("model_type"))
    mlx_type = _MLX_MODEL_TYPES.get(family, family)
    if mlx_type != family:
        over["model_type"] = mlx_type

    def add(key: str, value: Any) -> None:
        if key not in raw and value is not None:
            over[key] = value

    rp = raw.get("rope_parameters")
    layer_types = [str(t) for t in (raw.get("layer_types") or [])]
    if isinstance(rp, dict) and rp and not any(isinstance(v, dict) for v in rp.values()):
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        add("rope_theta", rp.get("rope_theta"))
        add("partial_rotary_factor", rp.get("partial_rotary_factor"))
        if "rope_scaling" not in raw:
            over["rope_scaling"] = None if rope_type == "default" else {**rp, "type": rope_type}
    elif isinstance(rp, dict) and rp:
        full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        add("rope_theta", full.get("rope_theta"))
        add("rope_local_base_freq", local.get("rope_theta"))
        full_type = full.get("rope_type", full.get("type", "default"))
        if "rope_scaling" not in raw and full_type not in ("default", "proportional"):
            over["rope_scaling"] = {**full, "type": full_type}
    if layer_types and mlx_type in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        interval = _periodic_interval(layer_types, "full_attention")
        if interval is None:
            raise UnsupportedModelError(f"{family}: mlx-lm places full attention at every k-th layer; layer types "
                                        f"{layer_types} are not of that form")
        add("full_attention_interval", interval)
    if layer_types and mlx_type.startswith("gemma3"):
        interval = _periodic_interval(layer_types, "full_attention")
        if interval is None:
            raise UnsupportedModelError(f"{family}: mlx-lm places global layers at every k-th layer; layer types "
                                        f"{layer_types} are not of that form")
        add("sliding_window_pattern", interval)
    if mlx_type.startswith("gemma4") and "global_head_dim" not in raw:
        per_layer = raw.get("per_layer_config") or {}
        dims = {int(v["head_dim"]) for k, v in per_layer.items() if isinstance(v, dict) and "head_dim" in v
                and k.isdigit() and int(k) < len(layer_types) and layer_types[int(k)] == "full_attention"}
        over["global_head_dim"] = dims.pop() if len(dims) == 1 else raw.get("head_dim")
    # Aliases transformers resolves (num_experts <- num_local_experts, ...) and every field mlx-lm
    # reads whose default may differ from transformers': take transformers' value.
    fields = set(inspect.signature(_model_args_class(mlx_type)).parameters)
    try:
        from transformers import AutoConfig

        if folder is not None:
            resolved = AutoConfig.from_pretrained(str(folder))
        else:
            resolved = AutoConfig.for_model(family, **{k: v for k, v in raw.items() if k != "model_type"})
        for alias, canonical in getattr(type(resolved), "attribute_map", {}).items():
            if canonical in raw:
                add(alias, raw[canonical])
        as_dict = resolved.to_dict()
        if "text_config" not in as_dict:  # a flat config read as transformers' composite one: no defaults from it
            for key in fields - _ROPE_KEYS - {"model_type"}:
                if key in as_dict:
                    add(key, as_dict[key])
    except Exception:  # noqa: BLE001 - a config transformers cannot read: mlx-lm's own folder, complete as it is
        pass
    return over


def _fuse_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Per-expert MoE weights (what transformers 5 writes for Qwen3.5-MoE) -> the fused
    `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] mlx-lm's sanitize reads."""
    groups: dict[str, dict[int, dict[str, mx.array]]] = {}
    for key in list(weights):
        m = re.match(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", key)
        if m:
            groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = weights.pop(key)
    for prefix, experts in groups.items():
        order = sorted(experts)
        weights[f"{prefix}.gate_up_proj"] = mx.stack(
            [mx.concatenate([experts[e]["gate_proj"], experts[e]["up_proj"]], axis=0) for e in order])
        weights[f"{prefix}.down_proj"] = mx.stack([experts[e]["down_proj"] for e in order])
    return weights


def _gpt_oss_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers' bf16 gpt-oss experts (gate_up_proj [E, H, 2I] with gate / up interleaved on the
    last axis, down_proj [E, I, H], biases) -> mlx-lm's SwitchGLU names and [E, out, in] layout
    (its sanitize reads only the MXFP4 `_blocks` form)."""
    for key in [k for k in weights if k.endswith(".experts.gate_up_proj")]:
        p = key.removesuffix(".gate_up_proj")
        gate_up = weights.pop(key).swapaxes(1, 2)
        bias = weights.pop(f"{p}.gate_up_proj_bias")
        weights[f"{p}.gate_proj.weight"] = mx.contiguous(gate_up[:, ::2, :])
        weights[f"{p}.up_proj.weight"] = mx.contiguous(gate_up[:, 1::2, :])
        weights[f"{p}.gate_proj.bias"] = mx.contiguous(bias[:, ::2])
        weights[f"{p}.up_proj.bias"] = mx.contiguous(bias[:, 1::2])
        weights[f"{p}.down_proj.weight"] = mx.contiguous(weights.pop(f"{p}.down_proj").swapaxes(1, 2))
        weights[f"{p}.down_proj.bias"] = weights.pop(f"{p}.down_proj_bias")
    return weights


def fix_weights(family: str, weights: dict[str, mx.array]) -> dict[str, mx.array]:
    if family.startswith("qwen3_5_moe"):
        return _fuse_experts(weights)
    if family == "gpt_oss" and any(k.endswith(".experts.gate_up_proj") for k in weights):
        return _gpt_oss_experts(weights)
    return weights


def _folder_dtype(model: Module) -> mx.Dtype:
    """The floating dtype most of a loaded model's parameters have (a quantized model: its scales)."""
    from mlx.utils import tree_flatten

    counts: dict[mx.Dtype, int] = {}
    p: Any
    for _, p in tree_flatten(model.parameters()):  # type: ignore[no-untyped-call, str-unpack]
        if mx.issubdtype(p.dtype, mx.floating):
            counts[p.dtype] = counts.get(p.dtype, 0) + int(p.size)
    return max(counts, key=lambda d: counts[d]) if counts else mx.float32


def _honour_yarn_truncate(model: Module, rope_scaling: dict[str, Any]) -> None:
    """mlx-lm's YarnRoPE always rounds the correction range (floor / ceil); a config with
    `truncate: false` (gpt-oss) asks for the unrounded one, as transformers computes it. Recompute
    the frequencies of every YarnRoPE with mlx-lm's own formula minus the rounding."""
    from mlx_lm.models.rope_utils import YarnRoPE

    if rope_scaling.get("truncate", True) is not False:
        return
    base = float(rope_scaling.get("rope_theta", 10000.0))
    factor = float(rope_scaling["factor"])
    original = float(rope_scaling.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(rope_scaling.get("beta_fast", 32)), float(rope_scaling.get("beta_slow", 1))
    for _, module in model.named_modules():  # type: ignore[no-untyped-call]
        if not isinstance(module, YarnRoPE):
            continue
        dims = int(module.dims)

        def correction(rotations: float, dims: int = dims) -> float:
            return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = max(correction(beta_fast), 0.0), min(correction(beta_slow), dims - 1.0)
        if low == high:
            high += 0.001
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        mask = 1.0 - ramp
        extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        inter = factor * extra
        module._freqs = (inter * extra) / (inter * mask + extra * (1 - mask))


def unloaded_model(raw: dict[str, Any], folder: Path) -> Module:
    """mlx-lm's model for a config, without weights (MLX builds its random init lazily: no memory)."""
    from mlx_lm.utils import _get_classes

    config = {**raw, **mlx_config(raw, folder)}
    try:
        model_class, args_class = _get_classes(config)
    except ValueError as e:
        raise UnsupportedModelError(f"{raw.get('model_type')}: mlx-lm has no model module for this family") from e
    try:
        model: Module = model_class(args_class.from_dict(config))
    except (TypeError, ValueError, KeyError) as e:
        raise UnsupportedModelError(f"{raw.get('model_type')}: mlx-lm cannot build its model from this config: "
                                    f"{e}") from e
    return model


def load_folder(folder: Path, dtype: str) -> tuple[Module, dict[str, Any], str]:
    """mlx-lm's loader on `folder`, with the config entries and expert layouts of `mlx_config` /
    `fix_weights`; floating parameters cast to `dtype` ("auto": the folder's own)."""
    from mlx_lm.utils import _get_classes, load_model

    raw = read_config(folder)
    over = mlx_config(raw, folder)
    family = str(raw.get("model_type"))
    model_class, args_class = _get_classes({**raw, **over})

    class WithFixedWeights(model_class):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            weights = fix_weights(family, weights)
            parent = getattr(super(), "sanitize", None)
            return parent(weights) if parent is not None else weights

    try:
        model, _ = load_model(folder, lazy=True, model_config=over,
                              get_model_classes=lambda config: (WithFixedWeights, args_class))
    except ValueError as e:
        raise UnsupportedModelError(f"{folder.name}: mlx-lm cannot load this folder: {e}") from e
    scaling = {**raw, **over}.get("rope_scaling")
    if isinstance(scaling, dict):
        _honour_yarn_truncate(model, {"rope_theta": {**raw, **over}.get("rope_theta", 10000.0), **scaling})
    own = _folder_dtype(model)
    target = own if dtype == "auto" else DTYPES[dtype]
    if target != own:
        model.set_dtype(target)
    mx.eval(model.parameters())
    return model, raw, DTYPE_NAMES[target]
