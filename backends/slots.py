"""Runtime-neutral pieces of the slot cache, shared by the torch and MLX backends.

Both backends keep attention K/V in preallocated slots with an explicit RoPE position per slot
and an `order` (the logical attention sequence as slot numbers). Everything here works on those
numpy arrays or on plain numbers, so the two backends compute positions, sampled tokens and the
model identity the same way by construction, not by copying. Depends on numpy, xxhash and
backends.base (Counters, BackendError); never on a runtime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import xxhash

from .base import BackendError, Counters

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


def as_run(slots: np.ndarray) -> tuple[int, int] | None:
    """(first, last + 1) when `slots` is a run of consecutive increasing slot numbers."""
    n = slots.shape[0]
    if n and int(slots[-1]) - int(slots[0]) + 1 == n and (n < 3 or bool(np.all(np.diff(slots) == 1))):
        return int(slots[0]), int(slots[-1]) + 1
    return None


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
    if later.shape[0] and int(saved[0]) > prev and int(saved[-1]) < int(later_old[0]):
        block_pos = saved.copy()
    else:
        block_pos = np.arange(prev + 1, prev + 1 + n, dtype=np.int64)
    # Later tokens move up only as far as needed: new[j] = max(old[j], new[j-1] + 1), so a gap
    # further right absorbs the shift and everything after it stays put.
    steps = np.arange(later.shape[0], dtype=np.int64)
    later_new = steps + np.maximum.accumulate(np.maximum(later_old - steps, int(block_pos[-1]) + 1))
    top = int(later_new[-1]) if later_new.shape[0] else int(block_pos[-1])
    return InsertPlan(block_pos, later, later_old, later_new, compact=top >= position_limit)


class SlotStoreState(Protocol):
    """What the bookkeeping below needs of a runtime's slot store (its buffers stay its own)."""

    capacity: int
    pos: np.ndarray       # int64 [capacity]: the RoPE position each slot's key holds
    tokens: np.ndarray    # int32 [capacity]: the token in each slot
    occupied: np.ndarray  # bool [capacity]
    order: np.ndarray     # the held tokens, in attention order, as slot numbers

    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None: ...


class SlotBookkeeping:
    """The backend methods that only read and move slot numbers and positions, the same for every
    runtime. A runtime supplies its store, counters and `_page_op` (how it runs a page operation:
    locks, device synchronisation); the tensors never pass through here."""

    _store: SlotStoreState
    _counters: Counters
    _stream_tokens: int
    _pending: int | None
    _last_logits: np.ndarray | None
    _broken: str | None
    position_limit: int

    def _page_op(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    @property
    def attention_tokens(self) -> int:
        return int(self._store.order.shape[0])

    @property
    def stream_tokens(self) -> int:
        return self._stream_tokens

    @property
    def pending_token(self) -> int | None:
        return self._pending

    @property
    def counters(self) -> dict[str, int]:
        return self._counters.as_dict()

    @property
    def capacity(self) -> int:
        return self._store.capacity

    def positions(self) -> np.ndarray:
        held: np.ndarray = self._store.pos[self._store.order].copy()
        return held

    def held_token_ids(self) -> np.ndarray:
        held: np.ndarray = self._store.tokens[self._store.order].copy()
        return held

    def last_logits(self) -> np.ndarray:
        if self._last_logits is None:
            raise BackendError("no logits yet: prefill first")
        return self._last_logits.copy()

    def remove_attention_range(self, start: int, end: int) -> None:
        self._check_range(start, end, nonempty=True)
        st = self._store
        with self._page_op():
            # Only flags change: the freed slots keep stale data that the mask hides, no buffer
            # moves, and later tokens keep their positions (the gap is compacted lazily).
            st.occupied[st.order[start:end]] = False
            st.order = np.concatenate([st.order[:start], st.order[end:]])
            self._counters.evicted_tokens += end - start

    def compact_positions(self) -> int:
        with self._page_op():
            return self._compact()

    def _next_positions(self, n: int) -> np.ndarray:
        st = self._store
        last = int(st.pos[st.order[-1]]) if st.order.shape[0] else -1
        if last + n >= self.position_limit and last + 1 > st.order.shape[0]:
            self.compact_positions()
            last = int(st.order.shape[0]) - 1
        return np.arange(last + 1, last + 1 + n, dtype=np.int64)

    def _plan_insert(self, at: int, saved_positions: np.ndarray) -> InsertPlan:
        return plan_insert(self._store.pos, self._store.order, at, saved_positions, self.position_limit)

    def _commit_insert(self, at: int, plan: InsertPlan, slots: np.ndarray, token_ids: np.ndarray) -> None:
        st = self._store
        n = int(slots.shape[0])
        st.occupied[slots] = True
        st.tokens[slots] = token_ids
        st.order = np.concatenate([st.order[:at], slots, plan.later])
        self._counters.restored_tokens += n
        if plan.compact:
            # Positions would leave the allowed range: renumber everything densely instead. The
            # sentinel marks the block's keys as changed so compaction rotates them too.
            st.pos[slots] = -1
            self._compact()
        else:
            st.pos[slots] = plan.block_pos
            moved = plan.later_new != plan.later_old
            st.reanchor(plan.later[moved], plan.later_new[moved])
            self._counters.reanchored_keys += n + int(moved.sum())

    def _compact(self) -> int:
        st = self._store
        dense = np.arange(st.order.shape[0], dtype=np.int64)
        changed = st.pos[st.order] != dense
        count = int(changed.sum())
        if count:
            st.reanchor(st.order[changed], dense[changed])
            self._counters.reanchored_keys += count
            self._counters.compactions += 1
        return count

    def _check_insert_at(self, at: int) -> None:
        if not 0 <= at <= self.attention_tokens:
            raise IndexError(f"insert position {at} is outside 0..{self.attention_tokens}")

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise BackendError(f"session state is undefined: {self._broken}; reset() the session")

    def _check_range(self, start: int, end: int, nonempty: bool = False) -> None:
        n = self.attention_tokens
        if not (0 <= start <= end <= n) or (nonempty and start == end):
            raise IndexError(f"range [{start}, {end}) is not a {'non-empty ' if nonempty else ''}range of 0..{n}")
