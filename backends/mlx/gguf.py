"""The GGUF path: a llama-architecture GGUF -> the Hugging Face form (the torch backend's weights)
-> mlx-lm's llama model.

The SmolLM2 GGUF (and other llama-architecture GGUF files) is read by `mx.load` and dequantised
exactly as transformers' GGUF loader does, so both runtimes run the same weights.

Dependency rules: mlx, mlx-lm, backends.errors / model_config / models and this package's host
and loading modules; transformers for the config and torch (meta device) for parameter names in
Hugging Face order.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.nn.layers.base import Module

from ..errors import UnsupportedModelError
from ..model_config import check_supported, read_config
from ..models import ModelSource, gguf_folder
from .host import DTYPES
from .loading import mlx_config

__all__ = ["load_gguf"]

# llama.cpp tensor names -> Hugging Face parameter names (per block "blk.N.").
_GGUF_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_GROUP_SIZE = 32  # every quantised type mx.load reads from GGUF (Q4_0, Q4_1, Q8_0) uses groups of 32


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


def load_gguf(source: ModelSource, dtype: str) -> tuple[Module, dict[str, Any], list[tuple[str, mx.array]]]:
    """The model of a llama-architecture GGUF file, dequantised with float32 scales (bit-identical to
    the gguf reference dequantiser transformers uses), in Hugging Face names and order."""
    from transformers import AutoConfig

    assert source.path is not None and source.gguf_file is not None
    path = Path(source.path) / source.gguf_file
    described = gguf_folder(source)
    config = AutoConfig.from_pretrained(str(described))
    cfg = read_config(described)
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
    target = DTYPES["float32" if dtype == "auto" else dtype]

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
