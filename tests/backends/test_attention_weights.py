"""The model's own attention, read off the forward a prefill makes anyway
(`Backend.observe_attention` / `attention_weights`, the attention eviction order's input): what
the weights are, which forward they describe, and that slot order does not change them.

Each case runs on both runtimes (the `models` fixture); the two runtimes' weights for the same
real weights are compared in tests/backends/test_cross_backend.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import Backend

from .conftest import Models

TOL = dict(rtol=1e-4, atol=1e-6)


def watched(models: Models, model: str, queries: int = 8) -> Backend:
    be = models.fresh(model, capacity=640)
    be.observe_attention(queries, range(len(be.layer_view.attention_layers)))
    return be


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3", "tiny-qwen3-next"])
def test_the_weights_are_a_mean_softmax_row_over_the_held_tokens(models: Models, model: str) -> None:
    """Every watched query's weights over the held tokens sum to one at a paged (global) layer, so
    their mean does, for each watched layer and query head apart; a sliding-window or recurrent
    layer is never watched. A forward over 40 tokens in one call reads as the same 40 tokens
    ending a longer call (one row per query, the forward's own causal mask, whichever mask kernel
    ran)."""
    be = watched(models, model)
    be.prefill(models.tokens[:300])
    be.prefill(models.tokens[300:340])
    weights = be.attention_weights()
    assert weights is not None and weights.dtype == np.float64
    layers, heads, tokens = weights.shape          # every paged layer is watched here, each query head apart
    assert (layers, tokens) == (len(be.layer_view.attention_layers), 340) and heads >= 2
    assert (weights >= 0).all()
    np.testing.assert_allclose(weights.sum(axis=-1), np.ones((layers, heads)), atol=1e-5)
    assert weights[..., 332:].sum() > 0       # the last queries see themselves...
    assert np.ptp(weights, axis=1).max() > 1e-3   # ...and heads read apart
    once = watched(models, model)
    once.prefill(models.tokens[:340])
    np.testing.assert_allclose(once.attention_weights(), weights, **TOL)


def test_sinks_take_their_share_of_the_weights(models: Models) -> None:
    """gpt-oss's attention sinks take part of every row: what is left on the held tokens is below one
    (the tiny model's random sinks take a few parts in 1e5; float32 rows sum to one within 1e-6)."""
    be = watched(models, "tiny-gpt-oss")
    be.prefill(models.tokens[:200])
    weights = be.attention_weights()
    assert weights is not None
    rows = weights.sum(axis=-1)
    assert (rows > 0.99).all() and rows.mean() < 1.0 - 1e-5   # a head's sink may take less than rounding


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gemma3"])
def test_the_weights_follow_held_order_not_slots(models: Models, model: str) -> None:
    """A page taken out and put back in its place lands in other slots; the next forward's weights,
    in held order, are those of a twin that never moved it."""
    be, twin = watched(models, model), watched(models, model)
    for b in (be, twin):
        b.prefill(models.tokens[:400])
    page = be.save_block(128, 256)
    be.remove_attention_range(128, 256)
    be.prefill(models.tokens[400:420])   # the freed slots go to these tokens
    be.remove_attention_range(272, 292)
    be.insert_block(page, 128)
    twin.prefill(models.tokens[400:420])
    twin.remove_attention_range(400, 420)
    be.prefill(models.tokens[420:440])
    twin.prefill(models.tokens[420:440])
    np.testing.assert_array_equal(be.held_token_ids(), twin.held_token_ids())
    np.testing.assert_allclose(be.attention_weights(), twin.attention_weights(), **TOL)


def test_weights_describe_the_last_forward_only(models: Models) -> None:
    """After a page operation, a recompute, a decode or a forward without a watch there are no
    weights: they would describe a view that is no longer held. A fork watches as its parent
    does; 0 queries stops; a layer the model does not page is refused."""
    be = watched(models, "tiny-llama")
    be.prefill(models.tokens[:200])
    assert be.attention_weights() is not None
    blended = be.fork()
    blended.prefill(models.tokens[200:210])
    assert blended.attention_weights() is not None
    blended.recompute(range(0, 20))   # the held K/V changed, not the stream
    assert blended.attention_weights() is None
    fork = be.fork()
    be.decode()
    be.decode()
    assert be.attention_weights() is None
    fork.prefill(models.tokens[200:210])
    assert fork.attention_weights() is not None
    fork.remove_attention_range(0, 10)
    assert fork.attention_weights() is None
    fork.observe_attention(0, [])
    fork.prefill(models.tokens[210:220])
    assert fork.attention_weights() is None
    with pytest.raises(ValueError, match="do not exist"):
        fork.observe_attention(8, [len(fork.layer_view.attention_layers)])


def test_watching_changes_no_logit_and_no_count(models: Models) -> None:
    """The weights are read beside the forward: its logits, its K/V and its counters are those of
    an unwatched session."""
    be, plain = watched(models, "tiny-llama"), models.fresh("tiny-llama", capacity=640)
    logits = [b.prefill(models.tokens[:260]) for b in (be, plain)]
    np.testing.assert_array_equal(logits[0], logits[1])
    np.testing.assert_array_equal(be.rotated_keys(), plain.rotated_keys())
    assert be.counters.model_forward_tokens == plain.counters.model_forward_tokens == 260
