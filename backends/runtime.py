"""What the torch and MLX runtimes share: everything of a backend session that is not tensor work.

A runtime supplies a loaded model (`backends.loaded_model.LoadedModel` plus its own fields, with
the `LayerRoles` it found in its model), a slot store (`backends.slot_store.SlotStore`: buffers,
gathers, writes and re-anchoring in its tensor library, and the window caches of sliding-window
layers) and the hooks `SlotBackend` declares abstract (one forward pass, the cache object its
model code sees, the recurrent states, ...): a runtime missing one cannot be instantiated. This
base turns them into the `Backend` protocol: identity, the prefill / decode loop, sampling, slot
bookkeeping for evict / insert / compaction, the streaming, verified insert of a stored block, the
window caches' positions, recurrent snapshots (windows included), fork and reset. The two runtimes
therefore count, position and check the same way by construction, not by copying.

Sliding-window layers are never paged. Each keeps the newest W - 1 tokens the model consumed (W
the window), as canonical keys, rotated keys and values; a forward appends its tokens and attends
to those plus its own, within W of each other in the stream. Page operations never touch a
window: the window always holds the last tokens of the stream, whatever attention holds. Its keys
sit at the positions just before the next forward's first position (the stream distances the
model was trained on); a compaction or an insert that moves that position re-rotates them from
their canonical form before the next forward.

Dependency rules: numpy and backends.protocol / slots / models / loaded_model / slot_store; never a
tensor library.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar

import numpy as np

from . import blockfile
from .loaded_model import LayerRoles, LoadedModel
from .models import ModelSource, SourceKind, load_tokenizer, resolve
from .protocol import (
    STORAGE_DTYPES,
    BackendError,
    Block,
    BlockFormatError,
    BlockMismatchError,
    BlockStream,
    Counters,
    DecodeStep,
    LayerView,
    RecurrentSnapshot,
    StoredBlock,
    Tokenizer,
    UnsupportedModelError,
)
from .slot_store import Landing, Redo, SlotStore, Watch
from .slots import BatchPlan, checked_token_ids, pick_token, plan_inserts

__all__ = ["SlotBackend", "keep_torch_out"]


def keep_torch_out(model: str) -> bool:
    """For a process that will run `model` on MLX and nothing on torch: when `model` is a folder
    (Hugging Face or mlx-lm) and neither torch nor transformers is imported yet, mark torch as not
    importable, so transformers (imported for configs and tokenizers, and by mlx-lm) leaves it
    alone; it would import it merely because it is installed (transformers 5 has no switch for
    this: `USE_TORCH` is gone). A served chat turn on the 4-bit SmolLM2 folder then peaks at 591 MB
    instead of 830 MB (of which ~300 MB is the float32 slot cache of the default 4,096-token
    budget). Not for GGUF files or MLX copies of the built-in models: reading a GGUF and making an
    MLX copy need torch. Returns whether torch was kept out."""
    if resolve(model).kind is not SourceKind.HF_DIR or "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError; find_spec is None
    return True


B = TypeVar("B", bound="SlotBackend")


# The read buffers one `insert_block_files` batch holds at once: 32 SmolLM2 float32 pages (5.9 MB
# each) go in one batch; a long plan for a big model goes in several, each still read in parallel.
INSERT_BATCH_BYTES = 256 << 20
# Threads that read one insert's files, in the order they go in (blockfile.ReadQueue). One kept
# ahead of the copies on this disk and beat two (16 cold SmolLM2 pages, interleaved runs: 69.7 ms
# with one, 72.9 ms with two, 86.7 ms with a thread per file all reading at once).
READ_THREADS = 1
# How long a backend's read thread waits for the next insert before it ends: long enough to span
# an agent's turns, so a turn's restores start no thread (blockfile.ReadQueue).
READ_LINGER_S = 30.0


def _batches(files: Sequence[StoredBlock]) -> Iterator[list[int]]:
    """Indices of `files` in consecutive runs of at most INSERT_BATCH_BYTES (at least one file)."""
    run: list[int] = []
    total = 0
    for i, f in enumerate(files):
        if run and total + f.size > INSERT_BATCH_BYTES:
            yield run
            run, total = [], 0
        run.append(i)
        total += f.size
    if run:
        yield run


class _Rows(Protocol):
    """Where a block's layers come from while it is placed: a stored file being read
    (`BlockStream`) or a block already in memory (`_HeldBlock`)."""

    def keys_land(self) -> bool: ...

    def land(self, keys: list[memoryview] | None, values: list[memoryview] | None) -> tuple[bool, bool]: ...

    def rows(self, section: str, start: int, stop: int) -> np.ndarray: ...

    def arrived(self, section: str, rows: int) -> None: ...

    def small(self, section: str) -> np.ndarray: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class _HeldBlock:
    """A block in memory, read the way a stored file is. It never lands: its arrays are copied
    into the slots once either way."""

    def __init__(self, block: Block) -> None:
        self.block = block

    def keys_land(self) -> bool:
        return False

    def land(self, keys: list[memoryview] | None, values: list[memoryview] | None) -> tuple[bool, bool]:
        return False, False

    def rows(self, section: str, start: int, stop: int) -> np.ndarray:
        return self.block.keys[start:stop] if section == "keys" else self.block.values[start:stop]

    def arrived(self, section: str, rows: int) -> None:
        pass

    def small(self, section: str) -> np.ndarray:
        return self.block.positions if section == "positions" else self.block.token_ids

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class _Incoming:
    """One block to place: before the held token `at`, at `wanted` positions (exactly, or where
    they fit), its layers from `source`."""

    at: int
    wanted: np.ndarray
    exact: bool
    source: _Rows


def _wanted_positions(saved: np.ndarray, position: int | None) -> np.ndarray:
    """The block's own saved positions, or the run starting at `position`."""
    if position is None:
        return saved
    return np.arange(position, position + int(saved.shape[0]), dtype=np.int64)


class SlotBackend(abc.ABC):
    """The `Backend` protocol over a runtime's slot store. Subclasses implement the abstract hooks below."""

    name: str
    _rt: LoadedModel
    _store: SlotStore

    def __init__(self, rt: LoadedModel, model_name: str, *, capacity: int = 4096, prefill_chunk: int = 512,
                 position_limit: int | None = None, seed: int = 0) -> None:
        self._rt = rt
        self.model_name = model_name
        self.device = self._device_name()
        self.prefill_chunk = int(prefill_chunk)
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        # Compaction runs when a token would get a position >= position_limit.
        self.position_limit = int(position_limit or rt.max_position_embeddings)
        self._counters = Counters()
        self._rng = np.random.default_rng(seed)
        self._store = self._new_store(max(1, int(capacity)))
        self._cache = self._new_cache()
        self._stream_tokens = 0
        self._pending: int | None = None
        self._last_logits: np.ndarray | None = None
        self._broken: str | None = None
        self._scoring: SlotBackend | None = None  # see _scoring_session
        self._watch: Watch | None = None           # see observe_attention
        # The last watched prefill's weights per held token; every forward that lands after it, a
        # page operation and a reset drop them.
        self._weights: np.ndarray | None = None
        self._reads = blockfile.ReadQueue(READ_THREADS, READ_LINGER_S)

    @classmethod
    def load(cls: type[B], model: str, device: str = "cpu", dtype: str = "float32", *, capacity: int = 4096,
             prefill_chunk: int = 512, position_limit: int | None = None, seed: int = 0,
             model_id: str | None = None) -> B:
        """Load `model` (name or path, see backends.models) into a new session.

        capacity: initial slots per attention layer (grows by doubling). prefill_chunk: tokens per
        forward during prefill. position_limit: positions at or above it trigger compaction
        (default: the model's max_position_embeddings). model_id: skip hashing the weights and use
        this identity.
        """
        source = resolve(model)
        rt = cls._load_model(source, device, dtype, model_id)
        cls(rt, source.name, capacity=16, position_limit=position_limit)._check_rotation()
        return cls(rt, source.name, capacity=capacity, prefill_chunk=prefill_chunk, position_limit=position_limit,
                   seed=seed)

    def _check_rotation(self) -> None:
        """At load, on a throwaway session: one short forward far from position 0. The keys the model
        rotated itself must equal our re-anchoring of the canonical keys it computed, in the paged
        and in the window layers; a layout, frequency or scaling we do not reproduce is refused here
        instead of drifting later. The forward's length differs from every head count, so it also
        fixes the layout of each key module's output."""
        rt = self._rt
        heads = {rt.num_kv_heads} | ({rt.window.num_kv_heads} if rt.window else set())
        n = next(k for k in range(5, 64) if k not in heads)
        first = max(0, min(1000, self.position_limit - 2 * n))
        positions = np.arange(first, first + n, dtype=np.int64)
        self._run_model([(7 + 131 * i) % rt.vocab_size for i in range(n)], positions)
        st = self._store
        slots = st.order.copy()
        checks: list[tuple[str, np.ndarray, Callable[[], None], Callable[[], np.ndarray]]] = [
            ("paged", st.rotated(slots), lambda: st.reanchor(slots, positions), lambda: st.rotated(slots))]
        if rt.roles.window:
            checks.append(("window", np.stack(st.rotated_window()),
                           lambda: st.reanchor_window(st.window_positions(first + n)),
                           lambda: np.stack(st.rotated_window())))
        for what, model_keys, reanchor, ours in checks:
            with self._page_op():
                reanchor()
            err = float(np.abs(ours() - model_keys).max())
            if not err <= 1e-5 * max(1.0, float(np.abs(model_keys).max())):
                raise UnsupportedModelError(
                    f"{rt.family}: the model's rotary embedding of its {what} layers differs from re-anchoring "
                    f"(half-split layout, the rotary module's frequencies and scaling) by {err:.3g}; an adapter for "
                    "its rotary layout is missing")

    # -- hooks a runtime implements ------------------------------------------------------------
    @staticmethod
    @abc.abstractmethod
    def _load_model(source: ModelSource, device: str, dtype: str, model_id: str | None) -> LoadedModel:
        """The loaded model for `source`."""

    @abc.abstractmethod
    def _device_name(self) -> str:
        """The device string the protocol reports."""

    @abc.abstractmethod
    def _new_store(self, capacity: int) -> SlotStore:
        """A fresh slot store of the runtime's tensors with `capacity` slots."""

    @abc.abstractmethod
    def _new_cache(self) -> Any:
        """The cache object the model code sees, over this session's store (recurrent layers empty)."""

    @abc.abstractmethod
    def _forward(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, high_water: int,
                 every: bool = False, logits: bool = True) -> np.ndarray | None:
        """Run the model over `ids` (already placed in `slots` at `positions`); float32 last logits,
        or with `every` the logits after each token, [len(ids), vocab]; None without `logits` (a
        chunk of `extend`: MLX then never evaluates the last layer past its keys and values)."""

    @abc.abstractmethod
    def _page_op(self) -> contextlib.AbstractContextManager[None]:
        """How the runtime runs a page operation (locks, device streams; synchronous on return),
        around `_marked_page_op`."""

    @abc.abstractmethod
    def _read_recurrent(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        """Host copies of the recurrent states in the Hugging Face layout, and their dtype names."""

    @abc.abstractmethod
    def _write_recurrent(self, snap: RecurrentSnapshot) -> None:
        """Overwrite the recurrent states from `snap` (validated first: nothing half-written)."""

    @abc.abstractmethod
    def _copy_recurrent_to(self, other: SlotBackend) -> None:
        """Give a fork's fresh cache copies of this session's recurrent states."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Wait until queued device work is done."""

    @abc.abstractmethod
    def _settle(self) -> None:
        """Called before anything but a decode reads or changes the session (a prefill, a page
        operation, a fork, a reset, diagnostics): a runtime that keeps work in flight between
        decodes finishes or undoes it here (MLX: the greedy step dispatched ahead)."""

    # -- identity ------------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self._rt.view.model_id

    @property
    def layer_view(self) -> LayerView:
        return self._rt.view

    @property
    def tokenizer(self) -> Tokenizer:
        with self._rt.lock:
            if self._rt.tokenizer is None:
                self._rt.tokenizer = load_tokenizer(self._rt.source)
            return self._rt.tokenizer

    @property
    def vocab_size(self) -> int:
        return self._rt.vocab_size

    @property
    def layer_roles(self) -> LayerRoles:
        """What each decoder layer is to paging (not part of the protocol; for diagnostics and tests)."""
        return self._rt.roles

    @property
    def is_hybrid(self) -> bool:
        """The model keeps per-stream state outside the paged layers (recurrent layers, sliding-window
        caches): `snapshot_recurrent` covers it, and a cut must restore it."""
        return bool(self._rt.roles.recurrent or self._rt.roles.window)

    # -- state ---------------------------------------------------------------------------------
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
    def counters(self) -> Counters:
        """A copy of the session's forward-token accounting."""
        return self._counters.copy()

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
            raise BackendError("no logits: nothing was prefilled since the last reset or extend")
        return self._last_logits.copy()

    def rotated_keys(self, start: int = 0, end: int | None = None) -> np.ndarray:
        end = self.attention_tokens if end is None else end
        self._check_range(start, end)
        with self._rt.lock:
            return self._store.rotated(self._store.order[start:end])

    def window_state(self) -> tuple[np.ndarray | None, list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
        """Diagnostics (not part of the protocol): the positions the window keys are rotated at now
        (None before the first forward after a snapshot restore), per window layer the rotated keys
        (float32 [1, heads, n, head_dim]) and the canonical keys and values (storage dtype)."""
        self._settle()
        st = self._store
        with self._rt.lock:
            if not st.win_len:
                return np.zeros(0, dtype=np.int64), [], []
            if st.win_last_pos is None:
                return None, [], st.read_window()
            return st.window_positions(st.win_last_pos + 1), st.rotated_window(), st.read_window()

    # -- running the model ---------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        self._prefill_chunks(token_ids, every=False, logits=True)
        return self.last_logits()

    def extend(self, token_ids: Sequence[int]) -> None:
        self._prefill_chunks(token_ids, every=False, logits=False)

    def prefill_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        return np.concatenate(self._prefill_chunks(token_ids, every=True, logits=True))

    def _prefill_chunks(self, token_ids: Sequence[int], every: bool, logits: bool) -> list[np.ndarray]:
        """Append `token_ids` chunk by chunk; with `every`, each chunk's logits after every token;
        else, with `logits`, the last chunk's last logits (the chunks before it have none)."""
        ids = checked_token_ids(token_ids, self._rt.vocab_size)
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._settle()
        self._pending = None
        out = []
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            last = i + self.prefill_chunk >= len(ids)
            self._store.watch = self._watch if last else None
            if self._store.watch is not None:
                self._store.take_watched()   # what a forward that failed may have left
            try:
                got = self._run_model(chunk, every=every, logits=every or (logits and last))
            finally:
                self._store.watch = None
            if got is not None:
                out.append(got)
            self._counters.new_prefill_tokens += len(chunk)
        if self._watch is not None:
            per_slot = self._store.take_watched()
            if per_slot is not None:
                self._weights = per_slot[self._store.order]
        return out

    # -- the model's own attention, read off the forward a prefill makes anyway -----------------
    def observe_attention(self, queries: int, layers: Sequence[int]) -> None:
        if queries < 0:
            raise ValueError(f"queries must be >= 0, got {queries}")
        paged = len(self._rt.roles.paged)
        outside = sorted({int(a) for a in layers if not 0 <= int(a) < paged})
        if outside:
            raise ValueError(f"paged layers {outside} do not exist: this model pages {paged} layers")
        if queries and layers and not paged:
            raise UnsupportedModelError(f"{self.model_name} has no paged attention layer to observe")
        self._watch = Watch(queries, frozenset(int(a) for a in layers)) if queries and layers else None
        self._weights = None

    def attention_weights(self) -> np.ndarray | None:
        return None if self._weights is None else self._weights.copy()

    def score_after_blocks(self, blocks: Sequence[Block], token_ids: Sequence[int],
                           sink: Block | None = None) -> tuple[np.ndarray, int]:
        """Every block with its own copy of `token_ids` right after it, in one scratch session that
        shares the weights: copy i runs at positions lead + i*n .. (n tokens, `lead` the longest
        block plus the sink) and block i is re-anchored to the positions just before it, with its
        own copy of `sink` just before the block, so every copy sees its block at the distances a
        restore would give; the slot groups keep each copy's attention to its sink, its own block
        and its own earlier tokens. One forward: on this 2-core CPU a SmolLM2 forward costs ~110 ms
        whatever it holds, plus ~2 ms a token, so k copies in one forward cost about a k-th of k
        forwards."""
        rt = self._rt
        if rt.roles.window or rt.roles.recurrent:
            raise UnsupportedModelError(f"{rt.family}: scoring over separate blocks needs every layer to be full "
                                        "attention; this model has sliding-window or recurrent layers")
        ids = checked_token_ids(token_ids, rt.vocab_size)
        if len(ids) < 2 or not blocks:
            raise ValueError("scoring needs at least one block and at least two tokens")
        for blk in [*blocks] if sink is None else [sink, *blocks]:
            rt.view.require_same(blk.view)
        n, k = len(ids), len(blocks)
        s = 0 if sink is None else sink.n_tokens
        lead = max(blk.n_tokens for blk in blocks) + s
        scratch = self._scoring_session(sum(blk.n_tokens for blk in blocks) + k * (s + n), lead + k * n)
        st = scratch._store
        held: list[np.ndarray] = []
        with scratch._page_op():
            for i, blk in enumerate(blocks):
                end = lead + i * n
                parts = [(blk, end)] if sink is None else [(sink, end - blk.n_tokens), (blk, end)]
                mine: list[np.ndarray] = []
                for part, stop in parts:
                    positions = np.arange(stop - part.n_tokens, stop, dtype=np.int64)
                    mine.append(scratch._hold(part.token_ids, positions))
                    for a0, a1 in st.layer_groups(part.n_tokens):
                        st.write_keys(mine[-1], a0, a1, part.keys[a0:a1], positions)
                        st.write_values(mine[-1], a0, a1, part.values[a0:a1])
                held.append(np.concatenate(mine))
        positions = np.arange(lead, lead + k * n, dtype=np.int64)
        slots = scratch._hold(np.asarray(ids * k, dtype=np.int32), positions)
        groups = np.full(st.capacity, -1, dtype=np.int64)
        for i, block_slots in enumerate(held):
            groups[block_slots] = i
        groups[slots] = np.repeat(np.arange(k), n)
        st.groups = groups
        try:
            logits = scratch._forward(ids * k, positions, slots, st.high_water(), every=True)
        finally:
            st.groups = None
            scratch.reset()
        assert logits is not None
        z = logits.reshape(k, n, -1)[:, :-1]
        top = z.max(axis=-1, keepdims=True)
        picked = np.take_along_axis(z, np.asarray(ids[1:], dtype=np.int64)[None, :, None], axis=-1)[..., 0]
        shifted = np.subtract(z, top)
        total = np.exp(shifted, out=shifted).sum(axis=-1).astype(np.float64)
        return (picked - top[..., 0]).astype(np.float64) - np.log(total), k * n

    def prefill_alone(self, token_ids: Sequence[int]) -> Block:
        """The K/V `token_ids` get prefilled on their own from position 0, as a block: what a
        separate controller model reads a page's text into once and scores it over from then on
        (serving.scoring). Runs in the scratch session `score_after_blocks` uses, emptied after."""
        ids = checked_token_ids(token_ids, self._rt.vocab_size)
        if not ids:
            raise ValueError("prefill_alone needs at least one token")
        scratch = self._scoring_session(len(ids), len(ids))
        try:
            scratch.prefill(ids)
            return scratch.save_block(0, len(ids))
        finally:
            scratch.reset()

    def _scoring_session(self, tokens: int, position_limit: int) -> SlotBackend:
        """The empty scratch session `score_after_blocks` and `prefill_alone` run in, kept between calls: building one
        zero-fills its buffers, ~50 ms of a ~450 ms SmolLM2 re-rank of 4 pages (cProfile over the
        rerank selector's probes). It shares the weights and nothing else with this session."""
        scratch = self._scoring
        if scratch is None:
            scratch = self._scoring = type(self)(self._rt, self.model_name, capacity=tokens,
                                                 position_limit=position_limit)
        scratch.position_limit = max(scratch.position_limit, position_limit)
        return scratch

    def _hold(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Free slots entered in the table as holding `token_ids` at `positions`, last in the order."""
        st = self._store
        slots = st.allocate(int(positions.shape[0]))
        st.pos[slots] = positions
        st.occupied[slots] = True
        st.tokens[slots] = token_ids
        st.order = np.concatenate([st.order, slots])
        return slots

    def decode(self, token: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> int:
        feed = token if token is not None else self._pending
        if feed is not None:
            feed = checked_token_ids([feed], self._rt.vocab_size)[0]
        elif self._last_logits is None:
            raise BackendError("decode needs a prefill (or an explicit token) first")
        greedy = greedy or temperature <= 0.0
        logits = self._decode_step(feed, greedy)
        if feed is not None:
            self._counters.decoded_tokens += 1
        return self._pick(logits, greedy, temperature, top_k, top_p, seed)

    def _pick(self, logits: np.ndarray, greedy: bool, temperature: float, top_k: int, top_p: float,
              seed: int | None) -> int:
        """The next token from `logits` by this session's sampler (reseeded by `seed`); it becomes pending."""
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        nxt = pick_token(logits, greedy, temperature, top_k, top_p, self._rng)
        self._pending = nxt
        return nxt

    def decode_batch(self, steps: Sequence[DecodeStep]) -> list[int]:
        rows: list[SlotBackend] = []
        for step in steps:
            b = step.backend
            if not isinstance(b, SlotBackend) or b._rt is not self._rt:
                raise BackendError("decode_batch takes the sessions of this backend and its forks only")
            if any(b is r for r in rows):
                raise BackendError("decode_batch takes one step per session")
            rows.append(b)
        # every token is checked before any session moves
        feeds = checked_token_ids([s.token for s in steps if s.token is not None], self._rt.vocab_size)
        if len(rows) < 2 or not self.batches_decode or len(feeds) < len(steps):
            return [s.backend.decode(s.token, greedy=s.greedy, temperature=s.temperature, top_k=s.top_k,
                                     top_p=s.top_p, seed=s.seed) for s in steps]
        for b in rows:
            b._check_usable()
        placed = [b._place([feed], None) for b, feed in zip(rows, feeds, strict=True)]
        started = time.perf_counter_ns()
        try:
            logits = self._forward_rows([(b, feed, slots, positions, b._store.high_water())
                                         for b, feed, (slots, positions) in zip(rows, feeds, placed, strict=True)])
        except BaseException as e:
            for b in rows:
                b._forward_failed(e)
            raise
        picked = []
        for i, (b, step, (_, positions)) in enumerate(zip(rows, steps, placed, strict=True)):
            b._advance(positions)
            b._landed(logits[i], started, b._store.take_entered())
            b._counters.decoded_tokens += 1
            greedy = step.greedy or step.temperature <= 0.0
            picked.append(b._pick(logits[i], greedy, step.temperature, step.top_k, step.top_p, step.seed))
        return picked

    @property
    def batches_decode(self) -> bool:
        return False

    def _forward_rows(self, rows: Sequence[tuple[SlotBackend, int, np.ndarray, np.ndarray, int]]) -> np.ndarray:
        """One forward of one token in each of several sessions (backend, token, slot, position,
        high-water slot, each placed by its backend's `_place`): their last logits, [rows, vocab]."""
        raise NotImplementedError

    def _decode_step(self, feed: int | None, greedy: bool) -> np.ndarray:
        """One decode step: feed `feed` (None: nothing, right after a prefill) and return the logits
        the next token is picked from. A runtime may pipeline greedy steps (MlxBackend)."""
        if feed is not None:
            self._run_model([feed])
        assert self._last_logits is not None
        return self._last_logits

    def _run_model(self, ids: list[int], positions: np.ndarray | None = None, every: bool = False,
                   logits: bool = True) -> np.ndarray | None:
        """The one place that runs the model synchronously: allocate slots, place the tokens,
        forward; returns the logits (`_forward`'s). `positions` (consecutive, past every held one)
        only for the load-time rotation check."""
        slots, positions = self._place(ids, positions)
        started = time.perf_counter_ns()
        try:
            out = self._forward(ids, positions, slots, self._store.high_water(), every, logits)
        except BaseException as e:
            self._forward_failed(e)
            raise
        self._advance(positions)
        self._landed(None if out is None else out[-1] if every else out, started, self._store.take_entered())
        return out

    def _place(self, ids: list[int], positions: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Slots and positions for `ids` about to enter the model, entered in the slot table."""
        self._check_usable()
        st = self._store
        n = len(ids)
        if positions is None:
            positions = self._next_positions(n)
        first = int(positions[0])
        if self._window_moved(first):
            # A compaction, an insert or a restored snapshot moved the stream's head: the window keys
            # go right before the new tokens again, rotated from their canonical form.
            with self._page_op():
                st.reanchor_window(st.window_positions(first))
            st.win_last_pos = first - 1
        return self._hold(np.asarray(ids, dtype=np.int32), positions), positions

    def _placing_pages(self, n: int) -> bool:
        """Whether placing `n` new tokens runs a page operation first (a compaction, or the window
        keys moving to the new head): what a step dispatched ahead of its token must not do."""
        return self._compaction_due(n) or self._window_moved(int(self._next_positions(n)[0]))

    def _window_moved(self, first: int) -> bool:
        st = self._store
        return bool(st.win_len) and st.win_last_pos != first - 1

    def _forward_failed(self, e: BaseException) -> None:
        # Linear-attention layers before the failure may already have advanced their state, so
        # the session no longer describes any prefix of the stream. Tokens that entered count.
        self._counters.model_forward_tokens += self._store.take_entered()
        self._broken = f"a forward pass failed ({type(e).__name__}: {e})"

    def _advance(self, positions: np.ndarray) -> None:
        """The stream after a forward over `positions` (placed by `_place`)."""
        n = int(positions.shape[0])
        self._stream_tokens += n
        if self._rt.roles.window:
            st = self._store
            st.win_len = min(self._rt.roles.window_size - 1, st.win_len + n)
            st.win_last_pos = int(positions[-1])

    def _landed(self, last_logits: np.ndarray | None, started: int, entered: int) -> None:
        """A forward started at `started` (perf_counter_ns) has ended: the `entered` tokens its
        embedding saw are counted, its time too, and its last logits (None after `extend`) are
        what the next pick reads."""
        self._counters.model_forward_tokens += entered
        self._counters.forward_ns += time.perf_counter_ns() - started
        self._last_logits = last_logits
        self._weights = None   # they described the view before this forward (a recompute's too)

    # -- recomputing held tokens in place (the blend) ------------------------------------------
    def recompute(self, indices: Sequence[int] | np.ndarray) -> int:
        """Recompute the K/V of the held tokens at logical `indices` in the current view: one
        forward over their tokens at their own positions, each attending to every held token at a
        position up to its own (the others' K/V as held, its fellows' as recomputed), its K/V
        written into its own slots layer by layer, so a later layer reads the updated tokens
        (CacheBlend's update). On sliding-window layers a recomputed token reads its recomputed
        fellows within the window (`Redo`); the stream's window is left as it is.

        The exact K/V each token held before are kept: `save_block` hands them out, so a store
        never sees recomputed K/V, and `drop_recomputed` puts them back. Counted as
        `blend_forward_tokens`. Afterwards `last_logits` and a `decode` without a token refuse
        until a forward with logits. Returns the tokens recomputed.

        Raises UnsupportedModelError for a model with recurrent layers: they consume the stream in
        order, and a held token fed again would fold into their state a second time."""
        refusal = self.recompute_refusal
        if refusal is not None:
            raise UnsupportedModelError(refusal)
        rt = self._rt
        self._settle()
        self._check_usable()
        idx = np.unique(np.asarray(indices, dtype=np.int64))
        if not idx.shape[0]:
            return 0
        if idx[0] < 0 or idx[-1] >= self.attention_tokens:
            raise IndexError(f"recompute indices must lie in 0..{self.attention_tokens - 1}")
        st = self._store
        slots = st.order[idx]
        slots = slots[np.argsort(st.pos[slots], kind="stable")]
        positions = st.pos[slots].copy()
        ids = st.tokens[slots].copy()
        st.keep_exact(slots)
        high_water = st.high_water()
        windows = len(rt.roles.window)
        st.redo = Redo(np.zeros(0, dtype=np.int64), [None] * windows, [None] * windows)
        started = time.perf_counter_ns()
        try:
            for a, b in self._recompute_runs(positions):
                self._forward(ids[a:b].tolist(), positions[a:b], slots[a:b], high_water, every=False, logits=False)
                st.redo.positions = np.concatenate([st.redo.positions, positions[a:b]])
        except BaseException as e:
            self._forward_failed(e)
            raise
        finally:
            st.redo = None
        self._landed(None, started, st.take_entered())
        self._counters.blend_forward_tokens += int(ids.shape[0])
        return int(ids.shape[0])

    @property
    def recompute_refusal(self) -> str | None:
        """Why `recompute` refuses this model, or None where it runs."""
        rt = self._rt
        if rt.roles.recurrent:
            return (f"{rt.family}: held tokens cannot be recomputed on a model with recurrent layers (they would "
                    "enter the recurrent state a second time)")
        return None

    def _recompute_runs(self, positions: np.ndarray) -> list[tuple[int, int]]:
        """The forwards a recompute of tokens at `positions` (ascending) runs, as index ranges in
        position order: one, where the runtime takes a position per token (torch); a runtime that
        takes only a first position per forward (mlx-lm's `offset`) runs one per run of
        consecutive positions, which attends alike: every token a forward reads at a lower
        position was recomputed by an earlier one."""
        return [(0, int(positions.shape[0]))]

    @property
    def recomputed_tokens(self) -> int:
        """Held tokens whose K/V a recompute replaced (and whose exact K/V are kept)."""
        return int(self._store.exact_slots.shape[0])

    def drop_recomputed(self) -> int:
        """Put the exact K/V back into every recomputed held token (at its current position);
        return how many. Afterwards the cache is what the stored pages and the stream make it."""
        st = self._store
        slots = st.exact_slots
        n = int(slots.shape[0])
        if not n:
            return 0
        keys, values = st.exact_keys, st.exact_values
        assert keys is not None and values is not None
        with self._page_op():
            for a0, a1 in st.layer_groups(n):
                st.write_keys(slots, a0, a1, keys[a0:a1], st.pos[slots])
                st.write_values(slots, a0, a1, values[a0:a1])
            st.forget_exact()
        self._last_logits = None
        return n

    # -- page operations -----------------------------------------------------------------------
    def save_block(self, start: int, end: int) -> Block:
        self._check_range(start, end, nonempty=True)
        st = self._store
        with self._page_op():
            slots = st.order[start:end]
            keys, values = st.gather_exact(slots)
            return Block(view=self._rt.view, keys=keys, values=values, positions=st.pos[slots].copy(),
                         token_ids=st.tokens[slots].copy(), model_name=self.model_name)

    def remove_attention_range(self, start: int, end: int) -> None:
        self._check_range(start, end, nonempty=True)
        st = self._store
        with self._page_op():
            # Only flags change: the freed slots keep stale data that the mask hides, no buffer
            # moves, and later tokens keep their positions (the gap is compacted lazily).
            st.occupied[st.order[start:end]] = False
            st.forget_exact(st.order[start:end])
            st.order = np.concatenate([st.order[:start], st.order[end:]])
            self._counters.evicted_tokens += end - start

    def insert_block(self, blk: Block, at: int, *, position: int | None = None) -> None:
        self._rt.view.require_same(blk.view)
        self._check_insert_at(at)
        results: list[BlockFormatError | None] = [None]
        with self._page_op():
            self._place_blocks({0: _Incoming(at, _wanted_positions(blk.positions, position), position is not None,
                                             _HeldBlock(blk))}, 0, results)

    def insert_block_file(self, path: str | os.PathLike[str], at: int, *, checksum: str, size: int,
                          token_ids: np.ndarray | None = None, position: int | None = None) -> None:
        error = self.insert_block_files([StoredBlock(path, at, checksum, size, token_ids, position)])[0]
        if error is not None:
            raise error

    def insert_block_files(self, files: Sequence[StoredBlock],
                           opened: Callable[[], object] | None = None) -> list[BlockFormatError | None]:
        for f in files:
            self._check_insert_at(f.at)
        results: list[BlockFormatError | None] = [None] * len(files)
        inserted = 0
        with self._page_op():
            for chunk in _batches(files):
                inserted += self._insert_files(files, chunk, inserted, results, opened)
                opened = None
        if opened is not None:   # no files
            opened()
        return results

    def _insert_files(self, files: Sequence[StoredBlock], chunk: list[int], shift: int,
                      results: list[BlockFormatError | None], opened: Callable[[], object] | None) -> int:
        """One batch of `insert_block_files` (its `at`s moved on by the `shift` tokens inserted
        before it); returns the tokens inserted. Every file is opened at once, so their headers
        and token ids are read first; their bulk is read READ_THREADS files at a time, in the
        order they go in, ahead of the copies. Nothing becomes visible before every block that
        goes in has verified."""
        streams: dict[int, BlockStream] = {}
        try:
            for i in chunk:
                try:
                    streams[i] = BlockStream(files[i].path, files[i].checksum, files[i].size,
                                             expect=self._rt.view, queue=self._reads, landing=True,
                                             read_here=i == chunk[0])
                except BlockFormatError as e:
                    results[i] = e
            if opened is not None:
                opened()
            for i in list(streams):
                try:
                    files[i].check_tokens(streams[i].small("token_ids"))
                except BlockFormatError as e:
                    results[i] = e
                    streams.pop(i).close()
            return self._place_blocks({i: _Incoming(files[i].at, _wanted_positions(rd.small("positions"),
                                                                                  files[i].position),
                                                    files[i].position is not None, rd)
                                       for i, rd in streams.items()}, shift, results)
        finally:
            for rd in streams.values():
                rd.close()

    def _place_blocks(self, incoming: dict[int, _Incoming], shift: int,
                      results: list[BlockFormatError | None]) -> int:
        """Put blocks into free slots at the positions the batch plan gives them, layer group by
        layer group, keys first, then values (a streamed file is consumed in its on-disk order):
        landed there by the file's reader where the store allows (`SlotStore.landing`; then only
        the keys' rotation is left), keys only from a file read from the disk or by this thread
        (`BlockStream.keys_land`), else copied; verify each,
        then commit the ones that verified and re-anchor each held key at most once. Until the
        commit the slots stay free, so a failure leaves no trace beyond zeroed free slots. An
        exact block must take its wanted positions as they are (a recovery puts each page back
        where it was, so attention sees the same relative distances as before). Returns the
        tokens inserted; `results[i]` gets the error of a block that failed."""
        st = self._store

        def split(values: np.ndarray, ids: list[int]) -> dict[int, np.ndarray]:
            """`values` cut into consecutive pieces, one per block in `ids`, of its token count."""
            ends = np.cumsum([incoming[i].wanted.shape[0] for i in ids])
            return {i: values[end - incoming[i].wanted.shape[0]:end] for i, end in zip(ids, ends, strict=True)}

        def plan_for(ids: list[int]) -> tuple[BatchPlan, dict[int, np.ndarray]]:
            plan = plan_inserts(st.pos, st.order, [(incoming[i].at + shift, incoming[i].wanted, incoming[i].exact)
                                                   for i in ids], self.position_limit)
            fresh = plan.sources < 0
            return plan, split(plan.positions[fresh][np.argsort(-1 - plan.sources[fresh])], ids)

        live = sorted(incoming)
        if not live:
            return 0
        plan, placed = plan_for(live)
        slots = st.allocate(int(sum(incoming[i].wanted.shape[0] for i in live)))
        where = split(slots, live)
        token_ids: dict[int, np.ndarray] = {}
        try:
            # All told first: each reader then reads its bulk straight into the slots. Values land
            # wherever the store allows; keys only from a file read from the disk or by this thread
            # (BlockStream.keys_land).
            landings: dict[int, tuple[Landing, bool, bool]] = {}
            for i in live:
                landing = st.landing(where[i])
                if landing is not None:
                    keys_land = incoming[i].source.keys_land()
                    landed = incoming[i].source.land(landing.keys if keys_land else None, landing.values)
                    landings[i] = (landing, *landed)
                else:
                    incoming[i].source.land(None, None)
            for i in live:
                rd = incoming[i].source
                try:
                    groups = list(st.layer_groups(int(where[i].shape[0])))
                    landing, keys_landed, values_landed = landings.get(i, (None, False, False))
                    for a0, a1 in groups:
                        if keys_landed:
                            assert landing is not None
                            rd.arrived("keys", a1)
                            landing.rotate(a0, a1, placed[i])
                        else:
                            st.write_keys(where[i], a0, a1, rd.rows("keys", a0, a1), placed[i])
                    if not values_landed:
                        for a0, a1 in groups:
                            st.write_values(where[i], a0, a1, rd.rows("values", a0, a1))
                    rd.finish()
                    token_ids[i] = rd.small("token_ids")
                except BlockFormatError as e:
                    rd.close()  # its reader writes into the slots no more
                    st.clear(where[i])
                    results[i] = e
            if not token_ids:
                return 0
            kept = sorted(token_ids)
            if kept != live:
                # Placed as if the failed blocks had never been asked for: the survivors' keys are
                # rotated again where their positions moved.
                plan, moved_to = plan_for(kept)
                for i in kept:
                    if not np.array_equal(placed[i], moved_to[i]):
                        st.reanchor(where[i], moved_to[i])
                placed = moved_to
        except BaseException:
            for i in live:
                incoming[i].source.close()
            st.clear(slots)
            raise
        new_slots = np.concatenate([where[i] for i in kept])
        order = plan.sources.copy()
        fresh = order < 0
        order[fresh] = new_slots[-1 - order[fresh]]
        moved = ~fresh
        moved[~fresh] = st.pos[order[~fresh]] != plan.positions[~fresh]
        if moved.any():
            st.reanchor(order[moved], plan.positions[moved])
        st.occupied[new_slots] = True
        st.tokens[new_slots] = np.concatenate([token_ids[i] for i in kept])
        st.pos[new_slots] = np.concatenate([placed[i] for i in kept])
        st.order = order
        n = int(new_slots.shape[0])
        self._counters.restored_tokens += n
        self._counters.reanchored_keys += n + int(moved.sum())
        self._counters.compactions += plan.compactions
        return n

    def compact_positions(self) -> int:
        with self._page_op():
            return self._compact()

    def reposition(self, positions: np.ndarray) -> int:
        st = self._store
        wanted = np.asarray(positions, dtype=np.int64)
        if wanted.shape != st.order.shape:
            raise ValueError(f"{wanted.shape[0]} positions for {st.order.shape[0]} held tokens")
        if wanted.size and (int(wanted.min()) < 0 or int(wanted.max()) >= self.position_limit
                            or np.unique(wanted).shape[0] != wanted.shape[0] or int(wanted[-1]) != int(wanted.max())):
            raise ValueError(f"positions must be distinct, in 0..{self.position_limit - 1}, and highest for the last "
                             "held token")
        with self._page_op():
            changed = st.pos[st.order] != wanted
            count = int(changed.sum())
            if count:
                st.reanchor(st.order[changed], wanted[changed])
                self._counters.reanchored_keys += count
            return count

    def _next_positions(self, n: int) -> np.ndarray:
        if self._compaction_due(n):
            self.compact_positions()
        st = self._store
        last = int(st.pos[st.order[-1]]) if st.order.shape[0] else -1
        # Window keys sit right before the new tokens: leave them room at non-negative positions.
        first = max(last + 1, st.win_len)
        return np.arange(first, first + n, dtype=np.int64)

    def _compaction_due(self, n: int) -> bool:
        """`n` new tokens would pass the position limit, and compacting leaves them room."""
        st = self._store
        last = int(st.pos[st.order[-1]]) if st.order.shape[0] else -1
        return last + n >= self.position_limit and last + 1 > st.order.shape[0]

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

    # -- recurrent state -----------------------------------------------------------------------
    def snapshot_recurrent(self) -> RecurrentSnapshot | None:
        """Recurrent states ("conv/<layer>/<i>", "recurrent/<layer>/<i>", in the Hugging Face layout)
        and the window caches ("window/<layer>/keys": canonical keys [1, heads, n, head_dim], and
        "window/<layer>/values"): everything a cut or a recovery must put back besides the pages."""
        if not self.is_hybrid:
            return None
        with self._page_op():
            states, dtypes = self._read_recurrent() if self._rt.roles.recurrent else ({}, {})
            if self._store.win_len:
                for layer, (keys, values) in zip(self._rt.roles.window, self._store.read_window(), strict=True):
                    for kind, arr in (("keys", keys), ("values", values)):
                        states[f"window/{layer}/{kind}"] = arr
                        dtypes[f"window/{layer}/{kind}"] = self._rt.dtype_name
        return RecurrentSnapshot(model_id=self.model_id, stream_tokens=self._stream_tokens, states=states,
                                 dtypes=dtypes)

    def _window_from_snapshot(self, snap: RecurrentSnapshot) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """The snapshot's window caches, checked against this model (BlockMismatchError otherwise)."""
        roles, shape = self._rt.roles, self._rt.window
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
            if tuple(keys.shape) != want_k or tuple(values.shape) != want_v or dtypes != {self._rt.dtype_name}:
                raise BlockMismatchError(
                    f"recurrent snapshot window layer {layer} has keys {tuple(keys.shape)} / values "
                    f"{tuple(values.shape)} in {sorted(dtypes)}, this model needs {want_k} / {want_v} in "
                    f"{self._rt.dtype_name}")
            out.append((keys, values))
        if len(lengths) != 1 or not 0 < lengths.pop() < roles.window_size:
            raise BlockMismatchError("recurrent snapshot window layers differ in length or exceed the window")
        return out

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        if not self.is_hybrid:
            raise BackendError("this model has no recurrent layers")
        if snap.model_id != self.model_id:
            raise BlockMismatchError(
                f"recurrent snapshot belongs to model_id {snap.model_id}, this backend is {self.model_id}")
        unknown = sorted({name for name in snap.dtypes.values()} - set(STORAGE_DTYPES))
        if unknown:
            raise BlockMismatchError(f"recurrent snapshot states have unsupported dtypes {unknown}")
        window = self._window_from_snapshot(snap)
        with self._page_op():
            if self._rt.roles.recurrent:
                self._write_recurrent(snap)
            if self._rt.roles.window:
                self._store.write_window(window)
                self._store.win_len = 0 if window is None else int(window[0][0].shape[2])
                self._store.win_last_pos = None
            self._stream_tokens = snap.stream_tokens
            # Logits and the pending token belong to the stream point being left.
            self._last_logits = None
            self._pending = None

    # -- session -------------------------------------------------------------------------------
    def fork(self: B) -> B:
        self._settle()
        other = type(self).__new__(type(self))
        other._rt = self._rt
        other.model_name = self.model_name
        other.device = self.device
        other.prefill_chunk = self.prefill_chunk
        other.position_limit = self.position_limit
        other._counters = self._counters.copy()
        other._rng = np.random.default_rng()
        other._rng.bit_generator.state = self._rng.bit_generator.state
        with self._rt.lock:
            other._store = self._store.clone()
        other._cache = other._new_cache()
        self._copy_recurrent_to(other)
        other._stream_tokens = self._stream_tokens
        other._pending = self._pending
        other._last_logits = None if self._last_logits is None else self._last_logits.copy()
        other._broken = self._broken
        other._scoring = None
        other._watch, other._weights = self._watch, None
        other._reads = blockfile.ReadQueue(READ_THREADS, READ_LINGER_S)
        # Every field a session holds is decided above: one added to `__init__` and not here fails
        # every fork, not silently one session. (A runtime's field that only ever holds its class
        # default once settled, such as MLX's steps ahead, reads the same on the fork.)
        held = {name for name, value in vars(self).items() if getattr(type(self), name, object()) is not value}
        assert held <= vars(other).keys(), sorted(held - vars(other).keys())
        return other

    def reset(self) -> None:
        self._settle()
        st = self._store
        st.occupied[:] = False
        st.order = np.zeros(0, dtype=np.int64)
        st.forget_exact()
        if self._rt.roles.window:
            st.write_window(None)
        st.win_len, st.win_last_pos = 0, None
        self._cache = self._new_cache()
        self._stream_tokens = 0
        self._pending = None
        self._last_logits = None
        self._weights = None
        self._broken = None

    # -- checks --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _marked_page_op(self) -> Iterator[None]:
        """For runtimes' `_page_op`: refuse a broken session and mark the operation, so a token
        entering the model meanwhile is counted as a historical forward."""
        self._settle()
        self._check_usable()
        self._weights = None   # the held tokens may move: weights of the last forward describe none
        self._rt.page_op = self._counters
        try:
            yield
        finally:
            self._rt.page_op = None

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
