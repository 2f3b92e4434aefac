"""The torch runtime: Hugging Face transformers model code (CPU, CUDA) with a slot cache.

One concept per module, as backends/mlx/ keeps its own apart:

    host.py        torch tensors <-> host numpy arrays in storage dtype, the dtypes by name
    structure.py   each layer's role, from transformers' cache kinds and the decoder's modules; K/V shapes
    rotary.py      the model's rotary tables, and rotating canonical keys with them
    gguf.py        a GGUF unpacked once into a Hugging Face folder of float32 weights
    model.py       the loaded model shared by a session and its forks, and its hooks
    slot_store.py  the slot buffers (stacked over the paged layers) and window caches in torch tensors
    cache.py       the transformers `Cache` objects attention sees over the slot stores (a session, a batch)
    attention.py   the registered attention function: SDPA over the slot cache under the backend's masks
    loading.py     config, checks and weights through transformers' loader, into the loaded model
    backend.py     the session: masks, forward, batched decode, recurrent state, page operations

`load` (what `backends.load_backend("torch", ...)` calls), `TorchBackend`, `classify` and
`unpacked_gguf` are this package's public names.

The package is named after its runtime, as backends/mlx/ is; its modules import the library
absolutely (`import torch`), which never resolves to this package.

Dependency rules: torch, transformers, safetensors, numpy, xxhash; backends know nothing about
contextd or policy.
"""

from __future__ import annotations

from .backend import TorchBackend, load
from .gguf import unpacked_gguf
from .structure import classify

__all__ = ["TorchBackend", "classify", "load", "unpacked_gguf"]
