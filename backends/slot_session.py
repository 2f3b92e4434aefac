"""One backend session over a runtime's slot store: what it holds, where new tokens go, and running
the model over them. Every operation of the protocol is built from these (backends/runtime.py).

`SlotSession` is the lower half of `SlotBackend`, the base both runtimes subclass: the session's
fields; the hooks a runtime implements for one forward pass (`_forward`, the cache object its model
code sees, the slot store of its tensors, how a page operation runs, `_settle`); what the session
is and holds (identity, held tokens, positions, counters); the model loop (`_run_model`: allocate
slots, place the tokens at positions, forward, account for it); the position policy (new tokens
go after the last held one; positions are compacted when the next would pass the limit;
`reposition`); and the checks a forward or a page operation makes first. It is apart from
`SlotBackend` because those operations (prefill, decode, the blend, scoring, page moves,
snapshots, fork) all run through this loop, while the loop needs none of them.

Positions: eviction leaves a gap and moves nothing; RoPE is relative, so a gap is as if the page
were there but invisible. Compaction renumbers the held tokens 0..n-1 and re-anchors only keys
whose position changed. The window caches' keys sit at the positions just before the next
forward's first; when a compaction, an insert or a restored snapshot moved that position,
`_place` re-rotates them from their canonical form before the forward.

Dependency rules: numpy and backends.blocks / errors / loaded_model / models / protocol /
slot_store / slots; never a tensor library, never backends.runtime.
"""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from .blocks import LayerView
from .errors import BackendError
from .loaded_model import LayerRoles, LoadedModel
from .models import load_tokenizer
from .protocol import Counters, Tokenizer
from .slot_store import SlotStore, Watch

__all__ = ["SlotSession"]


class SlotSession(abc.ABC):
    """A session's state over a runtime's slot store and the model loop it runs; `SlotBackend`
    (backends/runtime.py) builds the `Backend` protocol on it. Subclasses implement the abstract
    hooks below."""

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
        self._watch: Watch | None = None           # see SlotBackend.observe_attention
        # The last watched prefill's weights per held token; every forward that lands after it, a
        # page operation and a reset drop them.
        self._weights: np.ndarray | None = None

    # -- hooks a runtime implements for a forward ----------------------------------------------
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

    # -- running the model over new tokens -----------------------------------------------------
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

    def _hold(self, token_ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Free slots entered in the table as holding `token_ids` at `positions`, last in the order."""
        st = self._store
        slots = st.allocate(int(positions.shape[0]))
        st.pos[slots] = positions
        st.occupied[slots] = True
        st.tokens[slots] = token_ids
        st.order = np.concatenate([st.order, slots])
        return slots

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

    # -- positions -----------------------------------------------------------------------------
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
