"""The MLX backend session: `Backend` on mlx-lm, over the slot store and cache of this package.

Everything but tensor work is the shared base's (backends/runtime.py:SlotBackend); this module
runs the forward (`_build`: the slot mask, the model over the session's cache), converts the
recurrent states to and from the Hugging Face layout snapshots use, and pipelines greedy decoding.

Greedy decoding runs one step ahead, as mlx-lm's `generate_step` does, in one generator
(`_greedy_steps`) the session keeps between decodes: each step dispatches the next one, fed with
its argmax still on the device, before reading its own logits back, so building one step's graph
overlaps the previous step's compute. The next decode takes that step when it feeds the same token
greedily; anything else closes the generator first (`_settle`, which the base calls before every
prefill, page operation, fork, reset and diagnostic read), and puts the step's state back. The
generator itself takes no lock as it closes (the collector may close it on any thread).
A taken step is placed, advanced and counted by the base's own `_place`, `_advance` and `_landed`
(the tokens its embedding saw while it was built), so there is one accounting for both paths, and
it runs the graph the plain step would: tokens, logits and counters are those of the synchronous
path.

Dependency rules: mlx, mlx-lm's cache classes, numpy, backends.blocks / errors / protocol / runtime /
slots and this package's host, model, slot store and cache modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Generator, Iterator, Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx_lm.models.cache import ArraysCache

from ..blocks import RecurrentSnapshot
from ..errors import BlockMismatchError
from ..protocol import Backend
from ..runtime import SlotBackend
from ..slots import as_run, pick_token
from .cache import SlotLayer, WindowLayer, copy_arrays_cache, watch_attention, window_mask
from .host import DTYPE_NAMES, DTYPES, from_numpy, to_numpy
from .model import MlxModel, load_model
from .rotary import position_runs
from .slot_store import MlxSlotStore

__all__ = ["MlxBackend", "load"]


@dataclasses.dataclass
class _Ahead:
    """A greedy decode step dispatched before the token it feeds was read back. Its slot is
    written on the device but free in the slot table until the step is taken; the recurrent states
    and windows it replaced are kept to put back otherwise."""

    ids: mx.array                        # [1, 1]: the token it feeds, as the device picked it
    logits: mx.array                     # its float32 last logits
    pick: mx.array                       # [1, 1]: their argmax, the token the step after it feeds
    slots: np.ndarray
    entered: int                         # tokens its embedding saw: counted when it is taken
    recurrent: list[list[Any]]           # per ArraysCache of the session, its entries before the step
    windows: tuple[list[Any], list[Any], list[Any]]  # the store's win_canon / win_rot / win_v before it

    def feeds(self, token: int) -> bool:
        """Whether this step feeds `token` (reads back the device's pick)."""
        return token == self.ids.item()


class MlxBackend(SlotBackend):
    """`Backend` on mlx-lm. Construct with `load_backend("mlx", ...)`."""

    name = "mlx"
    _rt: MlxModel
    _store: MlxSlotStore
    _cache: list[Any]
    _steps: Generator[np.ndarray, int | None, None] | None = None
    _orphan: _Ahead | None = None   # the step ahead a closed `_greedy_steps` left for `_settle` to put back
    # Greedy decodes run one step ahead (see `_greedy_steps`); a harness that observes every forward
    # the model runs turns it off.
    lookahead = True

    _load_model = staticmethod(load_model)

    @property
    def mlx_model(self) -> Module:
        """The underlying mlx-lm model (shared with forks; for harnesses and diagnostics)."""
        return self._rt.model

    def _device_name(self) -> str:
        return "cpu" if self._rt.device.type == mx.cpu else "gpu"

    def observe_attention(self, queries: int, layers: Sequence[int]) -> None:
        if queries and layers:
            rt = self._rt
            watch_attention(rt.family, (rt.structure.attention[layer] for layer in rt.roles.paged))
        super().observe_attention(queries, layers)

    def _new_store(self, capacity: int) -> MlxSlotStore:
        return MlxSlotStore(self._rt, capacity)

    def _new_cache(self) -> list[Any]:
        rt = self._rt
        model: Any = rt.model
        template = model.make_cache() if hasattr(model, "make_cache") else []
        paged = {layer: a for a, layer in enumerate(rt.roles.paged)}
        window = {layer: w for w, layer in enumerate(rt.roles.window)}
        out: list[Any] = []
        for j, layer in enumerate(rt.structure.cache_layers):
            if layer in paged:
                out.append(SlotLayer(self._store, paged[layer]))
            elif layer in window:
                out.append(WindowLayer(self._store, window[layer]))
            else:
                out.append(template[j])
        return out

    def _forward(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, high_water: int,
                 every: bool = False, logits: bool = True) -> np.ndarray | None:
        with self._rt.lock, mx.stream(self._rt.device):
            out = self._build(mx.array([ids], dtype=mx.int32), positions, slots, high_water, every)
            # Without logits only the states are evaluated: the lazy graph then never runs the last
            # layer past its keys and values (mlx-lm's prefill does the same; a quarter of the tiny
            # hybrid's prefill, docs/backends.md), and the states' bits are the same either way.
            # A watched forward's weights are evaluated with it, under the runtime's lock.
            watched = list(self._store.watched)
            if not logits:
                mx.eval(self._state(), *watched)
                return None
            mx.eval(out, self._state(), *watched)
        return np.array(out)

    def _build(self, ids: mx.array, positions: np.ndarray, slots: np.ndarray, high_water: int,
               every: bool = False) -> mx.array:
        """The forward's graph over `ids` [1, n] (placed in `slots` at `positions`): its float32
        last logits (every position's with `every`), unevaluated (the caller holds the lock and
        the device stream)."""
        st, rt = self._store, self._rt
        n = int(ids.shape[1])
        # Without a gap below the high-water slot and with this forward in the last slots, the slot
        # mask is plain causal attention: mlx's own (none for one token) runs its fastest kernel.
        # A recompute's slots need not follow its positions: it always takes the explicit masks.
        dense = (st.groups is None and st.redo is None and bool(st.occupied[:high_water].all())
                 and as_run(slots) == (high_water - n, high_water))
        st.fwd_slots, st.fwd_high_water, st.fwd_offset = slots, high_water, int(positions[0])
        try:
            if dense:
                st.fwd_mask = None if n == 1 else "causal"
            else:
                st.fwd_mask = mx.array(st.slot_mask(slots, high_water))[None, None]
            if rt.roles.window and st.redo is not None:
                st.fwd_win_mask = mx.array(st.redo_window_mask(positions))[None, None]
            elif rt.roles.window:
                if st.win_len + n <= rt.roles.window_size:
                    st.fwd_win_mask = None if n == 1 else "causal"
                else:
                    st.fwd_win_mask = window_mask(st.win_len, n, rt.roles.window_size)[None, None]
            rt.active, rt.all_positions = st, every
            try:
                out = rt.model(ids, cache=self._cache)
            finally:
                rt.active, rt.all_positions = None, False
            logits: mx.array = (out[0] if every else out[0, -1]).astype(mx.float32)
        finally:
            st.fwd_slots, st.fwd_mask, st.fwd_win_mask = None, None, None
        return logits

    def _recompute_runs(self, positions: np.ndarray) -> list[tuple[int, int]]:
        """One forward per run of consecutive positions: mlx-lm's attention rotates a forward's
        tokens from its cache's one `offset` on."""
        return position_runs(positions)

    def _state(self) -> list[Any]:
        """Every array a forward updates besides its logits: slot buffers, windows, recurrent states."""
        return [self._store.buffers(), [c.cache for c in self._recurrent_caches()]]

    @contextlib.contextmanager
    def _page_op(self) -> Iterator[None]:
        """Page operations are synchronous: their buffer updates are evaluated before they return."""
        with self._rt.lock, mx.stream(self._rt.device), self._marked_page_op():
            yield
            mx.eval(self._store.buffers())

    def synchronize(self) -> None:
        mx.synchronize()

    # -- greedy decoding, one step ahead ---------------------------------------------------------
    def _decode_step(self, feed: int | None, greedy: bool) -> np.ndarray:
        """A greedy step is the session's `_greedy_steps`' next (started by the first one); any other
        closes them first and is the base's plain step."""
        if not (greedy and self.lookahead) or self._orphan is not None:
            self._settle()
        if not (greedy and self.lookahead):
            return super()._decode_step(feed, greedy)
        # Detached while it runs: a page operation it triggers (a placement's) has nothing to settle.
        steps, self._steps = self._steps, None
        if steps is None:
            steps = self._greedy_steps(feed)
            logits = next(steps)
        else:
            logits = steps.send(feed)
        self._steps = steps
        return logits

    def _greedy_steps(self, feed: int | None) -> Generator[np.ndarray, int | None, None]:
        """mlx-lm's `generate_step` for this session: sent the token each greedy decode feeds (None:
        nothing, right after a prefill), yields the logits it picks from, and keeps the next step
        dispatched in between. A step ahead that feeds the token sent is taken; otherwise it is put
        back and the step is the base's plain one, after which the next is dispatched again.

        Closing the generator only hands the step ahead to the session (`_orphan`); `_settle`,
        which closes it, then puts the step back, before the session's next step or page
        operation. The generator takes no lock as it closes: the garbage collector finalizes a
        dropped session's generator on whichever thread allocates, a restore's reader included,
        while the restore holds the runtime's lock and waits for that reader (a `make test`
        hung so, both waiting for ever)."""
        ahead: _Ahead | None = None
        try:
            while True:
                if ahead is not None and feed is not None and ahead.feeds(feed):
                    taken, ahead = ahead, None
                    logits, ahead = self._take(taken, feed)
                else:
                    if ahead is not None:
                        self._drop(ahead)
                        ahead = None
                    logits = super()._decode_step(feed, True)
                    ahead = self._dispatch(mx.array([[pick_token(logits, True, 0.0, 0, 1.0, self._rng)]],
                                                    dtype=mx.int32))
                feed = yield logits
        finally:
            if ahead is not None:
                self._orphan = ahead

    def _take(self, ahead: _Ahead, token: int) -> tuple[np.ndarray, _Ahead | None]:
        """The step dispatched ahead becomes this decode's: its token takes the slot it was written
        to, the step after it is dispatched, and only then are its logits read back. Returns them
        and the new step ahead."""
        started = time.perf_counter_ns()
        slots, positions = self._place([token], None)
        assert np.array_equal(slots, ahead.slots), (slots, ahead.slots)  # nothing moved since it was dispatched
        self._advance(positions)
        try:
            following = self._dispatch(ahead.pick)
            logits = np.array(ahead.logits)
        except BaseException as e:
            self._forward_failed(e)
            raise
        self._landed(logits, started, ahead.entered)
        return logits, following

    def _dispatch(self, ids: mx.array) -> _Ahead | None:
        """The next greedy step over `ids` [1, 1], dispatched and not placed; None where placing it
        would run a page operation first (a compaction, a window moved) or need more slots, or where
        a cache of the session could not be put back."""
        st = self._store
        if (self._broken is not None or self._placing_pages(1) or bool(st.occupied.all())
                or not all(isinstance(c, (SlotLayer, ArraysCache)) for c in self._cache)):
            return None
        with self._rt.lock, mx.stream(self._rt.device):
            recurrent = [list(c.cache) for c in self._recurrent_caches()]
            windows = (list(st.win_canon), list(st.win_rot), list(st.win_v))
            slots, positions = self._place([0], None)  # the token is entered when the step is taken
            try:
                logits = self._build(ids, positions, slots, st.high_water())
            except BaseException:
                st.take_entered()
                self._restore(recurrent, windows)
                raise
            finally:
                st.occupied[slots] = False
                st.order = st.order[:-1]
            pick = mx.argmax(logits).astype(mx.int32).reshape(1, 1)
            mx.async_eval(logits, pick, self._state())  # type: ignore[no-untyped-call]
        return _Ahead(ids=ids, logits=logits, pick=pick, slots=slots, entered=st.take_entered(),
                      recurrent=recurrent, windows=windows)

    def _drop(self, ahead: _Ahead) -> None:
        """Undo a step dispatched ahead: its slot is free already (its stale contents hidden by the
        mask, as after an eviction); the recurrent states and windows go back to before it."""
        with self._rt.lock:
            self._restore(ahead.recurrent, ahead.windows)

    def _restore(self, recurrent: list[list[Any]], windows: tuple[list[Any], list[Any], list[Any]]) -> None:
        for c, entries in zip(self._recurrent_caches(), recurrent, strict=True):
            c.cache = entries
        st = self._store
        st.win_canon, st.win_rot, st.win_v = windows

    def _settle(self) -> None:
        """Close the greedy steps and put back the step they had dispatched ahead (or left behind
        when a failure ended them)."""
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.close()
        orphan, self._orphan = self._orphan, None
        if orphan is not None:
            self._drop(orphan)

    # -- recurrent state -----------------------------------------------------------------------
    # Snapshots use the Hugging Face layout, so they mean the same in both runtimes: conv state
    # [1, conv_dim, kernel] (mlx-lm keeps the kernel - 1 newest inputs as [1, kernel - 1, conv_dim];
    # the oldest column, which no later step reads, is stored as zeros); Gated DeltaNet state
    # [1, heads, key_dim, value_dim] (mlx-lm: [1, heads, value_dim, key_dim]); Mamba2 state
    # [1, heads, head_dim, state] (the same in both).
    def _recurrent_caches(self) -> list[ArraysCache]:
        return [c for c in self._cache if isinstance(c, ArraysCache)]

    def _recurrent_entry(self, layer: int) -> ArraysCache:
        c = self._cache[self._rt.structure.cache_layers.index(layer)]
        assert isinstance(c, ArraysCache)
        return c

    def _is_delta_net(self, layer: int) -> bool:
        return "linear_attn" in self._rt.structure.decoder.layers[layer]

    def _hf_shapes(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        block: Any = self._rt.structure.decoder.layers[layer]
        try:
            if self._is_delta_net(layer):
                la = block.linear_attn
                return ((1, int(la.conv_dim), int(la.conv_kernel_size)),
                        (1, int(la.num_v_heads), int(la.head_k_dim), int(la.head_v_dim)))
            m = block.mixer
            return ((1, int(m.conv_dim), int(m.conv_kernel_size)),
                    (1, int(m.num_heads), int(m.head_dim), int(m.ssm_state_size)))
        except AttributeError:
            return None

    def _read_recurrent(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        states: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for i in self._rt.linear_layers:
            c = self._recurrent_entry(i)
            conv, rec = c[0], c[1]
            if conv is None or rec is None:
                continue
            pad = mx.zeros((conv.shape[0], 1, conv.shape[2]), dtype=conv.dtype)
            hf_conv = mx.concatenate([pad, conv], axis=1).transpose(0, 2, 1)
            hf_rec = rec.swapaxes(-1, -2) if self._is_delta_net(i) else rec
            for key, arr in ((f"conv/{i}/0", hf_conv), (f"recurrent/{i}/0", hf_rec)):
                states[key] = to_numpy(arr)
                dtypes[key] = DTYPE_NAMES[arr.dtype]
        return states, dtypes

    def _write_recurrent(self, snap: RecurrentSnapshot) -> None:
        updates: dict[int, tuple[mx.array, mx.array] | None] = {}
        for i in self._rt.linear_layers:
            conv_key, rec_key = f"conv/{i}/0", f"recurrent/{i}/0"
            if conv_key not in snap.states or rec_key not in snap.states:
                updates[i] = None
                continue
            got_conv, got_rec = tuple(snap.states[conv_key].shape), tuple(snap.states[rec_key].shape)
            want = self._hf_shapes(i)
            if want is not None and (got_conv, got_rec) != want:
                raise BlockMismatchError(
                    f"recurrent snapshot layer {i} has conv {got_conv} / recurrent {got_rec}, this model needs "
                    f"{want[0]} / {want[1]}")
            conv = from_numpy(snap.states[conv_key], DTYPES[snap.dtypes[conv_key]])
            rec = from_numpy(snap.states[rec_key], DTYPES[snap.dtypes[rec_key]])
            rec = rec.swapaxes(-1, -2) if self._is_delta_net(i) else rec
            updates[i] = (mx.contiguous(conv.transpose(0, 2, 1)[:, 1:, :]), mx.contiguous(rec))
        for i, upd in updates.items():
            c = self._recurrent_entry(i)
            c[0], c[1] = (None, None) if upd is None else upd
        mx.eval([c.cache for c in self._recurrent_caches()])

    def _copy_recurrent_to(self, other: SlotBackend) -> None:
        assert isinstance(other, MlxBackend)
        for j, c in enumerate(self._cache):
            if isinstance(c, ArraysCache):
                other._cache[j] = copy_arrays_cache(c)


load = MlxBackend.load

# Static conformance: mypy checks MlxBackend against the protocol here.
_conforms: type[Backend] = MlxBackend
