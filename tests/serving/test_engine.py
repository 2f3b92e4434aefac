"""The engine in-process: a tiny real model, a real contextd process, nothing of ours faked.

What the redesign must keep: every page move goes through the page mover and lands in the
manifest; the manifest is the truth a new engine recovers from; recovery brings back the exact
session (same next answer, same selector choice) and says what it had to fix; a corrupt payload
is reported and never served.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from backends import Backend, load_backend
from contextd.client import Client, pb
from contextd.wire import PageState
from controller.selectors import AttentionSelector, HybridSelector
from serving import paging
from serving.chat_format import ChatFormat
from serving.engine import QUESTION_TOKENS, Engine, EngineConfig
from serving.launcher import ContextdProcess
from serving.observe import TurnObserver
from serving.probe import probe
from serving.session import Session
from serving.turn import ChatRequest, Prepared, TurnResult
from tests.serving.engines import restarted_copy, turn

SYSTEM = {"role": "system", "content": "You are a coding agent. Be brief."}
CONFIG = EngineConfig(budget_tokens=1024, tail_tokens=256, max_new_tokens=6)


@pytest.fixture(scope="module")
def backend() -> Backend:
    return load_backend("torch", "tiny-llama", capacity=CONFIG.budget_tokens + 256)


def engine_on(backend: Backend, contextd: ContextdProcess) -> Engine:
    """An engine with its own backend session and its own connection (it outlives daemon restarts)."""
    fresh = backend.fork()
    fresh.reset()
    return Engine(fresh, ChatFormat(fresh.tokenizer), Client(contextd.socket, timeout=60.0), CONFIG,
                  HybridSelector())


def grow(engine: Engine, session: str, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Read the repository and take notes."}]
    for n in range(turns):
        result = turn(engine, session, messages)
        messages += [{"role": "assistant", "content": result.content},
                     {"role": "user", "content": f"File {n}: " + f"the handler {n} retries {n * 7} times. " * 30}]
    return messages


def manifest_states(client: Client, session: str) -> dict[str, int]:
    return {p.page_id: int(p.state) for p in client.query_pages(session)}


def test_pages_move_only_through_the_mover_and_the_manifest_says_where_each_is(backend: Backend,
                                                                                contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd)
    grow(engine, "m", 6)
    session = engine.sessions["m"]
    pager = session.pager
    assert any(p.state is PageState.COLD for p in pager.pages), "the session never went past its budget"
    client = contextd.client
    assert client is not None
    listed = manifest_states(client, "m")
    assert listed == {p.page_id: int(p.state) for p in pager.pages}
    # a pin is a row of its own beside a HOT page, and contextd counts the pinned pages as the pager does
    assert {pin.page_id for pin in client.query_pins("m")} == {pager.pages[i].page_id for i in pager.pins}
    counts = client.get_session("m").pages
    assert {"hot": counts.hot, "cold": counts.cold, "pinned": counts.pinned} == pager.counts()
    counters = session.counters
    assert counters.model_forward_tokens == \
        counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens
    assert counters.historical_forward_during_restore == 0
    assert counters.peak_attention_tokens <= CONFIG.budget_tokens
    assert engine.backend.attention_tokens == pager.hot_tokens
    np.testing.assert_array_equal(engine.backend.held_token_ids(),
                                  [t for p in pager.pages if p.resident
                                   for t in session.transcript.ids[p.token_start:p.token_end]])
    record = client.read_record("m")
    assert [list(s.token_ids) for s in record.segments] == [s.ids for s in session.transcript.segments]
    assert record.record.turn == pager.turn and dict(record.record.counters) == counters.as_dict()
    assert not client.verify("m").corrupt


def test_a_new_engine_recovers_the_session_exactly(backend: Backend, contextd: ContextdProcess,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # Resident pages come back three at a time (the next three's records asked for while these go
    # in), so the recovery below takes several rounds.
    monkeypatch.setattr(paging, "FILL_PAGES", 3)
    first = engine_on(backend, contextd)
    messages = grow(first, "r", 6)
    question = [*messages, {"role": "user", "content": "How many times does handler 1 retry?"}]
    before = probe(first, ChatRequest("r", question), [HybridSelector(), AttentionSelector()])
    assert before["hybrid"].restore and before["attention"].restore, \
        "a selector restored nothing: the comparison would say nothing"
    # The store as a restarted server finds it: a copy of the daemon's root, served by a second daemon.
    with restarted_copy(contextd) as copy:
        second = engine_on(backend, copy)
        after = probe(second, ChatRequest("r", question), [HybridSelector(), AttentionSelector()])
        for name in ("hybrid", "attention"):
            assert after[name].restore == before[name].restore and after[name].resident == before[name].resident
        recovered, original = second.sessions["r"], first.sessions["r"]
        assert recovered.recovery_notes == []
        assert recovered.counters.recovered_pages == sum(1 for p in recovered.pager.pages if p.resident) > 3
        assert recovered.transcript.ids == original.transcript.ids
        assert [p.state for p in recovered.pager.pages] == [p.state for p in original.pager.pages]
        assert [p.pin for p in recovered.pager.pages] == [p.pin for p in original.pager.pages]
        assert set(recovered.key_index.pages) == set(original.key_index.pages)  # type: ignore[union-attr]
        assert set(recovered.lexical_index.pages) == set(original.lexical_index.pages)  # type: ignore[union-attr]
        np.testing.assert_array_equal(second.backend.positions(), first.backend.positions())
        # the same request gives the same greedy answer from both
        one, two = turn(first, "r", question), turn(second, "r", question)
        assert one.content == two.content and one.prefilled_tokens == two.prefilled_tokens
        assert two.counters.historical_forward_during_restore == 0


def test_recovery_reconciles_what_a_dead_turn_left_and_says_so(backend: Backend, contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd)
    grow(engine, "d", 5)
    client = contextd.client
    assert client is not None
    pages = engine.sessions["d"].pager.pages
    # what a turn that died after storing a page, before its record, leaves behind
    stray = pb.Page(page_id=f"p{len(pages) + 3:07d}", index=len(pages) + 3, token_start=99_000, token_end=99_128)
    client.upsert_pages("d", [stray])
    restarted = engine_on(backend, contextd)
    session = restarted.recovery.rebuild("d", CONFIG.pager_config())
    assert session is not None
    assert any("deleted 1 stored pages" in note for note in session.recovery_notes), session.recovery_notes
    assert stray.page_id not in manifest_states(client, "d")
    assert [p.state for p in session.pager.pages] == [p.state for p in pages]


def test_a_corrupt_payload_is_reported_and_never_served(backend: Backend, contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd)
    messages = grow(engine, "c", 6)
    client = contextd.client
    assert client is not None
    session = engine.sessions["c"]
    cold = [p for p in session.pager.pages if p.state is PageState.COLD]
    target = cold[0]
    record = client.get_pages("c", [target.page_id])[0]
    path = contextd.root / "store" / record.locator
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x20
    path.write_bytes(bytes(data))
    from controller.pager import Decision

    restored = engine.mover.execute(session, Decision(evict=[], restore=[target.index], plan_used=False))
    assert restored == [] and target.state is PageState.COLD and not target.stored
    assert client.get_pages("c", [target.page_id])[0].state == PageState.CORRUPT
    assert target.page_id not in {lease.page_id for lease in client.query_leases("c")}
    # the session goes on: the next turn is served, the page stays out
    result = turn(engine, "c", [*messages, {"role": "user", "content": "next"}])
    assert result.finish_reason in ("stop", "length")
    assert target.state is PageState.COLD


def test_a_restore_from_what_the_server_stored_asks_contextd_nothing_first_and_a_changed_page_stays_out(
        backend: Backend, contextd: ContextdProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    from controller.pager import Decision

    engine = engine_on(backend, contextd)
    messages = grow(engine, "k", 6)
    client = contextd.client
    assert client is not None
    session = engine.sessions["k"]
    cold = [p.index for p in session.pager.pages if p.state is PageState.COLD]
    asked: list[list[str]] = []
    ask = Client.get_pages
    monkeypatch.setattr(Client, "get_pages", lambda self, sid, ids: asked.append(list(ids)) or ask(self, sid, ids))

    # the server wrote these pages: their payloads are known, contextd is asked nothing
    assert engine.mover.execute(session, Decision(evict=[], restore=cold[:2], plan_used=False)) == cold[:2]
    assert asked == []
    assert [p.state for p in client.get_pages("k", [session.pager.pages[i].page_id for i in cold[:2]])] == [
        PageState.HOT, PageState.HOT]
    asked.clear()

    # contextd marks one page corrupt behind the server's back (its file still reads fine): the
    # commit that names the payload read is refused, the pages come out, and the decision is
    # carried out on contextd's records: that page stays out, the other one comes back
    changed, fine = session.pager.pages[cold[2]], session.pager.pages[cold[3]]
    client.report_corrupt("k", changed.page_id, "found by a scrub")
    held = engine.backend.attention_tokens
    restored = engine.mover.execute(session, Decision(evict=[], restore=[changed.index, fine.index], plan_used=False))
    assert restored == [fine.index] and asked == [[changed.page_id, fine.page_id]]
    assert engine.backend.attention_tokens == held + fine.tokens
    assert changed.state is PageState.COLD and not changed.stored and fine.state is PageState.HOT
    states = {p.page_id: p.state for p in client.get_pages("k", [changed.page_id, fine.page_id])}
    assert states == {changed.page_id: PageState.CORRUPT, fine.page_id: PageState.HOT}
    assert {lease.page_id for lease in client.query_leases("k")} >= {fine.page_id}
    # the session answers on
    assert turn(engine, "k", [*messages, {"role": "user", "content": "next"}]).finish_reason in ("stop", "length")


def prepared(engine: Engine, session: str, messages: list[dict[str, Any]]) -> tuple[Prepared, TurnResult]:
    events = [e for e in engine.chat(ChatRequest(session, list(messages), max_tokens=4)) if not e.pause]
    first = events[0].prepared
    final = events[-1].final
    assert first is not None and final is not None
    return first, final


def n_tokens(engine: Engine, text: str) -> int:
    return len(engine.format.encode(text))


def test_an_answer_the_client_does_not_replay_leaves_the_tail_with_no_forward_and_no_notice(
        backend: Backend, contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd)
    u1 = {"role": "user", "content": "List the failing tests."}
    u2 = {"role": "user", "content": "Continue where you stopped."}
    _, first = prepared(engine, "t", [SYSTEM, u1])
    assert first.finish_reason == "length"
    session = engine.sessions["t"]
    # Pi 1.6 treats an answer cut at a length limit (or aborted) as a failed attempt and leaves it out
    opener = "<|im_start|>assistant\n"
    ready, _ = prepared(engine, "t", [SYSTEM, u1, u2])
    assert ready.rebuilt == ""
    assert ready.prefilled_tokens == n_tokens(engine, f"<|im_start|>user\n{u2['content']}<|im_end|>\n{opener}")
    # a retry of that request: only the opener is prefilled again, to have logits to answer from
    again, _ = prepared(engine, "t", [SYSTEM, u1, u2])
    assert again.rebuilt == "" and again.prefilled_tokens == n_tokens(engine, opener)
    counters = session.counters
    assert (counters.tail_drops, counters.rebuilds, counters.reprefilled_tokens) == (2, 0, 0)
    assert counters.model_forward_tokens == \
        counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens
    np.testing.assert_array_equal(engine.backend.held_token_ids(), session.transcript.ids)
    # an edit of the client's own history is a rebuild, and says so
    edited, _ = prepared(engine, "t", [SYSTEM, {"role": "user", "content": "List the passing tests."}, u2])
    assert "transcript changed" in edited.rebuilt and session.counters.rebuilds == 1
    assert session.counters.reprefilled_tokens == n_tokens(engine, f"<|im_start|>user\n{u2['content']}<|im_end|>\n")
    np.testing.assert_array_equal(engine.backend.held_token_ids(), session.transcript.ids)


def test_a_failed_turn_forgets_its_own_session_and_no_other(backend: Backend, contextd: ContextdProcess) -> None:
    fresh = backend.fork()
    fresh.reset()
    engine = Engine(fresh, ChatFormat(fresh.tokenizer), Client(contextd.socket, timeout=60.0),
                    dataclasses.replace(CONFIG, resident_sessions=2), HybridSelector())
    kept, failed = grow(engine, "kept", 3), grow(engine, "failed", 3)
    steps = engine.chat(ChatRequest("kept", [*kept[:-1], {"role": "user", "content": "And then?"}]))
    assert next(e for e in steps if not e.pause).prepared is not None   # "kept" is mid-turn
    held = engine.sessions.cache_of("kept").attention_tokens
    engine.forget("failed")   # what the worker does when another session's turn fails
    engine.resume("kept")
    assert held > 0 and engine.backend.attention_tokens == held
    final = [e.final for e in steps if e.final is not None]
    assert final and final[0].counters.recovered_pages == 0   # its cache was not touched
    assert "failed" not in engine.sessions and engine.sessions.cache_of("failed") is None
    again = turn(engine, "failed", [*failed[:-1], {"role": "user", "content": "Go on."}])
    assert again.counters.recovered_pages > 0   # it came back from contextd


def test_sessions_past_the_memory_bound_leave_it_and_come_back_from_contextd_as_they_were(
        backend: Backend, contextd: ContextdProcess) -> None:
    """At most `sessions_in_memory` sessions stay in memory; the least recently used idle one
    leaves and its next turn brings it back from contextd: copies of stored pages, no prefill of
    its history, and the same answer a server that kept it in memory gives."""
    fresh = backend.fork()
    fresh.reset()
    bounded = Engine(fresh, ChatFormat(fresh.tokenizer), Client(contextd.socket, timeout=60.0),
                     dataclasses.replace(CONFIG, sessions_in_memory=2), HybridSelector())
    roomy = engine_on(backend, contextd)
    histories = {name: grow(bounded, name, 3) for name in ("x1", "x2", "x3")}
    assert set(bounded.sessions) == {"x2", "x3"} and bounded.sessions.dropped == 1
    for name in ("y1", "y2", "y3"):
        grow(roomy, name, 3)
    assert set(roomy.sessions) == {"y1", "y2", "y3"}
    follow = {"role": "user", "content": "Which handler retries 14 times?"}
    back = turn(bounded, "x1", [*histories["x1"], follow])
    kept = turn(roomy, "y1", [*histories["x1"], follow])
    assert back.content == kept.content
    assert back.counters.recovered_pages > 0
    assert back.prefilled_tokens == kept.prefilled_tokens   # the new message only, never its history
    assert set(bounded.sessions) == {"x3", "x1"}   # x2 was the least recently used idle one
    assert bounded.sessions.dropped == 2


def test_the_memory_bound_must_hold_the_resident_sessions() -> None:
    with pytest.raises(ValueError, match="sessions_in_memory"):
        dataclasses.replace(CONFIG, resident_sessions=4, sessions_in_memory=2)


def test_a_cut_inside_a_cold_page_leaves_memory_and_contextd_with_the_same_leases(
        backend: Backend, contextd: ContextdProcess) -> None:
    """A client's edit that cuts inside a cold page brings that page back to cut it. What the
    pager then leases, contextd must hold too: a restarted server recovers leases from contextd,
    and one lease more in memory than on disk made a live session's next answers differ from
    the same session recovered (found by benchmarks.chaos)."""
    engine = engine_on(backend, contextd)
    messages = grow(engine, "cut", 6)
    session = engine.sessions["cut"]
    rendered_before = session.transcript.tokens
    edited = [*messages[:-6], {"role": "user", "content": "Forget those files; what did the first one say?"}]
    turn(engine, "cut", edited)
    assert session.counters.rebuilds == 1 and session.transcript.tokens < rendered_before
    pager = session.pager
    with Client(contextd.socket) as client:
        durable = {lease.page_id: lease.until_turn for lease in client.query_leases("cut")
                   if lease.until_turn > pager.turn}
    in_memory = {page.page_id: page.lease_until_turn for page in pager.pages if page.lease_until_turn > pager.turn}
    assert in_memory == durable


class _Placement(TurnObserver):
    """What the answer reads: each held token's position and the pages the turn restored."""

    def __init__(self) -> None:
        self.positions: np.ndarray | None = None
        self.restored: list[int] = []

    def answer_view(self, session: Session, backend: Backend, restored: list[int]) -> None:
        self.positions, self.restored = backend.positions().copy(), list(restored)


def test_one_long_message_pins_its_opening_only_and_reads_restores_right_before_its_question(
        backend: Backend, contextd: ContextdProcess) -> None:
    """RULER's form: the fact, then filler past the budget, then the question, all one user
    message. Only the message's first `objective_tokens` are pinned (not its first pages up to the
    pin cap), and the page restored for the question sits right before the question's last
    tokens, not before the message's start, which left attention while it was read."""
    fresh = backend.fork()
    fresh.reset()
    config = dataclasses.replace(CONFIG, objective_tokens=64)   # under the pin cap (256 tokens) here
    engine = Engine(fresh, ChatFormat(fresh.tokenizer), Client(contextd.socket, timeout=60.0), config,
                    HybridSelector())
    watch = _Placement()
    engine.observers.append(watch)
    filler = " ".join(f"line {n} of the log says nothing new." for n in range(260))
    text = (f"Remember this. The passphrase of zephyrquill is 4417.\n\n{filler}\n\n"
            "What is the passphrase of zephyrquill?")
    turn(engine, "long", [SYSTEM, {"role": "user", "content": text}])
    session = engine.sessions["long"]
    pager = session.pager
    system_tokens = len(engine.format.encode(engine.format.render([SYSTEM], None, "default", {}).text))
    pinned_end = system_tokens + config.objective_tokens
    assert pager.pins and all(pager.pages[i].token_start < pinned_end for i in pager.pins)
    assert max(pager.pages[i].token_end for i in pager.pins) <= (pinned_end // 128 + 1) * 128
    assert watch.restored and watch.positions is not None
    restored_at = [pager.logical_start(i) for i in watch.restored]
    restored_positions = np.concatenate([watch.positions[s:s + 128] for s in restored_at])
    # One block of positions, followed by the message's last QUESTION_TOKENS tokens and the
    # template's opening of the answer (a few tokens), and nothing else.
    assert np.ptp(restored_positions) + 1 == len(restored_positions)
    after = int((watch.positions > restored_positions.max()).sum())
    assert QUESTION_TOKENS <= after < QUESTION_TOKENS + 16, after
