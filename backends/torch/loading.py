"""Loading a model with transformers: its config, the folder its weights come from, and the load.

`load_model` decides from the modules before any weight is read (`classify` on the model built on
the meta device), loads the weights with the slot attention (attention.py) as the model's attention
implementation, then reads the K/V shapes and rotary tables, hashes the identity and installs the
hooks. MLX-quantized copies are refused here (the mlx backend serves them); a GGUF loads from its
unpacked folder (gguf.py).

Dependency rules: torch, transformers, backends.loaded_model / models / protocol / slots and this
package's attention, gguf, host, model, rotary and structure modules.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..errors import BackendUnavailableError, UnsupportedModelError
from ..loaded_model import WindowShape
from ..model_config import check_supported, read_config
from ..models import ModelSource, SourceKind, gguf_folder
from ..slots import folder_identity, model_identity
from .attention import ATTENTION_IMPLEMENTATION
from .gguf import unpacked_gguf
from .host import DTYPES, to_numpy
from .model import TorchModel, install_hooks
from .rotary import rope_of
from .structure import classify, kv_shape

__all__ = ["load_model"]


def _config(source: ModelSource) -> tuple[Any, Path, dict[str, Any]]:
    """(transformers config, the folder its weights load from, the config dict the identity hashes)."""
    assert source.path is not None
    if source.kind is SourceKind.MLX_QUANT:
        raise UnsupportedModelError(f"{source.name} is an MLX-quantized copy (mlx_lm.convert): serve it with the mlx "
                                    "backend")
    raw = read_config(gguf_folder(source) if source.kind is SourceKind.GGUF else source.path)
    if isinstance(raw.get("quantization"), dict):
        raise UnsupportedModelError(f"{source.name}: MLX-quantized weights ({raw['quantization'].get('bits')}-bit, "
                                    "mlx_lm.convert): serve it with the mlx backend")
    check_supported(raw, source.name)
    folder = unpacked_gguf(source) if source.kind is SourceKind.GGUF else source.path
    return AutoConfig.from_pretrained(str(folder)), folder, raw


def load_model(source: ModelSource, device: str, dtype: str, model_id: str | None) -> TorchModel:
    """`source` on `device` in `dtype`, classified, its rotary tables read and its hooks installed;
    `model_id` skips hashing the weights. The backend's `_load_model`: once per `load`, forks share it."""
    if dtype not in DTYPES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("device 'cuda' was requested but torch.cuda.is_available() is False")
    if dev.type not in ("cpu", "cuda"):
        raise BackendUnavailableError(f"device {device!r} is not supported by the torch backend (cpu, cuda)")
    config, folder, raw = _config(source)
    # The modules decide, before any weight is read: built on the meta device, nothing is allocated.
    with torch.device("meta"):
        classify(AutoModelForCausalLM.from_config(config))  # type: ignore[no-untyped-call]
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=DTYPES[dtype],
                                                      attn_implementation=ATTENTION_IMPLEMENTATION)
    model = model.eval().to(dev)
    shape = classify(model)
    roles = shape.roles
    heads, head_dim, value_dim = kv_shape(shape.family, "global-attention", roles.paged, shape.attention)
    inv_freq, scaling = rope_of(shape.decoder, "full_attention", dev)
    window: WindowShape | None = None
    win_inv_freq, win_scaling = torch.zeros(0, dtype=torch.float32, device=dev), 1.0
    if roles.window:
        w_heads, w_dim, w_value = kv_shape(shape.family, "sliding-window", roles.window, shape.attention)
        win_inv_freq, win_scaling = rope_of(shape.decoder, "sliding_attention", dev)
        window = WindowShape(w_heads, w_dim, w_value, 2 * int(win_inv_freq.shape[0]))
    if model_id:
        identity = model_id
    elif source.kind is SourceKind.GGUF:
        identity = model_identity(raw, ((name, to_numpy(p, copy=False), str(p.dtype))
                                        for name, p in model.named_parameters()))
    else:
        assert source.path is not None
        identity = folder_identity(source.path, raw)
    rt = TorchModel(
        source=source, model=model, shape=shape, family=shape.family, roles=roles, device=dev, dtype=DTYPES[dtype],
        num_kv_heads=heads, head_dim=head_dim, value_head_dim=value_dim, rotary_dim=2 * int(inv_freq.shape[0]),
        inv_freq=inv_freq, attention_scaling=scaling, window=window, win_inv_freq=win_inv_freq,
        win_scaling=win_scaling, max_position_embeddings=int(config.get_text_config().max_position_embeddings),
        vocab_size=int(config.get_text_config().vocab_size), model_id=identity, dtype_name=dtype,
    )
    if rt.rotary_dim > head_dim or (window is not None and window.rotary_dim > window.head_dim):
        raise UnsupportedModelError(f"{shape.family}: rotary dims exceed the head dims")
    install_hooks(rt)
    return rt
