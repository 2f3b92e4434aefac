"""Sliding-window layers (Gemma 3 / 4, gpt-oss, Ministral): never paged, always the newest tokens.

A window layer keeps the last W - 1 tokens the model consumed; page operations of the global layers
neither remove tokens from it nor add restored ones, and a compaction that moves the stream's head
re-rotates the window's keys before the next forward. The tiny models' window (160) is longer than a
128-token page, so the newest page lies inside it.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import Backend, Block, RecurrentSnapshot

from .conftest import PREFILL_TOKENS, WINDOWED, Harness, Models, skip_unless_runtime_has
from .test_backend_exactness import LOGIT_TOL, PAGE, assert_accounting, max_delta, next_logits_and_greedy

KEY_TOL = 1e-5
TRANSLATION_TOL = 1e-3
WINDOW_MODELS = [*WINDOWED, *(f"{m}-q4" for m in WINDOWED)]


@pytest.fixture(params=WINDOW_MODELS)
def model(request: pytest.FixtureRequest, backend_name: str) -> str:
    skip_unless_runtime_has(backend_name, str(request.param))
    return str(request.param)


def window_snapshot(be: Backend) -> RecurrentSnapshot:
    snap = be.snapshot_recurrent()
    assert snap is not None and any(k.startswith("window/") for k in snap.states)
    return RecurrentSnapshot.from_bytes(snap.to_bytes())


def test_evicting_the_newest_page_leaves_the_window(models: Models, model: str) -> None:
    """The newest page is inside every window: evicting it leaves the windows bit for bit, and
    restoring it puts the global layers back without adding its tokens to the windows twice."""
    pre = models.prefilled(model)
    ref, be = pre.fork(), pre.fork()
    base = window_snapshot(be)
    window = be.layer_roles.window_size  # type: ignore[attr-defined]
    assert window - 1 > PAGE
    tail = Block.from_bytes(be.save_block(PREFILL_TOKENS - PAGE, PREFILL_TOKENS).to_bytes(), expect=be.layer_view)
    be.remove_attention_range(PREFILL_TOKENS - PAGE, PREFILL_TOKENS)
    assert base.equals(be.snapshot_recurrent())
    middle = be.save_block(384, 512)
    be.remove_attention_range(384, 512)
    be.compact_positions()
    assert base.equals(be.snapshot_recurrent())
    be.insert_block(middle, 384)
    be.insert_block(tail, be.attention_tokens)
    assert base.equals(be.snapshot_recurrent())
    np.testing.assert_array_equal(be.positions(), np.arange(PREFILL_TOKENS))
    next_logits_and_greedy(ref, be, 16)
    assert_accounting(be)


def test_compaction_moves_window_keys_with_the_stream(models: Models, harness: Harness, model: str) -> None:
    """Evicting the first page and compacting shifts every held position down by a page. RoPE is
    relative, so the next tokens must come out exactly as without the compaction (a lazy gap at the
    front): that holds only if the window keys moved with the stream. Their rotated form is then
    the model's own rotary of their canonical keys at the new positions."""
    pre = models.prefilled(model)
    lazy, compacted = pre.fork(), pre.fork()
    for be in (lazy, compacted):
        be.remove_attention_range(0, PAGE)
    assert compacted.compact_positions() == PREFILL_TOKENS - PAGE
    assert int(compacted.positions()[-1]) == PREFILL_TOKENS - PAGE - 1
    # Exact in arithmetic; in float32 the rotary angles of other absolute positions round
    # differently (one ulp of the angle is ~6e-5 rad at position 1,000), hence TRANSLATION_TOL.
    # Window keys left at their old positions would be off by whole pages: errors of order one.
    for step in range(8):
        assert lazy.decode() == compacted.decode(), step
        assert max_delta(lazy.last_logits(), compacted.last_logits()) <= TRANSLATION_TOL

    positions, rotated, canonical = compacted.window_state()  # type: ignore[attr-defined]
    assert positions is not None
    np.testing.assert_array_equal(positions, np.arange(int(compacted.positions()[-1]) - positions.shape[0] + 1,
                                                       int(compacted.positions()[-1]) + 1))
    keys = np.stack([k[0] for k, _ in canonical])  # [layers, heads, n, dim], storage dtype float32
    expected = harness.model_rotate(compacted, keys.astype(np.float32), positions, "sliding_attention")
    assert max_delta(np.stack([r[0] for r in rotated]), expected) <= KEY_TOL
    # The window holds the newest stream tokens: the prefill's last ones, then the decoded ones.
    assert pre.window_keys is not None
    n_prefill = positions.shape[0] - (compacted.stream_tokens - PREFILL_TOKENS)
    assert max_delta(keys[:, :, :n_prefill], pre.window_keys[:, :, PREFILL_TOKENS - n_prefill:]) <= KEY_TOL
    assert_accounting(compacted)


def test_window_is_what_the_stock_cache_keeps(models: Models, harness: Harness, model: str,
                                              backend_name: str) -> None:
    """After a chunked prefill longer than the window, the window layers attend to what the runtime's
    own sliding-window cache would give them: the next tokens match the stock model's."""
    skip_unless_runtime_has(backend_name, model)
    be = models.fresh(model)
    ids = models.tokens[:700]
    be.prefill(ids[:300])
    be.prefill(ids[300:])
    stock = harness.stock_logits(be, ids)
    assert int(np.argmax(stock)) == int(np.argmax(be.last_logits()))
    assert max_delta(stock, be.last_logits()) <= LOGIT_TOL
