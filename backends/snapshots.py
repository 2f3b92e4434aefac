"""What a recurrent snapshot holds besides the runtime's recurrent states, and whether one fits.

A hybrid model's per-stream state is its recurrent layers' states (read and written by each
runtime in the Hugging Face layout) and its sliding-window caches, which are ours: the newest
W - 1 tokens' canonical keys and values per window layer. A snapshot carries both, so a cut or a
recovery puts back everything the pages do not hold; the window part is the same for both
runtimes and lives here, with the checks a snapshot must pass before anything of it is written
(its model, its dtypes, every window layer's shape and length), so a snapshot of another model
or layout is refused whole instead of half restored.

Dependency rules: numpy and backends.blocks / errors / loaded_model / slot_store only; never a
tensor library, never backends.runtime.
"""

from __future__ import annotations

import numpy as np

from .blocks import STORAGE_DTYPES, RecurrentSnapshot
from .errors import BlockMismatchError
from .loaded_model import LoadedModel
from .slot_store import SlotStore

__all__ = ["add_windows", "checked_windows"]


def add_windows(rt: LoadedModel, store: SlotStore, states: dict[str, np.ndarray], dtypes: dict[str, str]) -> None:
    """Add the window caches to a snapshot's `states` and `dtypes` ("window/<layer>/keys":
    canonical keys [1, heads, n, head_dim], and "window/<layer>/values"), if they hold any token."""
    if store.win_len:
        for layer, (keys, values) in zip(rt.roles.window, store.read_window(), strict=True):
            for kind, arr in (("keys", keys), ("values", values)):
                states[f"window/{layer}/{kind}"] = arr
                dtypes[f"window/{layer}/{kind}"] = rt.dtype_name


def checked_windows(rt: LoadedModel, snap: RecurrentSnapshot) -> list[tuple[np.ndarray, np.ndarray]] | None:
    """The snapshot's window caches (None for a model without window layers, or a snapshot of an
    empty stream), once the whole snapshot is checked against this model: its model id, its
    states' dtypes, and every window layer's shape, dtype and length (BlockMismatchError)."""
    if snap.model_id != rt.view.model_id:
        raise BlockMismatchError(
            f"recurrent snapshot belongs to model_id {snap.model_id}, this backend is {rt.view.model_id}")
    unknown = sorted({name for name in snap.dtypes.values()} - set(STORAGE_DTYPES))
    if unknown:
        raise BlockMismatchError(f"recurrent snapshot states have unsupported dtypes {unknown}")
    roles, shape = rt.roles, rt.window
    if not roles.window:
        return None
    present = [layer for layer in roles.window if f"window/{layer}/keys" in snap.states]
    if not present:
        if snap.stream_tokens:
            raise BlockMismatchError(f"recurrent snapshot of {snap.stream_tokens} tokens has no sliding-window "
                                     "state for this model's window layers")
        return None
    if present != list(roles.window):
        raise BlockMismatchError(f"recurrent snapshot has window state for layers {present}, this model's window "
                                 f"layers are {list(roles.window)}")
    assert shape is not None
    out: list[tuple[np.ndarray, np.ndarray]] = []
    lengths = set()
    for layer in roles.window:
        keys, values = snap.states[f"window/{layer}/keys"], snap.states[f"window/{layer}/values"]
        n = int(keys.shape[2]) if keys.ndim == 4 else -1
        lengths.add(n)
        want_k = (1, shape.num_kv_heads, n, shape.head_dim)
        want_v = (1, shape.num_kv_heads, n, shape.value_head_dim)
        dtypes = {snap.dtypes[f"window/{layer}/keys"], snap.dtypes[f"window/{layer}/values"]}
        if tuple(keys.shape) != want_k or tuple(values.shape) != want_v or dtypes != {rt.dtype_name}:
            raise BlockMismatchError(
                f"recurrent snapshot window layer {layer} has keys {tuple(keys.shape)} / values "
                f"{tuple(values.shape)} in {sorted(dtypes)}, this model needs {want_k} / {want_v} in "
                f"{rt.dtype_name}")
        out.append((keys, values))
    if len(lengths) != 1 or not 0 < lengths.pop() < roles.window_size:
        raise BlockMismatchError("recurrent snapshot window layers differ in length or exceed the window")
    return out
