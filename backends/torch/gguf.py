"""The GGUF path: a GGUF file as a Hugging Face folder of float32 weights, written once under the
cache folder, so that every load after the first reads a plain folder (`unpacked_gguf` says why).

Dependency rules: torch, transformers, safetensors and backends.models.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..models import ModelSource, build_once, cache_dir, gguf_folder

__all__ = ["unpacked_gguf"]


def unpacked_gguf(source: ModelSource) -> Path:
    """A GGUF source as a Hugging Face folder with its weights (float32, exactly as transformers'
    GGUF loader dequantizes them), written once under the cache folder. Why: that loader parses the
    header with its whole vocabulary and dequantizes every tensor on each load, most of a SmolLM2
    or Gemma 3 server's start; from the folder the same weights, with the same identity, load in
    a small fraction of that (docs/journal/2026-12-01-models.md)."""
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
