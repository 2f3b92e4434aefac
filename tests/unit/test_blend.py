"""The blend's policy (controller/blend.py): which held tokens a turn recomputes, by what they are."""

from __future__ import annotations

import numpy as np
import pytest

from contextd.wire import PinKind
from controller.blend import DEFAULT_BLEND, BlendPolicy, view_parts
from controller.pager import PAGE_TOKENS, Decision, Pager, PagerConfig


def session() -> tuple[Pager, list[int], int, np.ndarray]:
    """A pinned page, eight pages of history of which 2 and 3 left and came back this turn, and 40
    new tokens at the end of the open page. Positions as placement 'question' gives them: the
    restored pages right before the new message."""
    pager = Pager(PagerConfig(budget_tokens=4096, tail_tokens=256))
    pager.append(list(range(PAGE_TOKENS)), pin=PinKind.SYSTEM)
    pager.append(list(range(8 * PAGE_TOKENS + 60)))
    for i in (2, 3):
        pager.pages[i].stored = True
    pager.apply(Decision(evict=[2, 3], restore=[], plan_used=False))
    pager.begin_turn()
    pager.append(list(range(40)))
    pager.apply(Decision(evict=[], restore=[2, 3], plan_used=False))
    held = pager.hot_tokens
    logical = np.arange(held)
    restored = (logical >= 2 * PAGE_TOKENS) & (logical < 4 * PAGE_TOKENS)
    positions = np.where(restored, logical, 0).astype(np.int64)
    others = np.flatnonzero(~restored)
    before_new = others[others < held - 100]
    positions[before_new] = np.arange(before_new.shape[0])
    positions[restored] = before_new.shape[0] + np.arange(2 * PAGE_TOKENS)
    after = others[others >= held - 100]
    positions[after] = before_new.shape[0] + 2 * PAGE_TOKENS + np.arange(after.shape[0])
    return pager, [2, 3], 40, positions


def test_the_parts_split_the_view_and_runs_follow_positions() -> None:
    pager, restored, new_tokens, positions = session()
    parts = view_parts(pager, restored, new_tokens, positions)
    held = pager.hot_tokens
    assert parts.held == held
    assert parts.new.tolist() == list(range(held - 40, held))
    assert parts.restored.tolist() == list(range(2 * PAGE_TOKENS, 4 * PAGE_TOKENS))
    assert parts.pins.tolist() == list(range(PAGE_TOKENS))
    together = np.concatenate([parts.new, parts.restored, parts.pins, parts.tail])
    assert sorted(together.tolist()) == list(range(held)), "every held token in exactly one part"
    # In position order: pages 0-1, then 4-8 (cut where page 4 does not follow page 3's position),
    # the restored pages 2-3, then the rest of the open page with the new tokens.
    firsts = [int(run[0]) for run in parts.runs]
    assert firsts[0] == 0 and 2 * PAGE_TOKENS in firsts
    assert all(np.all(np.diff(positions[run]) > 0) for run in parts.runs)
    assert sorted(np.concatenate(parts.runs).tolist()) == list(range(held))
    assert parts.heads(4).shape[0] == 4 * len(parts.runs)


def test_a_policy_takes_its_parts_in_order_within_its_budget() -> None:
    pager, restored, new_tokens, positions = session()
    parts = view_parts(pager, restored, new_tokens, positions)
    chosen = DEFAULT_BLEND.choose(parts)
    room = int(0.2 * parts.held)
    assert chosen.shape[0] == room and np.all(np.diff(chosen) > 0)
    assert set(parts.new.tolist()) <= set(chosen.tolist())
    assert set(chosen.tolist()) - set(parts.new.tolist()) == set(parts.restored[:room - 40].tolist())
    everything = BlendPolicy(parts=("new", "restored"), budget=1.0).choose(parts)
    assert everything.tolist() == sorted(parts.new.tolist() + parts.restored.tolist())
    heads = BlendPolicy(heads=4, budget=1.0).choose(parts)
    assert heads.tolist() == sorted(parts.heads(4).tolist())
    assert BlendPolicy().choose(parts).shape[0] == 0 and BlendPolicy().off


def test_a_turn_that_brought_nothing_back_recomputes_nothing() -> None:
    pager, _, new_tokens, positions = session()
    parts = view_parts(pager, [], new_tokens, positions)
    assert parts.restored.shape[0] == 0
    assert DEFAULT_BLEND.choose(parts).shape[0] == 0


@pytest.mark.parametrize("bad", [dict(parts=("question",)), dict(parts=("heads",)), dict(heads=-1),
                                 dict(budget=1.5), dict(budget=-0.1)])
def test_a_policy_out_of_range_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        BlendPolicy(**bad)  # type: ignore[arg-type]
