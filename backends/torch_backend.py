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
import sys
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
from .models import ModelSource, build_tiny_model, check_supported
from .protocol import (
    Backend,
    BackendError,
    BackendUnavailableError,
    RecurrentSnapshot,
    UnsupportedModelError,
)
from .runtime import LoadedModel, SlotBackend, SlotStore, check_layer_split
from .slots import as_run, model_identity

__all__ = ["TorchBackend", "ATTENTION_IMPLEMENTATION", "load"]

ATTENTION_IMPLEMENTATION = "kv_elision_slots"

_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Families whose attention computes the pre-rotary key in k_norm (per-head RMSNorm after k_proj);
# the others produce it directly in k_proj as [batch, seq, heads * head_dim].
_KEY_FROM_K_NORM = frozenset({"qwen3", "qwen3_next"})


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


@dataclasses.dataclass(kw_only=True)
class _Runtime(LoadedModel):
    """One loaded transformers model, shared by a backend and its forks."""

    model: PreTrainedModel
    device: torch.device
    dtype: torch.dtype
    inv_freq: torch.Tensor
    attention_scaling: float


class _SlotStore(SlotStore):
    """Slot buffers of one session, stacked over the attention layers (see the module docstring)."""

    group_elements = 1 << 18  # a layer group's slice of a page: about a megabyte
    rt: _Runtime

    def __init__(self, rt: _Runtime, capacity: int) -> None:
        L, H = len(rt.attention_layers), rt.num_kv_heads
        self.k_rot = torch.zeros((L, 1, H, 0, rt.head_dim), dtype=rt.dtype, device=rt.device)
        self.k_canon = torch.zeros((L, 1, H, 0, rt.rotary_dim), dtype=rt.dtype, device=rt.device)
        self.v = torch.zeros((L, 1, H, 0, rt.value_head_dim), dtype=rt.dtype, device=rt.device)
        super().__init__(rt, capacity)

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
        """Canonical keys [a1 - a0, heads, n, head_dim] of attention layers [a0, a1) into `slots` and,
        given positions, their rotation there. The keys are read a second time for the rotation
        while still in cache."""
        rt = self.rt
        r = rt.rotary_dim
        k = _tensor_from_np(keys, rt.dtype, rt.device)
        self.put(self.k_canon[a0:a1, 0], slots, k[..., :r])
        if r < rt.head_dim:
            self.put(self.k_rot[a0:a1, 0, :, :, r:], slots, k[..., r:])
        if positions is None:
            return
        cos, sin = rope.cos_sin_torch(rt.inv_freq, torch.from_numpy(positions), rt.attention_scaling)
        run = as_run(slots)
        if run is not None:
            rope.apply_torch(k[..., :r], cos, sin, out=self.k_rot[a0:a1, 0, :, run[0]:run[1], :r])
        else:
            self.k_rot[a0:a1, 0, :, :, :r].index_copy_(2, self.index(slots), rope.apply_torch(k[..., :r], cos, sin))

    def write_values(self, slots: np.ndarray, a0: int, a1: int, values: np.ndarray) -> None:
        self.put(self.v[a0:a1, 0], slots, _tensor_from_np(values, self.rt.dtype, self.rt.device))

    def clear(self, slots: np.ndarray) -> None:
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
        model = build_tiny_model(source, ATTENTION_IMPLEMENTATION).to(dtype=dtype)
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
    check_layer_split(family, len(layers), attention_layers, linear_layers, getattr(config, "layer_types", None))
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
    rt = _Runtime(
        source=source, model=model, family=family, device=dev, dtype=_DTYPES[dtype],
        attention_layers=attention_layers, linear_layers=linear_layers, num_kv_heads=kv_heads,
        head_dim=head_dim, value_head_dim=value_head_dim, rotary_dim=rotary_dim, inv_freq=inv_freq,
        attention_scaling=scaling, max_position_embeddings=int(config.max_position_embeddings),
        vocab_size=int(config.vocab_size), model_id=identity, dtype_name=dtype,
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
        states = int(getattr(self._rt.model.config, "number_of_conv_states", 1))
        return _SlotCache(self._store, len(self._rt.model.model.layers), self._rt.attention_layers, states)

    def _forward(self, ids: list[int], positions: np.ndarray, slots: np.ndarray, high_water: int) -> np.ndarray:
        st, rt = self._store, self._rt
        dev = rt.device
        q_pos = torch.from_numpy(positions).to(dev)
        key_pos = torch.from_numpy(st.pos[:high_water]).to(dev)
        occupied = torch.from_numpy(st.occupied[:high_water]).to(dev)
        mask = (occupied[None, :] & (key_pos[None, :] <= q_pos[:, None]))[None, None]
        st.fwd_slots, st.fwd_high_water = slots, high_water
        input_ids = torch.tensor([ids], dtype=torch.long, device=dev)
        try:
            with rt.lock, torch.no_grad():
                rt.active = st
                try:
                    out = rt.model(input_ids=input_ids, position_ids=q_pos[None, :], attention_mask=mask,
                                   cache=self._cache, use_cache=True, logits_to_keep=1)
                finally:
                    rt.active = None
        finally:
            st.fwd_slots = None
        logits: np.ndarray = out.logits[0, -1].float().cpu().numpy()
        return logits

    @contextlib.contextmanager
    def _page_op(self) -> Iterator[None]:
        with self._rt.lock, torch.no_grad(), _single_threaded(self._rt.device), self._marked_page_op():
            yield

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
