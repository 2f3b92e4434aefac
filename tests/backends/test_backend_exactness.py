"""Exact attention-only evict / compact / restore, checked against an untouched reference and
against the model's own rotary embedding (issue 3 must-shows), for SmolLM2 and one tiny model per
family (issue 12), and on MLX also for their 4-bit copies made with mlx-lm's converter."""

from __future__ import annotations

import numpy as np
import pytest

from backends import Backend, Block

from .conftest import FAMILIES, PREFILL_TOKENS, QUANTIZED, Harness, Models, skip_unless_runtime_has, stacked

PAGE = 128
LOGIT_TOL = 1e-4
KEY_TOL = 1e-5
EXACT_MODELS = ["smollm2-135m", *FAMILIES, *QUANTIZED]


def through_bytes(be: Backend, blk: Block) -> Block:
    """Every restored block in this suite goes through the serialized form, as it does on disk."""
    return Block.from_bytes(blk.to_bytes(), expect=be.layer_view)


def max_delta(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


def assert_accounting(be: Backend) -> None:
    c = be.counters
    assert c.model_forward_tokens == c.new_prefill_tokens + c.decoded_tokens, c
    assert c.historical_forward_during_restore == 0, c


def next_logits_and_greedy(ref: Backend, other: Backend, n: int) -> None:
    """Both pick the next token from their current logits; then feeding it through each cache must
    give the same logits (argmax equal, max |delta| <= 1e-4) and the same `n` greedy tokens."""
    first_ref, first_other = ref.decode(), other.decode()
    assert first_ref == first_other
    seq_ref, seq_other = [first_ref, ref.decode()], [first_other, other.decode()]
    lr, lo = ref.last_logits(), other.last_logits()
    assert int(np.argmax(lr)) == int(np.argmax(lo))
    assert max_delta(lr, lo) <= LOGIT_TOL
    seq_ref += [ref.decode() for _ in range(n - 2)]
    seq_other += [other.decode() for _ in range(n - 2)]
    assert seq_ref == seq_other


@pytest.fixture(params=EXACT_MODELS)
def model(request: pytest.FixtureRequest, backend_name: str) -> str:
    skip_unless_runtime_has(backend_name, str(request.param))
    return str(request.param)


def test_prefill_matches_stock_model(models: Models, harness: Harness, model: str) -> None:
    """The slot cache and slot attention compute what the unmodified model computes."""
    pre = models.prefilled(model)
    stock = harness.stock_logits(pre.be, pre.ids)
    ours = pre.be.last_logits()
    assert int(np.argmax(stock)) == int(np.argmax(ours))
    assert max_delta(stock, ours) <= LOGIT_TOL


def test_evict_compact_restore_matches_untouched_reference(models: Models, model: str) -> None:
    pre = models.prefilled(model)
    ref, be = pre.fork(), pre.fork()
    recurrent = be.snapshot_recurrent()

    blk = through_bytes(be, be.save_block(384, 512))
    be.remove_attention_range(384, 512)
    assert be.attention_tokens == PREFILL_TOKENS - PAGE
    # Forced, whatever the lazy policy would do: every later key moves down by one page.
    assert be.compact_positions() == PREFILL_TOKENS - 512
    np.testing.assert_array_equal(be.positions(), np.arange(PREFILL_TOKENS - PAGE))
    be.insert_block(blk, 384)

    np.testing.assert_array_equal(be.positions(), np.arange(PREFILL_TOKENS))
    np.testing.assert_array_equal(be.held_token_ids(), np.asarray(pre.ids))
    assert max_delta(be.rotated_keys(), ref.rotated_keys()) <= KEY_TOL
    if recurrent is not None:
        after = be.snapshot_recurrent()
        assert after is not None and recurrent.equals(after)
    next_logits_and_greedy(ref, be, 32)
    assert_accounting(be)


def test_reanchored_keys_equal_model_rotary(models: Models, harness: Harness, model: str) -> None:
    """Keys are checked against the model itself: its own rotary embedding applied to the
    pre-rotary keys it computed during prefill, at each token's current position."""
    pre = models.prefilled(model)
    be = pre.fork()
    canon = pre.prerope_keys

    def check(original: np.ndarray) -> None:
        expected = harness.model_rotate(be, canon[:, :, original], be.positions())
        assert max_delta(be.rotated_keys(), expected) <= KEY_TOL

    everything = np.arange(PREFILL_TOKENS)
    survivors = np.concatenate([np.arange(384), np.arange(512, PREFILL_TOKENS)])
    check(everything)
    blk = through_bytes(be, be.save_block(384, 512))
    # The block carries the canonical (pre-rotary) keys the model computed.
    assert max_delta(blk.keys.astype(np.float32), canon[:, :, 384:512]) <= KEY_TOL

    be.remove_attention_range(384, 512)
    np.testing.assert_array_equal(be.positions()[384:390], np.arange(512, 518))  # lazy gap
    check(survivors)
    be.compact_positions()
    np.testing.assert_array_equal(be.positions(), np.arange(PREFILL_TOKENS - PAGE))
    check(survivors)
    be.insert_block(blk, 384)
    np.testing.assert_array_equal(be.positions(), everything)
    check(everything)

    view = be.layer_view
    if view.rotary_dim < view.head_dim:
        # Partial rotary: the dims past rotary_dim are never rotated.
        r = view.rotary_dim
        np.testing.assert_array_equal(be.rotated_keys()[..., r:], canon[..., r:])


def test_evict_decode_restore_decode_accounting(models: Models, model: str) -> None:
    pre = models.prefilled(model)
    be = pre.fork()
    c0 = be.counters
    blk = through_bytes(be, be.save_block(384, 512))
    be.remove_attention_range(384, 512)
    generated = [be.decode() for _ in range(16)]
    be.insert_block(blk, 384)
    generated += [be.decode() for _ in range(32)]

    c = be.counters
    delta = {k: v - getattr(c0, k) for k, v in c.as_dict().items() if k != "forward_ns"}
    # The first decode picks from the prefill logits; every later one feeds the previous token.
    assert delta == {
        "model_forward_tokens": 47,
        "new_prefill_tokens": 0,
        "decoded_tokens": 47,
        "historical_forward_during_restore": 0,
        "restored_tokens": PAGE,
        "evicted_tokens": PAGE,
        # The page went back into its own position gap: only its own keys were rotated.
        "reanchored_keys": PAGE,
        "compactions": 0,
        "blend_forward_tokens": 0,
    }
    assert_accounting(be)
    assert be.attention_tokens == PREFILL_TOKENS + 47
    assert be.pending_token == generated[-1]
    np.testing.assert_array_equal(be.held_token_ids(), np.asarray(pre.ids + generated[:47]))
    positions = be.positions()
    np.testing.assert_array_equal(positions, np.arange(PREFILL_TOKENS + 47))


def test_thousand_random_cycles_leave_no_drift(models: Models, harness: Harness, model: str) -> None:
    """1,000 random evict / re-anchor / restore cycles over the eight pages of a 1,024-token cache,
    every block through bytes; with every page back in place the cache equals the reference."""
    pre = models.prefilled(model)
    ref, be = pre.fork(), pre.fork()
    view = be.layer_view
    pages = PREFILL_TOKENS // PAGE
    hot = list(range(pages))
    cold: dict[int, bytes] = {}
    rng = np.random.default_rng(20250917)
    ops = {"evict": 0, "restore": 0, "compact": 0}

    def place(page: int) -> int:
        return sum(PAGE for p in hot if p < page)

    def restore(page: int) -> None:
        be.insert_block(Block.from_bytes(cold.pop(page), expect=view), place(page))
        hot.append(page)
        hot.sort()

    for _ in range(1000):
        roll = rng.random()
        if cold and (roll < 0.45 or len(hot) == 1):
            restore(int(rng.choice(sorted(cold))))
            ops["restore"] += 1
        elif roll < 0.9 and len(hot) > 1:
            page = int(rng.choice(hot))
            at = place(page)
            cold[page] = be.save_block(at, at + PAGE).to_bytes()
            be.remove_attention_range(at, at + PAGE)
            hot.remove(page)
            ops["evict"] += 1
        else:
            be.compact_positions()
            ops["compact"] += 1
        assert bool(np.all(np.diff(be.positions()) > 0))
    for page in rng.permutation(sorted(cold)):
        restore(int(page))
    be.compact_positions()

    assert min(ops.values()) > 50, ops
    np.testing.assert_array_equal(be.held_token_ids(), np.asarray(pre.ids))
    np.testing.assert_array_equal(be.positions(), np.arange(PREFILL_TOKENS))
    assert max_delta(be.rotated_keys(), ref.rotated_keys()) <= KEY_TOL
    expected = harness.model_rotate(be, pre.prerope_keys, np.arange(PREFILL_TOKENS))
    assert max_delta(be.rotated_keys(), expected) <= KEY_TOL
    c = be.counters
    assert c.restored_tokens == c.evicted_tokens > 0 and c.compactions > 0
    next_logits_and_greedy(ref, be, 4)
    assert_accounting(be)


@pytest.mark.slow
def test_smollm2_4bit_mlx_folder_pages_exactly(models: Models, harness: Harness, backend_name: str) -> None:
    """SmolLM2 as an mlx-lm 4-bit folder (GGUF -> Hugging Face folder -> mlx_lm.convert -q), run on
    mlx-lm's own quantized layers: the stock model's logits, a page evicted, compacted away and
    restored against an untouched reference, every key against the model's rotary. Short (a page
    and 16 tokens, 4 greedy tokens): MLX's CPU quantized matmul reads ~8 tokens a second here."""
    skip_unless_runtime_has(backend_name, "smollm2-135m-q4")
    be = models.fresh("smollm2-135m-q4")
    ids = models.tokens[:PAGE + 16]
    with harness.capture_prerope_keys(be) as captured:
        be.prefill(ids)
    keys = stacked(captured)
    stock = harness.stock_logits(be, ids)
    assert int(np.argmax(stock)) == int(np.argmax(be.last_logits()))
    assert max_delta(stock, be.last_logits()) <= LOGIT_TOL
    ref = be.fork()
    blk = through_bytes(be, be.save_block(0, PAGE))
    be.remove_attention_range(0, PAGE)
    assert be.compact_positions() == len(ids) - PAGE
    be.insert_block(blk, 0)
    np.testing.assert_array_equal(be.positions(), np.arange(len(ids)))
    assert max_delta(be.rotated_keys(), harness.model_rotate(be, keys, np.arange(len(ids)))) <= KEY_TOL
    next_logits_and_greedy(ref, be, 4)
    assert_accounting(be)


@pytest.mark.parametrize("runs", [1, 3, 7])
def test_keys_written_into_slots_in_runs_are_the_models_rotation(models: Models, harness: Harness, runs: int,
                                                                 backend_name: str, device: str) -> None:
    """A page put back lands in whatever slots are free: one run, a few runs (slice copies run by
    run) or many (index copies). In each case the slots hold the canonical keys and values as
    given and the keys rotated as the model rotates them, also after they move again, and so do
    the slots a block was landed in (torch on the CPU, a few runs: `SlotStore.landing`). Checked
    on the slot store both runtimes implement, above everything the session holds."""
    be = models.prefilled("smollm2-135m").fork()
    store = be._store  # type: ignore[attr-defined]
    view = be.layer_view
    n = 21
    base = store.capacity
    store.grow(base + 4 * n)
    # `runs` runs of consecutive slots with a free slot between two runs.
    cuts = np.linspace(0, n, runs + 1).astype(int)
    pairs = zip(cuts[:-1], cuts[1:], strict=True)
    slots = np.concatenate([base + a + i + np.arange(b - a) for i, (a, b) in enumerate(pairs)])
    assert int(np.count_nonzero(np.diff(slots) != 1)) == runs - 1
    rng = np.random.default_rng(runs)
    layers, heads = len(view.attention_layers), view.num_kv_heads
    keys = rng.standard_normal((layers, heads, n, view.head_dim)).astype(np.float32)
    values = rng.standard_normal((layers, heads, n, view.value_head_dim)).astype(np.float32)
    positions = np.sort(rng.choice(5000, n, replace=False)).astype(np.int64)
    for a0, a1 in store.layer_groups(n):
        store.write_keys(slots, a0, a1, keys[a0:a1], positions)
        store.write_values(slots, a0, a1, values[a0:a1])
    canon, held_values = store.gather(slots)
    np.testing.assert_array_equal(canon, keys)
    np.testing.assert_array_equal(held_values, values)
    assert max_delta(store.rotated(slots), harness.model_rotate(be, keys, positions)) <= KEY_TOL
    moved = positions + 1000
    store.reanchor(slots, moved)
    assert max_delta(store.rotated(slots), harness.model_rotate(be, keys, moved)) <= KEY_TOL

    # The same block landed: its bytes copied where the store's landing says (what a block
    # file's reader does), then rotated layer group by layer group, holds what writing it did.
    store.clear(slots)
    landing = store.landing(slots)
    assert (landing is not None) == (backend_name == "torch" and device == "cpu" and runs < 4)
    if landing is None:
        return
    for where, section in ((landing.keys, keys), (landing.values, values)):
        data = memoryview(np.ascontiguousarray(section).tobytes())
        at = 0
        for buf in where:
            buf.cast("B")[:] = data[at:at + buf.nbytes]
            at += buf.nbytes
        assert at == len(data)
    for a0, a1 in store.layer_groups(n):
        landing.rotate(a0, a1, positions)
    canon, held_values = store.gather(slots)
    np.testing.assert_array_equal(canon, keys)
    np.testing.assert_array_equal(held_values, values)
    assert max_delta(store.rotated(slots), harness.model_rotate(be, keys, positions)) <= KEY_TOL
