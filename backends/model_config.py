"""What a model's config says about serving it exactly, before any weight is read.

`config_refusals` reads a config.json for what no runtime can page exactly (multi-head latent
attention, ALiBi, chunked or bidirectional attention, attention logit softcapping, rotary that
depends on the sequence length, a model whose attention layers are all sliding windows), each
reason naming what is missing; `check_supported` raises them. Support is decided from the model
itself, not from a list of family names: each runtime then checks the modules it built
(`classify` in backends/torch/structure.py and backends/mlx/structure.py). `text_config` is the language
model's part of a composite (multimodal) config. Apart from backends/models.py because the
runtimes read configs at load and the listing (backends/model_listing.py) reads them for its
verdicts, and neither needs to know how a name finds its files.

Dependency rules: backends.errors and backends.rope only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UnsupportedModelError
from .rope import DYNAMIC_ROPE_TYPES

__all__ = ["check_supported", "config_refusals", "read_config", "text_config"]


def read_config(folder: Path) -> dict[str, Any]:
    """A model folder's config.json."""
    cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    return cfg


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a (possibly multimodal, composite) config."""
    inner = cfg.get("text_config")
    if isinstance(inner, dict):
        merged = dict(inner)
        merged.setdefault("model_type", cfg.get("model_type"))
        return merged
    return cfg


def _rope_types(c: dict[str, Any]) -> list[str]:
    types: list[str] = []
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        nested = [v for v in rp.values() if isinstance(v, dict)]
        for r in nested or [rp]:
            types.append(str(r.get("rope_type", r.get("type", "default"))))
    rs = c.get("rope_scaling")
    if isinstance(rs, dict):
        types.append(str(rs.get("rope_type", rs.get("type", "default"))))
    return types


def config_refusals(cfg: dict[str, Any]) -> list[str]:
    """What in a config (a config.json dict) prevents serving the model exactly, each reason naming
    what is missing. Empty when nothing does; the runtime still checks the modules it builds."""
    c = text_config(cfg)
    family = str(c.get("model_type") or cfg.get("model_type"))
    out: list[str] = []
    if c.get("kv_lora_rank") is not None or c.get("q_lora_rank") is not None:
        out.append("multi-head latent attention (MLA: kv_lora_rank / q_lora_rank): keys are rebuilt from a compressed "
                   "latent plus a rotary part shared by the heads, there is no per-head pre-rotary key to page")
    attn_config: dict[str, Any] = c["attn_config"] if isinstance(c.get("attn_config"), dict) else {}
    if (c.get("alibi") or c.get("position_embedding_type") == "alibi" or family in ("bloom", "mpt")
            or attn_config.get("alibi")):
        out.append("ALiBi position bias: keys carry no rotation and the bias depends on query-key distances inside "
                   "the attention kernel, not on positions the cache could re-anchor")
    layer_types = [str(t) for t in (c.get("layer_types") or c.get("layers_block_type") or [])]
    if c.get("attention_chunk_size") is not None or "chunked_attention" in layer_types:
        out.append("chunked attention (attention_chunk_size): a block-local mask that is neither global attention "
                   "nor a sliding window")
    if c.get("use_bidirectional_attention") in (True, "all"):
        out.append("bidirectional attention (use_bidirectional_attention): a token's keys see later tokens")
    if c.get("attn_logit_softcapping") is not None and family.startswith("gemma2"):
        out.append("attention logit softcapping (attn_logit_softcapping): needs an attention kernel that applies it")
    dynamic = sorted(set(_rope_types(c)) & DYNAMIC_ROPE_TYPES)
    if dynamic:
        out.append(f"rope_type {dynamic[0]!r} changes its frequencies with the sequence length, so cached keys "
                   "cannot be re-anchored exactly; static rope types (default, linear, yarn, llama3, proportional) "
                   "are supported")
    attention = [t for t in layer_types if t in ("full_attention", "sliding_attention")]
    sliding_everywhere = (not layer_types and c.get("sliding_window") is not None
                          and c.get("use_sliding_window", True) is not False)
    if (attention and "full_attention" not in attention) or sliding_everywhere:
        out.append("no global-attention layer to page: every attention layer is a sliding window")
    return out


def check_supported(cfg: dict[str, Any], name: str = "") -> None:
    """Raise UnsupportedModelError with every config-level reason (see config_refusals)."""
    reasons = config_refusals(cfg)
    if reasons:
        family = text_config(cfg).get("model_type") or cfg.get("model_type")
        raise UnsupportedModelError(f"{name or family} ({family}) cannot be served exactly: " + "; ".join(reasons))
