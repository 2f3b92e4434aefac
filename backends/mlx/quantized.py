"""MLX-quantized copies of models, made with mlx-lm's converter.

`quantized_copy` makes the copy a "-q4" / "-q8" built-in name stands for ("tiny-llama-q4",
"smollm2-135m-q4"), once, under the cache folder; `make_mlx_folder` writes any model (a name,
folder or .gguf) as an mlx-lm folder for `--backend mlx --model OUT`. A GGUF source first becomes a
Hugging Face folder (this package's GGUF reader, float32, its tokenizer); a folder gets an
mlx-readable copy (`mlx_config`, `fix_weights`).

Dependency rules: mlx, mlx-lm, backends.model_config / models and this package's gguf and
loading modules; transformers for the tokenizer of a GGUF.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import cast

import mlx.core as mx

from ..model_config import read_config
from ..models import ModelSource, build_once, cache_dir, copy_gguf_tokenizer, resolve
from .gguf import load_gguf
from .loading import fix_weights, mlx_config

__all__ = ["make_mlx_folder", "quantized_copy"]


def _write_mlx_folder(source: ModelSource, out: Path, bits: int, group: int) -> None:
    """`out` (not existing yet) := `source` quantized by mlx-lm's converter. A GGUF source first
    becomes a Hugging Face folder (transformers' GGUF loader, float32, its tokenizer); a folder gets
    an mlx-readable copy (the config entries of `mlx_config`, the expert layouts of `fix_weights`)."""
    from mlx_lm import convert

    assert source.path is not None
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-work-", dir=out.parent))
    try:
        base = source.path
        if source.gguf_file is not None:
            # transformers will not save a GGUF-loaded model: write the Hugging Face form this
            # module reads from the GGUF (the torch backend's exact weights) as the folder.
            base = work / "hf"
            base.mkdir()
            _, cfg, params = load_gguf(source, "float32")
            (base / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
            mx.save_safetensors(str(base / "model.safetensors"), dict(params), {"format": "pt"})
            del params
            copy_gguf_tokenizer(source, base)
        ready = work / "mlx-readable"
        ready.mkdir()
        raw = read_config(base)
        family = str(raw.get("model_type"))
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json",
                                                                                       "model.safetensors.index.json"):
                shutil.copy(f, ready / f.name)
        (ready / "config.json").write_text(json.dumps({**raw, **mlx_config(raw, base)}, indent=2))
        weights: dict[str, mx.array] = {}
        for f in sorted(base.glob("*.safetensors")):
            weights.update(cast(dict[str, mx.array], mx.load(str(f))))
        mx.save_safetensors(str(ready / "model.safetensors"), fix_weights(family, weights), {"format": "mlx"})
        del weights
        with contextlib.redirect_stdout(None):
            convert(hf_path=str(ready), mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=group)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def quantized_copy(source: ModelSource) -> Path:
    """The MLX-quantized copy of a built-in model ("tiny-llama-q4", "smollm2-135m-q4"), made once
    under the cache folder with mlx-lm's converter."""
    assert source.path is not None and source.quant_bits and source.quant_group
    bits, group = source.quant_bits, source.quant_group
    stem = source.path.name if source.gguf_file is None else Path(source.gguf_file).stem

    def build(tmp: Path) -> None:
        tmp.rmdir()  # the converter writes the folder itself
        _write_mlx_folder(source, tmp, bits, group)

    return build_once(cache_dir() / "mlx" / f"{stem}-mlx-q{bits}g{group}", build)


def make_mlx_folder(model: str, out: Path, bits: int = 4, group: int = 64) -> Path:
    """`out` := `model` (a name, folder or .gguf) as an mlx-lm folder quantized to `bits` (what
    `mlx_lm.convert -q` writes), for `--backend mlx --model OUT`. Nothing is done when `out` exists."""

    def build(tmp: Path) -> None:
        tmp.rmdir()
        _write_mlx_folder(resolve(model), tmp, bits, group)

    return build_once(out, build)
