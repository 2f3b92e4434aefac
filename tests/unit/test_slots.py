"""The runtime-neutral slot arithmetic both backends share (backends/slots.py)."""

from __future__ import annotations

import numpy as np
import pytest

from backends.slots import as_run, checked_token_ids, model_identity, pick_free_slots, pick_token, plan_insert


def test_a_block_keeps_its_saved_positions_when_they_fit_and_later_tokens_move_only_to_the_next_gap() -> None:
    order = np.arange(6)
    pos = np.array([0, 1, 2, 10, 11, 30], dtype=np.int64)  # a gap after 2 and after 11
    fits = plan_insert(pos, order, 3, np.array([5, 6, 7]), position_limit=100)
    assert fits.block_pos.tolist() == [5, 6, 7] and fits.later_new.tolist() == [10, 11, 30]
    shifted = plan_insert(pos, order, 3, np.array([40, 41, 42, 43, 44, 45, 46, 47]), position_limit=100)
    assert shifted.block_pos.tolist() == list(range(3, 11))
    assert shifted.later_new.tolist() == [11, 12, 30]  # the gap before 30 absorbs the shift
    assert not shifted.compact
    assert plan_insert(pos, order, 6, np.arange(80), position_limit=100).compact


def test_sampling_is_reproducible_from_the_generator_state_and_greedy_is_argmax() -> None:
    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    assert pick_token(logits, True, 1.0, 0, 1.0, np.random.default_rng(1)) == int(np.argmax(logits))
    draws = [pick_token(logits, False, 0.8, 10, 0.9, np.random.default_rng(7)) for _ in range(3)]
    assert len(set(draws)) == 1
    top10 = set(np.argsort(-logits)[:10].tolist())
    rng = np.random.default_rng(3)
    assert all(pick_token(logits, False, 1.5, 10, 1.0, rng) in top10 for _ in range(200))


def test_runs_ids_and_identity() -> None:
    assert as_run(np.array([4, 5, 6])) == (4, 7) and as_run(np.array([4, 6, 7])) is None
    assert checked_token_ids([1, 2], 10) == [1, 2]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        checked_token_ids([3, 10], 10)
    weights = [("w", np.ones((2, 2), dtype=np.float32), "torch.float32")]
    base = model_identity({"hidden_size": 2, "_name_or_path": "a"}, weights)
    assert base == model_identity({"hidden_size": 2, "_name_or_path": "b"}, weights)  # ignored key
    assert base != model_identity({"hidden_size": 3}, weights)
    assert base != model_identity({"hidden_size": 2}, [("w", np.zeros((2, 2), dtype=np.float32), "torch.float32")])


def test_free_slots_come_as_a_run_when_one_fits_below_the_high_water_mark() -> None:
    free = np.array([2, 5, 6, 7, 8, 20, 21, 22, 23, 30], dtype=np.int64)
    # The 4 lowest (2, 5, 6, 7) reach 7 and slots up to 19 are held: the run 5..8 is taken.
    assert pick_free_slots(free, 4, high_water=20).tolist() == [5, 6, 7, 8]
    # A session holding nothing above 7: the run 20..23 would raise the mark, so the lowest come.
    assert pick_free_slots(free, 4, high_water=8).tolist() == [2, 5, 6, 7]
    assert pick_free_slots(free, 5, high_water=29).tolist() == [2, 5, 6, 7, 8]  # no run of 5
    assert pick_free_slots(free, 1, high_water=0).tolist() == [2]


def test_slots_split_into_runs_up_to_a_limit() -> None:
    from backends.slots import runs_of

    assert runs_of(np.array([4, 5, 6]), 4) == [(4, 7, 0)]
    assert runs_of(np.array([2, 3, 9, 10, 11, 20]), 4) == [(2, 4, 0), (9, 12, 2), (20, 21, 5)]
    assert runs_of(np.array([2, 3, 9, 10, 11, 20]), 2) is None
    assert runs_of(np.array([5, 4]), 4) == [(5, 6, 0), (4, 5, 1)]  # decreasing slots are runs of one
    assert runs_of(np.zeros(0, dtype=np.int64), 1) == []
