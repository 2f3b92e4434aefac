"""Torch tensors and host numpy arrays: the model dtypes by name, and copies in storage dtype.

bfloat16 has no numpy dtype, so its bits travel as uint16 (backends.protocol.STORAGE_DTYPES); these
are the only conversions between the two, so blocks, snapshots and the model identity see one
layout whatever the device.

Dependency rules: torch and numpy only.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

__all__ = ["DTYPES", "from_numpy", "to_numpy"]

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def to_numpy(t: torch.Tensor, *, copy: bool = True) -> np.ndarray:
    """Host numpy array of `t` in storage dtype (bfloat16 bits as uint16). With `copy` it shares no
    memory with `t` (a snapshot of live state must not change with it); `copy=False` lets a CPU
    tensor's memory be shared, for fresh temporaries and for reading right away."""
    t = t.detach()
    if t.device.type == "cpu" and copy:
        t = t.clone(memory_format=torch.contiguous_format)
    t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Tensor on `device` from a (possibly read-only) storage-dtype array, without an extra host copy."""
    if dtype == torch.bfloat16:
        a = a.view(np.int16)
    with warnings.catch_warnings():
        # Block arrays are read-only views into the file buffer; the tensor is only read from.
        warnings.filterwarnings("ignore", message=".*not writable.*")
        t = torch.from_numpy(a)
    if dtype == torch.bfloat16:
        t = t.view(torch.bfloat16)
    return t.to(device=device, dtype=dtype, non_blocking=False)
