"""The torch backend: Hugging Face transformers model code, CPU and CUDA, with a slot-based cache.

Layer roles come from the model itself: transformers' own per-layer cache kinds
(`get_layer_types_and_kwargs`, what its DynamicCache is built from) and the decoder's modules. Global
attention layers are paged; sliding-window layers keep a window cache of their own; linear-attention
and Mamba layers keep transformers' stock recurrent cache layers; kv-shared attention (Gemma 4) and
MLP / MoE blocks keep nothing. A model that fits none of these, or whose attention has no per-head
pre-rotary key (fused QKV, latent attention, absolute position embeddings) is refused, naming why.

Cache layout. The paged layers share one set of preallocated slot buffers, stacked over those
layers so a page operation is one tensor op for all of them:

    k_rot   [layers, 1, kv_heads, capacity, head_dim]   keys as attention uses them (rotated)
    k_canon [layers, 1, kv_heads, capacity, rotary_dim] pre-rotary keys, rotary dims only (the
                                                        pass-through dims are equal in k_rot)
    v       [layers, 1, kv_heads, capacity, value_dim]

plus, on the host, a RoPE position and an occupied flag per slot and the logical order of the held
tokens (an array of slot numbers). Because a key carries its position in its rotation and the mask
is built from positions (`occupied & slot_pos <= query_pos`), attention does not depend on slot
order: new tokens take the lowest free slots, eviction only clears flags, and a restored page
lands in whatever slots are free. Re-anchoring always recomputes `rope(k_canon, new_pos)`. A window
layer holds its newest W - 1 tokens as canonical keys, rotated keys and values (see backends/runtime.py).

Hooking into transformers. The model runs its own code; small attachments make it slot-aware: a
forward hook on the module that produces the pre-rotary key (k_norm where the attention module has
one, else k_proj; its output layout is read off the first forward) writes the exact canonical key;
a `Cache` subclass whose paged layers write rotated keys and values into the slots the backend
allocated for this forward and whose window layers append to their windows; an attention function
registered with `AttentionInterface` that runs SDPA over what the cache returned with the backend's
boolean mask (one per layer type, as a dict where the model takes one), applies attention sinks
(gpt-oss `s_aux`) as a virtual key, and refuses to run without a mask or with logit softcapping.
A forward pre-hook on the embedding counts every token that enters the model.

Dependency rules: torch, transformers, numpy, xxhash; backends know nothing about contextd or policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import shutil
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import (
    Cache,
    CacheLayerMixin,
    DummyLayer,
    LinearAttentionLayer,
    get_layer_types_and_kwargs,
)
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from . import rope
from .loaded_model import LayerRoles, LoadedModel, WindowShape
from .models import ModelSource, SourceKind, build_once, cache_dir, check_supported, gguf_folder, read_config
from .protocol import (
    Backend,
    BackendError,
    BackendUnavailableError,
    RecurrentSnapshot,
    UnsupportedModelError,
)
from .runtime import SlotBackend
from .slot_store import Landing, SlotStore
from .slots import as_run, folder_identity, model_identity, runs_of

__all__ = ["TorchBackend", "ATTENTION_IMPLEMENTATION", "classify", "load", "unpacked_gguf"]

ATTENTION_IMPLEMENTATION = "kv_elision_slots"
# Slots in up to this many runs are written run by run with slice copies; more, with index copies.
MOST_RUNS = 4

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# The masks of the forward running on this thread that are plain causal attention (no gap, the
# forward's tokens last): id(mask) -> "causal" (square: SDPA's is_causal) or "all" (one query).
_SHORTCUTS = threading.local()
# The batched decode running on this thread, if any (`_BatchRows`): attention runs row by row over
# each session's own slots.
_BATCH = threading.local()
# The slot store of the forward running on this thread when that forward is watched (its `watch`):
# the attention of its watched layers reports its weights there.
_WATCHED = threading.local()


def _watch_weights(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor,
                   scaling: float | None, s_aux: torch.Tensor | None) -> None:
    """Add this layer's softmax weights of the watched queries, summed over heads and queries, to
    the store's per-slot accumulator: the same scores the layer's SDPA computes, for the last few
    queries only (SDPA does not hand its weights out)."""
    st: _SlotStore | None = getattr(_WATCHED, "store", None)
    if st is None or st.watch is None:
        return
    a = st.rt.paged_index.get(getattr(module, "layer_idx", -1))
    if a is None or a not in st.watch.layers:
        return
    n = min(st.watch.queries, query.shape[2])
    q = query[:, :, -n:].float()
    k = repeat_kv(key, query.shape[1] // key.shape[1]).float()
    logits = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    logits = logits.masked_fill(~mask[..., -n:, :], float("-inf"))
    if s_aux is not None:
        sink = s_aux.float().view(1, -1, 1, 1).expand(*logits.shape[:3], 1)
        weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(logits, dim=-1)
    st.accumulate_weights(weights.sum(dim=(0, 1, 2)), int(weights.shape[0] * weights.shape[1] * n))


def _slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA over what the slot cache returned. Free slots hold stale data, so running without the
    slot mask would be silently wrong: refuse instead. A mask the backend marked as plain causal
    runs as SDPA's own causal attention (or unmasked, for one query), its fastest kernels.
    `s_aux` (gpt-oss attention sinks, one logit per query head) enters as a virtual key whose logit
    is the sink and whose value is zero: that is the model's softmax over [scores, sink] with the
    sink column dropped."""
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
        raise BackendError("slot attention needs the backend's boolean slot mask; run the model through TorchBackend")
    if kwargs.get("softcap") is not None:
        raise UnsupportedModelError("attention logit softcapping is not applied by the slot attention")
    kwargs.pop("is_causal", None)
    kwargs.pop("sliding_window", None)  # the window is in the mask
    rows: _BatchRows | None = getattr(_BATCH, "rows", None)
    if rows is not None and rows.reads:
        reads, rows.reads = rows.reads, []
        outs = [_slot_attention(module, query[b:b + 1], k, v, mask, dropout, scaling, s_aux, **kwargs)[0]
                for b, (k, v, mask) in enumerate(reads)]
        return torch.cat(outs, dim=0), None
    _watch_weights(module, query, key, attention_mask, scaling, s_aux)
    shortcut = getattr(_SHORTCUTS, "masks", {}).get(id(attention_mask))
    if s_aux is None:
        if shortcut is not None and tuple(attention_mask.shape[-2:]) == (query.shape[2], key.shape[2]):
            return sdpa_attention_forward(module, query, key, value, None, dropout=dropout, scaling=scaling,
                                          is_causal=shortcut == "causal", **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=False, **kwargs)
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    b, h, s, _ = query.shape
    k = key.shape[2]
    bias = torch.zeros((1, 1, s, k), dtype=query.dtype, device=query.device)
    bias = bias.masked_fill(~attention_mask, float("-inf")).expand(b, h, s, k)
    sink = s_aux.to(query.dtype).view(1, h, 1, 1).expand(b, h, s, 1)
    key = torch.cat([key, key.new_zeros(b, h, 1, key.shape[-1])], dim=2)
    value = torch.cat([value, value.new_zeros(b, h, 1, value.shape[-1])], dim=2)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=torch.cat([bias, sink], dim=-1), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION_IMPLEMENTATION, _slot_attention)


def _np_from_tensor(t: torch.Tensor, *, copy: bool = True) -> np.ndarray:
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


def _tensor_from_np(a: np.ndarray, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


# ------------------------------------------------------------------------------------------------
# What the model is: layer roles from transformers' cache kinds and the decoder's modules
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Classified:
    """A transformers model as the backend sees it."""

    family: str
    roles: LayerRoles
    decoder: Any                           # the module holding `layers` (model.model, or its language_model)
    attention: dict[int, Any]              # paged and window layers -> their attention module
    key_modules: dict[int, str]            # paged and window layers -> "k_norm" or "k_proj"
    mask_types: tuple[str, ...]            # the config's layer types (keys of a mask dict)
    mask_dict: bool                        # the decoder takes masks as a dict by layer type


def _decoder(model: Any, family: str) -> Any:
    inner = getattr(model, "model", None)
    for candidate in (inner, getattr(inner, "language_model", None)):
        if isinstance(candidate, torch.nn.Module) and isinstance(getattr(candidate, "layers", None),
                                                                 torch.nn.ModuleList):
            return candidate
    raise UnsupportedModelError(f"{family}: {type(model).__name__} has no decoder with a `layers` list "
                                "(model.model.layers): no adapter knows where its attention layers are")


def _attention_module(layer: Any) -> Any:
    for name in ("self_attn", "mixer", "attention", "attn"):
        mod = getattr(layer, name, None)
        if isinstance(mod, torch.nn.Module) and hasattr(mod, "q_proj"):
            return mod
    return None


def _takes_mask_dict(decoder: Any) -> bool:
    try:
        source = inspect.getsource(type(decoder).forward)
    except (OSError, TypeError):
        return False
    return "isinstance(causal_mask_mapping := attention_mask, dict)" in source


def classify(model: Any) -> Classified:
    """Roles of every decoder layer (see module docstring); UnsupportedModelError names what is missing."""
    config = model.config.get_text_config()
    family = str(getattr(config, "model_type", type(model).__name__))
    decoder = _decoder(model, family)
    for absolute in ("embed_positions", "wpe", "position_embeddings"):
        if isinstance(getattr(decoder, absolute, None), torch.nn.Module):
            raise UnsupportedModelError(f"{family}: learned absolute position embeddings ({absolute}): keys depend "
                                        "on absolute positions and cannot be re-anchored")
    layers = decoder.layers
    kinds, kwargs = get_layer_types_and_kwargs(config)
    if len(kinds) != len(layers):
        raise UnsupportedModelError(f"{family}: {len(kinds)} layer types for {len(layers)} layers")
    paged: list[int] = []
    window: list[int] = []
    recurrent: list[int] = []
    shared: list[int] = []
    stateless: list[int] = []
    windows: set[int] = set()
    attention: dict[int, Any] = {}
    key_modules: dict[int, str] = {}
    for i, (layer, kind, kw) in enumerate(zip(layers, kinds, kwargs, strict=True)):
        attn = _attention_module(layer)
        if kind in ("full_attention", "sliding_attention") or (kind == "dummy" and attn is not None):
            if attn is None:
                raise UnsupportedModelError(f"{family}: layer {i} ({kind}) has no attention module with q_proj / "
                                            "k_proj: no per-head pre-rotary key to page (fused QKV?)")
            if getattr(attn, "is_kv_shared_layer", False):
                shared.append(i)
                continue
            if kind == "dummy":
                raise UnsupportedModelError(f"{family}: layer {i} has attention without a cache of its own")
            if isinstance(getattr(attn, "k_norm", None), torch.nn.Module):
                key_modules[i] = "k_norm"
            elif isinstance(getattr(attn, "k_proj", None), torch.nn.Module):
                key_modules[i] = "k_proj"
            else:
                raise UnsupportedModelError(f"{family}: attention module {type(attn).__name__} of layer {i} has no "
                                            "k_proj: no per-head pre-rotary key to page")
            if getattr(config, "attn_logit_softcapping", None) is not None and "softcap" in inspect.getsource(
                    type(attn).forward):
                raise UnsupportedModelError(f"{family}: attention logit softcapping (attn_logit_softcapping) needs an "
                                            "attention kernel that applies it")
            attention[i] = attn
            if kind == "full_attention":
                paged.append(i)
            else:
                window.append(i)
                windows.add(int(kw["sliding_window"]))
        elif kind == "linear_attention":
            recurrent.append(i)
        elif kind == "dummy":
            stateless.append(i)
        else:
            raise UnsupportedModelError(f"{family}: layer {i} is {kind!r}, which the slot cache cannot page exactly")
    if len(windows) > 1:
        raise UnsupportedModelError(f"{family}: sliding windows of different sizes {sorted(windows)}")
    roles = LayerRoles(n_layers=len(layers), paged=tuple(paged), window=tuple(window), recurrent=tuple(recurrent),
                       shared=tuple(shared), stateless=tuple(stateless), window_size=windows.pop() if windows else 0)
    roles.check(family)
    mask_types = tuple(dict.fromkeys(str(k) for k in (getattr(config, "layer_types", None) or kinds)))
    return Classified(family=family, roles=roles, decoder=decoder, attention=attention, key_modules=key_modules,
                      mask_types=mask_types, mask_dict=_takes_mask_dict(decoder))


def _layer_shape(family: str, what: str, layers: Sequence[int],
                 attention: dict[int, Any]) -> tuple[int, int, int]:
    """(kv heads, head dim, value dim), the same for every layer of `layers`."""
    shapes = set()
    for i in layers:
        attn: Any = attention[i]
        head_dim = int(attn.head_dim)
        heads = int(attn.k_proj.out_features) // head_dim
        v_proj: Any = getattr(attn, "v_proj", None)
        value_dim = int(v_proj.out_features) // heads if v_proj is not None else head_dim
        shapes.add((heads, head_dim, value_dim))
    if len(shapes) != 1:
        raise UnsupportedModelError(f"{family}: the {what} layers differ in their K/V shapes {sorted(shapes)}")
    return shapes.pop()


def _rotary(decoder: Any, layer_type: str, device: torch.device) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling the model's rotary module uses for `layer_type` (per-layer-type
    buffers as in Gemma 3 / 4, else the single ones); empty without a rotary module (NoPE)."""
    rot = getattr(decoder, "rotary_emb", None)
    if rot is None:
        return torch.zeros(0, dtype=torch.float32, device=device), 1.0
    inv_freq = getattr(rot, f"{layer_type}_inv_freq", None)
    scaling = getattr(rot, f"{layer_type}_attention_scaling", None)
    if inv_freq is None:
        inv_freq, scaling = rot.inv_freq, getattr(rot, "attention_scaling", 1.0)
    return inv_freq.detach().to(device=device, dtype=torch.float32), float(1.0 if scaling is None else scaling)


# ------------------------------------------------------------------------------------------------
# The runtime and the slot store
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(kw_only=True)
class _Runtime(LoadedModel):
    """One loaded transformers model, shared by a backend and its forks."""

    model: PreTrainedModel
    shape: Classified
    device: torch.device
    dtype: torch.dtype
    inv_freq: torch.Tensor
    attention_scaling: float
    win_inv_freq: torch.Tensor
    win_scaling: float


def _rotate_into(canon: torch.Tensor, out: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                 positions: np.ndarray) -> None:
    """out[..., :r] = rope(canon[..., :r]) at `positions` (r = 2 * len(inv_freq); nothing when 0)."""
    if inv_freq.shape[0] == 0:
        return
    cos, sin = rope.cos_sin_torch(inv_freq, torch.from_numpy(positions), scaling)
    rope.apply_torch(canon, cos, sin, out=out)


def _byte_runs(buf: torch.Tensor, pieces: list[tuple[int, int, int]]) -> list[memoryview]:
    """buf[a, 0, h, first:end] as bytes for every layer a, head h and run (first, end, _) of
    `pieces`, in that order: where a block's [layers, heads, tokens, dim] section lands. Sliced
    out of one flat view of the (contiguous) buffer: a numpy view per run cost ~2.4 us, 0.44 ms
    of a warm SmolLM2 page's ~5 ms restore for its 180 runs."""
    assert buf.is_contiguous() and buf.shape[1] == 1
    layers, _, heads, capacity, dim = buf.shape
    flat = buf.view(torch.uint8).numpy().data.cast("B")
    row = dim * buf.element_size()
    spans = [(first * row, end * row) for first, end, _ in pieces]
    return [flat[base + a:base + b] for base in range(0, layers * heads * capacity * row, capacity * row)
            for a, b in spans]


class _SlotStore(SlotStore):
    """Slot buffers of one session, stacked over the paged layers, and the window caches (see the
    module docstring)."""

    group_elements = 1 << 18  # a layer group's slice of a page: about a megabyte
    rt: _Runtime

    def __init__(self, rt: _Runtime, capacity: int) -> None:
        L, H = len(rt.attention_layers), rt.num_kv_heads
        self.k_rot = torch.zeros((L, 1, H, 0, rt.head_dim), dtype=rt.dtype, device=rt.device)
        self.k_canon = torch.zeros((L, 1, H, 0, rt.rotary_dim), dtype=rt.dtype, device=rt.device)
        self.v = torch.zeros((L, 1, H, 0, rt.value_head_dim), dtype=rt.dtype, device=rt.device)
        self._tables: tuple[np.ndarray, torch.Tensor, torch.Tensor] | None = None
        super().__init__(rt, capacity)
        self.write_window(None)

    def _cos_sin(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at `positions`, kept for the last positions asked: a page's layer groups are
        rotated to the same positions one after another, and forming the tables for each group cost
        ~0.1 ms of a warm SmolLM2 page restore's ~9 ms (`write_keys` of 3 groups, 1.95 -> 1.67 ms)."""
        held = self._tables
        if held is None or not np.array_equal(held[0], positions):
            rt = self.rt
            cos, sin = rope.cos_sin_torch(rt.inv_freq, torch.from_numpy(positions), rt.attention_scaling)
            held = self._tables = (positions.copy(), cos, sin)
        return held[1], held[2]

    def _grow_buffers(self, capacity: int) -> None:
        old = self.capacity

        def bigger(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            shape[3] = capacity
            out = torch.zeros(shape, dtype=t.dtype, device=t.device)
            out[:, :, :, :old] = t
            return out

        self.k_rot, self.k_canon, self.v = bigger(self.k_rot), bigger(self.k_canon), bigger(self.v)

    def _copy_buffers(self) -> None:
        self.k_rot, self.k_canon, self.v = self.k_rot.clone(), self.k_canon.clone(), self.v.clone()
        self.win_canon = [t.clone() for t in self.win_canon]
        self.win_rot = [t.clone() for t in self.win_rot]
        self.win_v = [t.clone() for t in self.win_v]
        self.fwd_win_canon = [None] * len(self.win_canon)

    @staticmethod
    def _cat(a: Any, b: Any) -> Any:
        return torch.cat([a, b], dim=2)

    def index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.rt.device)

    def put(self, buf: torch.Tensor, slots: np.ndarray, src: torch.Tensor) -> None:
        """buf[:, :, slots] = src for a [layers, heads, capacity, d] view; slots in a few runs (the
        usual case: a restored page lands in slots evictions freed) are slice copies."""
        pieces = runs_of(slots, MOST_RUNS)
        if pieces is None:
            buf.index_copy_(2, self.index(slots), src)
            return
        for first, end, at in pieces:
            buf[:, :, first:end].copy_(src[:, :, at:at + end - first])

    def take(self, buf: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        """buf[:, :, slots] as a new tensor [layers, heads, n, d]."""
        pieces = runs_of(slots, MOST_RUNS)
        if pieces is None:
            return buf.index_select(2, self.index(slots))
        if len(pieces) == 1:
            return buf[:, :, pieces[0][0]:pieces[0][1]].clone()
        return torch.cat([buf[:, :, first:end] for first, end, _ in pieces], dim=2)

    def _rotate(self, a0: int, a1: int, slots: np.ndarray, positions: np.ndarray,
                canon: torch.Tensor | None = None) -> None:
        """k_rot[a0:a1, slots, :r] = rope(canonical keys, positions), run by run straight into
        place or by an index copy. `canon` [a1 - a0, heads, n, r]: the keys, when they are not
        (yet) the ones held in k_canon at `slots`."""
        cos, sin = self._cos_sin(positions)
        r = self.rt.rotary_dim
        pieces = runs_of(slots, MOST_RUNS)
        if pieces is None:
            idx = self.index(slots)
            src = canon if canon is not None else self.k_canon[a0:a1, 0].index_select(2, idx)
            self.k_rot[a0:a1, 0, :, :, :r].index_copy_(2, idx, rope.apply_torch(src, cos, sin))
            return
        for first, end, at in pieces:
            stop = at + end - first
            src = canon[:, :, at:stop] if canon is not None else self.k_canon[a0:a1, 0, :, first:end]
            rope.apply_torch(src, cos[at:stop], sin[at:stop], out=self.k_rot[a0:a1, 0, :, first:end, :r])

    # -- called from inside the model's forward ------------------------------------------------
    def write_layer(self, a: int, k_rot: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's rotated keys / values of paged layer `a`; return what attention reads."""
        assert self.fwd_slots is not None
        self.put(self.k_rot[a], self.fwd_slots, k_rot)
        self.put(self.v[a], self.fwd_slots, v)
        hw = self.fwd_high_water
        return self.k_rot[a, :, :, :hw], self.v[a, :, :, :hw]

    def write_canon(self, a: int, k_pre: torch.Tensor) -> None:
        """Store the exact pre-rotary keys [1, heads, n, head_dim] of paged layer `a`."""
        assert self.fwd_slots is not None
        self.put(self.k_canon[a], self.fwd_slots, k_pre[..., : self.rt.rotary_dim])

    # -- page operations ---------------------------------------------------------------------
    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """k_rot[slots] = rope(k_canon[slots], positions), for every paged layer."""
        if slots.shape[0] == 0:
            return
        if self.rt.rotary_dim:
            for a0, a1 in self.layer_groups(int(slots.shape[0])):
                self._rotate(a0, a1, slots, positions)
        self.pos[slots] = positions

    def gather(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rt = self.rt
        canon = self.take(self.k_canon[:, 0], slots)
        if rt.rotary_dim < rt.head_dim:
            canon = torch.cat([canon, self.take(self.k_rot[:, 0, :, :, rt.rotary_dim:], slots)], dim=-1)
        return _np_from_tensor(canon, copy=False), _np_from_tensor(self.take(self.v[:, 0], slots), copy=False)

    def rotated(self, slots: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return self.take(self.k_rot[:, 0], slots).float().cpu().numpy()

    def write_keys(self, slots: np.ndarray, a0: int, a1: int, keys: np.ndarray, positions: np.ndarray | None) -> None:
        """Canonical keys [a1 - a0, heads, n, head_dim] of paged layers [a0, a1) into `slots` and,
        given positions, their rotation there. The keys are read a second time for the rotation
        while still in cache."""
        rt = self.rt
        r = rt.rotary_dim
        k = _tensor_from_np(keys, rt.dtype, rt.device)
        self.put(self.k_canon[a0:a1, 0], slots, k[..., :r])
        if r < rt.head_dim:
            self.put(self.k_rot[a0:a1, 0, :, :, r:], slots, k[..., r:])
        if positions is None or not r:
            return
        self._rotate(a0, a1, slots, positions, k[..., :r])

    def write_values(self, slots: np.ndarray, a0: int, a1: int, values: np.ndarray) -> None:
        self.put(self.v[a0:a1, 0], slots, _tensor_from_np(values, self.rt.dtype, self.rt.device))

    def landing(self, slots: np.ndarray) -> Landing | None:
        """The slots' memory when the buffers are on the CPU, `slots` lie in a few runs, and a key's
        dims all go to one buffer (all rotary: k_canon; none: k_rot); else None."""
        rt = self.rt
        r = rt.rotary_dim
        pieces = runs_of(slots, MOST_RUNS)
        if rt.device.type != "cpu" or pieces is None or r not in (0, rt.head_dim):
            return None

        def rotate(a0: int, a1: int, positions: np.ndarray) -> None:
            if r:
                self._rotate(a0, a1, slots, positions)

        return Landing(_byte_runs(self.k_canon if r else self.k_rot, pieces), _byte_runs(self.v, pieces), rotate)

    def clear(self, slots: np.ndarray) -> None:
        for buf in (self.k_rot, self.k_canon, self.v):
            self.put(buf[:, 0], slots, torch.zeros_like(self.take(buf[:, 0], slots)))

    # -- window caches ---------------------------------------------------------------------------
    def reanchor_window(self, positions: np.ndarray) -> None:
        rt = self.rt
        r = rt.window.rotary_dim if rt.window else 0
        for w, canon in enumerate(self.win_canon):
            rot = canon.clone()
            _rotate_into(canon[..., :r], rot[..., :r], rt.win_inv_freq, rt.win_scaling, positions)
            self.win_rot[w] = rot

    def _to_host(self, t: Any) -> np.ndarray:
        return _np_from_tensor(t)

    def _weights_to_host(self, t: Any) -> np.ndarray:
        weights: np.ndarray = t.double().cpu().numpy()
        return weights

    def _from_host(self, a: np.ndarray) -> Any:
        return _tensor_from_np(a, self.rt.dtype, self.rt.device).clone()

    def rotated_window(self) -> list[np.ndarray]:
        with torch.no_grad():
            return [k.float().cpu().numpy() for k in self.win_rot]


@contextlib.contextmanager
def _single_threaded(device: torch.device) -> Iterator[None]:
    """Run CPU page operations on one intra-op thread.

    They are short, memory-bound copies. Parallel regions must wait for every worker, so whenever
    another process holds a core each op waits for a descheduled thread: on a 2-core machine with
    one busy neighbour a 128-token SmolLM2 restore took 80-200 ms with two threads and 6-8 ms with
    one. On an idle machine a restore costs the same either way (within ~1 ms of noise); a large
    compaction takes about twice as long, which its rarity pays for. (torch's thread count is
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


# transformers' cache classes are untyped; subclassing them is the one place we accept that.
class _SlotAttentionLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """Cache layer of one paged attention layer: a window onto the session's shared slot buffers."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: _SlotCache, attention_index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        # A weak reference: the cache owns its layers, and a cycle back to it kept every forked
        # session's slot buffers alive until a full garbage collection (a benchmark scoring views
        # on forks of an 8k-token cache grew to 17 GB and was killed).
        self.owner: _SlotCache = weakref.proxy(owner)
        self.attention_index = attention_index
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.store.write_layer(self.attention_index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.store.fwd_high_water, 0

    def get_seq_length(self) -> int:
        return int(self.owner.store.order.shape[0])

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise BackendError("slot attention layers are reset through TorchBackend.reset()")

    def crop(self, tokens_to_remove: int) -> None:
        raise BackendError("slot attention layers are edited through the backend's page operations")


class _WindowLayer(_SlotAttentionLayer):  # type: ignore[no-untyped-call]
    """Cache layer of one sliding-window layer: its own window of the newest stream tokens."""

    is_sliding = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.owner.store.append_window(self.attention_index, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.store.win_len + query_length, 0


class _SlotCache(Cache):
    """transformers `Cache` whose paged layers are slot windows, whose window layers keep their own
    windows, whose linear-attention layers are the stock ones (so hybrid recurrent state follows
    transformers exactly) and whose other layers hold nothing."""

    def __init__(self, store: _SlotStore, rt: _Runtime, linear_states: int) -> None:
        self.store = store
        paged, window, roles = rt.paged_index, rt.window_index, rt.roles
        layers: list[Any] = []
        for layer in range(roles.n_layers):
            if layer in paged:
                layers.append(_SlotAttentionLayer(self, paged[layer]))
            elif layer in window:
                layers.append(_WindowLayer(self, window[layer]))
            elif layer in roles.recurrent:
                layers.append(LinearAttentionLayer(number_of_states=linear_states))
            else:
                layers.append(DummyLayer())  # type: ignore[no-untyped-call]
        super().__init__(layers=layers)


def _tall_head(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """The vocabulary projection of a few rows as weight @ hidden^T: on the CPU the same product
    as `F.linear`, with the tall weight as the left operand. For SmolLM2's 49,152 x 576 head on
    this 2-core CPU, `F.linear` took 10.7 / 21.9 / 28.7 ms for 1 / 2 / 4 rows and this form 12.0 /
    7.8 / 8.2 ms: it reads the weight once for all rows (batched decode only)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.mm(head.weight, flat.t()).t()
    if head.bias is not None:
        out = out + head.bias
    return out.reshape(*hidden.shape[:-1], out.shape[-1])


class _BatchRows:
    """The sessions of one batched decode forward, row b being `stores[b]`'s one token: what the
    model's hooks (`rt.active`) and the batch cache's layers dispatch to, row by row. Each row's
    attention runs over its own session's slots with its own mask, so no session's K/V is copied
    or padded; only the projections and MLPs see the batch."""

    def __init__(self, stores: list[_SlotStore], masks: list[dict[str, torch.Tensor | None]]) -> None:
        self.stores = stores
        self.masks = masks
        # Per row, what the attention about to run reads: (keys, values, mask), set by a layer's update.
        self.reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def observe_key(self, layer: int, out: torch.Tensor) -> None:
        for b, st in enumerate(self.stores):
            st.observe_key(layer, out[b:b + 1])

    def count_entered(self, n: int) -> None:
        assert n % len(self.stores) == 0
        for st in self.stores:
            st.count_entered(n // len(self.stores))


class _BatchLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """A paged or window layer of a batched decode: each row's token goes to its own session's
    slots (or window), and what each row's attention reads is left in `rows.reads`."""

    is_compileable = False
    is_croppable = False

    def __init__(self, rows: _BatchRows, index: int, sliding: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.rows, self.index, self.is_sliding = rows, index, sliding
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        kind = "sliding_attention" if self.is_sliding else "full_attention"
        reads = []
        for b, st in enumerate(self.rows.stores):
            k, v = key_states[b:b + 1], value_states[b:b + 1]
            keys, values = st.append_window(self.index, k, v) if self.is_sliding else st.write_layer(self.index, k, v)
            reads.append((keys, values, self.rows.masks[b][kind]))
        self.rows.reads = reads
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return 1, 0

    def get_seq_length(self) -> int:
        return max(int(st.order.shape[0]) for st in self.rows.stores)

    def get_max_length(self) -> int:
        return -1


class _BatchCache(Cache):
    """transformers `Cache` of one batched decode over sessions whose layers are all paged,
    window or cache-free (`TorchBackend.batches_decode`)."""

    def __init__(self, rows: _BatchRows, rt: _Runtime) -> None:
        paged, window = rt.paged_index, rt.window_index
        layers: list[Any] = []
        for layer in range(rt.roles.n_layers):
            if layer in paged:
                layers.append(_BatchLayer(rows, paged[layer], sliding=False))
            elif layer in window:
                layers.append(_BatchLayer(rows, window[layer], sliding=True))
            else:
                layers.append(DummyLayer())  # type: ignore[no-untyped-call]
        super().__init__(layers=layers)


def _clone_linear_layer(layer: LinearAttentionLayer) -> LinearAttentionLayer:
    out = LinearAttentionLayer(number_of_states=layer.number_of_states)
    for i in range(layer.number_of_states):
        conv, rec = layer.conv_states[i], layer.recurrent_states[i]
        out.conv_states[i] = conv.clone() if conv is not None else None
        out.recurrent_states[i] = rec.clone() if rec is not None else None
    out.is_conv_states_initialized = dict(layer.is_conv_states_initialized)
    out.is_recurrent_states_initialized = dict(layer.is_recurrent_states_initialized)
    out.has_previous_state = dict(layer.has_previous_state)
    out.conv_kernel_size = dict(layer.conv_kernel_size)
    out.device, out.dtype = layer.device, layer.dtype
    return out


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------

def unpacked_gguf(source: ModelSource) -> Path:
    """A GGUF source as a Hugging Face folder with its weights (float32, exactly as transformers'
    GGUF loader dequantizes them), written once under the cache folder. Why: that loader parses the
    header with its whole vocabulary and dequantizes every tensor on each load, 25 of the 30 s a
    SmolLM2 server took to start on 2 cores (Gemma 3: 68 of 80 s); from the folder the same weights,
    with the same identity, load in about a second."""
    assert source.path is not None and source.gguf_file is not None
    path, gguf_file, described = source.path, source.gguf_file, gguf_folder(source)

    def build(tmp: Path) -> None:
        from safetensors.torch import save_model

        config = AutoConfig.from_pretrained(str(described))
        model = AutoModelForCausalLM.from_pretrained(str(path), config=config, gguf_file=gguf_file,
                                                     dtype=torch.float32)
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # tied weights once
        shutil.copy(described / "config.json", tmp / "config.json")

    return build_once(cache_dir() / "gguf-torch" / described.name, build)


def _config(source: ModelSource) -> tuple[Any, Path, dict[str, Any]]:
    """(transformers config, the folder its weights load from, the config dict the identity hashes)."""
    assert source.path is not None
    if source.kind is SourceKind.MLX_QUANT:
        raise UnsupportedModelError(f"{source.name} is an MLX-quantized copy (mlx_lm.convert): serve it with the mlx "
                                    "backend")
    raw = read_config(gguf_folder(source) if source.kind is SourceKind.GGUF else source.path)
    if isinstance(raw.get("quantization"), dict):
        raise UnsupportedModelError(f"{source.name}: MLX-quantized weights ({raw['quantization'].get('bits')}-bit, "
                                    "mlx_lm.convert): serve it with the mlx backend")
    check_supported(raw, source.name)
    folder = unpacked_gguf(source) if source.kind is SourceKind.GGUF else source.path
    return AutoConfig.from_pretrained(str(folder)), folder, raw


def _make_runtime(source: ModelSource, device: str, dtype: str, model_id: str | None) -> _Runtime:
    if dtype not in _DTYPES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("device 'cuda' was requested but torch.cuda.is_available() is False")
    if dev.type not in ("cpu", "cuda"):
        raise BackendUnavailableError(f"device {device!r} is not supported by the torch backend (cpu, cuda)")
    config, folder, raw = _config(source)
    # The modules decide, before any weight is read: built on the meta device, nothing is allocated.
    with torch.device("meta"):
        classify(AutoModelForCausalLM.from_config(config))  # type: ignore[no-untyped-call]
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), config=config, dtype=_DTYPES[dtype],
                                                      attn_implementation=ATTENTION_IMPLEMENTATION)
    model = model.eval().to(dev)
    shape = classify(model)
    roles = shape.roles
    heads, head_dim, value_dim = _layer_shape(shape.family, "global-attention", roles.paged, shape.attention)
    inv_freq, scaling = _rotary(shape.decoder, "full_attention", dev)
    window: WindowShape | None = None
    win_inv_freq, win_scaling = torch.zeros(0, dtype=torch.float32, device=dev), 1.0
    if roles.window:
        w_heads, w_dim, w_value = _layer_shape(shape.family, "sliding-window", roles.window, shape.attention)
        win_inv_freq, win_scaling = _rotary(shape.decoder, "sliding_attention", dev)
        window = WindowShape(w_heads, w_dim, w_value, 2 * int(win_inv_freq.shape[0]))
    if model_id:
        identity = model_id
    elif source.kind is SourceKind.GGUF:
        identity = model_identity(raw, ((name, _np_from_tensor(p, copy=False), str(p.dtype))
                                        for name, p in model.named_parameters()))
    else:
        assert source.path is not None
        identity = folder_identity(source.path, raw)
    rt = _Runtime(
        source=source, model=model, shape=shape, family=shape.family, roles=roles, device=dev, dtype=_DTYPES[dtype],
        num_kv_heads=heads, head_dim=head_dim, value_head_dim=value_dim, rotary_dim=2 * int(inv_freq.shape[0]),
        inv_freq=inv_freq, attention_scaling=scaling, window=window, win_inv_freq=win_inv_freq,
        win_scaling=win_scaling, max_position_embeddings=int(config.get_text_config().max_position_embeddings),
        vocab_size=int(config.get_text_config().vocab_size), model_id=identity, dtype_name=dtype,
    )
    if rt.rotary_dim > head_dim or (window is not None and window.rotary_dim > window.head_dim):
        raise UnsupportedModelError(f"{shape.family}: rotary dims exceed the head dims")
    _install_hooks(rt)
    return rt


def _install_hooks(rt: _Runtime) -> None:
    """Hooks on the shared model dispatch to whichever session is running a forward (`rt.active`)."""
    shape = rt.shape

    def key_hook(layer: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> None:
            if rt.active is not None:
                rt.active.observe_key(layer, out)
        return hook

    for layer, attn in shape.attention.items():
        getattr(attn, shape.key_modules[layer]).register_forward_hook(key_hook(layer))

    def count_tokens(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        rt.tokens_entered(int(args[0].numel()) if args and isinstance(args[0], torch.Tensor) else 0)

    rt.model.get_input_embeddings().register_forward_pre_hook(count_tokens)


class TorchBackend(SlotBackend):
    """`Backend` on Hugging Face transformers. Construct with `load_backend("torch", ...)`."""

    name = "torch"
    _rt: _Runtime
    _store: _SlotStore
    _cache: _SlotCache

    _load_model = staticmethod(_make_runtime)

    @property
    def hf_model(self) -> PreTrainedModel:
        """The underlying transformers model (shared with forks; for harnesses and diagnostics)."""
        return self._rt.model

    def _device_name(self) -> str:
        return str(self._rt.device)

    def _new_store(self, capacity: int) -> _SlotStore:
        return _SlotStore(self._rt, capacity)

    def _new_cache(self) -> _SlotCache:
        states = int(getattr(self._rt.model.config.get_text_config(), "number_of_conv_states", 1))
        return _SlotCache(self._store, self._rt, states)

    def _masks(self, positions: np.ndarray, slots: np.ndarray,
               high_water: int) -> tuple[torch.Tensor | dict[str, torch.Tensor | None], dict[int, str]]:
        """The boolean masks: slots by position for the paged layers; by stream distance for the
        window layers (their window, then this forward's tokens). And which of them are plain causal
        attention (see `_slot_attention`): no free slot below the high-water one and this forward's
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
                _SHORTCUTS.masks, _WATCHED.store = shortcuts, st if st.watch is not None else None
                try:
                    out = rt.model(input_ids=input_ids, position_ids=position_ids, attention_mask=masks,
                                   cache=self._cache, use_cache=True, logits_to_keep=0 if every else 1)
                finally:
                    rt.active = None
                    _SHORTCUTS.masks, _WATCHED.store = {}, None
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
        stores: list[_SlotStore] = []
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
        batch = _BatchRows(stores, masks)
        n = len(rows)
        # The model only passes these along; each row's attention takes its own mask (`_slot_attention`).
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
                _SHORTCUTS.masks, _BATCH.rows = shortcuts, batch
                if tall:
                    head.forward = functools.partial(_tall_head, head)  # shadows Linear.forward for this call
                try:
                    out = rt.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                                   cache=_BatchCache(batch, rt), use_cache=True, logits_to_keep=1)
                finally:
                    rt.active = None
                    _SHORTCUTS.masks, _BATCH.rows = {}, None
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
                        states[key] = _np_from_tensor(t)
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
                    t = _tensor_from_np(snap.states[key], _DTYPES[snap.dtypes[key]], self._rt.device)
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
            other._cache.layers[i] = _clone_linear_layer(layer)


load = TorchBackend.load

# Static conformance: mypy checks TorchBackend against the protocol here.
_conforms: type[Backend] = TorchBackend
