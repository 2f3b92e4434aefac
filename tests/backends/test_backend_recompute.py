"""Recomputing held tokens in place (`Backend.recompute`, the blend): what it computes, what it keeps
exact, and what it refuses.

The view every test builds is one a paged session holds after a restore: 400 tokens prefilled, the
page [128, 256) saved, taken out and put back at the end, positions compacted. Its restored page
sits in the slots it left but at the view's last positions, so slot order and position order
differ, as they do in a served cache.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backends import Backend, UnsupportedModelError

from .conftest import HYBRIDS, Models

DENSE = ["tiny-llama", "tiny-qwen3", "tiny-mistral"]
WINDOWED = ["tiny-gemma3", "tiny-gemma4", "tiny-gpt-oss", "tiny-ministral"]
# float32 sums taken in another order (a masked attention over scrambled slots against a causal
# one over a contiguous cache) differ in their last bits; a wrong key or mask differs by O(1).
TOL = dict(rtol=2e-4, atol=2e-4)


def restored_view(models: Models, model: str) -> Backend:
    be = models.fresh(model, capacity=640)
    be.prefill(models.tokens[:400])
    page = be.save_block(128, 256)
    be.remove_attention_range(128, 256)
    be.insert_block(page, be.attention_tokens)
    be.compact_positions()
    np.testing.assert_array_equal(be.positions(), np.arange(400))
    return be


def counted(be: Backend) -> tuple[int, int]:
    c = be.counters
    return c.model_forward_tokens, c.new_prefill_tokens + c.decoded_tokens + c.blend_forward_tokens


@pytest.mark.parametrize("model", DENSE + WINDOWED)
def test_recomputing_every_token_equals_a_fresh_prefill_of_the_view(models: Models, model: str) -> None:
    """Every held token recomputed: the paged layers hold the K/V a fresh prefill of the same tokens at
    the same positions computes (within float32 rounding, `TOL`); on a dense model the next
    tokens then read the same logits. (On a sliding-window model the stream's window keeps the
    stream's newest tokens, which a fresh prefill of the view replaces, so only keys are compared.)"""
    be = restored_view(models, model)
    fresh = models.fresh(model, capacity=640)
    fresh.prefill(be.held_token_ids().tolist())
    assert not np.allclose(be.rotated_keys(), fresh.rotated_keys(), **TOL)   # the restored view is stale
    assert be.recompute(range(400)) == 400
    np.testing.assert_allclose(be.rotated_keys(), fresh.rotated_keys(), **TOL)
    np.testing.assert_array_equal(be.positions(), np.arange(400))
    assert be.attention_tokens == 400 and be.stream_tokens == 400 and be.recomputed_tokens == 400
    assert be.counters.blend_forward_tokens == 400
    forward, fed = counted(be)
    assert forward == fed == 800
    if model in DENSE:
        nxt = models.tokens[400:408]
        np.testing.assert_allclose(be.prefill(nxt), fresh.prefill(nxt), **TOL)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_recomputing_the_last_tokens_equals_prefilling_them_again(models: Models, model: str) -> None:
    """The view's last tokens recomputed attend to the rest as held, as a prefill of them does."""
    be = restored_view(models, model)
    again = be.fork()
    ids = again.held_token_ids()[370:].tolist()
    again.remove_attention_range(370, 400)
    again.prefill(ids)
    assert be.recompute(range(370, 400)) == 30
    np.testing.assert_allclose(be.rotated_keys(), again.rotated_keys(), **TOL)
    np.testing.assert_array_equal(be.rotated_keys(0, 370), again.rotated_keys(0, 370))
    nxt = models.tokens[400:408]
    np.testing.assert_allclose(be.prefill(nxt), again.prefill(nxt), **TOL)


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_scattered_tokens_equal_their_runs_recomputed_in_position_order(models: Models, model: str) -> None:
    """One recompute of scattered tokens reads what the same runs recomputed one call each, in
    position order, read: a token sees its earlier fellows recomputed, its later ones not at all.
    (On a sliding-window model the runs lie a window apart: a window layer reads the recomputed
    fellows of its own call only.)"""
    runs = [range(0, 8), range(140, 180), range(300, 316)]
    if model == "tiny-gemma3":
        runs = [range(0, 8), range(180, 220), range(390, 400)]
    chosen = [i for run in runs for i in run]
    at_once, by_run = restored_view(models, model), restored_view(models, model)
    at_once.recompute(chosen)
    for run in runs:
        by_run.recompute(run)
    np.testing.assert_allclose(at_once.rotated_keys(), by_run.rotated_keys(), **TOL)
    untouched = np.setdiff1d(np.arange(400), chosen)
    np.testing.assert_array_equal(at_once.rotated_keys()[:, :, untouched], by_run.rotated_keys()[:, :, untouched])


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_recomputing_nothing_changes_nothing(models: Models, model: str) -> None:
    be = restored_view(models, model)
    logits = be.prefill(models.tokens[400:404])
    keys, counters = be.rotated_keys(), be.counters
    assert be.recompute([]) == 0
    np.testing.assert_array_equal(be.rotated_keys(), keys)
    np.testing.assert_array_equal(be.last_logits(), logits)
    assert be.counters == counters and be.recomputed_tokens == 0


@pytest.mark.parametrize("model", DENSE[:1] + WINDOWED[:1])
def test_the_exact_kv_are_what_a_store_gets_and_what_comes_back(models: Models, model: str) -> None:
    """A recompute changes attention only: `save_block` returns the K/V held before, bit for bit;
    `drop_recomputed` puts them back, after which the session reads as if nothing had been
    recomputed. Positions, the stream, the window and the pending token are left alone."""
    be = restored_view(models, model)
    be.prefill(models.tokens[400:404])
    be.decode()
    twin = be.fork()
    exact = be.save_block(0, 404)
    keys, snap = be.rotated_keys(), be.snapshot_recurrent()
    chosen = np.r_[10:20, 250:300]
    be.recompute(chosen)
    moved = be.rotated_keys()
    assert not np.array_equal(moved[:, :, chosen], keys[:, :, chosen])
    np.testing.assert_array_equal(np.delete(moved, chosen, axis=2), np.delete(keys, chosen, axis=2))
    again = be.save_block(0, 404)
    np.testing.assert_array_equal(again.keys, exact.keys)
    np.testing.assert_array_equal(again.values, exact.values)
    assert be.pending_token == twin.pending_token and be.stream_tokens == twin.stream_tokens
    np.testing.assert_array_equal(be.positions(), twin.positions())
    if snap is not None:
        assert snap.equals(be.snapshot_recurrent())
    with pytest.raises(Exception, match="no logits|needs a prefill"):
        be.last_logits()
    assert be.drop_recomputed() == 60 and be.recomputed_tokens == 0
    np.testing.assert_array_equal(be.rotated_keys(), keys)
    assert [be.decode() for _ in range(4)] == [twin.decode() for _ in range(4)]
    np.testing.assert_array_equal(be.last_logits(), twin.last_logits())
    assert dataclasses.replace(be.counters, blend_forward_tokens=0, model_forward_tokens=0, forward_ns=0) == \
        dataclasses.replace(twin.counters, model_forward_tokens=0, forward_ns=0)
    forward, fed = counted(be)
    assert forward == fed


def test_forks_evictions_and_resets_keep_the_exact_kv_straight(models: Models) -> None:
    be = restored_view(models, "tiny-llama")
    exact = be.save_block(0, 400)
    be.recompute(range(100, 300))
    fork = be.fork()
    assert fork.recomputed_tokens == 200
    np.testing.assert_array_equal(fork.save_block(0, 400).keys, exact.keys)
    fork.drop_recomputed()
    assert be.recomputed_tokens == 200 and fork.recomputed_tokens == 0
    # Evicted recomputed tokens are forgotten with their slots; what stays is still handed out exact.
    be.remove_attention_range(200, 400)
    assert be.recomputed_tokens == 100
    np.testing.assert_array_equal(be.save_block(0, 200).values, exact.values[:, :, :200])
    be.prefill(models.tokens[:200])   # new tokens in the freed slots are not recomputed ones
    assert be.recomputed_tokens == 100
    assert be.save_block(200, 400).token_ids.tolist() == models.tokens[:200]
    be.reset()
    assert be.recomputed_tokens == 0


@pytest.mark.parametrize("model", HYBRIDS[:1])
def test_a_model_with_recurrent_layers_is_refused(models: Models, model: str) -> None:
    be = models.fresh(model)
    be.prefill(models.tokens[:64])
    with pytest.raises(UnsupportedModelError, match="recurrent"):
        be.recompute(range(8))
    assert be.counters.blend_forward_tokens == 0


def test_indices_outside_the_view_are_refused(models: Models) -> None:
    be = models.fresh("tiny-llama")
    be.prefill(models.tokens[:64])
    for bad in ([64], [-1], [0, 70]):
        with pytest.raises(IndexError):
            be.recompute(bad)
    assert be.recomputed_tokens == 0 and be.counters.blend_forward_tokens == 0
