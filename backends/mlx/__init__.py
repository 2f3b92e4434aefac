"""The MLX runtime: mlx-lm model code (Apple silicon; Linux CPU through `mlx[cpu]`) with a slot cache.

One concept per module, as mlx-lm keeps its own apart:

    host.py        MLX arrays <-> host numpy arrays in storage dtype, the dtypes by name
    loading.py     a model folder through mlx-lm's loader (config entries and expert layouts it lacks)
    gguf.py        a llama-architecture GGUF, dequantised as transformers does, into mlx-lm's llama
    quantized.py   MLX-quantized copies ("tiny-llama-q4", "smollm2-135m-q4", `make_mlx_folder`)
    structure.py   each layer's role, from mlx-lm's cache list and the layers' modules; K/V shapes
    rotary.py      the model's rotary module, checked against the half-split layout, and re-anchoring
    model.py       the loaded model shared by a session and its forks, with its hooks installed
    slot_store.py  the slot buffers and window caches in mlx arrays
    cache.py       the cache objects mlx-lm's attention sees over the slot store
    backend.py     the session: forward, recurrent snapshots, greedy decoding one step ahead

`load` (what `backends.load_backend("mlx", ...)` calls), `quantized_copy`, `make_mlx_folder` and
`mlx_config` are this package's public names.

Dependency rules: mlx, mlx-lm, numpy, xxhash; transformers for configs and tokenizers; torch only
for the GGUF path (parameter names in Hugging Face order) and to build tiny folders. Backends know
nothing about contextd or policy.
"""

from __future__ import annotations

from .backend import MlxBackend, load
from .loading import mlx_config
from .quantized import make_mlx_folder, quantized_copy

__all__ = ["MlxBackend", "load", "make_mlx_folder", "mlx_config", "quantized_copy"]
