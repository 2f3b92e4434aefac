"""One loaded transformers model, shared by a backend session and its forks, and its hooks.

`TorchModel` adds to the runtime-neutral `LoadedModel` what the loader found: the model, its
structure, device and dtype, and the rotary tables of its paged and window layers. `install_hooks`
makes the shared model slot-aware without touching its code: a forward hook on the module that
produces the pre-rotary key (`k_norm` where the attention has one, else `k_proj`; its output layout
is read off the first forward) hands the exact canonical key to the running session's store, and a
forward pre-hook on the embedding counts every token that enters the model. The hooks dispatch to
whichever session runs a forward (`TorchModel.active`).

Dependency rules: torch, transformers, backends.loaded_model and this package's structure module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from ..loaded_model import LoadedModel
from .structure import Classified

__all__ = ["TorchModel", "install_hooks"]


@dataclasses.dataclass(kw_only=True)
class TorchModel(LoadedModel):
    """One loaded transformers model, shared by a backend and its forks."""

    model: PreTrainedModel
    shape: Classified
    device: torch.device
    dtype: torch.dtype
    inv_freq: torch.Tensor
    attention_scaling: float
    win_inv_freq: torch.Tensor
    win_scaling: float


def install_hooks(rt: TorchModel) -> None:
    """Hooks on the shared model dispatch to whichever session is running a forward (`rt.active`)."""
    shape = rt.shape

    def key_hook(layer: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            if rt.active is not None:
                rt.active.observe_key(layer, out)
        return hook

    for layer, attn in shape.attention.items():
        getattr(attn, shape.key_modules[layer]).register_forward_hook(key_hook(layer))

    def count_tokens(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        rt.tokens_entered(int(args[0].numel()) if args and isinstance(args[0], torch.Tensor) else 0)

    rt.model.get_input_embeddings().register_forward_pre_hook(count_tokens)
