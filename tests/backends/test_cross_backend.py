"""Torch and MLX run the same models on the same canonical formats (issue 7 must-shows).

- Both runtimes compute one model identity and one layer view for the same weights, so a block is
  accepted by the other runtime, and nothing else is.
- The same SmolLM2 prompt gives the same 32 greedy tokens on both.
- A block saved by torch restores in MLX and vice versa: the next-token logits equal the receiving
  runtime's own untouched reference within the suite's 1e-4, and greedy decoding goes on the same.
- Hybrid and sliding-window models: a whole session - attention block plus recurrent / window
  snapshot - moves between runtimes and continues as the receiving runtime would have computed it.
- Every family's tiny model loads from the same folder in both runtimes (transformers' loader;
  mlx-lm's own loader and model classes) as one model.

Tolerances: within one runtime the suite's (1e-4 logits). Across runtimes the arithmetic differs
legitimately - matmul and RMSNorm summation order, and the rotary angle `p * inv_freq` rounded to
float32 (at position 1,000 one ulp of the angle is 6e-5 rad), so canonical keys from the two
runtimes differ by ~3e-4 absolute on keys of magnitude ~10 and logits (magnitude ~20) by ~1e-4.
CROSS_LOGIT_TOL = 1e-3 bounds that with margin (5e-5 relative); a divergence in greedy tokens fails
with the top-2 margin at the divergence, so a near-tie is told apart from a real difference.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from backends import Backend, Block, BlockMismatchError, RecurrentSnapshot, load_backend
from backends.models import load_tokenizer, resolve
from backends.tiny_models import TINY_MODELS
from controller.eviction import page_votes
from harness.corpus import sample_tokens

from .conftest import FAMILIES

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlx") is None or importlib.util.find_spec("torch") is None,
    reason="cross-backend tests need both torch and mlx installed",
)

LOGIT_TOL = 1e-4  # the exactness suite's, for a restore checked against the same runtime
CROSS_LOGIT_TOL = 1e-3  # logits of the two runtimes against each other (see the module docstring)
# Nemotron-H's Mamba2 layers compute differently in the two runtimes (chunked scan, float32 state
# vs mlx-lm's): ~1e-2 apart on these logits. What it means for a block from the other runtime:
# its keys were computed by that runtime's Mamba2, so they fit the receiving runtime to that much.
FAMILY_TOL = {"tiny-nemotron-h": 3e-2}
TINY = FAMILIES
SESSION_MOVES = ["tiny-qwen3-next", "tiny-qwen3-5", "tiny-nemotron-h", "tiny-gemma3", "tiny-gpt-oss"]
SMOLLM2_PROMPT = 1024
PAGE = (384, 512)


def max_delta(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return sample_tokens(load_tokenizer(resolve("smollm2-135m")), SMOLLM2_PROMPT)


@dataclasses.dataclass
class Pair:
    torch: Backend
    mlx: Backend
    ids: list[int]

    def runtimes(self) -> list[tuple[Backend, Backend]]:
        """(source, destination) both ways."""
        return [(self.torch, self.mlx), (self.mlx, self.torch)]


def prefilled_pair(model: str, ids: list[int]) -> Pair:
    pair = Pair(load_backend("torch", model, capacity=len(ids) + 64),
                load_backend("mlx", model, capacity=len(ids) + 64), ids)
    pair.torch.prefill(ids)
    pair.mlx.prefill(ids)
    return pair


def assert_same_greedy(a: Backend, b: Backend, steps: int, tol: float = CROSS_LOGIT_TOL) -> None:
    """Both runtimes pick `steps` greedy tokens from their current state; tokens equal and every
    step's logits within `tol`. A divergence reports both top-2 margins."""
    worst = 0.0
    for step in range(steps):
        ta, tb = a.decode(), b.decode()
        la, lb = a.last_logits(), b.last_logits()
        if ta != tb:
            margins = [float(np.diff(np.sort(x)[-2:])[0]) for x in (la, lb)]
            pytest.fail(f"greedy tokens diverge at step {step}: {ta} vs {tb}; top-2 margins {margins}, "
                        f"logits max |delta| {max_delta(la, lb):.3g}")
        worst = max(worst, max_delta(la, lb))
    assert worst <= tol, worst


def restore_foreign_block(dst: Backend, blk: Block, page: tuple[int, int]) -> Backend:
    """On a fork of `dst`: evict `page`, compact (every later key re-anchored), insert `blk` (saved by
    the other runtime) through its bytes. Returns the fork."""
    be = dst.fork()
    be.remove_attention_range(*page)
    be.compact_positions()
    be.insert_block(Block.from_bytes(blk.to_bytes(), expect=be.layer_view), page[0])
    return be


def assert_restore_matches_own_reference(dst: Backend, restored: Backend, steps: int, tol: float = LOGIT_TOL) -> None:
    ref = dst.fork()
    first = [ref.decode(), ref.decode()], [restored.decode(), restored.decode()]
    assert first[0] == first[1]
    assert int(np.argmax(ref.last_logits())) == int(np.argmax(restored.last_logits()))
    assert max_delta(ref.last_logits(), restored.last_logits()) <= tol
    assert [ref.decode() for _ in range(steps)] == [restored.decode() for _ in range(steps)]
    c = restored.counters
    assert c.model_forward_tokens == c.new_prefill_tokens + c.decoded_tokens
    assert c.historical_forward_during_restore == 0


@pytest.mark.parametrize("model", TINY)
def test_tiny_models_one_identity_same_tokens_blocks_both_ways(model: str, tokens: list[int]) -> None:
    tol = FAMILY_TOL.get(model, CROSS_LOGIT_TOL)
    pair = prefilled_pair(model, tokens[:384])
    assert pair.torch.layer_view == pair.mlx.layer_view
    assert max_delta(pair.torch.last_logits(), pair.mlx.last_logits()) <= tol
    assert_same_greedy(pair.torch.fork(), pair.mlx.fork(), 16, tol)
    for src, dst in pair.runtimes():
        blk = src.save_block(128, 256)
        np.testing.assert_array_equal(blk.positions, np.arange(128, 256))
        assert_restore_matches_own_reference(dst, restore_foreign_block(dst, blk, (128, 256)), 8,
                                             FAMILY_TOL.get(model, LOGIT_TOL))


@pytest.mark.parametrize("model", SESSION_MOVES)
def test_a_hybrid_session_moves_between_runtimes(model: str, tokens: list[int]) -> None:
    """Attention block of every held token + recurrent / window snapshot, through bytes, into an
    empty session of the other runtime: it continues as that runtime's own prefill would."""
    tol = FAMILY_TOL.get(model, LOGIT_TOL)
    pair = prefilled_pair(model, tokens[:300])
    for src, dst in pair.runtimes():
        blk = Block.from_bytes(src.save_block(0, 300).to_bytes(), expect=dst.layer_view)
        snapshot = src.snapshot_recurrent()
        assert snapshot is not None
        snap = RecurrentSnapshot.from_bytes(snapshot.to_bytes())
        moved = load_backend(dst.name, model, capacity=384)
        moved.insert_block(blk, 0)
        moved.restore_recurrent(snap)
        assert moved.stream_tokens == 300 and moved.attention_tokens == 300
        back = moved.snapshot_recurrent()
        assert back is not None and back.states.keys() == snap.states.keys()
        # One layout in both runtimes, read back bit for bit - except the oldest conv column, which
        # no later step reads: transformers keeps it, mlx-lm keeps only kernel - 1 inputs (zeros).
        for key, state in snap.states.items():
            got = back.states[key]
            np.testing.assert_array_equal(got[..., 1:] if key.startswith("conv/") else got,
                                          state[..., 1:] if key.startswith("conv/") else state)
        native = dst.fork()
        a = [moved.decode(tokens[300])] + [moved.decode() for _ in range(15)]
        b = [native.decode(tokens[300])] + [native.decode() for _ in range(15)]
        assert a == b
        assert max_delta(moved.last_logits(), native.last_logits()) <= tol
        c = moved.counters
        assert c.model_forward_tokens == c.decoded_tokens == 16 and c.new_prefill_tokens == 0


def test_blocks_of_another_runtime_with_another_dtype_are_refused(tokens: list[int]) -> None:
    half = load_backend("torch", "tiny-llama", dtype="bfloat16", capacity=256)
    half.prefill(tokens[:200])
    full = load_backend("mlx", "tiny-llama", capacity=256)
    full.prefill(tokens[:200])
    with pytest.raises(BlockMismatchError, match="dtype"):
        full.insert_block(Block.from_bytes(half.save_block(0, 128).to_bytes()), 0)
    other = load_backend("torch", "tiny-qwen3", capacity=256)
    other.prefill(tokens[:200])
    with pytest.raises(BlockMismatchError, match="model_id"):
        full.insert_block(other.save_block(0, 128), 0)
    assert full.attention_tokens == 200


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-next"])
def test_a_local_hugging_face_folder_loads_in_both_runtimes_as_one_model(model: str, tokens: list[int],
                                                                         tmp_path: Path) -> None:
    """A saved checkpoint (other weights than the seeded tiny model) goes through each runtime's
    folder loader - transformers' own loader, then for MLX the conversion to mlx-lm's layout
    (fused experts, conv axis, (1 + w) norms) - and comes out as the same model in both."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_MODELS[model])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    pair = prefilled_pair(str(tmp_path), tokens[:256])
    assert pair.torch.layer_view == pair.mlx.layer_view
    assert pair.mlx.model_id != load_backend("mlx", model, capacity=64).model_id
    assert max_delta(pair.torch.last_logits(), pair.mlx.last_logits()) <= CROSS_LOGIT_TOL
    assert_same_greedy(pair.torch, pair.mlx, 8)


@pytest.fixture(scope="module")
def smollm2(tokens: list[int]) -> Pair:
    return prefilled_pair("smollm2-135m", tokens)


@pytest.mark.slow
def test_smollm2_same_prompt_same_32_greedy_tokens(smollm2: Pair) -> None:
    assert smollm2.torch.layer_view == smollm2.mlx.layer_view
    assert int(np.argmax(smollm2.torch.last_logits())) == int(np.argmax(smollm2.mlx.last_logits()))
    assert max_delta(smollm2.torch.last_logits(), smollm2.mlx.last_logits()) <= CROSS_LOGIT_TOL
    assert_same_greedy(smollm2.torch.fork(), smollm2.mlx.fork(), 32)


@pytest.mark.slow
def test_smollm2_block_saved_by_one_runtime_restores_in_the_other(smollm2: Pair) -> None:
    for src, dst in smollm2.runtimes():
        blk = src.save_block(*PAGE)
        np.testing.assert_array_equal(blk.token_ids, np.asarray(smollm2.ids[PAGE[0]:PAGE[1]]))
        restored = restore_foreign_block(dst, blk, PAGE)
        np.testing.assert_array_equal(restored.positions(), np.arange(SMOLLM2_PROMPT))
        np.testing.assert_array_equal(restored.held_token_ids(), np.asarray(smollm2.ids))
        assert_restore_matches_own_reference(dst, restored, 30)


def test_smollm2_attention_weights_agree_between_runtimes(smollm2: Pair) -> None:
    """The weights the attention eviction order reads (`Backend.observe_attention`) are the model's
    own: the two runtimes, whose SDPA kernels differ, read the same weights off the same forward
    (to float32 rounding) and put the same pages first."""
    weights = []
    for be in (smollm2.torch, smollm2.mlx):
        fork = be.fork()
        fork.observe_attention(32, [7, 15, 22])
        fork.prefill(smollm2.ids[:200])
        got = fork.attention_weights()
        assert got is not None
        weights.append(got)
    np.testing.assert_allclose(weights[0], weights[1], rtol=1e-3, atol=1e-6)
    assert weights[0].shape[:2] == (3, 9)   # the watched layers, SmolLM2's 9 query heads
    pages = [page_votes(w, [(start, start + 128) for start in range(0, 1152, 128)]) for w in weights]
    assert list(np.argsort(-pages[0])) == list(np.argsort(-pages[1]))
