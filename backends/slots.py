"""Pure functions of the slot cache: model identity, slot runs, token checks, sampling, insert plans.

Both runtimes keep attention K/V in preallocated slots with an explicit RoPE position per slot
and an `order` (the logical attention sequence as slot numbers). Everything here works on those
numpy arrays or on plain numbers, so it is tested without a model (tests/unit/test_slots.py).
Dependency rules: numpy and xxhash only.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

# Config keys that do not change what the model computes; left out of its identity.
IDENTITY_IGNORED_KEYS = frozenset({
    "_name_or_path", "transformers_version", "architectures", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "dtype", "torch_dtype", "quantization_config",
    "_commit_hash", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
})


def model_identity(config: dict[str, Any], params: Iterable[tuple[str, np.ndarray, str]]) -> str:
    """xxh3-128 over the computation-relevant config and every parameter's bytes, given in Hugging
    Face order and naming with torch's dtype names ("torch.float32"): a block saved by one backend
    names the same model as the other's."""
    h = xxhash.xxh3_128()
    cfg = {k: v for k, v in config.items() if k not in IDENTITY_IGNORED_KEYS}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for name, array, dtype_name in params:
        h.update(f"{name}:{tuple(int(d) for d in array.shape)}:{dtype_name}".encode())
        h.update(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files a loader reads from `folder`: the ones the index names, else model*.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / n for n in names]
    files = sorted(folder.glob("model*.safetensors"))
    return files or sorted(folder.glob("*.safetensors"))


def folder_identity(folder: Path, config: dict[str, Any]) -> str:
    """xxh3-128 over the computation-relevant config.json entries and every stored tensor (name,
    dtype, shape, bytes, in name order) as the folder's safetensors files hold them. Both runtimes
    hash the same files this way, whatever each then does to the weights (renames, fused experts,
    quantized layers), so a block names the same model in both. Read in chunks, not mapped: the
    weights' pages must not count as the process's memory."""
    h = xxhash.xxh3_128()
    cfg = {k: v for k, v in config.items() if k not in IDENTITY_IGNORED_KEYS}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    tensors: list[tuple[str, str, tuple[int, ...], Path, int, int]] = []
    for path in weight_files(folder):
        with open(path, "rb") as stream:
            (n,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            tensors.append((name, str(info["dtype"]), tuple(int(d) for d in info["shape"]), path, base + start,
                            base + end))
    chunk = 8 << 20
    handles: dict[Path, Any] = {}
    try:
        for name, dtype, shape, path, start, end in sorted(tensors):
            h.update(f"{name}:{shape}:{dtype}".encode())
            f: Any = handles.get(path)
            if f is None:
                f = handles[path] = open(path, "rb")  # noqa: SIM115 - closed below
            f.seek(start)
            left = end - start
            while left:
                data = f.read(min(chunk, left))
                if not data:
                    raise OSError(f"{path} ends inside tensor {name}")
                h.update(data)
                left -= len(data)
    finally:
        for f in handles.values():
            f.close()
    return h.hexdigest()


def as_run(slots: np.ndarray) -> tuple[int, int] | None:
    """(first, last + 1) when `slots` is a run of consecutive increasing slot numbers."""
    n = slots.shape[0]
    if n and int(slots[-1]) - int(slots[0]) + 1 == n and (n < 3 or bool(np.all(np.diff(slots) == 1))):
        return int(slots[0]), int(slots[-1]) + 1
    return None


def runs_of(slots: np.ndarray, most: int) -> list[tuple[int, int, int]] | None:
    """`slots` as runs of consecutive increasing slot numbers, each (first slot, one past its
    last, where it starts in `slots`), when there are at most `most` of them; else None.

    Why: a page put back into slots freed by several evictions lands in a few runs, and a run is
    written with slice copies and a rotation straight into place, faster than an index copy of the
    whole page (a SmolLM2 key group in two runs: docs/journal/2026-11-29-restore-path.md)."""
    n = slots.shape[0]
    if n == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    if breaks.shape[0] >= most:
        return None
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), n]
    return [(int(slots[a]), int(slots[b - 1]) + 1, a) for a, b in zip(starts, ends, strict=True)]


def pick_free_slots(free: np.ndarray, n: int, high_water: int) -> np.ndarray:
    """`n` of the `free` slots (ascending, at least `n`): the lowest run of `n` consecutive ones
    that ends no higher than the `n` lowest would reach, else the `n` lowest, so the preference
    never raises the high-water mark (`high_water`: one past the highest occupied slot; attention
    reads up to it).

    Why a run: it is written with slice copies and a rotation straight into place, scattered slots
    with slower index copies (32 SmolLM2 pages in one decision, benchmarks.restore:
    docs/journal/2026-11-29-restore-path.md, "Figures moved out of code comments")."""
    lowest = free[:n]
    if n > 1:
        reach = max(int(lowest[-1]), high_water - 1)
        starts = np.flatnonzero(free[n - 1:] - free[:free.shape[0] - n + 1] == n - 1)
        if starts.shape[0] and int(free[starts[0] + n - 1]) <= reach:
            return free[starts[0]:starts[0] + n].astype(np.int64)
    return lowest.astype(np.int64)


def checked_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """Out-of-range ids are refused before the model runs: inside it they would fail half-way
    (and on CUDA as a device assert that poisons the whole context)."""
    ids = [int(t) for t in token_ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token ids {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}")
    return ids


def pick_token(logits: np.ndarray, greedy: bool, temperature: float, top_k: int, top_p: float,
               rng: np.random.Generator) -> int:
    """Greedy, or temperature / top-k / top-p sampling in float64 from `rng`: the same logits and
    generator state give the same token on every backend."""
    if greedy or temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.shape[0]:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.shape[0], p=p))


@dataclasses.dataclass(frozen=True)
class InsertPlan:
    """Positions for a block insert: the block's own, and the later tokens' before and after."""

    block_pos: np.ndarray
    later: np.ndarray
    later_old: np.ndarray
    later_new: np.ndarray
    compact: bool  # positions would pass the model's limit: renumber everything densely instead


def plan_insert(pos: np.ndarray, order: np.ndarray, at: int, saved_positions: np.ndarray,
                position_limit: int) -> InsertPlan:
    """Where a block of len(saved_positions) tokens goes in position space, inserted before the
    `at`-th held token: its saved positions when they still fit before the next held token, else
    the positions after its left neighbour."""
    n = int(saved_positions.shape[0])
    prev = int(pos[order[at - 1]]) if at > 0 else -1
    later = order[at:]
    later_old = pos[later]
    saved = saved_positions.astype(np.int64)
    if int(saved[0]) > prev and (not later.shape[0] or int(saved[-1]) < int(later_old[0])):
        block_pos = saved.copy()
    else:
        block_pos = np.arange(prev + 1, prev + 1 + n, dtype=np.int64)
    # Later tokens move up only as far as needed: new[j] = max(old[j], new[j-1] + 1), so a gap
    # further right absorbs the shift and everything after it stays put.
    steps = np.arange(later.shape[0], dtype=np.int64)
    later_new = steps + np.maximum.accumulate(np.maximum(later_old - steps, int(block_pos[-1]) + 1))
    top = int(later_new[-1]) if later_new.shape[0] else int(block_pos[-1])
    return InsertPlan(block_pos, later, later_old, later_new, compact=top >= position_limit)


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """Where blocks inserted in one call end up, as if `plan_insert` had placed them one after
    another: `sources` is the new logical order (a held token's slot, or -1 - i for token i of
    the blocks taken in order), `positions` the position of each; `compactions` how many times
    the one-by-one inserts would have renumbered everything."""

    sources: np.ndarray
    positions: np.ndarray
    compactions: int


def plan_inserts(pos: np.ndarray, order: np.ndarray, inserts: Sequence[tuple[int, np.ndarray, bool]],
                 position_limit: int) -> BatchPlan:
    """The final layout of inserting blocks (`at` in the current held order, ascending; the block's
    wanted positions; whether it must keep them exactly) one by one, computed on positions alone.

    Why: inserted one at a time, each block re-anchors every later held token it pushes, so k
    pages restored into a dense timeline re-anchored the later tokens k times, and rotary
    arithmetic was most of the time (benchmarks.restore: docs/journal/2026-11-29-restore-path.md,
    "One decision, many pages" and "Figures moved out of code comments"). Planned on integers
    first, each key moves at most once. Raises ValueError for an exact block whose positions do
    not fit where it goes."""
    sources = order.astype(np.int64)
    positions = pos[order].astype(np.int64)
    inserted = compactions = 0
    previous_at = 0
    for at, wanted, exact in inserts:
        if at < previous_at:
            raise ValueError(f"inserts must come in ascending order of place (got {at} after {previous_at})")
        previous_at = at
        n = int(wanted.shape[0])
        here = at + inserted
        plan = plan_insert(positions, np.arange(positions.shape[0]), here, wanted, position_limit)
        if exact and (plan.compact or not np.array_equal(plan.block_pos, wanted)):
            raise ValueError(f"positions {int(wanted[0])}..{int(wanted[-1])} do not fit at {at} between the held "
                             "neighbours")
        sources = np.concatenate([sources[:here], -1 - np.arange(inserted, inserted + n, dtype=np.int64),
                                  sources[here:]])
        if plan.compact:
            positions = np.arange(sources.shape[0], dtype=np.int64)
            compactions += 1
        else:
            positions = np.concatenate([positions[:here], plan.block_pos, plan.later_new])
        inserted += n
    return BatchPlan(sources, positions, compactions)
