"""The torch backend: Hugging Face transformers model code, CPU and CUDA, with a slot-based cache.

Cache layout. Every attention layer shares one set of preallocated slot buffers, stacked over the
attention layers so a page operation is one tensor op for all layers:

    k_rot   [layers, 1, kv_heads, capacity, head_dim]   keys as attention uses them (rotated)
    k_canon [layers, 1, kv_heads, capacity, rotary_dim] pre-rotary keys, rotary dims only (the
                                                        pass-through dims are equal in k_rot)
    v       [layers, 1, kv_heads, capacity, value_dim]

plus, on the host, a RoPE position and an occupied flag per slot and the logical order of the held
tokens (an array of slot numbers). Because a key carries its position in its rotation and the mask
is built from positions (`occupied & slot_pos <= query_pos`), attention does not depend on slot
order: new tokens take the lowest free slots, eviction only clears flags, and a restored page
lands in whatever slots are free. Re-anchoring always recomputes `rope(k_canon, new_pos)`.

Hooking into transformers. The model runs its own code; three small attachments make it slot-aware:
a forward hook on the module that produces the pre-rotary key (k_proj, or k_norm where the family
has one) writes the exact canonical key into `k_canon`; a `Cache` subclass whose attention layers
write rotated keys and values into the slots the backend allocated for this forward (linear-attention
layers are the stock `LinearAttentionLayer`, so Gated DeltaNet conv / recurrent states behave exactly
as in transformers); and an attention function registered with `AttentionInterface` that runs SDPA
over the slot buffers with the backend's slot mask (and refuses to run without one). A forward
pre-hook on the embedding counts every token that enters the model.

Dependency rules: torch, transformers, numpy, xxhash; backends know nothing about contextd or policy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from . import rope
from .base import (
    ROPE_LAYOUT_NEOX,
    Backend,
    BackendError,
    BackendUnavailableError,
    Block,
    BlockFileReader,
    BlockMismatchError,
    Counters,
    LayerView,
    RecurrentSnapshot,
    Tokenizer,
    UnsupportedModelError,
)
from .models import ModelSource, check_supported, load_tokenizer, resolve
from .slots import SlotBookkeeping, as_run, checked_token_ids, model_identity, pick_token

__all__ = ["TorchBackend", "ATTENTION_IMPLEMENTATION", "load"]

ATTENTION_IMPLEMENTATION = "kv_elision_slots"

# Key elements per step of page work (see _SlotStore.layer_groups).
_GROUP_ELEMENTS = 1 << 18

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Families whose attention computes the pre-rotary key in k_norm (per-head RMSNorm after k_proj);
# the others produce it directly in k_proj as [batch, seq, heads * head_dim].
_KEY_FROM_K_NORM = frozenset({"qwen3", "qwen3_next"})

# Config keys that do not change what the model computes; left out of the identity hash so the
# same weights loaded from another path or by another transformers version keep their identity.


def _slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA over slot buffers. Free slots hold stale data, so running without the slot mask would be
    silently wrong: refuse instead."""
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
        raise BackendError("slot attention needs the backend's boolean slot mask; run the model through TorchBackend")
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, attention_mask, is_causal=False, **kwargs)


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


@dataclasses.dataclass
class _Runtime:
    """One loaded model, shared by a backend and its forks."""

    source: ModelSource
    model: PreTrainedModel
    family: str
    device: torch.device
    dtype: torch.dtype
    dtype_name: str
    attention_layers: tuple[int, ...]
    linear_layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    value_head_dim: int
    rotary_dim: int
    inv_freq: torch.Tensor
    attention_scaling: float
    max_position_embeddings: int
    vocab_size: int
    view: LayerView
    lock: threading.RLock = dataclasses.field(default_factory=threading.RLock)
    active: _SlotStore | None = None
    page_op: TorchBackend | None = None
    tokenizer: Tokenizer | None = None


class _SlotStore:
    """Slot buffers and per-slot metadata of one session (see the module docstring)."""

    def __init__(self, rt: _Runtime, capacity: int) -> None:
        self.rt = rt
        self.capacity = 0
        L, H = len(rt.attention_layers), rt.num_kv_heads
        self.k_rot = torch.zeros((L, 1, H, 0, rt.head_dim), dtype=rt.dtype, device=rt.device)
        self.k_canon = torch.zeros((L, 1, H, 0, rt.rotary_dim), dtype=rt.dtype, device=rt.device)
        self.v = torch.zeros((L, 1, H, 0, rt.value_head_dim), dtype=rt.dtype, device=rt.device)
        self.pos = np.zeros(0, dtype=np.int64)
        self.occupied = np.zeros(0, dtype=bool)
        self.tokens = np.zeros(0, dtype=np.int32)
        self.order = np.zeros(0, dtype=np.int64)
        # Set for the duration of one forward: where this forward's tokens go, how far attention reads.
        self.fwd_slots: np.ndarray | None = None
        self.fwd_high_water = 0
        # The counters of the session owning this store; the embedding hook adds forward tokens here.
        self.owner_counters: Counters | None = None
        self.grow(capacity)

    def grow(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        old = self.capacity

        def bigger(t: torch.Tensor) -> torch.Tensor:
            shape = list(t.shape)
            shape[3] = capacity
            # zeros, not empty: masked slots still take part in SDPA's weights @ values product,
            # where a weight of 0 times uninitialised NaN bits would still be NaN.
            out = torch.zeros(shape, dtype=t.dtype, device=t.device)
            out[:, :, :, :old] = t
            return out

        self.k_rot, self.k_canon, self.v = bigger(self.k_rot), bigger(self.k_canon), bigger(self.v)
        self.pos = np.concatenate([self.pos, np.zeros(capacity - old, dtype=np.int64)])
        self.occupied = np.concatenate([self.occupied, np.zeros(capacity - old, dtype=bool)])
        self.tokens = np.concatenate([self.tokens, np.zeros(capacity - old, dtype=np.int32)])
        self.capacity = capacity

    def allocate(self, n: int) -> np.ndarray:
        """The `n` lowest free slots (growing the buffers if needed); keeps the high-water mark low."""
        free = np.flatnonzero(~self.occupied)
        if free.shape[0] < n:
            self.grow(max(2 * self.capacity, self.capacity + n - free.shape[0]))
            free = np.flatnonzero(~self.occupied)
        return free[:n].astype(np.int64)

    def high_water(self) -> int:
        occ = np.flatnonzero(self.occupied)
        return int(occ[-1]) + 1 if occ.shape[0] else 0

    def clone(self) -> _SlotStore:
        other = _SlotStore.__new__(_SlotStore)
        other.rt = self.rt
        other.capacity = self.capacity
        other.k_rot, other.k_canon, other.v = self.k_rot.clone(), self.k_canon.clone(), self.v.clone()
        other.pos, other.occupied = self.pos.copy(), self.occupied.copy()
        other.tokens, other.order = self.tokens.copy(), self.order.copy()
        other.fwd_slots, other.fwd_high_water = None, 0
        other.owner_counters = None
        return other

    def index(self, slots: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(slots, dtype=np.int64)).to(self.rt.device)

    def put(self, buf: torch.Tensor, slots: np.ndarray, src: torch.Tensor,
            idx: torch.Tensor | None = None) -> None:
        """buf[:, :, slots] = src for a [layers, heads, capacity, d] view; a run of consecutive slots
        (the usual case: a restored page lands in the slots its eviction freed) is a plain copy.
        `idx`: the slots as a device tensor, when the caller has it already."""
        run = as_run(slots)
        if run is not None:
            buf[:, :, run[0]:run[1]].copy_(src)
        else:
            buf.index_copy_(2, self.index(slots) if idx is None else idx, src)

    def take(self, buf: torch.Tensor, slots: np.ndarray) -> torch.Tensor:
        """buf[:, :, slots] as a new tensor [layers, heads, n, d]."""
        run = as_run(slots)
        if run is not None:
            return buf[:, :, run[0]:run[1]].clone()
        return buf.index_select(2, self.index(slots))

    # -- called from inside the model's forward ------------------------------------------------
    def write_layer(self, a: int, k_rot: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's rotated keys / values of attention layer `a`; return what attention reads."""
        assert self.fwd_slots is not None
        self.put(self.k_rot[a], self.fwd_slots, k_rot)
        self.put(self.v[a], self.fwd_slots, v)
        hw = self.fwd_high_water
        return self.k_rot[a, :, :, :hw], self.v[a, :, :, :hw]

    def write_canon(self, a: int, k_pre: torch.Tensor) -> None:
        """Store the exact pre-rotary keys [1, heads, n, head_dim] of attention layer `a`."""
        assert self.fwd_slots is not None
        self.put(self.k_canon[a], self.fwd_slots, k_pre[..., : self.rt.rotary_dim])

    # -- page operations ---------------------------------------------------------------------
    def layer_groups(self, n_tokens: int) -> Iterator[tuple[int, int]]:
        """Ranges of attention layers whose slice of a page is about a megabyte: whole-cache
        temporaries made compaction several times slower, and one step per layer made a page
        restore pay per-op overhead thirty times over."""
        n_layers, heads, dim = self.k_rot.shape[0], self.k_rot.shape[2], self.k_rot.shape[4]
        group = max(1, _GROUP_ELEMENTS // max(1, heads * n_tokens * dim))
        for a0 in range(0, n_layers, group):
            yield a0, min(n_layers, a0 + group)

    def reanchor(self, slots: np.ndarray, positions: np.ndarray) -> None:
        """k_rot[slots] = rope(k_canon[slots], positions), for every attention layer."""
        if slots.shape[0] == 0:
            return
        rt = self.rt
        r = rt.rotary_dim
        cos, sin = rope.cos_sin_torch(rt.inv_freq, torch.from_numpy(positions), rt.attention_scaling)
        run = as_run(slots)
        idx = self.index(slots) if run is None else None
        for a0, a1 in self.layer_groups(int(slots.shape[0])):
            if run is not None:
                src = self.k_canon[a0:a1, 0, :, run[0]:run[1]]
                rope.apply_torch(src, cos, sin, out=self.k_rot[a0:a1, 0, :, run[0]:run[1], :r])
            else:
                assert idx is not None
                src = self.k_canon[a0:a1, 0].index_select(2, idx)
                self.k_rot[a0:a1, 0, :, :, :r].index_copy_(2, idx, rope.apply_torch(src, cos, sin))
        self.pos[slots] = positions

    def write_keys(self, slots: np.ndarray, layers: tuple[int, int], keys: torch.Tensor,
                   cos_sin: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Store canonical keys [a1 - a0, heads, n, head_dim] of attention layers `layers` in
        `slots` and, given cos / sin, their rotation at those positions. The keys are read a
        second time for the rotation while still in cache."""
        a0, a1 = layers
        r = self.rt.rotary_dim
        self.put(self.k_canon[a0:a1, 0], slots, keys[..., :r])
        if r < self.rt.head_dim:
            self.put(self.k_rot[a0:a1, 0, :, :, r:], slots, keys[..., r:])
        if cos_sin is None:
            return
        cos, sin = cos_sin
        run = as_run(slots)
        if run is not None:
            rope.apply_torch(keys[..., :r], cos, sin, out=self.k_rot[a0:a1, 0, :, run[0]:run[1], :r])
        else:
            rotated = rope.apply_torch(keys[..., :r], cos, sin)
            self.k_rot[a0:a1, 0, :, :, :r].index_copy_(2, self.index(slots), rotated)

    def write_values(self, slots: np.ndarray, layers: tuple[int, int], values: torch.Tensor) -> None:
        self.put(self.v[layers[0]:layers[1], 0], slots, values)

    def clear(self, slots: np.ndarray) -> None:
        """Zero `slots` (after an aborted write: free slots must hold finite numbers, see grow)."""
        for buf in (self.k_rot, self.k_canon, self.v):
            self.put(buf[:, 0], slots, torch.zeros_like(self.take(buf[:, 0], slots)))


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
    """Cache layer of one attention layer: a window onto the session's shared slot buffers."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, owner: _SlotCache, attention_index: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.owner = owner
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


class _SlotCache(Cache):
    """transformers `Cache` whose attention layers are slot windows and whose linear-attention
    layers are the stock ones (so hybrid recurrent state follows transformers exactly)."""

    def __init__(self, store: _SlotStore, n_layers: int, attention_layers: Sequence[int],
                 linear_states: int) -> None:
        self.store = store
        layers: list[Any] = []
        att = {layer: i for i, layer in enumerate(attention_layers)}
        for layer in range(n_layers):
            if layer in att:
                layers.append(_SlotAttentionLayer(self, att[layer]))
            else:
                layers.append(LinearAttentionLayer(number_of_states=linear_states))
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


def _build_model(source: ModelSource, dtype: torch.dtype, device: torch.device) -> PreTrainedModel:
    if source.kind == "tiny":
        assert source.tiny_config is not None
        cfg_dict = dict(source.tiny_config)
        config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
        check_supported(config)
        # Seeded on a forked RNG: the same tiny model every time, without disturbing the caller's RNG.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(source.seed)
            model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, dtype=torch.float32, attn_implementation=ATTENTION_IMPLEMENTATION
            )
        model = model.to(dtype=dtype)
    else:
        assert source.path is not None
        kw: dict[str, Any] = {"gguf_file": source.gguf_file} if source.kind == "gguf" else {}
        config = AutoConfig.from_pretrained(str(source.path), **kw)
        check_supported(config)
        model = AutoModelForCausalLM.from_pretrained(
            str(source.path), dtype=dtype, attn_implementation=ATTENTION_IMPLEMENTATION, **kw
        )
    model.eval()
    loaded: PreTrainedModel = model.to(device)
    return loaded


def _check_rotary_layout(model: PreTrainedModel, attn: torch.nn.Module, inv_freq: torch.Tensor,
                         scaling: float, head_dim: int) -> None:
    """Compare our rotation with the model's own `apply_rotary_pos_emb` on fixed random keys: a family
    with another layout or scaling than we assume is refused instead of silently drifting."""
    modeling = sys.modules[type(attn).__module__]
    apply_model = getattr(modeling, "apply_rotary_pos_emb", None)
    if apply_model is None:
        raise UnsupportedModelError(
            f"{modeling.__name__} has no apply_rotary_pos_emb to check the rotary layout against"
        )
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn((1, 2, 5, head_dim), generator=gen).to(inv_freq.device)
    positions = torch.tensor([[0, 1, 17, 1000, 4097]], device=inv_freq.device)
    cos, sin = model.model.rotary_emb(keys, positions)
    _, expected = apply_model(keys, keys, cos, sin)
    r = 2 * inv_freq.shape[0]
    c, s = rope.cos_sin_torch(inv_freq, positions[0], scaling)
    ours = torch.cat([rope.apply_torch(keys[..., :r], c, s), keys[..., r:]], dim=-1)
    err = float((ours - expected.float()).abs().max())
    if not err <= 1e-5 * max(1.0, float(expected.abs().max())):
        raise UnsupportedModelError(
            f"{type(model).__name__}: the model's rotary embedding differs from the half-split ('neox') layout by "
            f"{err:.3g}; a family adapter for its layout is missing"
        )


def _make_runtime(source: ModelSource, device: str, dtype: str, model_id: str | None) -> _Runtime:
    if dtype not in _DTYPES:
        raise UnsupportedModelError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise BackendUnavailableError("device 'cuda' was requested but torch.cuda.is_available() is False")
    if dev.type not in ("cpu", "cuda"):
        raise BackendUnavailableError(f"device {device!r} is not supported by the torch backend (cpu, cuda)")
    model = _build_model(source, _DTYPES[dtype], dev)
    config = model.config
    family = str(config.model_type)
    layers = model.model.layers
    attention_layers = tuple(i for i, layer in enumerate(layers) if hasattr(layer, "self_attn"))
    linear_layers = tuple(i for i, layer in enumerate(layers) if hasattr(layer, "linear_attn"))
    if not attention_layers:
        raise UnsupportedModelError(f"{family}: the model has no attention layers to page")
    if len(attention_layers) + len(linear_layers) != len(layers):
        raise UnsupportedModelError(f"{family}: some layers are neither attention nor linear attention")
    attn = layers[attention_layers[0]].self_attn
    head_dim = int(attn.head_dim)
    kv_heads = int(config.num_key_value_heads)
    value_head_dim = int(attn.v_proj.out_features) // kv_heads
    rotary = model.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().to(device=dev, dtype=torch.float32)
    scaling = float(getattr(rotary, "attention_scaling", 1.0))
    _check_rotary_layout(model, attn, inv_freq, scaling, head_dim)
    module_name = "k_norm" if family in _KEY_FROM_K_NORM else "k_proj"
    for i in attention_layers:
        if not isinstance(getattr(layers[i].self_attn, module_name, None), torch.nn.Module):
            raise UnsupportedModelError(
                f"{family}: attention layer {i} has no {module_name} to read pre-rotary keys from"
            )
    identity = model_id or model_identity(model.config.to_dict(), (
        (name, _np_from_tensor(p, copy=False), str(p.dtype)) for name, p in model.named_parameters()))
    rotary_dim = 2 * int(inv_freq.shape[0])
    view = LayerView(
        model_id=identity,
        family=family,
        attention_layers=attention_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        value_head_dim=value_head_dim,
        rotary_dim=rotary_dim,
        rope_layout=ROPE_LAYOUT_NEOX,
        dtype=dtype,
    )
    rt = _Runtime(
        source=source, model=model, family=family, device=dev, dtype=_DTYPES[dtype], dtype_name=dtype,
        attention_layers=attention_layers, linear_layers=linear_layers, num_kv_heads=kv_heads,
        head_dim=head_dim, value_head_dim=value_head_dim, rotary_dim=rotary_dim, inv_freq=inv_freq,
        attention_scaling=scaling, max_position_embeddings=int(config.max_position_embeddings),
        vocab_size=int(config.vocab_size), view=view,
    )
    _install_hooks(rt, module_name)
    return rt


def _install_hooks(rt: _Runtime, module_name: str) -> None:
    """Hooks on the shared model dispatch to whichever session is running a forward (`rt.active`)."""
    layers = rt.model.model.layers
    head_dim = rt.head_dim

    def canon_hook(a: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            store = rt.active
            if store is None:
                return
            k = output
            if module_name == "k_proj":
                k = k.view(*k.shape[:-1], -1, head_dim)
            store.write_canon(a, k.transpose(1, 2))
        return hook

    for a, i in enumerate(rt.attention_layers):
        getattr(layers[i].self_attn, module_name).register_forward_hook(canon_hook(a))

    def count_tokens(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        n = int(args[0].numel()) if args and isinstance(args[0], torch.Tensor) else 0
        if rt.page_op is not None:
            rt.page_op._counters.historical_forward_during_restore += n
        if rt.active is not None and rt.active.owner_counters is not None:
            rt.active.owner_counters.model_forward_tokens += n

    rt.model.model.embed_tokens.register_forward_pre_hook(count_tokens)


class TorchBackend(SlotBookkeeping):
    """`Backend` on Hugging Face transformers. Construct with `load_backend("torch", ...)`."""

    name = "torch"
    _store: _SlotStore

    def __init__(self, rt: _Runtime, model_name: str, *, capacity: int = 4096, prefill_chunk: int = 512,
                 position_limit: int | None = None, seed: int = 0) -> None:
        self._rt = rt
        self.model_name = model_name
        self.device = str(rt.device)
        self.prefill_chunk = int(prefill_chunk)
        if self.prefill_chunk < 1:
            raise ValueError("prefill_chunk must be >= 1")
        # Compaction runs when a token would get a position >= position_limit.
        self.position_limit = int(position_limit or rt.max_position_embeddings)
        self._counters = Counters()
        self._rng = np.random.default_rng(seed)
        self._store = _SlotStore(rt, max(1, int(capacity)))
        self._store.owner_counters = self._counters
        self._cache = self._new_cache(self._store)
        self._stream_tokens = 0
        self._pending: int | None = None
        self._last_logits: np.ndarray | None = None
        self._broken: str | None = None

    # -- identity ----------------------------------------------------------------------------
    @property
    def hf_model(self) -> PreTrainedModel:
        """The underlying transformers model (shared with forks; for harnesses and diagnostics)."""
        return self._rt.model

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
    def is_hybrid(self) -> bool:
        return bool(self._rt.linear_layers)

    @property
    def max_position(self) -> int:
        return self._rt.max_position_embeddings - 1

    # -- state -------------------------------------------------------------------------------
    def rotated_keys(self, start: int = 0, end: int | None = None) -> np.ndarray:
        end = self.attention_tokens if end is None else end
        self._check_range(start, end)
        with torch.no_grad():
            return self._store.take(self._store.k_rot[:, 0], self._store.order[start:end]).float().cpu().numpy()

    # -- running the model -------------------------------------------------------------------
    def prefill(self, token_ids: Sequence[int]) -> np.ndarray:
        ids = checked_token_ids(token_ids, self._rt.vocab_size)
        if not ids:
            raise ValueError("prefill needs at least one token")
        self._pending = None
        for i in range(0, len(ids), self.prefill_chunk):
            chunk = ids[i:i + self.prefill_chunk]
            self._run_model(chunk)
            self._counters.new_prefill_tokens += len(chunk)
        return self.last_logits()

    def decode(self, token: int | None = None, *, greedy: bool = True, temperature: float = 1.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> int:
        feed = token if token is not None else self._pending
        if feed is not None:
            self._run_model(checked_token_ids([feed], self._rt.vocab_size))
            self._counters.decoded_tokens += 1
        elif self._last_logits is None:
            raise BackendError("decode needs a prefill (or an explicit token) first")
        if seed is not None:
            self._rng = np.random.default_rng(seed)
        assert self._last_logits is not None
        nxt = pick_token(self._last_logits, greedy, temperature, top_k, top_p, self._rng)
        self._pending = nxt
        return nxt

    def _run_model(self, ids: list[int]) -> None:
        """The one place that runs the model: allocate slots, build the slot mask, forward."""
        self._check_usable()
        st, rt = self._store, self._rt
        n = len(ids)
        positions = self._next_positions(n)
        slots = st.allocate(n)
        st.pos[slots] = positions
        st.occupied[slots] = True
        st.tokens[slots] = ids
        st.order = np.concatenate([st.order, slots])
        hw = st.high_water()
        dev = rt.device
        q_pos = torch.from_numpy(positions).to(dev)
        key_pos = torch.from_numpy(st.pos[:hw]).to(dev)
        occupied = torch.from_numpy(st.occupied[:hw]).to(dev)
        mask = (occupied[None, :] & (key_pos[None, :] <= q_pos[:, None]))[None, None]
        st.fwd_slots = slots
        st.fwd_high_water = hw
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        try:
            with rt.lock, torch.no_grad():
                rt.active = st
                try:
                    out = rt.model(input_ids=input_ids, position_ids=q_pos[None, :], attention_mask=mask,
                                   cache=self._cache, use_cache=True, logits_to_keep=1)
                finally:
                    rt.active = None
        except BaseException as e:
            # Linear-attention layers before the failure may already have advanced their state, so
            # the session no longer describes any prefix of the stream.
            self._broken = f"a forward pass failed ({type(e).__name__}: {e})"
            raise
        finally:
            st.fwd_slots = None
        self._stream_tokens += n
        self._last_logits = out.logits[0, -1].float().cpu().numpy()

    # -- page operations ---------------------------------------------------------------------
    @contextlib.contextmanager
    def _page_op(self) -> Iterator[None]:
        self._check_usable()
        with self._rt.lock, torch.no_grad(), _single_threaded(self._rt.device):
            self._rt.page_op = self
            try:
                yield
            finally:
                self._rt.page_op = None

    def save_block(self, start: int, end: int) -> Block:
        self._check_range(start, end, nonempty=True)
        st, rt = self._store, self._rt
        with self._page_op():
            slots = st.order[start:end]
            canon = st.take(st.k_canon[:, 0], slots)
            if rt.rotary_dim < rt.head_dim:
                canon = torch.cat([canon, st.take(st.k_rot[:, 0, :, :, rt.rotary_dim:], slots)], dim=-1)
            values = st.take(st.v[:, 0], slots)
            return Block(
                view=rt.view,
                keys=_np_from_tensor(canon, copy=False),
                values=_np_from_tensor(values, copy=False),
                positions=st.pos[slots].copy(),
                token_ids=st.tokens[slots].copy(),
                model_name=self.model_name,
            )

    def insert_block(self, blk: Block, at: int) -> None:
        rt, st = self._rt, self._store
        rt.view.require_same(blk.view)
        self._check_insert_at(at)
        with self._page_op():
            plan = self._plan_insert(at, blk.positions)
            slots = st.allocate(blk.n_tokens)
            keys = _tensor_from_np(blk.keys, rt.dtype, rt.device)
            values = _tensor_from_np(blk.values, rt.dtype, rt.device)
            cos_sin = None if plan.compact else self._cos_sin(plan.block_pos)
            for layers in st.layer_groups(blk.n_tokens):
                st.write_keys(slots, layers, keys[layers[0]:layers[1]], cos_sin)
                st.write_values(slots, layers, values[layers[0]:layers[1]])
            self._commit_insert(at, plan, slots, blk.token_ids)

    def insert_block_file(self, path: str | os.PathLike[str], at: int) -> None:
        """`insert_block(Block.from_file(path), at)`, with the disk read overlapped: keys are copied
        and rotated layer group by layer group as they arrive. Nothing becomes visible before the
        whole file has been read and its checksum verified."""
        rt, st = self._rt, self._store
        self._check_insert_at(at)
        with BlockFileReader(path, expect=rt.view) as rd, self._page_op():
            n = rd.n_tokens
            rd.wait("positions")
            plan = self._plan_insert(at, rd.arrays["positions"])
            slots = st.allocate(n)
            try:
                cos_sin = None if plan.compact else self._cos_sin(plan.block_pos)
                groups = list(st.layer_groups(n))
                for a0, a1 in groups:
                    rd.wait("keys", rows=a1)
                    keys = _tensor_from_np(rd.arrays["keys"][a0:a1], rt.dtype, rt.device)
                    st.write_keys(slots, (a0, a1), keys, cos_sin)
                for a0, a1 in groups:
                    rd.wait("values", rows=a1)
                    st.write_values(slots, (a0, a1), _tensor_from_np(rd.arrays["values"][a0:a1], rt.dtype, rt.device))
                blk = rd.finish()
            except BaseException:
                st.clear(slots)
                raise
            self._commit_insert(at, plan, slots, blk.token_ids)

    def _cos_sin(self, positions: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        rt = self._rt
        return rope.cos_sin_torch(rt.inv_freq, torch.from_numpy(positions), rt.attention_scaling)

    # -- recurrent state ---------------------------------------------------------------------
    def _linear_layers(self) -> list[tuple[int, LinearAttentionLayer]]:
        out = []
        for i in self._rt.linear_layers:
            layer = self._cache.layers[i]
            assert isinstance(layer, LinearAttentionLayer)
            out.append((i, layer))
        return out

    def snapshot_recurrent(self) -> RecurrentSnapshot | None:
        if not self.is_hybrid:
            return None
        states: dict[str, np.ndarray] = {}
        dtypes: dict[str, str] = {}
        with self._page_op():
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
        return RecurrentSnapshot(model_id=self.model_id, stream_tokens=self._stream_tokens,
                                 states=states, dtypes=dtypes)

    def restore_recurrent(self, snap: RecurrentSnapshot) -> None:
        if not self.is_hybrid:
            raise BackendError("this model has no recurrent layers")
        if snap.model_id != self.model_id:
            raise BlockMismatchError(
                f"recurrent snapshot belongs to model_id {snap.model_id}, this backend is {self.model_id}")
        with self._page_op():
            for i, layer in self._linear_layers():
                for s in range(layer.number_of_states):
                    conv_key, rec_key = f"conv/{i}/{s}", f"recurrent/{i}/{s}"
                    if conv_key not in snap.states:
                        layer.reset()
                        continue
                    for key, tensors, ready in ((conv_key, layer.conv_states, layer.is_conv_states_initialized),
                                                (rec_key, layer.recurrent_states,
                                                 layer.is_recurrent_states_initialized)):
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
            self._stream_tokens = snap.stream_tokens
            # Logits and the pending token belong to the stream point being left.
            self._last_logits = None
            self._pending = None

    # -- session -----------------------------------------------------------------------------
    def synchronize(self) -> None:
        if self._rt.device.type == "cuda":
            torch.cuda.synchronize(self._rt.device)

    def fork(self) -> TorchBackend:
        other = TorchBackend.__new__(TorchBackend)
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
        other._store.owner_counters = other._counters
        other._cache = other._new_cache(other._store)
        for i, layer in self._linear_layers():
            other._cache.layers[i] = _clone_linear_layer(layer)
        other._stream_tokens = self._stream_tokens
        other._pending = self._pending
        other._last_logits = None if self._last_logits is None else self._last_logits.copy()
        other._broken = self._broken
        return other

    def reset(self) -> None:
        st = self._store
        st.occupied[:] = False
        st.order = np.zeros(0, dtype=np.int64)
        self._cache = self._new_cache(st)
        self._stream_tokens = 0
        self._pending = None
        self._last_logits = None
        self._broken = None

    def _new_cache(self, store: _SlotStore) -> _SlotCache:
        states = int(getattr(self._rt.model.config, "number_of_conv_states", 1))
        return _SlotCache(store, len(self._rt.model.model.layers), self._rt.attention_layers, states)

def load(model: str, device: str = "cpu", dtype: str = "float32", *, capacity: int = 4096,
         prefill_chunk: int = 512, position_limit: int | None = None, seed: int = 0,
         model_id: str | None = None) -> TorchBackend:
    """Load `model` (name or path, see backends.models) into a new torch backend session.

    capacity: initial slots per attention layer (grows by doubling). prefill_chunk: tokens per
    forward during prefill. position_limit: positions at or above it trigger compaction (default:
    the model's max_position_embeddings). model_id: skip hashing the weights and use this identity.
    """
    source = resolve(model)
    rt = _make_runtime(source, device, dtype, model_id)
    return TorchBackend(rt, source.name, capacity=capacity, prefill_chunk=prefill_chunk,
                        position_limit=position_limit, seed=seed)


# Static conformance: mypy checks TorchBackend against the protocol here.
_conforms: type[Backend] = TorchBackend
