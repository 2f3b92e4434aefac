"""Planning several block inserts at once (backends.slots.plan_inserts) gives exactly the layout
of inserting them one by one with plan_insert, the rule the runtime used per page before: on
random held layouts, gaps, places and limits, including renumbering at the position limit."""

from __future__ import annotations

import numpy as np
import pytest

from backends.slots import plan_insert, plan_inserts


def one_by_one(pos: np.ndarray, order: np.ndarray, inserts: list[tuple[int, np.ndarray]], limit: int
               ) -> tuple[list[int], list[int], int]:
    """(sources, positions, compactions) as the runtime's single insert leaves them."""
    sources, positions = [int(s) for s in order], [int(p) for p in pos[order]]
    inserted = compactions = 0
    for at, wanted in inserts:
        here = at + inserted
        plan = plan_insert(np.array(positions, dtype=np.int64), np.arange(len(positions)), here, wanted, limit)
        n = int(wanted.shape[0])
        sources = sources[:here] + [-1 - (inserted + t) for t in range(n)] + sources[here:]
        if plan.compact:
            positions = list(range(len(sources)))
            compactions += 1
        else:
            positions = positions[:here] + [int(p) for p in plan.block_pos] + [int(p) for p in plan.later_new]
        inserted += n
    return sources, positions, compactions


@pytest.mark.parametrize("seed", range(200))
def test_batch_plan_equals_inserting_one_by_one(seed: int) -> None:
    rng = np.random.default_rng(seed)
    held = int(rng.integers(0, 40))
    slots = rng.permutation(64)[:held].astype(np.int64)
    pos = np.zeros(64, dtype=np.int64)
    pos[slots] = np.sort(rng.choice(300, size=held, replace=False))
    limit = int(rng.choice([310, 400, 10_000]))
    ats = np.sort(rng.integers(0, held + 1, size=int(rng.integers(1, 6))))
    inserts = []
    for at in ats:
        start = int(rng.integers(0, 300))
        inserts.append((int(at), np.arange(start, start + int(rng.integers(1, 9)), dtype=np.int64)))
    plan = plan_inserts(pos, slots, [(at, wanted, False) for at, wanted in inserts], limit)
    sources, positions, compactions = one_by_one(pos, slots, inserts, limit)
    assert plan.sources.tolist() == sources and plan.positions.tolist() == positions
    assert plan.compactions == compactions


def test_an_exact_block_that_does_not_fit_and_places_out_of_order_are_refused() -> None:
    pos = np.array([0, 1, 2, 3], dtype=np.int64)
    order = np.arange(4, dtype=np.int64)
    with pytest.raises(ValueError, match="do not fit"):
        plan_inserts(pos, order, [(2, np.array([1, 2]), True)], 100)
    with pytest.raises(ValueError, match="ascending"):
        plan_inserts(pos, order, [(3, np.array([10]), False), (1, np.array([11]), False)], 100)
    fits = plan_inserts(np.array([0, 1, 8, 9], dtype=np.int64), order, [(2, np.array([4, 5]), True)], 100)
    assert fits.positions.tolist() == [0, 1, 4, 5, 8, 9] and fits.sources.tolist() == [0, 1, -1, -2, 2, 3]
