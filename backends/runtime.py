"""What the torch and MLX runtimes share: `SlotBackend`, the `Backend` protocol over a runtime's
slot store, everything of a backend session that is not tensor work.

A runtime supplies a loaded model (`backends.loaded_model.LoadedModel` plus its own fields, with
the `LayerRoles` it found in its model), a slot store (`backends.slot_store.SlotStore`: buffers,
gathers, writes and re-anchoring in its tensor library, and the window caches of sliding-window
layers) and the hooks `SlotBackend` and its base declare abstract (one forward pass, the cache
object its model code sees, the recurrent states, ...): a runtime missing one cannot be
instantiated. The base, `SlotSession` (backends/slot_session.py), holds the session's state, its
position policy and the model loop; `SlotBackend` builds the protocol's operations on them:
loading with the rotary check, prefill / extend, decoding and sampling (one forward across forks
where the runtime can), the attention a prefill observes, scoring blocks in a scratch session,
the blend's recompute, save / evict / insert, recurrent snapshots, fork and reset. The two
runtimes therefore count, position and check the same way by construction, not by copying. Two
of its parts are collaborators given the session's store and counters rather than the session:
putting blocks into the slots, streamed from their files or from memory (backends/inserts.py),
and the window part of a snapshot with its checks (backends/snapshots.py).

Sliding-window layers are never paged. Each keeps the newest W - 1 tokens the model consumed (W
the window), as canonical keys, rotated keys and values; a forward appends its tokens and attends
to those plus its own, within W of each other in the stream. Page operations never touch a
window: the window always holds the last tokens of the stream, whatever attention holds. Its keys
sit at the positions just before the next forward's first position (the stream distances the
model was trained on); a compaction or an insert that moves that position re-rotates them from
their canonical form before the next forward.

Dependency rules: numpy and backends.blocks / block_stream / errors / inserts / loaded_model /
models / protocol / slot_session / slot_store / slots / snapshots; never a tensor library.
"""

from __future__ import annotations

import abc
import os
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np

from .block_stream import StoredBlock
from .blocks import Block, RecurrentSnapshot
from .errors import BackendError, BlockFormatError, UnsupportedModelError
from .inserts import Inserts, read_queue
from .loaded_model import LoadedModel
from .models import ModelSource, resolve
from .protocol import DecodeStep
from .slot_session import SlotSession
from .slot_store import Redo, Watch
from .slots import checked_token_ids, pick_token
from .snapshots import add_windows, checked_windows

__all__ = ["SlotBackend"]

B = TypeVar("B", bound="SlotBackend")


class SlotBackend(SlotSession):
    """The `Backend` protocol over a runtime's slot store. Subclasses implement the abstract hooks
    below and `SlotSession`'s."""

    def __init__(self, rt: LoadedModel, model_name: str, *, capacity: int = 4096, prefill_chunk: int = 512,
                 position_limit: int | None = None, seed: int = 0) -> None:
        super().__init__(rt, model_name, capacity=capacity, prefill_chunk=prefill_chunk, position_limit=position_limit,
                         seed=seed)
        self._scoring: SlotBackend | None = None  # see _scoring_session
        self._reads = read_queue()                # what `insert_block_files` reads its files on

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

    # -- prefilling ----------------------------------------------------------------------------
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
                self._weights = per_slot[..., self._store.order]
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

    # -- scoring blocks in a scratch session ---------------------------------------------------
    def score_after_blocks(self, blocks: Sequence[Block], token_ids: Sequence[int],
                           sink: Block | None = None) -> tuple[np.ndarray, int]:
        """Every block with its own copy of `token_ids` right after it, in one scratch session that
        shares the weights: copy i runs at positions lead + i*n .. (n tokens, `lead` the longest
        block plus the sink) and block i is re-anchored to the positions just before it, with its
        own copy of `sink` just before the block, so every copy sees its block at the distances a
        restore would give; the slot groups keep each copy's attention to its sink, its own block
        and its own earlier tokens. One forward: on the CPU most of a SmolLM2 forward's cost is
        fixed, whatever it holds, and each token adds little, so k copies in one forward cost far
        less than k forwards (docs/journal/2026-12-06-controller-long-form.md, "Cost")."""
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
        zero-fills its buffers, a noticeable share of a SmolLM2 re-rank (cProfile over the rerank
        selector's probes: docs/journal/2026-12-02-reranker.md). It shares the weights and nothing
        else with this session."""
        scratch = self._scoring
        if scratch is None:
            scratch = self._scoring = type(self)(self._rt, self.model_name, capacity=tokens,
                                                 position_limit=position_limit)
        scratch.position_limit = max(scratch.position_limit, position_limit)
        return scratch

    # -- decoding ------------------------------------------------------------------------------
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
        with self._page_op():
            Inserts(self._store, self._counters, self.position_limit).held(blk, at, position)

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
        with self._page_op():
            Inserts(self._store, self._counters, self.position_limit).files(files, results, self._rt.view,
                                                                            self._reads, opened)
        if opened is not None and not files:   # no files: nothing was opened
            opened()
        return results

    # -- recurrent state -----------------------------------------------------------------------
    def snapshot_recurrent(self) -> RecurrentSnapshot | None:
        """Recurrent states ("conv/<layer>/<i>", "recurrent/<layer>/<i>", in the Hugging Face layout)
        and the window caches ("window/<layer>/keys": canonical keys [1, heads, n, head_dim], and
        "window/<layer>/values"): everything a cut or a recovery must put back besides the pages."""
        if not self.is_hybrid:
            return None
        with self._page_op():
            states, dtypes = self._read_recurrent() if self._rt.roles.recurrent else ({}, {})
            add_windows(self._rt, self._store, states, dtypes)
        return RecurrentSnapshot(model_id=self.model_id, stream_tokens=self._stream_tokens, states=states,
                                 dtypes=dtypes)

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        if not self.is_hybrid:
            raise BackendError("this model has no recurrent layers")
        window = checked_windows(self._rt, snap)
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
        other._reads = read_queue()
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
