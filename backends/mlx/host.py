"""MLX arrays and host numpy arrays: the model dtypes by name, and copies in storage dtype.

bfloat16 has no numpy dtype, so its bits travel as uint16 (backends.blocks.STORAGE_DTYPES); these
are the only conversions between the two.

Dependency rules: mlx and numpy only.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

__all__ = ["DTYPES", "DTYPE_NAMES", "from_numpy", "to_numpy"]

DTYPES: dict[str, mx.Dtype] = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DTYPE_NAMES: dict[mx.Dtype, str] = {v: k for k, v in DTYPES.items()}


def to_numpy(a: mx.array) -> np.ndarray:
    """Host copy of `a` in storage dtype (bfloat16 bits as uint16), sharing no memory with MLX."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16))
    return np.array(a)


def from_numpy(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """MLX array of model dtype `dtype` from a storage-dtype numpy array (bf16 bits as uint16)."""
    if dtype == mx.bfloat16:
        return mx.array(np.ascontiguousarray(a).view(np.uint16)).view(mx.bfloat16)
    return mx.array(np.ascontiguousarray(a)).astype(dtype)
