"""The MLX backend: mlx-lm model code (Apple silicon; Linux CPU through `mlx[cpu]`) with a slot cache.

Loading. A model folder (Hugging Face safetensors as transformers saves it, or an mlx-lm folder,
4-bit / 8-bit quantized as `mlx_lm.convert -q` writes it) goes through mlx-lm's own loader and model
classes (`mlx_lm.utils.load_model`): no torch, no dequantisation, quantized layers stay quantized.
The few keys a transformers-5 config.json lacks for mlx-lm (a nested `rope_theta`, Gemma's sliding
pattern, Gemma 4's global head dim, mlx-lm defaults that differ from transformers') are filled in
from the config itself, and two expert layouts transformers writes that mlx-lm's `sanitize` does
not read (per-expert Qwen3.5-MoE, bf16 gpt-oss) are put in the layout it does. The SmolLM2 GGUF
(and other llama-architecture GGUF files) is read by `mx.load` and dequantised exactly as
transformers' GGUF loader does, so both runtimes run the same weights. The tiny models' MLX-
quantized copies ("tiny-x-q4") are made here once with mlx-lm's converter.

Layer roles come from mlx-lm's own cache list (`model.make_cache()`: KVCache -> paged, RotatingKVCache
-> a window cache of our own, ArraysCache -> recurrent, left as is) and the layers' modules
(attention without k_proj reads another layer's K/V; MLP / MoE blocks have no cache entry).

Cache layout. Each paged layer owns three preallocated slot buffers, as mlx-lm's own KVCache lays
them out (batch 1, heads, slots, dims), so attention reads them without a copy:

    k_rot[a]   [1, kv_heads, capacity, head_dim]    keys as attention uses them (rotated)
    k_canon[a] [1, kv_heads, capacity, rotary_dim]  pre-rotary keys, rotary dims only (the
                                                    pass-through dims are equal in k_rot)
    v[a]       [1, kv_heads, capacity, value_dim]

plus, on the host, a RoPE position and an occupied flag per slot and the logical order of the held
tokens (an array of slot numbers) - the same bookkeeping as the torch backend, so both hand out the
same positions and count the same way. The mask is built from positions (`occupied & slot_pos <=
query_pos`), or is mlx's own "causal" / none when the slots hold no gap. A window layer holds its
newest W - 1 tokens as canonical keys, rotated keys and values (see runtime.py).

MLX arrays are values. Every buffer update is functional (`mx.slice_update` / `mx.put_along_axis`)
and rebinds the list entry; with no other reference alive MLX donates the old buffer, so an update
costs the size of the update, not of the buffer. A fork copies its buffers up front so its page
operations donate too.

Greedy decoding runs one step ahead, as mlx-lm's own loop does: a greedy decode dispatches the next
step, fed with its argmax on the device, before reading its own logits back, so building one
step's graph overlaps the previous step's compute; the next decode takes that step when it feeds
the same token greedily, anything else puts its state back first (see `MlxBackend.decode`).

Hooking into mlx-lm. The model runs its own code: the module that produces the pre-rotary key
(`k_norm` where the attention has one, else `k_proj`) is wrapped so its output is also written
into `k_canon` (or the window); each paged / window layer gets a cache object whose
`update_and_fetch` writes the forward's rotated keys and values and whose `make_mask` returns the
backend's mask; the embedding is wrapped to count every token that enters the model, and the final
norm to hand only the last position to the output head (the model's own head, tied or not, with its
own softcapping).

Re-anchoring calls the model's own rotary module (`attn.rope`: `mx.fast.rope` with the model's
base and scaling, YaRN, proportional, ...) on the canonical keys, with the target position as its
offset: a re-anchored key is bit for bit the key the model computes at that position.

Dependency rules: mlx, mlx-lm, numpy, xxhash; transformers for configs and tokenizers; torch only
for the GGUF path (parameter names in Hugging Face order) and to build tiny folders. Backends know
nothing about contextd or policy.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib
import inspect
import json
import math
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from .models import ModelSource, build_once, cache_dir, check_supported, read_config
from .protocol import (
    Backend,
    BackendError,
    BackendUnavailableError,
    BlockMismatchError,
    RecurrentSnapshot,
    UnsupportedModelError,
)
from .runtime import LayerRoles, LoadedModel, SlotBackend, SlotStore, WindowShape
from .slots import as_run, folder_identity, model_identity, pick_token

__all__ = ["MlxBackend", "load", "make_mlx_folder", "mlx_config", "quantized_copy"]

_DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_DTYPE_NAMES: dict[mx.Dtype, str] = {v: k for k, v in _DTYPES.items()}

# llama.cpp tensor names -> Hugging Face parameter names (per block "blk.N.").
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_GROUP_SIZE = 32  # every quantised type mx.load reads from GGUF (Q4_0, Q4_1, Q8_0) uses groups of 32


def _to_numpy(a: mx.array) -> np.ndarray:
    """Host copy of `a` in storage dtype (bfloat16 bits as uint16), sharing no memory with MLX."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def _from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """MLX array of model dtype `dtype` from a storage-dtype numpy array (bf16 bits as uint16)."""
    if dtype == mx.bfloat16:
        return mx.array(np.ascontiguousarray(a).view(np.uint16)).view(mx.bfloat16)
    return mx.array(np.ascontiguousarray(a)).astype(dtype)


def _position_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """[(i0, i1)] index ranges over which `positions` step by exactly 1."""
    n = int(positions.shape[0])
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    edges = [0, *breaks.tolist(), n]
    return [(edges[i], edges[i + 1]) for i in range(len(edges) - 1)]


# ------------------------------------------------------------------------------------------------
# Config and weights: what transformers writes -> what mlx-lm reads
# ------------------------------------------------------------------------------------------------

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


def _fix_weights(family: str, weights: dict[str, mx.array]) -> dict[str, mx.array]:
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


def _unloaded(raw: dict[str, Any], folder: Path) -> Module:
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


def _load_folder(folder: Path, dtype: str) -> tuple[Module, dict[str, Any], str]:
    """mlx-lm's loader on `folder`, with the config entries and expert layouts of `mlx_config` /
    `_fix_weights`; floating parameters cast to `dtype` ("auto": the folder's own)."""
    from mlx_lm.utils import _get_classes, load_model

    raw = read_config(folder)
    over = mlx_config(raw, folder)
    family = str(raw.get("model_type"))
    model_class, args_class = _get_classes({**raw, **over})

    class WithFixedWeights(model_class):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            weights = _fix_weights(family, weights)
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
    target = own if dtype == "auto" else _DTYPES[dtype]
    if target != own:
        model.set_dtype(target)
    mx.eval(model.parameters())
    return model, raw, _DTYPE_NAMES[target]


def _write_mlx_folder(source: ModelSource, out: Path, bits: int, group: int) -> None:
    """`out` (not existing yet) := `source` quantized by mlx-lm's converter. A GGUF source first
    becomes a Hugging Face folder (transformers' GGUF loader, float32, its tokenizer); a folder gets
    an mlx-readable copy (the config entries of `mlx_config`, the expert layouts of `_fix_weights`)."""
    from mlx_lm import convert

    assert source.path is not None
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-work-", dir=out.parent))
    try:
        base = source.path
        if source.gguf_file is not None:
            # transformers will not save a GGUF-loaded model: write the Hugging Face form this
            # module reads from the GGUF (the torch backend's exact weights) as the folder.
            from transformers import AutoTokenizer

            base = work / "hf"
            base.mkdir()
            _, cfg, params = _load_gguf(source, "float32")
            (base / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
            mx.save_safetensors(str(base / "model.safetensors"), dict(params), {"format": "pt"})
            del params
            AutoTokenizer.from_pretrained(str(source.path), gguf_file=source.gguf_file).save_pretrained(str(base))
        ready = work / "mlx-readable"
        ready.mkdir()
        raw = read_config(base)
        family = str(raw.get("model_type"))
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                       "model.safetensors.index.json"):
                shutil.copy(f, ready / f.name)
        (ready / "config.json").write_text(json.dumps({**raw, **mlx_config(raw, base)}, indent=2))
        weights: dict[str, mx.array] = {}
        for f in sorted(base.glob("*.safetensors")):
            weights.update(cast(dict[str, mx.array], mx.load(str(f))))
        mx.save_safetensors(str(ready / "model.safetensors"), _fix_weights(family, weights), {"format": "mlx"})
        del weights
        with contextlib.redirect_stdout(None):
            convert(hf_path=str(ready), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=group)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def quantized_copy(source: ModelSource) -> Path:
    """The MLX-quantized copy of a built-in model ("tiny-llama-q4", "smollm2-135m-q4"), made once
    under the cache folder with mlx-lm's converter."""
    assert source.path is not None and source.quant_bits and source.quant_group
    bits, group = source.quant_bits, source.quant_group
    stem = source.path.name if source.gguf_file is None else Path(source.gguf_file).stem

    def build(tmp: Path) -> None:
        tmp.rmdir()  # the converter writes the folder itself
        _write_mlx_folder(source, tmp, bits, group)

    return build_once(cache_dir() / "mlx" / f"{stem}-mlx-q{bits}g{group}", build)


def make_mlx_folder(model: str, out: Path, bits: int = 4, group: int = 64) -> Path:
    """`out` := `model` (a name, folder or .gguf) as an mlx-lm folder quantized to `bits` (what
    `mlx_lm.convert -q` writes), for `--backend mlx --model OUT`. Nothing is done when `out` exists."""
    from .models import resolve

    def build(tmp: Path) -> None:
        tmp.rmdir()
        _write_mlx_folder(resolve(model), tmp, bits, group)

    return build_once(out, build)


# ------------------------------------------------------------------------------------------------
# The GGUF path: llama-architecture GGUF -> Hugging Face form (the torch backend's weights) -> mlx-lm
# ------------------------------------------------------------------------------------------------

def _hf_param_shapes(config: Any) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face parameter names and shapes in `named_parameters()` order, without weights."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def _unpermute_rows(w: mx.array, heads: int) -> mx.array:
    """llama.cpp stores each head's Q/K rows interleaved (pairs for the 'traditional' rotary); put
    them back in the Hugging Face half-split order (the inverse of convert_hf_to_gguf's permute)."""
    rows, cols = w.shape
    half = rows // heads // 2
    return w.reshape(heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _load_gguf(source: ModelSource, dtype: str) -> tuple[Module, dict[str, Any], list[tuple[str, mx.array]]]:
    """The model of a llama-architecture GGUF file, dequantised with float32 scales (bit-identical to
    the gguf reference dequantiser transformers uses), in Hugging Face names and order."""
    from transformers import AutoConfig

    assert source.path is not None and source.gguf_file is not None
    path = Path(source.path) / source.gguf_file
    config = AutoConfig.from_pretrained(str(source.path), gguf_file=source.gguf_file)
    cfg = config.to_dict()
    check_supported(cfg, source.name)
    loaded = cast(tuple[dict[str, mx.array], dict[str, Any]], mx.load(str(path), return_metadata=True))
    tensors, meta = loaded
    arch = str(meta.get("general.architecture", ""))
    if arch != "llama":
        raise UnsupportedModelError(
            f"{path.name}: the MLX backend reads GGUF files of the llama architecture (got {arch!r}); "
            "load other families from a safetensors folder"
        )
    heads = {"q_proj": int(config.num_attention_heads), "k_proj": int(config.num_key_value_heads)}
    target = _DTYPES["float32" if dtype == "auto" else dtype]

    def gguf_name(hf: str) -> str:
        base, _, kind = hf.rpartition(".")
        if base.startswith("model.layers."):
            _, _, idx, rest = base.split(".", 3)
            for g, h in _GGUF_BLOCK_NAMES.items():
                if h == rest:
                    return f"blk.{idx}.{g}.{kind}"
        for g, h in _GGUF_TOP_NAMES.items():
            if h == base:
                return f"{g}.{kind}"
        raise UnsupportedModelError(f"{path.name}: no GGUF tensor for parameter {hf}")

    used: set[str] = set()
    params: list[tuple[str, mx.array]] = []
    for hf, shape in _hf_param_shapes(config):
        g = gguf_name(hf)
        stem = g.rsplit(".", 1)[0]
        if g not in tensors:
            raise UnsupportedModelError(f"{path.name}: tensor {g} (for {hf}) is missing")
        if f"{stem}.scales" in tensors:
            q, scales, biases = tensors[g], tensors[f"{stem}.scales"], tensors[f"{stem}.biases"]
            bits = q.shape[-1] * 32 // (scales.shape[-1] * _GGUF_GROUP_SIZE)
            w = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32),
                              group_size=_GGUF_GROUP_SIZE, bits=bits)
            used.update({g, f"{stem}.scales", f"{stem}.biases"})
        else:
            w = tensors[g].astype(mx.float32)
            used.add(g)
        proj = hf.rsplit(".", 2)[-2]
        if proj in heads and hf.endswith(".weight"):
            w = _unpermute_rows(w, heads[proj])
        if tuple(w.shape) != shape:
            raise UnsupportedModelError(f"{path.name}: {g} has shape {tuple(w.shape)}, {hf} needs {shape}")
        params.append((hf, w.astype(target)))
    unused = sorted(set(tensors) - used)
    if unused:
        raise UnsupportedModelError(f"{path.name}: tensors {unused[:5]} have no place in the model")
    arch_module = importlib.import_module("mlx_lm.models.llama")
    args = {**cfg, **mlx_config(cfg), "rope_traditional": False}
    model: Module = arch_module.Model(arch_module.ModelArgs.from_dict(args))
    try:
        model.load_weights([(n, w) for n, w in params if "rotary_emb" not in n], strict=True)
    except ValueError as e:
        raise UnsupportedModelError(f"{path.name}: the weights do not fit mlx-lm's model: {e}") from e
    model.eval()
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    return model, cfg, params


# ------------------------------------------------------------------------------------------------
# What the model is: roles from mlx-lm's cache list and the layers' modules
# ------------------------------------------------------------------------------------------------

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
    """The decoder's final norm on the last position only: the output head then runs once per
    forward, whatever head (tied, softcapped, ...) the model has."""

    def __init__(self, inner: Module) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.inner: Any = inner

    def __call__(self, x: mx.array) -> mx.array:
        out: mx.array = self.inner(x[:, -1:, :])
        return out


@dataclasses.dataclass(frozen=True)
class _Structure:
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


def _classify(model: Any, family: str) -> _Structure:
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
    return _Structure(family=family, roles=roles, decoder=decoder, attention=attention, cache_layers=tuple(owners))


def _kv_shape(family: str, what: str, attns: list[Any]) -> tuple[int, int, int]:
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


def _rope_of(family: str, what: str, attns: list[Any], head_dim: int) -> tuple[Any, int, bool]:
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


def _rotate(rope_mod: Any, exact_offsets: bool, x: mx.array, positions: np.ndarray) -> mx.array:
    """The model's own rotary embedding of canonical keys x [1, H, n, r] at `positions` [n]."""
    runs = _position_runs(positions)
    out: mx.array
    if len(runs) == 1:
        out = rope_mod(x, offset=int(positions[0]))
    elif exact_offsets and len(runs) > 8:
        out = rope_mod(x.transpose(2, 1, 0, 3), offset=mx.array(positions.astype(np.int32))).transpose(2, 1, 0, 3)
    else:
        out = mx.concatenate([rope_mod(x[:, :, i0:i1], offset=int(positions[i0])) for i0, i1 in runs], axis=2)
    return out


# ------------------------------------------------------------------------------------------------
# The runtime: one loaded model shared by a backend and its forks
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class _Runtime(LoadedModel):
    """One loaded mlx-lm model, shared by a backend and its forks."""

    model: Module
    structure: _Structure
    device: mx.Device
    dtype: mx.Dtype
    rope: Any
    array_offsets_exact: bool
    win_rope: Any = None

    def rotate(self, x: mx.array, positions: np.ndarray) -> mx.array:
        return _rotate(self.rope, self.array_offsets_exact, x, positions)


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


def _make_runtime(source: ModelSource, device: str, dtype: str, model_id: str | None) -> _Runtime:
    if dtype not in _DTYPES and dtype != "auto":
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)} or 'auto'")
    dev = _device(device)
    with mx.stream(dev):
        if source.kind == "gguf":
            model, cfg, params = _load_gguf(source, dtype)
            dtype_name = "float32" if dtype == "auto" else dtype
            identity = model_id or model_identity(cfg, [(n, _to_numpy(w), f"torch.{dtype_name}") for n, w in params])
            del params
        else:
            assert source.path is not None
            folder = quantized_copy(source) if source.kind == "mlx_quant" else source.path
            raw = read_config(folder)
            check_supported(raw, source.name)
            # mlx-lm's model classes may edit the dicts of a config they are given: hash a pristine one.
            identity = model_id or folder_identity(folder, raw)
            # The modules decide, before any weight is read.
            _classify(_unloaded(copy.deepcopy(raw), folder), str(raw.get("model_type")))
            model, cfg, dtype_name = _load_folder(folder, dtype)
    family = str(cfg.get("model_type"))
    structure = _classify(model, family)
    roles = structure.roles
    paged = [structure.attention[i] for i in roles.paged]
    heads, head_dim, value_dim = _kv_shape(family, "global-attention", paged)
    with mx.stream(dev):
        rope_mod, rotary_dim, exact = _rope_of(family, "global-attention", paged, head_dim)
        window: WindowShape | None = None
        win_rope = None
        if roles.window:
            attns = [structure.attention[i] for i in roles.window]
            w_heads, w_dim, w_value = _kv_shape(family, "sliding-window", attns)
            win_rope, w_rotary, _ = _rope_of(family, "sliding-window", attns, w_dim)
            window = WindowShape(w_heads, w_dim, w_value, w_rotary)
    text: dict[str, Any] = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    rt = _Runtime(
        source=source, model=model, structure=structure, family=family, roles=roles, device=dev,
        dtype=_DTYPES[dtype_name], num_kv_heads=heads, head_dim=head_dim, value_head_dim=value_dim,
        rotary_dim=rotary_dim, rope=rope_mod, array_offsets_exact=exact, window=window, win_rope=win_rope,
        max_position_embeddings=int(text.get("max_position_embeddings") or cfg["max_position_embeddings"]),
        vocab_size=int(text.get("vocab_size") or cfg["vocab_size"]), model_id=identity, dtype_name=dtype_name,
    )
    _install_taps(rt)
    return rt


def _install_taps(rt: _Runtime) -> None:
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
        n = int(x.size)
        if rt.page_op is not None:
            rt.page_op._counters.historical_forward_during_restore += n
        if rt.active is not None and rt.active.owner_counters is not None:
            rt.active.owner_counters.model_forward_tokens += n

    decoder = structure.decoder
    embed = "embed_tokens" if "embed_tokens" in decoder else "embeddings"
    setattr(decoder, embed, _Tap(getattr(decoder, embed), count_tokens))
    norm = next((n for n in ("norm", "norm_f", "final_norm") if n in decoder), None)
    if norm is None:
        raise UnsupportedModelError(f"{rt.family}: no final norm found in the decoder")
    setattr(decoder, norm, _LastPosition(getattr(decoder, norm)))


# ------------------------------------------------------------------------------------------------
# The slot store and the cache objects mlx-lm sees
# ------------------------------------------------------------------------------------------------

def _put(buf: mx.array, slots: np.ndarray, src: mx.array) -> mx.array:
    """buf with buf[:, :, slots, :d] = src (src [1, H, n, d], d <= buf's last dim)."""
    run = as_run(slots)
    if run is not None:
        return mx.slice_update(buf, src, mx.array([0, 0, run[0], 0]), axes=(0, 1, 2, 3))
    idx = mx.array(slots.astype(np.int32)).reshape(1, 1, -1, 1)
    d = src.shape[-1]
    if d < buf.shape[-1]:
        src = mx.concatenate([src, mx.take(buf, idx.reshape(-1), axis=2)[..., d:]], axis=-1)
    return mx.put_along_axis(buf, idx, src, axis=2)


def _take(buf: mx.array, slots: np.ndarray) -> mx.array:
    """buf[:, :, slots] -> [1, H, n, d]."""
    run = as_run(slots)
    if run is not None:
        return buf[:, :, run[0]:run[1]]
    return mx.take(buf, mx.array(slots.astype(np.int32)), axis=2)


class _SlotStore(SlotStore):
    """Slot buffers of one session, one set per paged layer, and the window caches (see the module
    docstring)."""

    # One `mx.fast.rope` call per layer group of about four megabytes: per-call overhead made 30
    # per-layer calls ~5x slower than one call over all layers of a page.
    group_elements = 1 << 20
    rt: _Runtime

    def __init__(self, rt: _Runtime, capacity: int) -> None:
        L = len(rt.attention_layers)
        H = rt.num_kv_heads
        with mx.stream(rt.device):
            self.k_rot = [mx.zeros((1, H, 0, rt.head_dim), dtype=rt.dtype) for _ in range(L)]
            # Without rotary embedding the rotated key is the canonical key: nothing to keep twice.
            self.k_canon = [mx.zeros((1, H, 0, rt.rotary_dim), dtype=rt.dtype) for _ in range(L if rt.rotary_dim
                                                                                               else 0)]
            self.v = [mx.zeros((1, H, 0, rt.value_head_dim), dtype=rt.dtype) for _ in range(L)]
        # Set for the duration of one forward besides the slots: its first position and its masks.
        self.fwd_offset = 0
        self.fwd_mask: mx.array | str | None = None
        self.fwd_win_mask: mx.array | str | None = None
        super().__init__(rt, capacity)
        self.write_window(None)

    def buffers(self) -> list[mx.array]:
        return [*self.k_rot, *self.k_canon, *self.v, *self.win_canon, *self.win_rot, *self.win_v]

    @staticmethod
    def _cat(a: Any, b: Any) -> Any:
        return mx.concatenate([a, b], axis=2)

    def _grow_buffers(self, capacity: int) -> None:
        extra = capacity - self.capacity

        def bigger(bufs: list[mx.array]) -> None:
            for a in range(len(bufs)):
                pad = mx.zeros((*bufs[a].shape[:2], extra, bufs[a].shape[3]), dtype=bufs[a].dtype)
                bufs[a] = mx.concatenate([bufs[a], pad], axis=2)

        with mx.stream(self.rt.device):
            bigger(self.k_rot)
            bigger(self.k_canon)
            bigger(self.v)
            mx.eval(self.buffers())

    def _copy_buffers(self) -> None:
        # Copied now (mx.array(x) copies), like torch's clone: sharing the buffers would be correct
        # too (MLX copies a shared buffer on its first write instead of donating it), but the first
        # page operation after a fork would then pay a copy of the whole cache.
        with mx.stream(self.rt.device):
            self.k_rot = [mx.array(x) for x in self.k_rot]
            self.k_canon = [mx.array(x) for x in self.k_canon]
            self.v = [mx.array(x) for x in self.v]
            self.win_canon = [mx.array(x) for x in self.win_canon]
            self.win_rot = [mx.array(x) for x in self.win_rot]
            self.win_v = [mx.array(x) for x in self.win_v]
            mx.eval(self.buffers())
        self.fwd_win_canon = [None] * len(self.win_canon)
        self.fwd_offset, self.fwd_mask, self.fwd_win_mask = 0, None, None

    # -- called from inside the model's forward ------------------------------------------------
    def write_layer(self, a: int, k_rot: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store this forward's rotated keys / values of paged layer `a`; return what attention reads."""
        assert self.fwd_slots is not None
        self.k_rot[a] = _put(self.k_rot[a], self.fwd_slots, k_rot)
        self.v[a] = _put(self.v[a], self.fwd_slots, v)
        hw = self.fwd_high_water
        return self.k_rot[a][:, :, :hw], self.v[a][:, :, :hw]

    def write_canon(self, a: int, k_pre: mx.array) -> None:
        """Store the exact pre-rotary keys [1, heads, n, head_dim] of paged layer `a`."""
        assert self.fwd_slots is not None
        if self.k_canon:
            self.k_canon[a] = _put(self.k_canon[a], self.fwd_slots, k_pre[..., : self.rt.rotary_dim])

    # -- page operations (callers evaluate the buffers when done) ------------------------------
    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """k_rot[slots, :r] = rope(k_canon[slots], positions), for every paged layer."""
        if slots.shape[0] == 0:
            return
        H = self.rt.num_kv_heads
        if self.k_canon:
            for a0, a1 in self.layer_groups(int(slots.shape[0])):
                canon = mx.concatenate([_take(self.k_canon[a], slots) for a in range(a0, a1)], axis=1)
                rot = self.rt.rotate(canon, positions)  # [1, group * H, n, r]
                for a in range(a0, a1):
                    j = (a - a0) * H
                    self.k_rot[a] = _put(self.k_rot[a], slots, rot[:, j:j + H])
        self.pos[slots] = positions

    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rt = self.rt
        if not self.k_canon:
            canon = mx.stack([_take(k, slots)[0] for k in self.k_rot])
        else:
            canon = mx.stack([_take(k, slots)[0] for k in self.k_canon])
            if rt.rotary_dim < rt.head_dim:
                passthrough = mx.stack([_take(k, slots)[0, :, :, rt.rotary_dim:] for k in self.k_rot])
                canon = mx.concatenate([canon, passthrough], axis=-1)
        return _to_numpy(canon), _to_numpy(mx.stack([_take(v, slots)[0] for v in self.v]))

    def rotated(self, slots: np.ndarray) -> np.ndarray:
        with mx.stream(self.rt.device):
            return np.array(mx.stack([_take(k, slots)[0] for k in self.k_rot]).astype(mx.float32))

    def write_keys(self, slots: np.ndarray, a0: int, a1: int, keys: np.ndarray, positions: np.ndarray | None) -> None:
        """Canonical keys [a1 - a0, H, n, D] of paged layers [a0, a1) into `slots` and, with
        `positions`, their rotation there (without, the keys are placed unrotated for a compaction
        to rotate). Evaluated before returning, so a streamed insert overlaps the next read."""
        r, d, H = self.rt.rotary_dim, self.rt.head_dim, self.rt.num_kv_heads
        n = int(slots.shape[0])
        k = _from_numpy(keys, self.rt.dtype).reshape(1, (a1 - a0) * H, n, d)
        canon = k if r == d else mx.contiguous(k[..., :r])
        rows = k
        if positions is not None and r:
            rot = self.rt.rotate(canon, positions)
            rows = mx.concatenate([rot, k[..., r:]], axis=-1) if r < d else rot
        for a in range(a0, a1):
            j = (a - a0) * H
            if self.k_canon:
                self.k_canon[a] = _put(self.k_canon[a], slots, canon[:, j:j + H])
            self.k_rot[a] = _put(self.k_rot[a], slots, rows[:, j:j + H])
        mx.eval(self.buffers())

    def write_values(self, slots: np.ndarray, a0: int, a1: int, values: np.ndarray) -> None:
        v = _from_numpy(values, self.rt.dtype)
        for a in range(a0, a1):
            self.v[a] = _put(self.v[a], slots, v[a - a0][None])

    def clear(self, slots: np.ndarray) -> None:
        for bufs in (self.k_rot, self.k_canon, self.v):
            for a in range(len(bufs)):
                bufs[a] = _put(bufs[a], slots, mx.zeros_like(_take(bufs[a], slots)))
        mx.eval(self.buffers())

    # -- window caches ---------------------------------------------------------------------------
    def reanchor_window(self, positions: np.ndarray) -> None:
        shape = self.rt.window
        assert shape is not None
        r = shape.rotary_dim
        if not r:
            return
        for w, canon in enumerate(self.win_canon):
            rot = _rotate(self.rt.win_rope, False, canon[..., :r], positions)
            self.win_rot[w] = mx.concatenate([rot, canon[..., r:]], axis=-1) if r < shape.head_dim else rot

    def _to_host(self, t: Any) -> np.ndarray:
        with mx.stream(self.rt.device):
            return _to_numpy(t)

    def _from_host(self, a: np.ndarray) -> Any:
        with mx.stream(self.rt.device):
            return _from_numpy(a, self.rt.dtype)

    def rotated_window(self) -> list[np.ndarray]:
        with mx.stream(self.rt.device):
            return [np.array(k.astype(mx.float32)) for k in self.win_rot]


class _SlotLayer:
    """What mlx-lm's attention sees as the cache of a paged layer: a window onto the slot buffers."""

    def __init__(self, store: _SlotStore, index: int) -> None:
        self.store = store
        self.index = index

    @property
    def offset(self) -> int:
        """RoPE position of this forward's first token (positions within a forward are consecutive)."""
        return self.store.fwd_offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.store.write_layer(self.index, keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        if window_size is not None:
            raise BackendError("a sliding-window mask was asked of a global-attention layer's cache")
        if self.store.fwd_slots is None or int(self.store.fwd_slots.shape[0]) != n:
            raise BackendError("slot attention needs the backend's slot mask; run the model through MlxBackend")
        mask = self.store.fwd_mask
        if return_array and isinstance(mask, str) or (return_array and mask is None):
            return self._array_mask(n)
        return mask

    def _array_mask(self, n: int) -> mx.array:
        st = self.store
        hw = st.fwd_high_water
        q = st.pos[st.fwd_slots]
        return mx.array(st.occupied[None, :hw] & (st.pos[None, :hw] <= q[:, None]))

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise BackendError("slot attention layers are edited through the backend's page operations")

    def size(self) -> int:
        return int(self.store.order.shape[0])

    def empty(self) -> bool:
        return self.size() == 0


class _WindowLayer(_SlotLayer):
    """The cache of a sliding-window layer: its own window of the newest stream tokens."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.store.append_window(self.index, keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        st = self.store
        if st.fwd_slots is None or int(st.fwd_slots.shape[0]) != n:
            raise BackendError("window attention needs the backend's mask; run the model through MlxBackend")
        mask = st.fwd_win_mask
        if return_array and not isinstance(mask, mx.array):
            return _window_mask(st.win_len, n, self.store.rt.roles.window_size)
        return mask

    def size(self) -> int:
        return self.store.win_len


def _window_mask(n_win: int, s: int, window: int) -> mx.array:
    """Query i (stream index n_win + i) sees key j (window, then this forward) within W."""
    query = np.arange(n_win, n_win + s)[:, None]
    key = np.arange(n_win + s)[None, :]
    return mx.array((key <= query) & (query - key < window))


def _copy_arrays_cache(c: ArraysCache) -> ArraysCache:
    out = copy.copy(c)
    out.cache = list(c.cache)  # the layers rebind entries, never write into them
    return out


@dataclasses.dataclass
class _Ahead:
    """A greedy decode step dispatched before the token it feeds was read back (see
    `MlxBackend.decode`). Its slot is written on the device but free in the slot table until the
    step is taken; the recurrent states and windows it replaced are kept to put back otherwise."""

    ids: mx.array                        # [1, 1]: the token it feeds, as the device picked it
    logits: mx.array                     # its float32 last logits
    pick: mx.array                       # [1, 1]: their argmax, the token the step after it feeds
    slots: np.ndarray
    recurrent: list[list[Any]]           # per ArraysCache of the session, its entries before the step
    windows: tuple[list[Any], list[Any], list[Any]]  # the store's win_canon / win_rot / win_v before it


# ------------------------------------------------------------------------------------------------
# The backend
# ------------------------------------------------------------------------------------------------

class MlxBackend(SlotBackend):
    """`Backend` on mlx-lm. Construct with `load_backend("mlx", ...)`."""

    name = "mlx"
    _rt: _Runtime
    _store: _SlotStore
    _cache: list[Any]
    _ahead: _Ahead | None = None
    # Dispatch the next greedy step before a greedy decode returns (see `decode`); a harness that
    # observes every forward the model runs turns it off.
    lookahead = True

    _load_model = staticmethod(_make_runtime)

    @property
    def mlx_model(self) -> Module:
        """The underlying mlx-lm model (shared with forks; for harnesses and diagnostics)."""
        return self._rt.model

    def _device_name(self) -> str:
        return "cpu" if self._rt.device.type == mx.cpu else "gpu"

    def _new_store(self, capacity: int) -> _SlotStore:
        return _SlotStore(self._rt, capacity)

    def _new_cache(self) -> list[Any]:
        rt = self._rt
        model: Any = rt.model
        template = model.make_cache() if hasattr(model, "make_cache") else []
        paged = {layer: a for a, layer in enumerate(rt.roles.paged)}
        window = {layer: w for w, layer in enumerate(rt.roles.window)}
        out: list[Any] = []
        for j, layer in enumerate(rt.structure.cache_layers):
            if layer in paged:
                out.append(_SlotLayer(self._store, paged[layer]))
            elif layer in window:
                out.append(_WindowLayer(self._store, window[layer]))
            else:
                out.append(template[j])
        return out

    def _forward(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, high_water: int,
                 every: bool = False) -> np.ndarray:
        with self._rt.lock, mx.stream(self._rt.device):
            logits = self._build(mx.array([ids], dtype=mx.int32), positions, slots, high_water, every)
            mx.eval(logits, self._state())
        return np.array(logits)

    def _build(self, ids: mx.array, positions: np.ndarray, slots: np.ndarray, high_water: int,
               every: bool = False) -> mx.array:
        """The forward's graph over `ids` [1, n] (placed in `slots` at `positions`): its float32
        last logits (every position's with `every`), unevaluated (the caller holds the lock and
        the device stream)."""
        st, rt = self._store, self._rt
        n = int(ids.shape[1])
        # Without a gap below the high-water slot and with this forward in the last slots, the slot
        # mask is plain causal attention: mlx's own (none for one token) runs its fastest kernel.
        dense = bool(st.occupied[:high_water].all()) and as_run(slots) == (high_water - n, high_water)
        st.fwd_slots, st.fwd_high_water, st.fwd_offset = slots, high_water, int(positions[0])
        try:
            if dense:
                st.fwd_mask = None if n == 1 else "causal"
            else:
                mask = st.occupied[None, :high_water] & (st.pos[None, :high_water] <= positions[:, None])
                st.fwd_mask = mx.array(mask)[None, None]
            if rt.roles.window:
                if st.win_len + n <= rt.roles.window_size:
                    st.fwd_win_mask = None if n == 1 else "causal"
                else:
                    st.fwd_win_mask = _window_mask(st.win_len, n, rt.roles.window_size)[None, None]
            rt.active = st
            try:
                out = rt.model(ids, cache=self._cache)
            finally:
                rt.active = None
            logits: mx.array = (out[0] if every else out[0, -1]).astype(mx.float32)
        finally:
            st.fwd_slots, st.fwd_mask, st.fwd_win_mask = None, None, None
        return logits

    def _state(self) -> list[Any]:
        """Every array a forward updates besides its logits: slot buffers, windows, recurrent states."""
        return [self._store.buffers(), [c.cache for c in self._recurrent_caches()]]

    @contextlib.contextmanager
    def _page_op(self) -> Iterator[None]:
        """Page operations are synchronous: their buffer updates are evaluated before they return."""
        self._settle()
        with self._rt.lock, mx.stream(self._rt.device), self._marked_page_op():
            yield
            mx.eval(self._store.buffers())

    def synchronize(self) -> None:
        mx.synchronize()

    # -- greedy decoding, one step ahead ---------------------------------------------------------
    # mlx-lm's own loop dispatches step n + 1 (fed with step n's argmax, still on the device) before
    # it reads step n's token back, so building one step's graph overlaps the previous step's
    # compute. A greedy decode here does the same: it leaves the next step dispatched. The next
    # call takes it when it feeds that token greedily; anything else (sampling, another token, a
    # page operation, a prefill, a snapshot, a fork) puts the step's state back first. Nothing the
    # model computes changes: the step ahead runs the graph the plain step would.
    def decode(self, token: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> int:
        ahead, self._ahead = self._ahead, None
        feed = token if token is not None else self._pending
        greedy = greedy or temperature <= 0.0
        if ahead is not None and not (greedy and feed == ahead.ids.item()):
            self._drop(ahead)
            ahead = None
        if ahead is None:
            nxt = super().decode(token, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
            if greedy and self.lookahead:
                with self._rt.lock, mx.stream(self._rt.device):
                    self._ahead = self._dispatch(mx.array([[nxt]], dtype=mx.int32))
            return nxt
        assert feed is not None
        started = time.perf_counter_ns()
        slots, positions = self._place([feed], None)
        assert np.array_equal(slots, ahead.slots), (slots, ahead.slots)  # nothing moved since it was dispatched
        self._counters.model_forward_tokens += 1
        self._counters.decoded_tokens += 1
        self._advance(positions)
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        if self.lookahead:
            with self._rt.lock, mx.stream(self._rt.device):
                self._ahead = self._dispatch(ahead.pick)
        try:
            logits = np.array(ahead.logits)
        except BaseException as e:
            self._ahead = None
            self._forward_failed(e)
            raise
        self._counters.forward_ns += time.perf_counter_ns() - started
        self._last_logits = logits
        self._pending = pick_token(logits, True, temperature, top_k, top_p, self._rng)
        return self._pending

    def _dispatch(self, ids: mx.array) -> _Ahead | None:
        """The next greedy step over `ids` [1, 1], dispatched (under the lock, on the device stream);
        None where it would need a page operation first (a compaction, more slots, a window moved)."""
        st = self._store
        last = int(st.pos[st.order[-1]]) if st.order.shape[0] else -1
        first = max(last + 1, st.win_len)  # as `_next_positions` places it
        if (self._broken is not None or first >= self.position_limit or bool(st.occupied.all())
                or (st.win_len and st.win_last_pos != first - 1)
                or not all(isinstance(c, (_SlotLayer, ArraysCache)) for c in self._cache)):
            return None
        recurrent = [list(c.cache) for c in self._recurrent_caches()]
        windows = (list(st.win_canon), list(st.win_rot), list(st.win_v))
        slots, positions = self._place([0], None)  # the token is entered when the step is taken
        st.owner_counters = None  # counted when taken
        try:
            logits = self._build(ids, positions, slots, st.high_water())
        except BaseException:
            self._restore(recurrent, windows)
            raise
        finally:
            st.owner_counters = self._counters
            st.occupied[slots] = False
            st.order = st.order[:-1]
        pick = mx.argmax(logits).astype(mx.int32).reshape(1, 1)
        mx.async_eval(logits, pick, self._state())  # type: ignore[no-untyped-call]
        return _Ahead(ids=ids, logits=logits, pick=pick, slots=slots, recurrent=recurrent, windows=windows)

    def _drop(self, ahead: _Ahead) -> None:
        """Undo a step dispatched ahead: its slot is free already (its stale contents hidden by the
        mask, as after an eviction); the recurrent states and windows go back to before it."""
        with self._rt.lock:
            self._restore(ahead.recurrent, ahead.windows)

    def _restore(self, recurrent: list[list[Any]], windows: tuple[list[Any], list[Any], list[Any]]) -> None:
        for c, entries in zip(self._recurrent_caches(), recurrent, strict=True):
            c.cache = entries
        st = self._store
        st.win_canon, st.win_rot, st.win_v = windows

    def _settle(self) -> None:
        """Before anything but a decode reads or changes the session: drop a step dispatched ahead."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            self._drop(ahead)

    def _run_model(self, ids: list[int], positions: np.ndarray | None = None, every: bool = False) -> np.ndarray:
        self._settle()
        return super()._run_model(ids, positions, every)

    def fork(self) -> MlxBackend:
        self._settle()
        return super().fork()

    def reset(self) -> None:
        self._settle()
        super().reset()

    def window_state(self) -> tuple[np.ndarray | None, list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
        self._settle()
        return super().window_state()

    # -- recurrent state -----------------------------------------------------------------------
    # Snapshots use the Hugging Face layout, so they mean the same in both runtimes: conv state
    # [1, conv_dim, kernel] (mlx-lm keeps the kernel - 1 newest inputs as [1, kernel - 1, conv_dim];
    # the oldest column, which no later step reads, is stored as zeros); Gated DeltaNet state
    # [1, heads, key_dim, value_dim] (mlx-lm: [1, heads, value_dim, key_dim]); Mamba2 state
    # [1, heads, head_dim, state] (the same in both).
    def _recurrent_caches(self) -> list[ArraysCache]:
        return [c for c in self._cache if isinstance(c, ArraysCache)]

    def _recurrent_entry(self, layer: int) -> ArraysCache:
        c = self._cache[self._rt.structure.cache_layers.index(layer)]
        assert isinstance(c, ArraysCache)
        return c

    def _is_delta_net(self, layer: int) -> bool:
        return "linear_attn" in self._rt.structure.decoder.layers[layer]

    def _hf_shapes(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        block: Any = self._rt.structure.decoder.layers[layer]
        try:
            if self._is_delta_net(layer):
                la = block.linear_attn
                return ((1, int(la.conv_dim), int(la.conv_kernel_size)),
                        (1, int(la.num_v_heads), int(la.head_k_dim), int(la.head_v_dim)))
            m = block.mixer
            return ((1, int(m.conv_dim), int(m.conv_kernel_size)),
                    (1, int(m.num_heads), int(m.head_dim), int(m.ssm_state_size)))
        except AttributeError:
            return None

    def _read_recurrent(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        states: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for i in self._rt.linear_layers:
            c = self._recurrent_entry(i)
            conv, rec = c[0], c[1]
            if conv is None or rec is None:
                continue
            pad = mx.zeros((conv.shape[0], 1, conv.shape[2]), dtype=conv.dtype)
            hf_conv = mx.concatenate([pad, conv], axis=1).transpose(0, 2, 1)
            hf_rec = rec.swapaxes(-1, -2) if self._is_delta_net(i) else rec
            for key, arr in ((f"conv/{i}/0", hf_conv), (f"recurrent/{i}/0", hf_rec)):
                states[key] = _to_numpy(arr)
                dtypes[key] = _DTYPE_NAMES[arr.dtype]
        return states, dtypes

    def _write_recurrent(self, snap: RecurrentSnapshot) -> None:
        updates: dict[int, tuple[mx.array, mx.array] | None] = {}
        for i in self._rt.linear_layers:
            conv_key, rec_key = f"conv/{i}/0", f"recurrent/{i}/0"
            if conv_key not in snap.states or rec_key not in snap.states:
                updates[i] = None
                continue
            got_conv, got_rec = tuple(snap.states[conv_key].shape), tuple(snap.states[rec_key].shape)
            want = self._hf_shapes(i)
            if want is not None and (got_conv, got_rec) != want:
                raise BlockMismatchError(
                    f"recurrent snapshot layer {i} has conv {got_conv} / recurrent {got_rec}, this model needs "
                    f"{want[0]} / {want[1]}")
            conv = _from_numpy(snap.states[conv_key], _DTYPES[snap.dtypes[conv_key]])
            rec = _from_numpy(snap.states[rec_key], _DTYPES[snap.dtypes[rec_key]])
            rec = rec.swapaxes(-1, -2) if self._is_delta_net(i) else rec
            updates[i] = (mx.contiguous(conv.transpose(0, 2, 1)[:, 1:, :]), mx.contiguous(rec))
        for i, upd in updates.items():
            c = self._recurrent_entry(i)
            c[0], c[1] = (None, None) if upd is None else upd
        mx.eval([c.cache for c in self._recurrent_caches()])

    def _copy_recurrent_to(self, other: SlotBackend) -> None:
        assert isinstance(other, MlxBackend)
        for j, c in enumerate(self._cache):
            if isinstance(c, ArraysCache):
                other._cache[j] = _copy_arrays_cache(c)


load = MlxBackend.load

# Static conformance: mypy checks MlxBackend against the protocol here.
_conforms: type[Backend] = MlxBackend
