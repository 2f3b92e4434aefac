"""The torch backend session: `Backend` on Hugging Face transformers, over this package's slot
store and cache.

Everything but tensor work is the shared base's (backends/runtime.py:SlotBackend); this module
builds the masks, runs the forward (one session's, or one batched decode's rows in one forward),
reads and writes transformers' recurrent cache layers for snapshots and forks, and runs page
operations under the model's lock, on the CPU on one intra-op thread.

Dependency rules: torch, transformers, numpy, backends.protocol / runtime / slots and this
package's attention, cache, host, loading, model and slot store modules.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel
from transformers.cache_utils import LinearAttentionLayer

from ..blocks import RecurrentSnapshot
from ..protocol import Backend
from ..runtime import SlotBackend
from ..slots import as_run
from .attention import BATCH, SHORTCUTS, WATCHED
from .cache import BatchCache, BatchRows, SlotCache, clone_linear_layer
from .host import DTYPES, from_numpy, to_numpy
from .loading import load_model
from .model import TorchModel
from .slot_store import TorchSlotStore

__all__ = ["TorchBackend", "load"]


@contextlib.contextmanager
def _single_threaded(device: torch.device) -> Iterator[None]:
    """Run CPU page operations on one intra-op thread.

    They are short, memory-bound copies. Parallel regions must wait for every worker, so whenever
    another process holds a core each op waits for a descheduled thread: on a 2-core machine with
    one busy neighbour a 128-token SmolLM2 restore took many times longer with two threads than
    with one. On an idle machine a restore costs the same either way; a large compaction takes
    longer on one thread, which its rarity pays for (docs/journal/2026-11-29-restore-path.md,
    "First figures" and "Figures moved out of code comments"). (torch's thread count is
    process-wide; the runtime lock is held meanwhile, so this session's forwards are unaffected.)
    """
    before = torch.get_num_threads()
    if device.type != "cpu" or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _tall_head(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The vocabulary projection of a few rows as weight @ hidden^T: on the CPU the same product
    as `F.linear`, with the tall weight as the left operand. It reads the weight once for all
    rows, so for SmolLM2's 49,152 x 576 head it is faster than `F.linear` from two rows on and a
    little slower for one (batched decode only; docs/journal/2026-11-30-runtime-speed.md)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.mm(head.weight, flat.t()).t()
    if head.bias is not None:
        out = out + head.bias
    return out.reshape(*hidden.shape[:-1], out.shape[-1])


class TorchBackend(SlotBackend):
    """`Backend` on Hugging Face transformers. Construct with `load_backend("torch", ...)`."""

    name = "torch"
    _rt: TorchModel
    _store: TorchSlotStore
    _cache: SlotCache

    _load_model = staticmethod(load_model)

    @property
    def hf_model(self) -> PreTrainedModel:
        """The underlying transformers model (shared with forks; for harnesses and diagnostics)."""
        return self._rt.model

    def _device_name(self) -> str:
        return str(self._rt.device)

    def _new_store(self, capacity: int) -> TorchSlotStore:
        return TorchSlotStore(self._rt, capacity)

    def _new_cache(self) -> SlotCache:
        states = int(getattr(self._rt.model.config.get_text_config(), "number_of_conv_states", 1))
        return SlotCache(self._store, self._rt, states)

    def _masks(self, positions: np.ndarray, slots: np.ndarray,
               high_water: int) -> tuple[torch.Tensor | dict[str, torch.Tensor | None], dict[int, str]]:
        """The boolean masks: slots by position for the paged layers; by stream distance for the
        window layers (their window, then this forward's tokens). And which of them are plain causal
        attention (see attention.py): no free slot below the high-water one and this forward's
        tokens in the last slots; for a window, all of it within reach."""
        st, rt = self._store, self._rt
        dev = rt.device
        s = int(positions.shape[0])
        shortcuts: dict[int, str] = {}
        # A recompute's slots need not follow its positions: it always takes the explicit mask.
        dense = (st.groups is None and st.redo is None and as_run(slots) == (high_water - s, high_water)
                 and bool(st.occupied[:high_water].all()))
        if dense and s == 1:
            full = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=dev).expand(1, 1, 1, high_water)
        else:
            q_pos = torch.from_numpy(positions).to(dev)
            key_pos = torch.from_numpy(st.pos[:high_water]).to(dev)
            occupied = torch.from_numpy(st.occupied[:high_water]).to(dev)
            seen = occupied[None, :] & (key_pos[None, :] <= q_pos[:, None])
            if st.groups is not None:
                seen &= torch.from_numpy(st.groups[:high_water][None, :] == st.groups[slots][:, None]).to(dev)
            full = seen[None, None]
        if dense and (s == 1 or s == high_water):
            shortcuts[id(full)] = "all" if s == 1 else "causal"
        if not rt.shape.mask_dict:
            return full, shortcuts
        masks: dict[str, torch.Tensor | None] = {t: None for t in rt.shape.mask_types}
        masks["full_attention"] = full
        if rt.roles.window and st.redo is not None:
            masks["sliding_attention"] = torch.from_numpy(st.redo_window_mask(positions))[None, None].to(dev)
        elif rt.roles.window:
            n, w = st.win_len, rt.roles.window_size
            query = torch.arange(n, n + s, device=dev)[:, None]
            key = torch.arange(n + s, device=dev)[None, :]
            window = ((key <= query) & (query - key < w))[None, None]
            masks["sliding_attention"] = window
            if (s == 1 and n < w) or (n == 0 and s <= w):
                shortcuts[id(window)] = "all" if s == 1 else "causal"
        return masks, shortcuts

    def _forward(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, high_water: int,
                 every: bool = False, logits: bool = True) -> np.ndarray | None:
        st, rt = self._store, self._rt
        masks, shortcuts = self._masks(positions, slots, high_water)
        st.fwd_slots, st.fwd_high_water = slots, high_water
        input_ids = torch.tensor([ids], dtype=torch.long, device=rt.device)
        position_ids = torch.from_numpy(positions).to(rt.device)[None, :]
        try:
            with rt.lock, torch.no_grad():
                rt.active = st
                SHORTCUTS.masks, WATCHED.store = shortcuts, st if st.watch is not None else None
                try:
                    out = rt.model(input_ids=input_ids, position_ids=position_ids, attention_mask=masks,
                                   cache=self._cache, use_cache=True, logits_to_keep=0 if every else 1)
                finally:
                    rt.active = None
                    SHORTCUTS.masks, WATCHED.store = {}, None
        finally:
            st.fwd_slots = None
        if not logits:   # transformers computes one row's anyway (`logits_to_keep` has no "none")
            return None
        got: np.ndarray = (out.logits[0] if every else out.logits[0, -1]).float().cpu().numpy()
        return got

    @property
    def batches_decode(self) -> bool:
        """Recurrent layers keep per-session state in transformers' own cache layers and kv-shared
        layers read another layer's cache: models with either decode one session at a time."""
        roles = self._rt.roles
        return not roles.recurrent and not roles.shared

    def _forward_rows(self, rows: Sequence[tuple[SlotBackend, int, np.ndarray, np.ndarray, int]]) -> np.ndarray:
        rt = self._rt
        stores: list[TorchSlotStore] = []
        masks: list[dict[str, torch.Tensor | None]] = []
        shortcuts: dict[int, str] = {}
        for backend, _, slots, positions, high_water in rows:
            assert isinstance(backend, TorchBackend)
            mask, fast = backend._masks(positions, slots, high_water)
            masks.append(mask if isinstance(mask, dict) else {"full_attention": mask})
            shortcuts.update(fast)
            st = backend._store
            st.fwd_slots, st.fwd_high_water = slots, high_water
            stores.append(st)
        batch = BatchRows(stores, masks)
        n = len(rows)
        # The model only passes these along; each row's attention takes its own mask (attention.py).
        passed = torch.ones((n, 1, 1, 1), dtype=torch.bool, device=rt.device)
        attention_mask: torch.Tensor | dict[str, torch.Tensor | None] = passed
        if rt.shape.mask_dict:
            attention_mask = {t: passed if t in ("full_attention", "sliding_attention") else None
                              for t in rt.shape.mask_types}
        input_ids = torch.tensor([[token] for _, token, _, _, _ in rows], dtype=torch.long, device=rt.device)
        position_ids = torch.from_numpy(np.concatenate([p for _, _, _, p, _ in rows])).to(rt.device)[:, None]
        head = rt.model.get_output_embeddings()  # type: ignore[no-untyped-call]
        tall = rt.device.type == "cpu" and type(head) is torch.nn.Linear
        try:
            with rt.lock, torch.no_grad():
                rt.active = batch
                SHORTCUTS.masks, BATCH.rows = shortcuts, batch
                if tall:
                    head.forward = functools.partial(_tall_head, head)  # shadows Linear.forward for this call
                try:
                    out = rt.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                   cache=BatchCache(batch, rt), use_cache=True, logits_to_keep=1)
                finally:
                    rt.active = None
                    SHORTCUTS.masks, BATCH.rows = {}, None
                    if tall:
                        del head.forward
        finally:
            for st in stores:
                st.fwd_slots = None
        logits: np.ndarray = out.logits[:, -1].float().cpu().numpy()
        return logits

    @contextlib.contextmanager
    def _page_op(self) -> Iterator[None]:
        with self._rt.lock, torch.no_grad(), _single_threaded(self._rt.device), self._marked_page_op():
            yield

    def _settle(self) -> None:
        """Nothing is in flight between decodes: every torch forward here returns its logits."""

    def synchronize(self) -> None:
        if self._rt.device.type == "cuda":
            torch.cuda.synchronize(self._rt.device)

    # -- recurrent state: transformers' own LinearAttentionLayer, in its own layout ------------
    def _linear_layers(self) -> list[tuple[int, LinearAttentionLayer]]:
        out = []
        for i in self._rt.linear_layers:
            layer = self._cache.layers[i]
            assert isinstance(layer, LinearAttentionLayer)
            out.append((i, layer))
        return out

    def _read_recurrent(self) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        states: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        for i, layer in self._linear_layers():
            for s in range(layer.number_of_states):
                for kind, tensors, ready in (("conv", layer.conv_states, layer.is_conv_states_initialized),
                                             ("recurrent", layer.recurrent_states,
                                              layer.is_recurrent_states_initialized)):
                    t = tensors[s]
                    if ready[s] and layer.has_previous_state[s] and t is not None:
                        key = f"{kind}/{i}/{s}"
                        states[key] = to_numpy(t)
                        dtypes[key] = str(t.dtype).removeprefix("torch.")
        return states, dtypes

    def _write_recurrent(self, snap: RecurrentSnapshot) -> None:
        for i, layer in self._linear_layers():
            for s in range(layer.number_of_states):
                conv_key, rec_key = f"conv/{i}/{s}", f"recurrent/{i}/{s}"
                if conv_key not in snap.states:
                    layer.reset()
                    continue
                for key, tensors, ready in ((conv_key, layer.conv_states, layer.is_conv_states_initialized),
                                            (rec_key, layer.recurrent_states, layer.is_recurrent_states_initialized)):
                    if key not in snap.states:
                        continue
                    t = from_numpy(snap.states[key], DTYPES[snap.dtypes[key]], self._rt.device)
                    cur = tensors[s]
                    if ready[s] and cur is not None and cur.shape == t.shape and cur.dtype == t.dtype:
                        cur.copy_(t)
                    else:
                        tensors[s] = t.clone()
                        ready[s] = True
                layer.conv_kernel_size[s] = int(snap.states[conv_key].shape[-1])
                layer.device, layer.dtype = self._rt.device, self._rt.dtype  # type: ignore[assignment]
                layer.has_previous_state[s] = True

    def _copy_recurrent_to(self, other: SlotBackend) -> None:
        assert isinstance(other, TorchBackend)
        for i, layer in self._linear_layers():
            other._cache.layers[i] = clone_linear_layer(layer)


load = TorchBackend.load

# Static conformance: mypy checks TorchBackend against the protocol here.
_conforms: type[Backend] = TorchBackend
