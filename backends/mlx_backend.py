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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import ArraysCache

from .models import ModelSource, build_tiny_model, check_supported
from .protocol import (
    Backend,
    BackendError,
    BackendUnavailableError,
    BlockMismatchError,
    RecurrentSnapshot,
    UnsupportedModelError,
)
from .runtime import LoadedModel, SlotBackend, SlotStore, check_layer_split
from .slots import as_run, model_identity

__all__ = ["MlxBackend", "load"]

_DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_DTYPE_NAMES: dict[mx.Dtype, str] = {v: k for k, v in _DTYPES.items()}

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
    # The torch backend's recipe exactly: the same seeded float32 model, then cast.
    model = build_tiny_model(source, "sdpa").to(dtype=_torch_dtype(dtype))
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


@dataclasses.dataclass(kw_only=True)
class _Runtime(LoadedModel):
    """One loaded mlx-lm model, shared by a backend and its forks."""

    model: Module
    device: mx.Device
    dtype: mx.Dtype
    rope: Module
    array_offsets_exact: bool

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
    check_layer_split(family, len(layers), attention_layers, linear_layers, cfg.get("layer_types"))
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
    rt = _Runtime(
        source=source, model=model, family=family, device=dev, dtype=_DTYPES[dtype],
        attention_layers=attention_layers, linear_layers=linear_layers, num_kv_heads=kv_heads, head_dim=head_dim,
        value_head_dim=value_head_dim, rotary_dim=rotary_dim, rope=rope_mod, array_offsets_exact=exact_offsets,
        max_position_embeddings=int(cfg["max_position_embeddings"]), vocab_size=int(cfg["vocab_size"]),
        model_id=identity, dtype_name=dtype,
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


class _SlotStore(SlotStore):
    """Slot buffers of one session, one set per attention layer (see the module docstring)."""

    # One `mx.fast.rope` call per layer group of about four megabytes: per-call overhead made 30
    # per-layer calls ~5x slower than one call over all layers of a page.
    group_elements = 1 << 20
    rt: _Runtime

    def __init__(self, rt: _Runtime, capacity: int) -> None:
        L = len(rt.attention_layers)
        H = rt.num_kv_heads
        with mx.stream(rt.device):
            self.k_rot = [mx.zeros((1, H, 0, rt.head_dim), dtype=rt.dtype) for _ in range(L)]
            self.k_canon = [mx.zeros((1, H, 0, rt.rotary_dim), dtype=rt.dtype) for _ in range(L)]
            self.v = [mx.zeros((1, H, 0, rt.value_head_dim), dtype=rt.dtype) for _ in range(L)]
        # Set for the duration of one forward besides the slots: its first position and its mask.
        self.fwd_offset = 0
        self.fwd_mask: mx.array | None = None
        super().__init__(rt, capacity)

    def buffers(self) -> list[mx.array]:
        return [*self.k_rot, *self.k_canon, *self.v]

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
            mx.eval(self.buffers())
        self.fwd_offset, self.fwd_mask = 0, None

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
    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """k_rot[slots, :r] = rope(k_canon[slots], positions), for every attention layer."""
        if slots.shape[0] == 0:
            return
        H = self.rt.num_kv_heads
        for a0, a1 in self.layer_groups(int(slots.shape[0])):
            canon = mx.concatenate([_take(self.k_canon[a], slots) for a in range(a0, a1)], axis=1)
            rot = self.rt.rotate(canon, positions)  # [1, group * H, n, r]
            for a in range(a0, a1):
                j = (a - a0) * H
                self.k_rot[a] = _put(self.k_rot[a], slots, rot[:, j:j + H])
        self.pos[slots] = positions

    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rt = self.rt
        canon = mx.stack([_take(k, slots)[0] for k in self.k_canon])
        if rt.rotary_dim < rt.head_dim:
            passthrough = mx.stack([_take(k, slots)[0, :, :, rt.rotary_dim:] for k in self.k_rot])
            canon = mx.concatenate([canon, passthrough], axis=-1)
        return _to_numpy(canon), _to_numpy(mx.stack([_take(v, slots)[0] for v in self.v]))

    def rotated(self, slots: np.ndarray) -> np.ndarray:
        with mx.stream(self.rt.device):
            return np.array(mx.stack([_take(k, slots)[0] for k in self.k_rot]).astype(mx.float32))

    def write_keys(self, slots: np.ndarray, a0: int, a1: int, keys: np.ndarray, positions: np.ndarray | None) -> None:
        """Canonical keys [a1 - a0, H, n, D] of attention layers [a0, a1) into `slots` and, with
        `positions`, their rotation there (without, the keys are placed unrotated for a compaction
        to rotate). Evaluated before returning, so a streamed insert overlaps the next read."""
        r, d, H = self.rt.rotary_dim, self.rt.head_dim, self.rt.num_kv_heads
        n = int(slots.shape[0])
        k = _from_numpy(keys, self.rt.dtype).reshape(1, (a1 - a0) * H, n, d)
        canon = k if r == d else mx.contiguous(k[..., :r])
        rows = k
        if positions is not None:
            rot = self.rt.rotate(canon, positions)
            rows = mx.concatenate([rot, k[..., r:]], axis=-1) if r < d else rot
        for a in range(a0, a1):
            j = (a - a0) * H
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

class MlxBackend(SlotBackend):
    """`Backend` on mlx-lm. Construct with `load_backend("mlx", ...)`."""

    name = "mlx"
    _rt: _Runtime
    _store: _SlotStore
    _cache: list[Any]

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
        att = {layer: a for a, layer in enumerate(self._rt.attention_layers)}
        return [_SlotLayer(self._store, att[i]) if i in att else ArraysCache(size=2)
                for i in range(len(self._rt.model.model.layers))]

    def _forward(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, high_water: int) -> np.ndarray:
        st, rt = self._store, self._rt
        mask = st.occupied[None, :high_water] & (st.pos[None, :high_water] <= positions[:, None])
        st.fwd_slots, st.fwd_high_water, st.fwd_offset = slots, high_water, int(positions[0])
        try:
            with rt.lock, mx.stream(rt.device):
                st.fwd_mask = mx.array(mask)[None, None]
                rt.active = st
                try:
                    hidden = rt.model.model(mx.array([ids], dtype=mx.int32), cache=self._cache)
                    logits = rt.head(hidden[:, -1:, :])[0, -1].astype(mx.float32)
                finally:
                    rt.active = None
                mx.eval(logits, st.buffers(), [c.cache for c in self._linear_caches()])
        finally:
            st.fwd_slots, st.fwd_mask = None, None
        return np.array(logits)

    @contextlib.contextmanager
    def _page_op(self) -> Iterator[None]:
        """Page operations are synchronous: their buffer updates are evaluated before they return."""
        with self._rt.lock, mx.stream(self._rt.device), self._marked_page_op():
            yield
            mx.eval(self._store.buffers())

    def synchronize(self) -> None:
        mx.synchronize()

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

    def _read_recurrent(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        states: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
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
        return states, dtypes

    def _write_recurrent(self, snap: RecurrentSnapshot) -> None:
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
            conv = _from_numpy(snap.states[conv_key], _DTYPES[snap.dtypes[conv_key]])
            rec = _from_numpy(snap.states[rec_key], _DTYPES[snap.dtypes[rec_key]])
            updates[i] = (mx.contiguous(conv.transpose(0, 2, 1)[:, 1:, :]), mx.contiguous(rec.swapaxes(-1, -2)))
        for i, upd in updates.items():
            c = self._cache[i]
            assert isinstance(c, ArraysCache)
            c[0], c[1] = (None, None) if upd is None else upd
        mx.eval([c.cache for c in self._linear_caches()])

    def _copy_recurrent_to(self, other: SlotBackend) -> None:
        assert isinstance(other, MlxBackend)
        for i in self._rt.linear_layers:
            c = self._cache[i]
            assert isinstance(c, ArraysCache)
            other._cache[i] = _copy_arrays_cache(c)


load = MlxBackend.load

# Static conformance: mypy checks MlxBackend against the protocol here.
_conforms: type[Backend] = MlxBackend
