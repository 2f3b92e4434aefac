"""The MLX backend: mlx-lm model code (Apple silicon; Linux CPU through `mlx[cpu]`) with a slot cache.

Cache layout. Each attention layer owns three preallocated slot buffers, as mlx-lm's own KVCache
lays them out (batch 1, heads, slots, dims), so attention reads them without a copy:

    k_rot[a]   [1, kv_heads, capacity, head_dim]    keys as attention uses them (rotated)
    k_canon[a] [1, kv_heads, capacity, rotary_dim]  pre-rotary keys, rotary dims only (the
                                                    pass-through dims are equal in k_rot)
    v[a]       [1, kv_heads, capacity, value_dim]

plus, on the host, a RoPE position and an occupied flag per slot and the logical order of the held
tokens (an array of slot numbers) - the same bookkeeping as the torch backend, so both hand out the
same positions and count the same way. The mask is built from positions (`occupied & slot_pos <=
query_pos`), so attention does not depend on slot order: new tokens take the lowest free slots,
eviction only clears flags, and a restored page lands in whatever slots are free.

MLX arrays are values. Every buffer update is functional (`mx.slice_update` / `mx.put_along_axis`)
and rebinds the list entry; with no other reference alive MLX donates the old buffer, so an update
costs the size of the update, not of the buffer. Nothing here assigns into an array in place, so a
buffer that is still shared (with a view attention holds, say) is copied instead of overwritten; a
fork copies its buffers up front so its page operations donate too.

Hooking into mlx-lm. The model runs its own code with three attachments, none of which changes
what it computes: the module that produces the pre-rotary key (`k_proj`, or `k_norm` where the
family has one) is wrapped so its output is also written into `k_canon`; each attention layer gets
a cache object whose `update_and_fetch` writes the forward's rotated keys and values into the slots
the backend allocated and hands attention the buffers up to the high-water slot, whose `offset` is
the forward's first RoPE position and whose `make_mask` returns the slot mask; the embedding is
wrapped to count every token that enters the model. Linear-attention (Gated DeltaNet) layers keep
mlx-lm's stock `ArraysCache`, which no page operation ever touches.

Re-anchoring calls the model's own rotary module (`attn.rope`, i.e. `mx.fast.rope` with the model's
base and scaling) on the canonical keys, with the target position as its offset: a re-anchored key
is bit for bit the key the model computes at that position, in float32 and in bf16 / fp16.

Weights. The SmolLM2 GGUF (and other llama-architecture GGUF files) is read by `mx.load`, dequantised
to float32 in float32 arithmetic (bit-identical to the gguf reference dequantiser transformers uses)
and its Q/K rows un-permuted from llama.cpp's interleaved order back to the Hugging Face half-split
order, so the weights are exactly the torch backend's and blocks are canonical "neox" keys. Tiny
models are built by transformers from the same config and seed as the torch backend and converted;
local Hugging Face folders load through transformers' own loader and are converted. The model
identity is computed over the Hugging Face form of config and weights, exactly like the torch
backend, so a block saved by one runtime is accepted by the other for the same model.

Dependency rules: mlx, mlx-lm, numpy, xxhash; transformers for configs / tokenizers, torch only to
build seeded tiny models, to load Hugging Face folders and to list parameter names in Hugging Face
order. Backends know nothing about contextd or policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import ArraysCache

from .base import (
    ROPE_LAYOUT_NEOX,
    Backend,
    BackendError,
    BackendUnavailableError,
    Block,
    BlockFileReader,
    BlockMismatchError,
    Counters,
    LayerView,
    RecurrentSnapshot,
    Tokenizer,
    UnsupportedModelError,
)
from .models import ModelSource, check_supported, load_tokenizer, resolve
from .slots import SlotBookkeeping, as_run, checked_token_ids, model_identity, pick_token

__all__ = ["MlxBackend", "load"]

_DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_DTYPE_NAMES: dict[mx.Dtype, str] = {v: k for k, v in _DTYPES.items()}

# Key elements per step of page work (see _SlotStore._layer_groups).
_GROUP_ELEMENTS = 1 << 20

# Families whose attention computes the pre-rotary key in k_norm (per-head RMSNorm after k_proj);
# the others produce it directly in k_proj as [batch, seq, heads * head_dim].
_KEY_FROM_K_NORM = frozenset({"qwen3", "qwen3_next"})


# llama.cpp tensor names -> Hugging Face parameter names (per block "blk.N.").
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_GROUP_SIZE = 32  # every quantised type mx.load reads from GGUF (Q4_0, Q4_1, Q8_0) uses groups of 32

# Qwen3-Next RMSNorms compute x * (1 + w); mlx-lm's nn.RMSNorm computes x * w.
_PLUS_ONE_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                   ".q_norm.weight", ".k_norm.weight")


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
# Loading: Hugging Face form (names, order, layout of the torch backend) -> mlx-lm model
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class _HfForm:
    """A model in Hugging Face form: config dict and parameters in `named_parameters()` order."""

    config: Any  # transformers PretrainedConfig
    params: list[tuple[str, mx.array]]


def _torch_dtype(dtype: str) -> Any:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def _hf_form_from_torch(model: Any, dtype: mx.Dtype) -> _HfForm:
    import torch

    params: list[tuple[str, mx.array]] = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = p.detach().cpu().contiguous()
            arr = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
            params.append((name, _from_numpy(arr, dtype)))
    return _HfForm(config=model.config, params=params)


def _hf_form_tiny(source: ModelSource, dtype: str) -> _HfForm:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assert source.tiny_config is not None
    cfg_dict = dict(source.tiny_config)
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    check_supported(config)
    # The torch backend's recipe exactly: seeded on a forked RNG, float32 init, then cast.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(source.seed)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(dtype=_torch_dtype(dtype))
    return _hf_form_from_torch(model, _DTYPES[dtype])


def _hf_form_folder(source: ModelSource, dtype: str) -> _HfForm:
    from transformers import AutoConfig, AutoModelForCausalLM

    assert source.path is not None
    config = AutoConfig.from_pretrained(str(source.path))
    check_supported(config)
    # transformers' own loader (key renames, fused experts, tied weights) gives exactly the torch
    # backend's parameters; they are converted to MLX arrays and the torch copy is dropped.
    model = AutoModelForCausalLM.from_pretrained(str(source.path), dtype=_torch_dtype(dtype))
    return _hf_form_from_torch(model, _DTYPES[dtype])


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


def _hf_form_gguf(source: ModelSource, dtype: str) -> _HfForm:
    from transformers import AutoConfig

    assert source.path is not None and source.gguf_file is not None
    path = Path(source.path) / source.gguf_file
    config = AutoConfig.from_pretrained(str(source.path), gguf_file=source.gguf_file)
    check_supported(config)
    loaded = cast(tuple[dict[str, mx.array], dict[str, Any]], mx.load(str(path), return_metadata=True))
    tensors, meta = loaded
    arch = str(meta.get("general.architecture", ""))
    if arch != "llama":
        raise UnsupportedModelError(
            f"{path.name}: the MLX backend reads GGUF files of the llama architecture (got {arch!r}); "
            "load other families from a Hugging Face folder"
        )
    heads = {"q_proj": int(config.num_attention_heads), "k_proj": int(config.num_key_value_heads)}
    target = _DTYPES[dtype]

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
            # float32 scales and biases: the products and sums then run in float32, exactly as the
            # reference dequantiser (in float16 they would be rounded to ~1e-3).
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
    return _HfForm(config=config, params=params)


def _mlx_args(family: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm ModelArgs fields from a transformers 5 config dict (rope_parameters nest rope_theta,
    the scaling and the partial rotary factor there)."""
    args = dict(cfg)
    rp = dict(cfg.get("rope_parameters") or {})
    args.pop("rope_parameters", None)
    args["rope_theta"] = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    args["rope_scaling"] = None if rope_type == "default" else rp
    args["rope_traditional"] = False
    args["partial_rotary_factor"] = float(rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if args.get("head_dim") is None:
        args.pop("head_dim", None)
    if family == "qwen3_next":
        layer_types = list(cfg.get("layer_types") or [])
        full = [i for i, t in enumerate(layer_types) if t == "full_attention"]
        interval = full[0] + 1 if full else 0
        periodic = interval > 0 and full == list(range(interval - 1, len(layer_types), interval))
        if not periodic:
            raise UnsupportedModelError(
                f"qwen3_next: mlx-lm places full attention at every k-th layer; layer types {layer_types} are not "
                "of that form"
            )
        args["full_attention_interval"] = interval
        args.setdefault("decoder_sparse_step", 1)
        args.setdefault("mlp_only_layers", [])
    return args


def _mlx_weights(family: str, params: list[tuple[str, mx.array]], cfg: dict[str, Any]) -> list[tuple[str, mx.array]]:
    """Hugging Face parameters -> mlx-lm parameter names and layouts."""
    if family != "qwen3_next":
        return [(n, w) for n, w in params if "rotary_emb" not in n]
    inter = int(cfg["moe_intermediate_size"])
    out: list[tuple[str, mx.array]] = []
    for name, w in params:
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".experts.gate_up_proj")
            out.append((f"{prefix}.switch_mlp.gate_proj.weight", w[:, :inter, :]))
            out.append((f"{prefix}.switch_mlp.up_proj.weight", w[:, inter:, :]))
        elif name.endswith(".mlp.experts.down_proj"):
            out.append((name.removesuffix(".experts.down_proj") + ".switch_mlp.down_proj.weight", w))
        elif name.endswith("conv1d.weight"):
            out.append((name, w.moveaxis(2, 1)))  # torch [C, 1, K] -> mlx [C, K, 1]
        elif name.endswith(_PLUS_ONE_NORMS) and w.ndim == 1:
            out.append((name, (w.astype(mx.float32) + 1.0).astype(w.dtype)))
        else:
            out.append((name, w))
    return out


def _build_mlx_model(family: str, cfg: dict[str, Any], params: list[tuple[str, mx.array]]) -> Module:
    try:
        arch = importlib.import_module(f"mlx_lm.models.{family}")
    except ModuleNotFoundError as e:
        raise UnsupportedModelError(f"{family}: mlx-lm has no model module for this family") from e
    model: Module = arch.Model(arch.ModelArgs.from_dict(_mlx_args(family, cfg)))
    try:
        model.load_weights(_mlx_weights(family, params, cfg), strict=True)
    except ValueError as e:
        raise UnsupportedModelError(f"{family}: the weights do not fit mlx-lm's model: {e}") from e
    model.eval()
    mx.eval(model.parameters())  # type: ignore[no-untyped-call]
    return model


# ------------------------------------------------------------------------------------------------
# The runtime: one loaded model shared by a backend and its forks
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


@dataclasses.dataclass
class _Runtime:
    source: ModelSource
    model: Module
    family: str
    device: mx.Device
    dtype: mx.Dtype
    dtype_name: str
    attention_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    rotary_dim: int
    rope: Module
    array_offsets_exact: bool
    max_position_embeddings: int
    vocab_size: int
    view: LayerView
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    active: _SlotStore | None = None
    page_op: MlxBackend | None = None
    tokenizer: Tokenizer | None = None

    def head(self, h: mx.array) -> mx.array:
        """The model's output head (tied embedding or lm_head) on hidden states `h`."""
        model: Any = self.model
        head = model.model.embed_tokens.as_linear if model.args.tie_word_embeddings else model.lm_head
        out: mx.array = head(h)
        return out

    def rotate(self, x: mx.array, positions: np.ndarray) -> mx.array:
        """The model's own rotary embedding of canonical keys x [1, H, n, r] at `positions` [n]."""
        rope: Any = self.rope
        runs = _position_runs(positions)
        out: mx.array
        if len(runs) == 1:
            out = rope(x, offset=int(positions[0]))
        elif self.array_offsets_exact and len(runs) > 8:
            out = rope(x.transpose(2, 1, 0, 3), offset=mx.array(positions.astype(np.int32))).transpose(2, 1, 0, 3)
        else:
            out = mx.concatenate([rope(x[:, :, i0:i1], offset=int(positions[i0])) for i0, i1 in runs], axis=2)
        return out


def _check_rotary(rope_mod: Module, r: int, head_dim: int, family: str, rope_params: dict[str, Any]) -> bool:
    """Check that the model's rotary module uses the half-split layout on the first `r` dims (with
    the configured frequencies for static default / linear rope), that rotating only those dims
    equals rotating the whole head, and whether per-token offsets agree bit for bit with the scalar
    offsets the model uses. A family with another layout is refused instead of silently drifting."""
    h = r // 2
    basis = mx.eye(r, dtype=mx.float32).reshape(r, 1, 1, r)
    out = np.array(rope_mod(basis, offset=1)).reshape(r, r)
    cos, sin = np.diagonal(out)[:h], out[np.arange(h), np.arange(h) + h]
    expected = np.zeros_like(out)
    idx = np.arange(h)
    expected[idx, idx], expected[idx, idx + h] = cos, sin
    expected[idx + h, idx + h], expected[idx + h, idx] = cos, -sin
    scale = float(np.abs(out).max())
    if not float(np.abs(out - expected).max()) <= 1e-5 * max(scale, 1.0):
        raise UnsupportedModelError(
            f"{family}: the model's rotary embedding is not the half-split ('neox') layout on its first {r} dims; "
            "a layout adapter is missing"
        )
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default"))
    if rope_type in ("default", "linear"):
        theta = float(rope_params.get("rope_theta", 10000.0))
        inv_freq = 1.0 / theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
        if rope_type == "linear":
            inv_freq = inv_freq / float(rope_params["factor"])
        got = np.arctan2(sin, cos)
        if not float(np.abs(got - inv_freq).max()) <= 1e-5:
            raise UnsupportedModelError(f"{family}: the model's rotary frequencies differ from its config")
    gen = np.random.default_rng(0)
    x = mx.array(gen.standard_normal((1, 2, 6, head_dim)).astype(np.float32))
    full = rope_mod(x, offset=1000)
    part = rope_mod(x[..., :r], offset=1000)
    if not (bool(mx.array_equal(full[..., :r], part)) and bool(mx.array_equal(full[..., r:], x[..., r:]))):
        raise UnsupportedModelError(f"{family}: rotating the first {r} dims alone differs from the model's rotation")
    per_token = rope_mod(x[..., :r].transpose(2, 1, 0, 3), offset=mx.arange(1000, 1006)).transpose(2, 1, 0, 3)
    return bool(mx.array_equal(per_token, part))


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
    if dtype not in _DTYPES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    dev = _device(device)
    with mx.stream(dev):
        if source.kind == "tiny":
            form = _hf_form_tiny(source, dtype)
        elif source.kind == "gguf":
            form = _hf_form_gguf(source, dtype)
        else:
            form = _hf_form_folder(source, dtype)
        cfg = form.config.to_dict()
        family = str(cfg["model_type"])
        model = _build_mlx_model(family, cfg, form.params)
    identity = model_id or model_identity(cfg, [(n, _to_numpy(w), f"torch.{dtype}") for n, w in form.params])
    del form

    layers = model.model.layers
    attention_layers = tuple(i for i, layer in enumerate(layers) if "self_attn" in layer)
    linear_layers = tuple(i for i, layer in enumerate(layers) if "linear_attn" in layer)
    if not attention_layers:
        raise UnsupportedModelError(f"{family}: the model has no attention layers to page")
    if len(attention_layers) + len(linear_layers) != len(layers):
        raise UnsupportedModelError(f"{family}: some layers are neither attention nor linear attention")
    hf_types = cfg.get("layer_types")
    if hf_types and tuple(i for i, t in enumerate(hf_types) if t == "full_attention") != attention_layers:
        raise UnsupportedModelError(f"{family}: mlx-lm's attention layers {attention_layers} differ from the config")
    attn = layers[attention_layers[0]].self_attn
    kv_heads = int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    value_head_dim = int(attn.v_proj.weight.shape[0]) // kv_heads
    rope_params = dict(cfg.get("rope_parameters") or {})
    partial = float(rope_params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    rope_mod = attn.rope
    mod_dims = getattr(rope_mod, "dims", getattr(rope_mod, "dim", None))
    if mod_dims != rotary_dim or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(
            f"{family}: rotary dims {mod_dims} of mlx-lm's rope != {rotary_dim} from the config")
    with mx.stream(dev):
        exact_offsets = _check_rotary(rope_mod, rotary_dim, head_dim, family, rope_params)
    key_module = "k_norm" if family in _KEY_FROM_K_NORM else "k_proj"
    for i in attention_layers:
        if key_module not in layers[i].self_attn:
            raise UnsupportedModelError(
                f"{family}: attention layer {i} has no {key_module} to read pre-rotary keys from")
    view = LayerView(
        model_id=identity, family=family, attention_layers=attention_layers, num_kv_heads=kv_heads,
        head_dim=head_dim, value_head_dim=value_head_dim, rotary_dim=rotary_dim, rope_layout=ROPE_LAYOUT_NEOX,
        dtype=dtype,
    )
    rt = _Runtime(
        source=source, model=model, family=family, device=dev, dtype=_DTYPES[dtype], dtype_name=dtype,
        attention_layers=attention_layers, linear_layers=linear_layers, num_kv_heads=kv_heads, head_dim=head_dim,
        value_head_dim=value_head_dim, rotary_dim=rotary_dim, rope=rope_mod, array_offsets_exact=exact_offsets,
        max_position_embeddings=int(cfg["max_position_embeddings"]), vocab_size=int(cfg["vocab_size"]), view=view,
    )
    _install_taps(rt, key_module)
    return rt


def _install_taps(rt: _Runtime, key_module: str) -> None:
    """Wrappers on the shared model dispatch to whichever session is running a forward (`rt.active`)."""
    layers = rt.model.model.layers
    head_dim = rt.head_dim

    def key_tap(a: int) -> Callable[[mx.array, mx.array], None]:
        def observe(x: mx.array, out: mx.array) -> None:
            store = rt.active
            if store is None:
                return
            k = out.reshape(*out.shape[:2], -1, head_dim) if key_module == "k_proj" else out
            store.write_canon(a, k.transpose(0, 2, 1, 3))
        return observe

    for a, i in enumerate(rt.attention_layers):
        attn = layers[i].self_attn
        setattr(attn, key_module, _Tap(getattr(attn, key_module), key_tap(a)))

    def count_tokens(x: mx.array, out: mx.array) -> None:
        n = int(x.size)
        if rt.page_op is not None:
            rt.page_op._counters.historical_forward_during_restore += n
        if rt.active is not None and rt.active.owner_counters is not None:
            rt.active.owner_counters.model_forward_tokens += n

    rt.model.model.embed_tokens = _Tap(rt.model.model.embed_tokens, count_tokens)


# ------------------------------------------------------------------------------------------------
# The slot store and the attention cache layers mlx-lm sees
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


class _SlotStore:
    """Slot buffers and per-slot metadata of one session (see the module docstring)."""

    def __init__(self, rt: _Runtime, capacity: int) -> None:
        self.rt = rt
        self.capacity = 0
        L = len(rt.attention_layers)
        H = rt.num_kv_heads
        with mx.stream(rt.device):
            self.k_rot = [mx.zeros((1, H, 0, rt.head_dim), dtype=rt.dtype) for _ in range(L)]
            self.k_canon = [mx.zeros((1, H, 0, rt.rotary_dim), dtype=rt.dtype) for _ in range(L)]
            self.v = [mx.zeros((1, H, 0, rt.value_head_dim), dtype=rt.dtype) for _ in range(L)]
        self.pos = np.zeros(0, dtype=np.int64)
        self.occupied = np.zeros(0, dtype=bool)
        self.tokens = np.zeros(0, dtype=np.int32)
        self.order = np.zeros(0, dtype=np.int64)
        # Set for the duration of one forward: where its tokens go, how far attention reads, its mask.
        self.fwd_slots: np.ndarray | None = None
        self.fwd_high_water = 0
        self.fwd_offset = 0
        self.fwd_mask: mx.array | None = None
        self.owner_counters: Counters | None = None
        self.grow(capacity)

    def buffers(self) -> list[mx.array]:
        return [*self.k_rot, *self.k_canon, *self.v]

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        extra = capacity - self.capacity

        def bigger(bufs: list[mx.array]) -> None:
            for a in range(len(bufs)):
                pad = mx.zeros((*bufs[a].shape[:2], extra, bufs[a].shape[3]), dtype=bufs[a].dtype)
                # zeros, not uninitialised memory: masked slots still take part in the weights @
                # values product, where a weight of 0 times NaN bits would still be NaN.
                bufs[a] = mx.concatenate([bufs[a], pad], axis=2)

        with mx.stream(self.rt.device):
            bigger(self.k_rot)
            bigger(self.k_canon)
            bigger(self.v)
            mx.eval(self.buffers())
        self.pos = np.concatenate([self.pos, np.zeros(extra, dtype=np.int64)])
        self.occupied = np.concatenate([self.occupied, np.zeros(extra, dtype=bool)])
        self.tokens = np.concatenate([self.tokens, np.zeros(extra, dtype=np.int32)])
        self.capacity = capacity

    def allocate(self, n: int) -> np.ndarray:
        """The `n` lowest free slots (growing the buffers if needed); keeps the high-water mark low."""
        free = np.flatnonzero(~self.occupied)
        if free.shape[0] < n:
            self.grow(max(2 * self.capacity, self.capacity + n - free.shape[0]))
            free = np.flatnonzero(~self.occupied)
        return free[:n].astype(np.int64)

    def high_water(self) -> int:
        occ = np.flatnonzero(self.occupied)
        return int(occ[-1]) + 1 if occ.shape[0] else 0

    def clone(self) -> _SlotStore:
        other = _SlotStore.__new__(_SlotStore)
        other.rt = self.rt
        other.capacity = self.capacity
        # Copied now (mx.array(x) copies), like torch's clone: sharing the buffers would be correct
        # too (MLX copies a shared buffer on its first write instead of donating it), but the first
        # page operation after a fork would then pay a copy of the whole cache.
        with mx.stream(self.rt.device):
            other.k_rot = [mx.array(x) for x in self.k_rot]
            other.k_canon = [mx.array(x) for x in self.k_canon]
            other.v = [mx.array(x) for x in self.v]
            mx.eval(other.buffers())
        other.pos, other.occupied = self.pos.copy(), self.occupied.copy()
        other.tokens, other.order = self.tokens.copy(), self.order.copy()
        other.fwd_slots, other.fwd_high_water, other.fwd_offset, other.fwd_mask = None, 0, 0, None
        other.owner_counters = None
        return other

    # -- called from inside the model's forward ------------------------------------------------
    def write_layer(self, a: int, k_rot: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        """Store this forward's rotated keys / values of attention layer `a`; return what attention reads."""
        assert self.fwd_slots is not None
        self.k_rot[a] = _put(self.k_rot[a], self.fwd_slots, k_rot)
        self.v[a] = _put(self.v[a], self.fwd_slots, v)
        hw = self.fwd_high_water
        return self.k_rot[a][:, :, :hw], self.v[a][:, :, :hw]

    def write_canon(self, a: int, k_pre: mx.array) -> None:
        """Store the exact pre-rotary keys [1, heads, n, head_dim] of attention layer `a`."""
        assert self.fwd_slots is not None
        self.k_canon[a] = _put(self.k_canon[a], self.fwd_slots, k_pre[..., : self.rt.rotary_dim])

    # -- page operations (callers evaluate the buffers when done) ------------------------------
    def _layer_groups(self, n_tokens: int) -> Iterator[tuple[int, int]]:
        """Ranges of attention layers whose slice of a page is about four megabytes: one
        `mx.fast.rope` call per group (per-call overhead made 30 per-layer calls ~5x slower than one
        call over all layers of a page), without whole-cache temporaries for a full compaction."""
        n_layers, heads, dim = len(self.k_rot), self.rt.num_kv_heads, self.rt.head_dim
        group = max(1, _GROUP_ELEMENTS // max(1, heads * n_tokens * dim))
        for a0 in range(0, n_layers, group):
            yield a0, min(n_layers, a0 + group)

    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """k_rot[slots, :r] = rope(k_canon[slots], positions), for every attention layer."""
        if slots.shape[0] == 0:
            return
        H = self.rt.num_kv_heads
        for a0, a1 in self._layer_groups(int(slots.shape[0])):
            canon = mx.concatenate([_take(self.k_canon[a], slots) for a in range(a0, a1)], axis=1)
            rot = self.rt.rotate(canon, positions)  # [1, group * H, n, r]
            for a in range(a0, a1):
                j = (a - a0) * H
                self.k_rot[a] = _put(self.k_rot[a], slots, rot[:, j:j + H])
        self.pos[slots] = positions

    def write_keys(self, slots: np.ndarray, a0: int, a1: int, keys: mx.array, positions: np.ndarray | None) -> None:
        """Store canonical keys [a1 - a0, H, n, D] of attention layers [a0, a1) in `slots` and, with
        `positions`, their rotation there (without, the keys are placed unrotated for a compaction
        to rotate). The slots' positions are the caller's to set."""
        r, d, H = self.rt.rotary_dim, self.rt.head_dim, self.rt.num_kv_heads
        n = int(slots.shape[0])
        k = keys.reshape(1, (a1 - a0) * H, n, d)
        canon = k if r == d else mx.contiguous(k[..., :r])
        rows = k
        if positions is not None:
            rot = self.rt.rotate(canon, positions)
            rows = mx.concatenate([rot, k[..., r:]], axis=-1) if r < d else rot
        for a in range(a0, a1):
            j = (a - a0) * H
            self.k_canon[a] = _put(self.k_canon[a], slots, canon[:, j:j + H])
            self.k_rot[a] = _put(self.k_rot[a], slots, rows[:, j:j + H])

    def write_values(self, slots: np.ndarray, a0: int, a1: int, values: mx.array) -> None:
        for a in range(a0, a1):
            self.v[a] = _put(self.v[a], slots, values[a - a0][None])

    def write_block(self, slots: np.ndarray, keys: mx.array, values: mx.array, positions: np.ndarray | None) -> None:
        """A whole block's keys [L, H, n, D] and values, layer group by layer group."""
        for a0, a1 in self._layer_groups(int(slots.shape[0])):
            self.write_keys(slots, a0, a1, keys[a0:a1], positions)
            self.write_values(slots, a0, a1, values[a0:a1])


class _SlotLayer:
    """What mlx-lm's attention sees as its cache: a window onto the session's slot buffers."""

    def __init__(self, store: _SlotStore, attention_index: int) -> None:
        self.store = store
        self.attention_index = attention_index

    @property
    def offset(self) -> int:
        """RoPE position of this forward's first token (positions within a forward are consecutive)."""
        return self.store.fwd_offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.store.write_layer(self.attention_index, keys, values)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        if window_size is not None:
            raise BackendError("sliding-window attention is not supported by the slot cache")
        mask = self.store.fwd_mask
        if mask is None or mask.shape[-2] != n:
            raise BackendError("slot attention needs the backend's slot mask; run the model through MlxBackend")
        return mask

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n: int) -> int:
        raise BackendError("slot attention layers are edited through the backend's page operations")

    def size(self) -> int:
        return int(self.store.order.shape[0])

    def empty(self) -> bool:
        return self.size() == 0


def _copy_arrays_cache(c: ArraysCache) -> ArraysCache:
    out = ArraysCache(len(c.cache))
    out.cache = list(c.cache)  # the layers rebind entries, never write into them
    return out


# ------------------------------------------------------------------------------------------------
# The backend
# ------------------------------------------------------------------------------------------------

class MlxBackend(SlotBookkeeping):
    """`Backend` on mlx-lm. Construct with `load_backend("mlx", ...)`."""

    name = "mlx"
    _store: _SlotStore

    def __init__(self, rt: _Runtime, model_name: str, *, capacity: int = 4096, prefill_chunk: int = 512,
                 position_limit: int | None = None, seed: int = 0) -> None:
        self._rt = rt
        self.model_name = model_name
        self.device = "cpu" if rt.device.type == mx.cpu else "gpu"
        self.prefill_chunk = int(prefill_chunk)
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        # Compaction runs when a token would get a position >= position_limit.
        self.position_limit = int(position_limit or rt.max_position_embeddings)
        self._counters = Counters()
        self._rng = np.random.default_rng(seed)
        self._store = _SlotStore(rt, max(1, int(capacity)))
        self._store.owner_counters = self._counters
        self._cache = self._new_cache(self._store)
        self._stream_tokens = 0
        self._pending: int | None = None
        self._last_logits: np.ndarray | None = None
        self._broken: str | None = None

    # -- identity ----------------------------------------------------------------------------
    @property
    def mlx_model(self) -> Module:
        """The underlying mlx-lm model (shared with forks; for harnesses and diagnostics)."""
        return self._rt.model

    @property
    def model_id(self) -> str:
        return self._rt.view.model_id

    @property
    def layer_view(self) -> LayerView:
        return self._rt.view

    @property
    def tokenizer(self) -> Tokenizer:
        with self._rt.lock:
            if self._rt.tokenizer is None:
                self._rt.tokenizer = load_tokenizer(self._rt.source)
            return self._rt.tokenizer

    @property
    def vocab_size(self) -> int:
        return self._rt.vocab_size

    @property
    def is_hybrid(self) -> bool:
        return bool(self._rt.linear_layers)

    @property
    def max_position(self) -> int:
        return self._rt.max_position_embeddings - 1

    # -- state -------------------------------------------------------------------------------
    def rotated_keys(self, start: int = 0, end: int | None = None) -> np.ndarray:
        end = self.attention_tokens if end is None else end
        self._check_range(start, end)
        slots = self._store.order[start:end]
        with mx.stream(self._rt.device):
            keys = mx.stack([_take(k, slots)[0] for k in self._store.k_rot]).astype(mx.float32)
            return np.array(keys)

    # -- running the model -------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = checked_token_ids(token_ids, self._rt.vocab_size)
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._pending = None
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            self._run_model(chunk)
            self._counters.new_prefill_tokens += len(chunk)
        return self.last_logits()

    def decode(self, token: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> int:
        feed = token if token is not None else self._pending
        if feed is not None:
            self._run_model(checked_token_ids([feed], self._rt.vocab_size))
            self._counters.decoded_tokens += 1
        elif self._last_logits is None:
            raise BackendError("decode needs a prefill (or an explicit token) first")
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        assert self._last_logits is not None
        nxt = pick_token(self._last_logits, greedy, temperature, top_k, top_p, self._rng)
        self._pending = nxt
        return nxt

    def _run_model(self, ids: list[int]) -> None:
        """The one place that runs the model: allocate slots, build the slot mask, forward, evaluate."""
        self._check_usable()
        st, rt = self._store, self._rt
        n = len(ids)
        positions = self._next_positions(n)
        slots = st.allocate(n)
        st.pos[slots] = positions
        st.occupied[slots] = True
        st.tokens[slots] = ids
        st.order = np.concatenate([st.order, slots])
        hw = st.high_water()
        mask = st.occupied[None, :hw] & (st.pos[None, :hw] <= positions[:, None])
        st.fwd_slots, st.fwd_high_water, st.fwd_offset = slots, hw, int(positions[0])
        try:
            with rt.lock, mx.stream(rt.device):
                st.fwd_mask = mx.array(mask)[None, None]
                rt.active = st
                try:
                    hidden = rt.model.model(mx.array([ids], dtype=mx.int32), cache=self._cache)
                    logits = rt.head(hidden[:, -1:, :])[0, -1].astype(mx.float32)
                finally:
                    rt.active = None
                states = [c.cache for c in self._linear_caches()]
                mx.eval(logits, st.buffers(), states)
        except BaseException as e:
            # Linear-attention layers before the failure may already have advanced their state, so
            # the session no longer describes any prefix of the stream.
            self._broken = f"a forward pass failed ({type(e).__name__}: {e})"
            raise
        finally:
            st.fwd_slots, st.fwd_mask = None, None
        self._stream_tokens += n
        self._last_logits = np.array(logits)

    # -- page operations ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _page_op(self) -> Iterator[None]:
        """Page operations are synchronous: their buffer updates are evaluated before they return."""
        self._check_usable()
        with self._rt.lock, mx.stream(self._rt.device):
            self._rt.page_op = self
            try:
                yield
                mx.eval(self._store.buffers())
            finally:
                self._rt.page_op = None

    def save_block(self, start: int, end: int) -> Block:
        self._check_range(start, end, nonempty=True)
        st, rt = self._store, self._rt
        with self._page_op():
            slots = st.order[start:end]
            canon = mx.stack([_take(k, slots)[0] for k in st.k_canon])
            if rt.rotary_dim < rt.head_dim:
                passthrough = mx.stack([_take(k, slots)[0, :, :, rt.rotary_dim:] for k in st.k_rot])
                canon = mx.concatenate([canon, passthrough], axis=-1)
            values = mx.stack([_take(v, slots)[0] for v in st.v])
            return Block(
                view=rt.view,
                keys=_to_numpy(canon),
                values=_to_numpy(values),
                positions=st.pos[slots].copy(),
                token_ids=st.tokens[slots].copy(),
                model_name=self.model_name,
            )

    def insert_block(self, blk: Block, at: int) -> None:
        rt, st = self._rt, self._store
        rt.view.require_same(blk.view)
        self._check_insert_at(at)
        with self._page_op():
            plan = self._plan_insert(at, blk.positions)
            slots = st.allocate(blk.n_tokens)
            st.write_block(slots, _from_numpy(blk.keys, rt.dtype), _from_numpy(blk.values, rt.dtype),
                           None if plan.compact else plan.block_pos)
            self._commit_insert(at, plan, slots, blk.token_ids)

    def insert_block_file(self, path: str | os.PathLike[str], at: int) -> None:
        """`insert_block(Block.from_file(path), at)`, with the disk read overlapped: keys are copied
        and rotated into free slots layer group by layer group as they arrive. Nothing becomes
        visible before the whole file has been read and its checksum verified (see
        `base.restore_block_file`)."""
        rt, st = self._rt, self._store
        self._check_insert_at(at)
        with BlockFileReader(path, expect=rt.view) as rd, self._page_op():
            n = rd.n_tokens
            rd.wait("positions")
            plan = self._plan_insert(at, rd.arrays["positions"])
            slots = st.allocate(n)
            positions = None if plan.compact else plan.block_pos
            groups = list(st._layer_groups(n))
            for a0, a1 in groups:
                rd.wait("keys", rows=a1)
                st.write_keys(slots, a0, a1, _from_numpy(rd.arrays["keys"][a0:a1], rt.dtype), positions)
                mx.eval(st.buffers())  # while the reader thread fetches the next layers
            for a0, a1 in groups:
                rd.wait("values", rows=a1)
                st.write_values(slots, a0, a1, _from_numpy(rd.arrays["values"][a0:a1], rt.dtype))
            blk = rd.finish()
            # The slots stay free (and so invisible) until here: a failed read leaves no trace.
            self._commit_insert(at, plan, slots, blk.token_ids)

    # -- recurrent state ---------------------------------------------------------------------
    # Snapshots use the Hugging Face layout, so they mean the same in both runtimes: conv state
    # [1, conv_dim, kernel] (mlx-lm keeps the kernel - 1 newest inputs as [1, kernel - 1, conv_dim];
    # the oldest column, which no later step reads, is stored as zeros) and recurrent state
    # [1, heads, key_dim, value_dim] (mlx-lm: [1, heads, value_dim, key_dim]).
    def _linear_caches(self) -> list[ArraysCache]:
        return [c for c in self._cache if isinstance(c, ArraysCache)]

    def _linear_shapes(self, i: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        la: Any = self._rt.model.model.layers[i].linear_attn
        return (1, int(la.conv_dim), int(la.conv_kernel_size)), (1, int(la.num_v_heads), int(la.head_k_dim),
                                                                    int(la.head_v_dim))

    def snapshot_recurrent(self) -> RecurrentSnapshot | None:
        if not self.is_hybrid:
            return None
        states: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        with self._page_op():
            for i in self._rt.linear_layers:
                c = self._cache[i]
                assert isinstance(c, ArraysCache)
                conv, rec = c[0], c[1]
                if conv is None or rec is None:
                    continue
                pad = mx.zeros((conv.shape[0], 1, conv.shape[2]), dtype=conv.dtype)
                hf_conv = mx.concatenate([pad, conv], axis=1).transpose(0, 2, 1)
                hf_rec = rec.swapaxes(-1, -2)
                for key, arr in ((f"conv/{i}/0", hf_conv), (f"recurrent/{i}/0", hf_rec)):
                    states[key] = _to_numpy(arr)
                    dtypes[key] = _DTYPE_NAMES[arr.dtype]
        return RecurrentSnapshot(model_id=self.model_id, stream_tokens=self._stream_tokens,
                                 states=states, dtypes=dtypes)

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        if not self.is_hybrid:
            raise BackendError("this model has no recurrent layers")
        if snap.model_id != self.model_id:
            raise BlockMismatchError(
                f"recurrent snapshot belongs to model_id {snap.model_id}, this backend is {self.model_id}")
        updates: dict[int, tuple[mx.array, mx.array] | None] = {}
        for i in self._rt.linear_layers:
            conv_key, rec_key = f"conv/{i}/0", f"recurrent/{i}/0"
            if conv_key not in snap.states or rec_key not in snap.states:
                updates[i] = None
                continue
            want_conv, want_rec = self._linear_shapes(i)
            got_conv, got_rec = tuple(snap.states[conv_key].shape), tuple(snap.states[rec_key].shape)
            if got_conv != want_conv or got_rec != want_rec:
                raise BlockMismatchError(
                    f"recurrent snapshot layer {i} has conv {got_conv} / recurrent {got_rec}, this model needs "
                    f"{want_conv} / {want_rec}")
            for key in (conv_key, rec_key):
                if snap.dtypes[key] not in _DTYPES:
                    raise BlockMismatchError(f"recurrent snapshot state {key} has unsupported dtype {snap.dtypes[key]}")
            conv = _from_numpy(snap.states[conv_key], _DTYPES[snap.dtypes[conv_key]])
            rec = _from_numpy(snap.states[rec_key], _DTYPES[snap.dtypes[rec_key]])
            updates[i] = (mx.contiguous(conv.transpose(0, 2, 1)[:, 1:, :]), mx.contiguous(rec.swapaxes(-1, -2)))
        with self._page_op():
            for i, upd in updates.items():
                c = self._cache[i]
                assert isinstance(c, ArraysCache)
                c[0], c[1] = (None, None) if upd is None else upd
            mx.eval([c.cache for c in self._linear_caches()])
            self._stream_tokens = snap.stream_tokens
            # Logits and the pending token belong to the stream point being left.
            self._last_logits = None
            self._pending = None

    # -- session -----------------------------------------------------------------------------
    def synchronize(self) -> None:
        mx.synchronize()

    def fork(self) -> MlxBackend:
        other = MlxBackend.__new__(MlxBackend)
        other._rt = self._rt
        other.model_name = self.model_name
        other.device = self.device
        other.prefill_chunk = self.prefill_chunk
        other.position_limit = self.position_limit
        other._counters = self._counters.copy()
        other._rng = np.random.default_rng()
        other._rng.bit_generator.state = self._rng.bit_generator.state
        with self._rt.lock:
            other._store = self._store.clone()
        other._store.owner_counters = other._counters
        other._cache = other._new_cache(other._store)
        for i in self._rt.linear_layers:
            c = self._cache[i]
            assert isinstance(c, ArraysCache)
            other._cache[i] = _copy_arrays_cache(c)
        other._stream_tokens = self._stream_tokens
        other._pending = self._pending
        other._last_logits = None if self._last_logits is None else self._last_logits.copy()
        other._broken = self._broken
        return other

    def reset(self) -> None:
        st = self._store
        st.occupied[:] = False
        st.order = np.zeros(0, dtype=np.int64)
        self._cache = self._new_cache(st)
        self._stream_tokens = 0
        self._pending = None
        self._last_logits = None
        self._broken = None

    def _new_cache(self, store: _SlotStore) -> list[Any]:
        att = {layer: a for a, layer in enumerate(self._rt.attention_layers)}
        return [_SlotLayer(store, att[i]) if i in att else ArraysCache(size=2)
                for i in range(len(self._rt.model.model.layers))]

def load(model: str, device: str = "cpu", dtype: str = "float32", *, capacity: int = 4096,
         prefill_chunk: int = 512, position_limit: int | None = None, seed: int = 0,
         model_id: str | None = None) -> MlxBackend:
    """Load `model` (name or path, see backends.models) into a new MLX backend session.

    device: "cpu" (default), or "gpu" / "metal" / "cuda" where this MLX build has that backend.
    capacity: initial slots per attention layer (grows by doubling). prefill_chunk: tokens per
    forward during prefill. position_limit: positions at or above it trigger compaction (default:
    the model's max_position_embeddings). model_id: skip hashing the weights and use this identity.
    """
    source = resolve(model)
    rt = _make_runtime(source, device, dtype, model_id)
    return MlxBackend(rt, source.name, capacity=capacity, prefill_chunk=prefill_chunk,
                      position_limit=position_limit, seed=seed)


# Static conformance: mypy checks MlxBackend against the protocol here.
_conforms: type[Backend] = MlxBackend
