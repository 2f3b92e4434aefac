"""`Backend.decode_batch`: several sessions (a backend and its forks) decode one token each, in one
forward where the runtime batches them. Each session must end exactly where its own `decode` would
have left it: the same tokens, held ids, positions and counters, and logits equal to float rounding
(a batched matrix product rounds differently, so not bit for bit). Sessions differ in length, in
gaps left by an eviction, in restored pages, in sampling, and cross a sliding window's size."""

from __future__ import annotations

import numpy as np
import pytest

from backends import Backend, BackendError, DecodeStep

from .conftest import Harness, Models

MODELS = ["tiny-llama", "tiny-qwen3-moe", "tiny-gemma3", "tiny-gpt-oss", "tiny-qwen3-next", "tiny-gemma4"]
STEPS = 12


def sessions(models: Models, model: str) -> list[Backend]:
    """Three sessions of `model` as a server holds them: 100 prefilled tokens; 300 with a page
    evicted from the middle and put back at its place; 180 (past a 160-token window)."""
    base = models.fresh(model)
    a, b, c = base, base.fork(), base.fork()
    a.prefill(models.tokens[:100])
    b.prefill(models.tokens[100:400])
    page = b.save_block(64, 192)
    b.remove_attention_range(64, 192)
    b.prefill(models.tokens[400:420])
    b.insert_block(page, 64)
    c.prefill(models.tokens[500:680])
    return [a, b, c]


SAMPLING = [{}, {}, {"greedy": False, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 5}]


@pytest.mark.parametrize("model", MODELS)
def test_a_batched_decode_leaves_each_session_where_its_own_decode_would(models: Models, model: str) -> None:
    if models.backend == "mlx" and model not in ("tiny-llama", "tiny-qwen3-next"):
        pytest.skip("MLX decodes a batch one session at a time; two families show it")
    alone, together = sessions(models, model), sessions(models, model)
    batching = together[0].batches_decode
    assert batching == (models.backend == "torch" and model not in ("tiny-qwen3-next", "tiny-gemma4"))
    tokens_alone = [[be.decode(**opts)] for be, opts in zip(alone, SAMPLING, strict=True)]  # type: ignore[arg-type]
    tokens_together = [[be.decode(**opts)] for be, opts in zip(together, SAMPLING, strict=True)]  # type: ignore[arg-type]
    for _ in range(STEPS):
        for be, picked, opts in zip(alone, tokens_alone, SAMPLING, strict=True):
            picked.append(be.decode(picked[-1], **{k: v for k, v in opts.items() if k != "seed"}))  # type: ignore[arg-type]
        steps = [DecodeStep(be, picked[-1], **{k: v for k, v in opts.items() if k != "seed"})  # type: ignore[arg-type]
                 for be, picked, opts in zip(together, tokens_together, SAMPLING, strict=True)]
        for picked, token in zip(tokens_together, together[1].decode_batch(steps), strict=True):
            picked.append(token)
        for one, other in zip(alone, together, strict=True):
            scale = float(np.abs(one.last_logits()).max())
            np.testing.assert_allclose(other.last_logits(), one.last_logits(), rtol=0, atol=1e-4 * max(scale, 1.0))
    assert tokens_together == tokens_alone
    for one, other in zip(alone, together, strict=True):
        np.testing.assert_array_equal(other.held_token_ids(), one.held_token_ids())
        np.testing.assert_array_equal(other.positions(), one.positions())
        mine, theirs = other.counters.as_dict(), one.counters.as_dict()
        mine.pop("forward_ns"), theirs.pop("forward_ns")
        assert mine == theirs
        assert mine["model_forward_tokens"] == mine["new_prefill_tokens"] + mine["decoded_tokens"]
        np.testing.assert_allclose(other.rotated_keys(), one.rotated_keys(), rtol=0, atol=1e-4)


def test_decode_batch_checks_its_input(models: Models) -> None:
    a = models.fresh("tiny-llama")
    b = a.fork()
    a.prefill(models.tokens[:40])
    b.prefill(models.tokens[40:90])
    stranger = models.fresh("tiny-qwen3")
    stranger.prefill(models.tokens[:40])
    assert a.decode_batch([]) == []
    with pytest.raises(BackendError, match="one step per session"):
        a.decode_batch([DecodeStep(a, 5), DecodeStep(a, 6)])
    with pytest.raises(BackendError, match="forks"):
        a.decode_batch([DecodeStep(a, 5), DecodeStep(stranger, 6)])
    with pytest.raises(ValueError, match="vocabulary"):
        a.decode_batch([DecodeStep(a, 5), DecodeStep(b, a.vocab_size)])
    assert a.attention_tokens == 40 and b.attention_tokens == 50   # nothing was placed
    # No token to feed (right after a prefill): each picks from its prefill logits, nothing runs.
    first = a.decode_batch([DecodeStep(a, None), DecodeStep(b, None)])
    assert first == [a.pending_token, b.pending_token] and a.counters.decoded_tokens == 0


def test_a_failed_batched_forward_fails_every_session_in_it(models: Models, harness: Harness) -> None:
    """Batched, both sessions were in the forward that failed; one by one (MLX), the first
    session's failure stops the batch before the second moves."""
    a = models.fresh("tiny-llama")
    b = a.fork()
    a.prefill(models.tokens[:40])
    b.prefill(models.tokens[40:90])
    with harness.fail_next_forward(a), pytest.raises(RuntimeError, match="injected"):
        a.decode_batch([DecodeStep(a, 5), DecodeStep(b, 6)])
    failed = [(a, 40), (b, 50)] if a.batches_decode else [(a, 40)]
    if not a.batches_decode:
        assert b.counters.model_forward_tokens == 50
        b.decode(6)
    for be, prefilled in failed:
        # its token entered the model (and counts) though no decode completed
        assert be.counters.model_forward_tokens == prefilled + 1 and be.counters.decoded_tokens == 0
        with pytest.raises(BackendError, match="reset"):
            be.decode(token=1)
        be.reset()
        be.prefill(models.tokens[:8])
        assert be.attention_tokens == 8
