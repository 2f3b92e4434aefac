"""Hybrid models: attention-only operations never touch the recurrent (Gated DeltaNet, Mamba2) state,
nor the window caches of sliding-window layers; snapshots of both put a session back exactly."""

from __future__ import annotations

import numpy as np
import pytest

from backends import BackendError, Block, BlockMismatchError, RecurrentSnapshot

from .conftest import HYBRIDS, PREFILL_TOKENS, WINDOWED, Harness, Models

HYBRID = "tiny-qwen3-next"
STATEFUL = [*HYBRIDS, *WINDOWED]


@pytest.mark.parametrize("model", STATEFUL)
def test_recurrent_and_window_states_bit_identical_across_attention_ops(models: Models, model: str) -> None:
    pre = models.prefilled(model)
    be = pre.fork()
    assert be.is_hybrid
    taken = be.snapshot_recurrent()
    assert taken is not None
    # Compare against a copy that cannot alias the live tensors.
    base = RecurrentSnapshot.from_bytes(taken.to_bytes())
    kinds = {k.split("/")[0] for k in base.states}
    assert kinds == ({"window"} if model in WINDOWED else {"conv", "recurrent"})
    assert base.stream_tokens == PREFILL_TOKENS

    def unchanged() -> None:
        now = be.snapshot_recurrent()
        assert now is not None and now.equals(base)

    view = be.layer_view
    middle = Block.from_bytes(be.save_block(384, 512).to_bytes(), expect=view)
    unchanged()
    be.remove_attention_range(384, 512)
    unchanged()
    be.compact_positions()
    unchanged()
    be.insert_block(middle, 384)
    unchanged()
    head = be.save_block(0, 128)
    be.remove_attention_range(0, 128)
    unchanged()
    tail = be.save_block(be.attention_tokens - 128, be.attention_tokens)
    be.remove_attention_range(be.attention_tokens - 128, be.attention_tokens)
    unchanged()
    be.compact_positions()
    unchanged()
    be.insert_block(tail, be.attention_tokens)
    unchanged()
    be.insert_block(head, 0)
    unchanged()
    be.rotated_keys()
    unchanged()
    np.testing.assert_array_equal(be.held_token_ids(), np.asarray(pre.ids))
    # The check has teeth: one forward does change the states, and the earlier snapshot does not
    # follow them.
    be.prefill(pre.ids[:3])
    moved = be.snapshot_recurrent()
    assert moved is not None
    assert all(not np.array_equal(moved.states[k], base.states[k]) for k in base.states
               if k.startswith(("recurrent/", "window/")))
    assert taken.equals(base)


@pytest.mark.parametrize("model", [HYBRID, "tiny-nemotron-h"])
def test_naive_whole_cache_range_removal_would_change_recurrent_state(models: Models, harness: Harness,
                                                                       model: str) -> None:
    """The whole-cache range removal a stock runtime offers (it clears every layer, recurrent ones
    included) changes the recurrent and conv states; the attention-only removal does not."""
    pre = models.prefilled(model)
    before, after = harness.stock_recurrent_after_naive_removal(pre.be, pre.ids, 384, 512)
    assert before.keys() == after.keys() and before
    changed = [k for k in before if not np.array_equal(before[k], after[k])]
    assert any(k.startswith("recurrent/") for k in changed)
    assert any(k.startswith("conv/") for k in changed)
    be = pre.fork()
    taken = be.snapshot_recurrent()
    assert taken is not None
    base = RecurrentSnapshot.from_bytes(taken.to_bytes())
    be.remove_attention_range(384, 512)
    assert base.equals(be.snapshot_recurrent())


@pytest.mark.parametrize("model", STATEFUL)
def test_snapshot_round_trip_and_rewind(models: Models, model: str) -> None:
    """snapshot -> more tokens -> drop them from attention + restore the snapshot = the old session:
    a cut back puts the recurrent state, and the window of a sliding-window layer, back as they were."""
    be = models.fresh(model)
    ids = models.tokens[:300]
    be.prefill(ids[:256])
    twin = be.fork()
    snap = be.snapshot_recurrent()
    assert snap is not None
    data = snap.to_bytes()
    back = RecurrentSnapshot.from_bytes(data)
    assert back.equals(snap) and back.nbytes == snap.nbytes

    be.prefill(ids[256:300])
    moved = be.snapshot_recurrent()
    assert moved is not None
    assert any(not np.array_equal(moved.states[k], back.states[k]) for k in back.states)
    assert snap.equals(back)  # the snapshot did not follow the live state
    be.remove_attention_range(256, 300)
    be.restore_recurrent(back)
    assert be.stream_tokens == 256
    assert snap.equals(be.snapshot_recurrent())
    assert be.pending_token is None
    # Logits from before the rewind describe another stream point: the caller feeds the next token.
    with pytest.raises(BackendError):
        be.decode()
    a = [be.decode(ids[256])] + [be.decode() for _ in range(5)]
    b = [twin.decode(ids[256])] + [twin.decode() for _ in range(5)]
    assert a == b
    assert float(np.abs(be.last_logits() - twin.last_logits()).max()) <= 1e-4


@pytest.mark.parametrize("model", [HYBRID, "tiny-nemotron-h", "tiny-gemma3"])
def test_snapshot_restores_into_an_empty_session(models: Models, model: str) -> None:
    src = models.fresh(model)
    src.prefill(models.tokens[:200])
    snap = src.snapshot_recurrent()
    assert snap is not None
    dst = models.fresh(model)
    dst.restore_recurrent(snap)
    assert snap.equals(dst.snapshot_recurrent())
    empty = models.fresh(model).snapshot_recurrent()
    assert empty is not None and not empty.states
    dst.restore_recurrent(empty)
    again = dst.snapshot_recurrent()
    assert again is not None and not again.states and again.stream_tokens == 0


def test_snapshot_from_another_model_is_refused(models: Models) -> None:
    be = models.fresh(HYBRID)
    be.prefill(models.tokens[:64])
    snap = be.snapshot_recurrent()
    assert snap is not None
    forged = RecurrentSnapshot(model_id="0" * 32, stream_tokens=snap.stream_tokens, states=snap.states,
                               dtypes=snap.dtypes)
    with pytest.raises(BlockMismatchError, match="model_id"):
        be.restore_recurrent(forged)


def test_attention_only_models_have_no_recurrent_state(models: Models) -> None:
    be = models.fresh("tiny-llama")
    assert not be.is_hybrid
    assert be.snapshot_recurrent() is None
