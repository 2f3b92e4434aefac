"""The pager's rules, tensor-free: budget and watermarks, pins and their cap, ledger, tail, leases, plans."""

from __future__ import annotations

from array import array

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from contextd.wire import PageState, PinKind
from controller.pager import PAGE_TOKENS, Decision, Pager, PagerConfig, Plan, PrefixChain


def grow(pager: Pager, tokens: int, pin: PinKind | None = None) -> None:
    pager.append(list(range(tokens)), pin=pin)


def run_turn(pager: Pager, tokens: int, plan: Plan | None = None, chunk: int = 256) -> list[Decision]:
    """Feed tokens the way the engine does: decide before each chunk, store and evict, then append."""
    pager.begin_turn()
    decisions = []
    left = tokens
    first = True
    while left:
        take = min(chunk, left)
        decision = pager.decide(plan if first else None, incoming_tokens=take)
        first = False
        for i in decision.evict:
            pager.pages[i].stored = True
        pager.apply(decision)
        grow(pager, take)
        assert pager.hot_tokens <= pager.config.budget_tokens
        decisions.append(decision)
        left -= take
    return decisions


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="watermarks"):
        PagerConfig(budget_tokens=4096, high_watermark=0.5, low_watermark=0.8)
    with pytest.raises(ValueError, match="under 4 pages"):
        PagerConfig(budget_tokens=256)
    with pytest.raises(ValueError, match="no room"):
        PagerConfig(budget_tokens=1024, tail_tokens=900)


def test_attention_never_exceeds_the_budget_and_evicts_down_to_the_low_watermark() -> None:
    pager = Pager(PagerConfig(budget_tokens=4096))
    grow(pager, 600, pin=PinKind.SYSTEM)
    peak = 0
    for _ in range(60):
        decisions = run_turn(pager, 1000)
        peak = max(peak, pager.hot_tokens)
        for d in decisions:
            if d.evict:
                assert pager.hot_tokens <= pager.config.budget_tokens
    assert peak <= 4096
    assert pager.total_tokens == 60_600
    counts = pager.counts()
    assert counts["cold"] > 400 and counts["pinned"] == 5
    # every page that left attention was stored first
    assert all(p.stored for p in pager.pages if p.state is PageState.COLD)


def test_hard_pins_hold_under_pressure_and_are_capped_at_a_quarter_of_the_budget() -> None:
    pager = Pager(PagerConfig(budget_tokens=4096))
    grow(pager, 1500, pin=PinKind.SYSTEM)  # 12 pages wanted, cap 1024 tokens = 8 pages
    assert sum(1 for p in pager.pages if p.pin is not None) == 8
    assert any("stays evictable" in w for w in pager.warnings)
    run_turn(pager, 20_000)
    pinned = [p for p in pager.pages if p.pin is not None]
    assert all(p.state is PageState.HOT for p in pinned)
    assert pager.pages[10].state is PageState.COLD  # past the cap: evicted like any other page


def test_the_recent_tail_and_the_open_page_stay() -> None:
    pager = Pager(PagerConfig(budget_tokens=2048, tail_tokens=512))
    run_turn(pager, 10_000 + 17)
    tail = pager.pages[-5:]
    assert all(p.state is PageState.HOT for p in tail)
    assert pager.pages[-1].tokens == (10_017 % PAGE_TOKENS)


def test_ledger_pages_stay_newest_first_within_their_cap() -> None:
    pager = Pager(PagerConfig(budget_tokens=4096))  # ledger cap 512 tokens = 4 pages
    for _ in range(10):
        run_turn(pager, 700)
        pager.mark_ledger(len(pager.pages) - 2)
    run_turn(pager, 8000)
    kept = [i for i in pager.ledger if pager.pages[i].state is PageState.HOT]
    assert kept == pager.ledger[-4:]
    assert set(kept) <= pager.protected()


def test_restored_pages_hold_their_lease_then_become_evictable() -> None:
    pager = Pager(PagerConfig(budget_tokens=2048, lease_turns=2))
    run_turn(pager, 6000)
    target = 3
    assert pager.pages[target].state is PageState.COLD
    run_turn(pager, 300, plan=Plan(restore=[target]))
    assert pager.pages[target].state is PageState.HOT
    run_turn(pager, 1500)  # pressure during the lease: the page stays
    assert pager.pages[target].state is PageState.HOT
    run_turn(pager, 3000)
    run_turn(pager, 3000)
    assert pager.pages[target].state is PageState.COLD  # lease over: oldest-first retention took it


def test_the_last_turns_restores_yield_some_of_their_room_to_this_turns() -> None:
    """Last turn's restores hold their lease against the default retention (above), and yield
    `lease_yield_tokens` of their room to this turn's restores: a question asked right after
    another still brings its best page back, without taking all the room the last one took."""
    pager = Pager(PagerConfig(budget_tokens=2048, lease_yield_tokens=2 * PAGE_TOKENS))
    run_turn(pager, 6000)
    pager.begin_turn()
    fits = pager.room() // PAGE_TOKENS
    cold = [p.index for p in pager.pages if p.state is PageState.COLD and p.tokens == PAGE_TOKENS]
    first, second = cold[:fits], cold[fits:2 * fits]
    assert fits >= 4 and len(second) == fits
    decision = pager.decide(Plan(restore=first))
    for i in decision.evict:
        pager.pages[i].stored = True
    pager.apply(decision)
    assert pager.room() < PAGE_TOKENS
    assert pager.validate(Plan(restore=second[:1]))[1]  # this turn's restores yield nothing
    pager.begin_turn()
    assert pager.room() == 2 * PAGE_TOKENS
    assert "room for 256" in pager.validate(Plan(restore=second[:3]))[1]
    decision = pager.decide(Plan(restore=second[:2]))
    assert decision.plan_used and set(decision.evict) <= set(first)
    pager.apply(decision)
    assert all(pager.pages[i].state is PageState.HOT for i in second[:2])
    assert pager.hot_tokens <= pager.config.high_tokens
    for _ in range(2):   # their leases over, the room is all this turn's again
        pager.begin_turn()
    assert pager.room() // PAGE_TOKENS >= fits - 1


def test_a_plan_naming_unknown_or_pinned_pages_changes_nothing_it_should_not() -> None:
    pager = Pager(PagerConfig(budget_tokens=2048))
    grow(pager, 256, pin=PinKind.TOOLS)
    run_turn(pager, 4000)
    before = [(p.state, p.pin) for p in pager.pages]
    plan = Plan(restore=[10_000, -1, 5, 5], pin=[], evict_first=[0, 1, 99_999])  # 0, 1 are hard-pinned
    cleaned, reason = pager.validate(plan)
    assert reason == "" and cleaned.restore == [5] and cleaned.evict_first == []
    decision = pager.decide(plan, incoming_tokens=0)
    assert 0 not in decision.evict and 1 not in decision.evict
    assert [(p.state, p.pin) for p in pager.pages][:2] == before[:2]


def test_a_plan_over_budget_is_rejected_whole_and_evicts_nothing_because_of_it() -> None:
    pager = Pager(PagerConfig(budget_tokens=2048))
    run_turn(pager, 8000)
    cold = [p.index for p in pager.pages if p.state is PageState.COLD]
    decision = pager.decide(Plan(restore=cold[:20], evict_first=cold[20:]))
    assert not decision.plan_used and "low watermark" in decision.plan_rejected
    assert decision.evict == [] and decision.restore == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "truncate", "decide", "restore", "turn"]),
                          st.integers(min_value=0, max_value=900)), max_size=60))
def test_the_incremental_bookkeeping_agrees_with_a_recount(ops: list[tuple[str, int]]) -> None:
    pager = Pager(PagerConfig(budget_tokens=1024, tail_tokens=256))
    pager.append(list(range(200)), pin=PinKind.SYSTEM)
    for op, n in ops:
        if op == "append":
            pager.append(list(range(n + 1)))
        elif op == "truncate":
            pager.truncate(min(pager.total_tokens, n * 4))
        elif op == "decide":
            decision = pager.decide(None, incoming_tokens=n)
            for i in decision.evict:
                pager.pages[i].stored = True
            pager.apply(decision)
        elif op == "restore":
            cold = [p.index for p in pager.pages if p.state is PageState.COLD]
            if cold:
                decision = pager.decide(Plan(restore=[cold[n % len(cold)]]))
                for i in decision.evict:
                    pager.pages[i].stored = True
                pager.apply(decision)
        else:
            pager.begin_turn()
        resident = [p.index for p in pager.pages if p.resident]
        assert pager.resident == resident
        assert pager.hot_tokens == sum(pager.pages[i].tokens for i in resident)
        assert all(pager.logical_start(i) == sum(pager.pages[j].tokens for j in resident if j < i)
                   for i in range(len(pager.pages)))
        pinned = [p.index for p in pager.pages if p.pin is not None and p.resident]
        assert pager.counts() == {"hot": len(resident), "cold": len(pager.pages) - len(resident), "pinned": len(pinned)}


def test_the_prefix_chain_names_every_token_before_each_full_page() -> None:
    ids = list(range(1000, 1000 + 5 * PAGE_TOKENS + 40))
    whole = PrefixChain().extend(ids)
    assert len(whole.hashes) == 5 and len(set(whole.hashes)) == 5
    pieces = PrefixChain()
    for start in range(0, len(ids), 37):   # as a session grows: chunks that straddle pages
        pieces.extend(ids[start:start + 37])
    assert pieces.hashes == whole.hashes
    changed = PrefixChain().extend([*ids[:200], 7, *ids[201:]])  # one token of page 1 differs
    assert changed.hashes[0] == whole.hashes[0] and not set(changed.hashes[1:]) & set(whole.hashes)
    pager = Pager(PagerConfig(budget_tokens=2048))
    pager.append(ids)
    pager.truncate(2 * PAGE_TOKENS + 5)   # a cut inside page 2, then other tokens
    pager.append([9] * 300)
    assert pager.chain.hashes == PrefixChain().extend([*ids[:2 * PAGE_TOKENS + 5], *[9] * 300]).hashes
    assert pager.pages[1].prefix_hash == whole.hashes[1]


def test_a_page_id_names_the_history_up_to_the_page_end() -> None:
    """A page cut back and regrown after other tokens is another version with another id, so
    storing it never replaces the payload of the version the last record names; the same
    tokens after the same history are the same version, whatever way they came."""
    ids = list(range(1000, 1000 + 4 * PAGE_TOKENS + 40))
    pager = Pager(PagerConfig(budget_tokens=2048))
    pager.append(ids)
    before = [p.page_id for p in pager.pages]
    assert len(set(before)) == 5
    assert [p.prefix_hash for p in pager.pages[:4]] == PrefixChain().extend(ids).hashes
    partial = pager.pages[4]
    assert partial.prefix_hash == xxhash.xxh64(array("q", ids).tobytes()).hexdigest()
    assert before[4] == f"p0000004.40-{partial.prefix_hash}" and before[0].startswith("p0000000-")
    # an edit of one token of page 1 that keeps the token count: every page from there on is another version
    pager.truncate(200)
    pager.append([7, *ids[201:]])
    after = [p.page_id for p in pager.pages]
    assert after[0] == before[0] and not set(after[1:]) & set(before[1:])
    # back to the first history: the same ids again, grown a token at a time as a decode grows them
    pager.truncate(100)
    for token in ids[100:]:
        pager.append([token])
    assert [p.page_id for p in pager.pages] == before
    # a page a store of the earlier scheme holds keeps that id until it changes
    pager.pages[4].stored_as = pager.pages[4].legacy_id
    assert pager.pages[4].page_id == "p0000004.40"
    pager.append([5])
    assert pager.pages[4].page_id == f"p0000004.41-{pager.pages[4].prefix_hash}"
