"""The attention function every model runs with: SDPA over the slot cache, under the backend's masks.

Importing this module registers `_slot_attention` with transformers' `AttentionInterface` as
`ATTENTION_IMPLEMENTATION`; the loader (loading.py) loads every model with it. Only the attention
function is ours, because free slots hold stale data: SDPA must run under the backend's boolean
masks (slots by position for paged layers, stream distance for window layers; one per layer type,
as a dict where the model takes one), and without one it refuses rather than be silently wrong. It
refuses logit softcapping too, which it does not apply; gpt-oss attention sinks (`s_aux`) enter as
a virtual key.

transformers hands an attention function nothing of ours but the mask, so what else a forward
tells its attention travels in thread-locals the backend sets around the model call: which masks
are plain causal (`SHORTCUTS`, run as SDPA's own causal attention), the rows of a batched decode
(`BATCH`, each row attending over its own session's slots) and the store of a watched forward
(`WATCHED`, to which the watched layers report their softmax weights).

Dependency rules: torch, transformers' SDPA integration, backends.protocol and this package's
cache and slot store modules.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.modeling_utils import AttentionInterface

from ..errors import BackendError, UnsupportedModelError
from .cache import BatchRows
from .slot_store import TorchSlotStore

__all__ = ["ATTENTION_IMPLEMENTATION", "BATCH", "SHORTCUTS", "WATCHED"]

ATTENTION_IMPLEMENTATION = "kv_elision_slots"

# The masks of the forward running on this thread that are plain causal attention (no gap, the
# forward's tokens last): id(mask) -> "causal" (square: SDPA's is_causal) or "all" (one query).
SHORTCUTS = threading.local()
# The batched decode running on this thread, if any (`BatchRows`): attention runs row by row over
# each session's own slots.
BATCH = threading.local()
# The slot store of the forward running on this thread when that forward is watched (its `watch`):
# the attention of its watched layers reports its weights there.
WATCHED = threading.local()


def _watch_weights(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor,
                   scaling: float | None, s_aux: torch.Tensor | None) -> None:
    """Add this layer's softmax weights of the watched queries, per head and summed over queries,
    to the store's per-slot accumulator: the same scores the layer's SDPA computes, for the last few
    queries only (SDPA does not hand its weights out)."""
    st: TorchSlotStore | None = getattr(WATCHED, "store", None)
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
    st.accumulate_weights(weights.sum(dim=(0, 2)), int(weights.shape[0] * n))


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
    rows: BatchRows | None = getattr(BATCH, "rows", None)
    if rows is not None and rows.reads:
        reads, rows.reads = rows.reads, []
        outs = [_slot_attention(module, query[b:b + 1], k, v, mask, dropout, scaling, s_aux, **kwargs)[0]
                for b, (k, v, mask) in enumerate(reads)]
        return torch.cat(outs, dim=0), None
    _watch_weights(module, query, key, attention_mask, scaling, s_aux)
    shortcut = getattr(SHORTCUTS, "masks", {}).get(id(attention_mask))
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
