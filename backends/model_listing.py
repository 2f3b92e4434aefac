"""What models this machine has, with per runtime whether each can be served (`kv-elision models`).

`list_local_models` walks the Hugging Face hub caches and LM Studio's models folders (where
`backends.models.resolve` finds `org/name`) and the built-in models whose packages are installed,
and gives each a verdict per runtime from its files alone: its config's refusals
(backends/model_config.py), MLX-quantized weights torch cannot read, a GGUF architecture the MLX
runtime does not read, a family mlx-lm has no module for. No weight is read and no runtime
imported; a runtime still checks a model's modules when it loads it. Apart from backends/models.py
because resolving a name is on every load's path, and this is only the listing's.

Dependency rules: backends.models / model_config / errors only.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import UnsupportedModelError
from .model_config import config_refusals, read_config, text_config
from .models import (
    GEMMA3_PACKAGE,
    ModelSource,
    SourceKind,
    hf_cache_roots,
    hf_snapshot,
    lmstudio_model_roots,
    resolve,
    source_from_folder,
)

__all__ = ["LocalModel", "describe_source", "list_local_models"]


@dataclasses.dataclass(frozen=True)
class LocalModel:
    """A model found on this machine: what it is and, per runtime, None (servable) or why not."""

    name: str
    path: Path
    origin: str
    format: str
    family: str
    runtimes: dict[str, str | None]


def _mlx_family_available(family: str) -> str | None:
    """Whether mlx-lm has a model module for `family`, from its files (importing mlx-lm takes seconds)."""
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or not spec.submodule_search_locations:
        return "mlx-lm is not installed"
    remap = {"mistral": "llama", "ministral": "llama", "qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe",
             "gemma4_unified": "gemma4"}
    module = remap.get(family, family)
    if not any((Path(loc) / "models" / f"{module}.py").is_file() for loc in spec.submodule_search_locations):
        return f"mlx-lm has no model module for {family!r}"
    return None


def describe_source(source: ModelSource) -> LocalModel:
    """Format, family and per-runtime verdict of a source, from its files alone (no weights read)."""
    assert source.path is not None
    if source.kind is SourceKind.GGUF:
        gguf = source.path / (source.gguf_file or "")
        family = _gguf_architecture(gguf)
        torch_ok: str | None = None
        mlx_ok = None if family == "llama" else f"the MLX backend reads GGUF files of the llama architecture only " \
                                               f"(this one is {family!r}); use a safetensors folder"
        if importlib.util.find_spec("mlx") is None:
            mlx_ok = "mlx is not installed"
        return LocalModel(source.name, gguf, source.origin, "gguf", family, {"torch": torch_ok, "mlx": mlx_ok})
    cfg = read_config(source.path)
    family = str(text_config(cfg).get("model_type") or cfg.get("model_type") or "?")
    reasons = config_refusals(cfg)
    common = "; ".join(reasons) if reasons else None
    quant = cfg.get("quantization")
    qconf: dict[str, Any] = cfg["quantization_config"] if isinstance(cfg.get("quantization_config"), dict) else {}
    if isinstance(quant, dict) and "bits" in quant:
        fmt = f"mlx {quant['bits']}-bit"
        torch_verdict: str | None = "MLX-quantized weights (mlx_lm.convert): serve it with --backend mlx"
    elif qconf.get("quant_method"):
        fmt = f"safetensors ({qconf['quant_method']})"
        torch_verdict = None
    else:
        fmt = "safetensors"
        torch_verdict = None
    mlx_verdict = _mlx_family_available(str(cfg.get("model_type") or family))
    return LocalModel(source.name, source.path, source.origin, fmt, family, {
        "torch": common or torch_verdict,
        "mlx": common or mlx_verdict,
    })


def _gguf_architecture(path: Path) -> str:
    """general.architecture of a GGUF file: llama.cpp writes it as the first key (parsing the whole
    header with GGUFReader takes seconds); anything else falls back to the reader."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
        if head[:4] == b"GGUF":
            offset = 4 + 4 + 8 + 8  # magic, version, tensor count, key count
            (klen,) = struct.unpack_from("<Q", head, offset)
            key = head[offset + 8:offset + 8 + klen]
            offset += 8 + klen
            (vtype,) = struct.unpack_from("<I", head, offset)
            if key == b"general.architecture" and vtype == 8:  # 8: string
                (vlen,) = struct.unpack_from("<Q", head, offset + 4)
                return head[offset + 12:offset + 12 + vlen].decode()
    except (OSError, struct.error, UnicodeDecodeError):
        pass
    try:
        from gguf import GGUFReader

        field = GGUFReader(str(path)).fields.get("general.architecture")
        if field is not None:
            return bytes(field.parts[field.data[0]]).decode()
    except Exception:  # a listing must not fail on one odd file
        pass
    return "?"


def _assembled_gemma3() -> Path | None:
    """The Gemma 3 270M GGUF where its package assembles it, if the package is installed and has
    assembled it already (not checked against its sha256: that is `gemma3_gguf_path`'s job)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        return None
    try:
        path = Path(importlib.import_module(GEMMA3_PACKAGE).default_output_path())
    except Exception:  # a listing must not fail on one odd package
        return None
    return path if path.is_file() else None


def _candidates() -> Iterator[ModelSource]:
    for root in hf_cache_roots():
        if not root.is_dir():
            continue
        for repo in sorted(root.glob("models--*--*")):
            name = repo.name.removeprefix("models--").replace("--", "/", 1)
            snap = hf_snapshot(root, name)
            if snap is not None:
                try:
                    found = source_from_folder(name, snap, "hf-cache")
                except UnsupportedModelError:
                    continue
                if found is not None:
                    yield found
    for root in lmstudio_model_roots():
        if not root.is_dir():
            continue
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()):
            name = f"{folder.parent.name}/{folder.name}"
            ggufs = sorted(folder.glob("*.gguf"))
            if len(ggufs) > 1:
                for g in ggufs:
                    yield ModelSource(name=str(g), kind=SourceKind.GGUF, path=folder, gguf_file=g.name,
                                      origin="lmstudio")
                continue
            found = source_from_folder(name, folder, "lmstudio")
            if found is not None:
                yield found


def list_local_models() -> list[LocalModel]:
    """Every model in the Hugging Face hub caches and LM Studio's models folders, plus the built-in
    models whose packages are installed (Gemma 3 270M once its GGUF is assembled: a listing does not
    write 253 MB), with per-runtime verdicts from their configs (the runtime checks modules at load)."""
    found: list[LocalModel] = []
    try:
        found.append(describe_source(resolve("smollm2-135m")))
    except UnsupportedModelError:
        pass
    gemma = _assembled_gemma3()
    if gemma is not None:
        found.append(describe_source(ModelSource(name="gemma3-270m", kind=SourceKind.GGUF, path=gemma.parent,
                                                 gguf_file=gemma.name, origin="package")))
    seen: set[Path] = set()
    for source in _candidates():
        assert source.path is not None
        key = (source.path / (source.gguf_file or "")).resolve()
        if key in seen:
            continue
        seen.add(key)
        try:
            found.append(describe_source(source))
        except (OSError, ValueError) as e:
            found.append(LocalModel(source.name, source.path, source.origin, "?", "?",
                                    {"torch": f"unreadable: {e}", "mlx": f"unreadable: {e}"}))
    return found
