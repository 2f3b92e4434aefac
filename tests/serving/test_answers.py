"""Reading answers: the likelihood scorer and where restored pages sit.

The scorer must give the same log-probabilities as prefilling each candidate after the view
and summing, must leave the scored backend exactly as it was (cache, positions, logits,
counters), and must do so on a hybrid too. A watched turn answers exactly as an unwatched one.
Placement "question" gives a turn's restored pages the positions right before the new message
while the answer is read, and the turn still ends in timeline positions, so recovery and the
next turn are as without it. Real tiny models and a real contextd process.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from backends import Backend, load_backend
from contextd.client import Client
from controller.blend import DEFAULT_BLEND, BlendPolicy, view_parts
from controller.selectors import HybridSelector, RecencySelector, RerankSelector, Selection, SelectionContext
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.launcher import ContextdProcess
from serving.likelihood import continuation_logprobs, log_softmax
from serving.observe import TurnObserver
from serving.paging import recompute_scratch
from serving.session import Session
from serving.watch import AnswerWatch
from tests.serving.engines import restarted_copy, turn

CONFIG = EngineConfig(budget_tokens=1024, tail_tokens=128, max_new_tokens=4)
CANDIDATES = [[5, 6, 7], [5, 6, 9], [5, 11], [40], [41, 42, 43, 44]]


def direct_logprobs(backend: Backend, candidate: list[int]) -> float:
    """Prefill the candidate token by token on a fork and add up the log-probabilities."""
    fork = backend.fork()
    logp = log_softmax(fork.last_logits())
    total = 0.0
    for token in candidate:
        total += float(logp[token])
        fork.prefill([token])
        logp = log_softmax(fork.last_logits())
    return total


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-next", "tiny-gemma3"])
def test_scores_equal_prefilling_each_candidate_and_leave_the_backend_as_it_was(model: str) -> None:
    backend = load_backend("torch", model, capacity=512)
    backend.prefill(list(range(3, 200)))
    logits, positions, held = backend.last_logits(), backend.positions(), backend.held_token_ids()
    counters = backend.counters
    snap = backend.snapshot_recurrent()
    scores, forwarded = continuation_logprobs(backend, CANDIDATES)
    expected = [direct_logprobs(backend, c) for c in CANDIDATES]
    assert scores == pytest.approx(expected, abs=1e-4)
    # The common lead-in [5] runs once, then each remainder but its last token in one forward.
    assert forwarded == sum(len(c) - 1 for c in CANDIDATES)
    assert np.array_equal(backend.last_logits(), logits)
    assert np.array_equal(backend.positions(), positions) and np.array_equal(backend.held_token_ids(), held)
    assert backend.counters == counters
    if snap is not None:
        after = backend.snapshot_recurrent()
        assert after is not None and after.equals(snap)
    # The next token is the one it would have been without scoring.
    twin = backend.fork()
    assert backend.decode() == twin.decode()


def test_a_candidate_must_have_tokens() -> None:
    backend = load_backend("torch", "tiny-llama", capacity=64)
    backend.prefill([3, 4, 5])
    with pytest.raises(ValueError):
        continuation_logprobs(backend, [[5], []])


def test_reposition_refuses_positions_that_break_the_order_of_new_tokens() -> None:
    backend = load_backend("torch", "tiny-llama", capacity=64)
    backend.prefill(list(range(3, 13)))
    with pytest.raises(ValueError, match="distinct"):
        backend.reposition(np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 8]))
    with pytest.raises(ValueError, match="highest"):
        backend.reposition(np.array([0, 1, 2, 3, 4, 5, 6, 7, 9, 8]))
    with pytest.raises(ValueError, match="held tokens"):
        backend.reposition(np.arange(3))
    assert backend.reposition(np.array([0, 1, 2, 6, 7, 3, 4, 5, 8, 9])) == 5
    assert backend.positions().tolist() == [0, 1, 2, 6, 7, 3, 4, 5, 8, 9]


# ------------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def backend() -> Backend:
    return load_backend("torch", "tiny-llama", capacity=CONFIG.budget_tokens + 256)


def watch_of(engine: Engine) -> AnswerWatch:
    """The engine's answer watch (serving.watch), made on first use as the server makes one."""
    found = next((o for o in engine.observers if isinstance(o, AnswerWatch)), None)
    return found if found is not None else AnswerWatch(engine)


def engine_on(backend: Backend, contextd: ContextdProcess, placement: str = "timeline",
              blend: BlendPolicy | None = None) -> Engine:
    fresh = backend.fork()
    fresh.reset()
    config = EngineConfig(budget_tokens=CONFIG.budget_tokens, tail_tokens=CONFIG.tail_tokens,
                          max_new_tokens=CONFIG.max_new_tokens, placement=placement, blend=blend)
    return Engine(fresh, ChatFormat(fresh.tokenizer), Client(contextd.socket, timeout=60.0), config, HybridSelector())


FACTS = ["zebra", "quasar", "walnut", "copper", "meadow", "lantern", "saffron", "glacier"]


def session_messages(engine: Engine, session: str, watch: list[str] | None = None) -> list[dict[str, Any]]:
    """Files each stating one fact, far past the budget, then a question about the first."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Remember every code."},
                                      {"role": "user", "content": "Read the files."}]
    for n, word in enumerate(FACTS):
        result = turn(engine, session, messages)
        messages += [{"role": "assistant", "content": result.content},
                     {"role": "user", "content": f"File {n}. The {word} code is {1000 + 111 * n}. "
                      + f"Filler line {n} about nothing in particular. " * 24}]
    result = turn(engine, session, messages)
    messages += [{"role": "assistant", "content": result.content},
                 {"role": "user", "content": "What is the zebra code?"}]
    if watch is not None:
        watch_of(engine).watch(session, watch)
    return messages


def test_a_watched_turn_answers_as_an_unwatched_one_and_its_reading_describes_the_view(
        backend: Backend, contextd: ContextdProcess) -> None:
    codes = [str(1000 + 111 * n) for n in range(len(FACTS))]
    watched, plain = engine_on(backend, contextd), engine_on(backend, contextd)
    asked = session_messages(watched, "w", watch=codes)
    assert session_messages(plain, "p") == asked
    a, b = turn(watched, "w", asked), turn(plain, "p", asked)
    assert a.content == b.content
    assert a.counters.model_forward_tokens == b.counters.model_forward_tokens
    assert a.counters.model_forward_tokens == \
        a.counters.new_prefill_tokens + a.counters.decoded_tokens + a.counters.blend_forward_tokens
    assert a.counters.historical_forward_during_restore == 0
    reading = watch_of(watched).reading("w")
    assert watch_of(plain).reading("p") is None and not watch_of(watched).watching("w")
    assert reading.candidates == codes and len(reading.logprobs) == len(codes)
    assert reading.scoring_forward_tokens > 0
    ids = reading.transcript_ids
    assert reading.view_ids == [t for start, end in reading.view_spans for t in ids[start:end]]
    assert ids == watched.sessions["w"].transcript.ids[:len(ids)]
    assert reading.view_spans[-1][1] == len(ids), "the view ends with the answer's opener"
    assert len(reading.view_ids) <= CONFIG.budget_tokens
    with pytest.raises(ValueError):
        watch_of(watched).watch("w", [])


def test_a_turn_answered_in_branches_reads_as_the_turn_itself_and_leaves_the_session_alone(
        backend: Backend, contextd: ContextdProcess) -> None:
    """A branch with the session's own selector reads what the session's turn then reads (same
    view, same scores): it starts from the session as its last turn left it, leases included (a
    question asked before leaves restored pages leased). Recency's branch restores nothing. The
    turn answers as in an engine that never branched, and no branch is left in memory or in
    contextd."""
    codes = [str(1000 + 111 * n) for n in range(len(FACTS))]
    branching, plain = engine_on(backend, contextd), engine_on(backend, contextd)
    asked = session_messages(branching, "b")
    assert session_messages(plain, "n") == asked
    earlier = turn(branching, "b", asked)
    assert turn(plain, "n", asked).content == earlier.content
    asked = [*asked, {"role": "assistant", "content": earlier.content},
             {"role": "user", "content": "And what is the quasar code?"}]
    assert any(p.lease_until_turn for p in branching.sessions["b"].pager.pages), "the first question leases pages"
    with pytest.raises(ValueError, match="twice"):
        watch_of(branching).watch("b", codes, [HybridSelector(), HybridSelector()])
    watch_of(branching).watch("b", codes, [HybridSelector(), RecencySelector()])
    answer = turn(branching, "b", asked)
    assert answer.content == turn(plain, "n", asked).content
    assert branching.totals.decoded_tokens == plain.totals.decoded_tokens, "the branches' answers are not the server's"
    assert answer.counters.model_forward_tokens == \
        answer.counters.new_prefill_tokens + answer.counters.decoded_tokens + answer.counters.blend_forward_tokens
    own, branches = watch_of(branching).reading("b"), watch_of(branching).branch_readings("b")
    assert set(branches) == {"hybrid", "recency"}
    same = branches["hybrid"]
    assert own.restored_pages, "the question must bring a page back for this test to mean anything"
    assert (same.view_ids, same.view_positions, same.restored_pages) == (own.view_ids, own.view_positions,
                                                                         own.restored_pages)
    assert same.logprobs == pytest.approx(own.logprobs, abs=1e-3)
    assert branches["recency"].restored_pages == []
    assert set(branching.sessions) == {"b"}
    # A later watched turn without branches has none: not the last branched turn's.
    watch_of(branching).watch("b", codes)
    turn(branching, "b", [*asked, {"role": "assistant", "content": answer.content},
                          {"role": "user", "content": "And the walnut code?"}])
    assert watch_of(branching).branch_readings("b") == {} and watch_of(branching).reading("b") is not own
    with Client(contextd.socket) as client:
        assert {s.session_id for s in client.list_sessions()} >= {"b", "n"}
        assert not [s.session_id for s in client.list_sessions() if s.session_id.startswith("b-branch")]


class FailingSelector(HybridSelector):
    def __init__(self) -> None:
        super().__init__(name="failing")

    def select(self, ctx: SelectionContext) -> Selection:
        raise RuntimeError("this selector fails")


def test_a_branch_that_fails_leaves_the_turn_and_the_engine_as_they_were(
        backend: Backend, contextd: ContextdProcess, caplog: pytest.LogCaptureFixture) -> None:
    codes = [str(1000 + 111 * n) for n in range(len(FACTS))]
    engine = engine_on(backend, contextd)
    asked = session_messages(engine, "f")
    serving = engine.selector
    watch_of(engine).watch("f", codes, [FailingSelector()])
    with caplog.at_level("WARNING", logger="kv_elision.watch"):
        assert turn(engine, "f", asked).content
    assert "this selector fails" in caplog.text
    reading = watch_of(engine).reading("f")
    assert engine.selector is serving and watch_of(engine).branch_readings("f") == {}
    assert reading is not None and reading.candidates == codes
    assert set(engine.sessions) == {"f"}
    with Client(contextd.socket) as client:
        assert not [s.session_id for s in client.list_sessions() if s.session_id.startswith("f-branch")]


def test_a_branch_that_cannot_score_on_this_model_is_refused_when_watched(contextd: ContextdProcess) -> None:
    hybrid = load_backend("torch", "tiny-qwen3-next", capacity=CONFIG.budget_tokens + 256)
    engine = Engine(hybrid, ChatFormat(hybrid.tokenizer), Client(contextd.socket, timeout=60.0), CONFIG,
                    HybridSelector())
    with pytest.raises(ValueError, match="sliding-window or recurrent"):
        watch_of(engine).watch("q", ["1"], [RerankSelector()])
    assert not watch_of(engine).watching("q")


def test_a_first_turn_has_no_branches_and_runs_as_it_would_have(backend: Backend, contextd: ContextdProcess,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A session contextd does not know yet has no state to branch from: said in the log, and the
    turn itself is answered and read as without branches."""
    engine = engine_on(backend, contextd)
    watch_of(engine).watch("first", ["1000", "1111"], [HybridSelector()])
    messages = [{"role": "system", "content": "Remember every code."}, {"role": "user", "content": "Hello."}]
    with caplog.at_level("WARNING", logger="kv_elision.watch"):
        assert turn(engine, "first", messages).content
    assert "not answered in branches" in caplog.text
    reading = watch_of(engine).reading("first")
    assert watch_of(engine).branch_readings("first") == {}
    assert reading is not None and reading.candidates == ["1000", "1111"]
    assert set(engine.sessions) == {"first"}


def test_placement_puts_restored_pages_before_the_question_and_ends_the_turn_in_timeline_order(
        backend: Backend, contextd: ContextdProcess) -> None:
    codes = [str(1000 + 111 * n) for n in range(len(FACTS))]
    engine = engine_on(backend, contextd, placement="question")
    asked = session_messages(engine, "q", watch=codes)
    turn(engine, "q", asked)
    reading = watch_of(engine).reading("q")
    assert reading.restored_pages, "the question must bring a page back for this test to mean anything"
    pages = engine.sessions["q"].pager.pages
    restored = {t for i in reading.restored_pages for t in range(pages[i].token_start, pages[i].token_end)}
    # Position order: everything else, then the restored pages, then the new message.
    spans = reading.view_spans
    assert spans[-1][1] == len(reading.transcript_ids)
    before_question = [t for start, end in spans[:-1] for t in range(start, end)]
    k = len(before_question) - len(restored)
    assert set(before_question[k:]) == restored
    assert max(before_question[:k]) > min(restored), "the tail's earlier messages come before the restored pages"
    assert reading.view_positions == sorted(reading.view_positions)
    # The turn ended in timeline positions: the recorded state is as without placement.
    held = engine.backend.positions()
    assert np.array_equal(held, np.arange(held.shape[0]))
    # A restarted server (a copy of the store, a second daemon) answers the next question alike.
    follow = [*asked, {"role": "assistant", "content": engine.sessions["q"].transcript.segments[-1].text},
              {"role": "user", "content": "And the quasar code?"}]
    with restarted_copy(contextd) as copy:
        again = engine_on(backend, copy, placement="question")
        assert turn(again, "q", follow).content == turn(engine, "q", follow).content


def test_a_blended_turn_recomputes_what_its_policy_names_counts_it_and_ends_exact(
        backend: Backend, contextd: ContextdProcess) -> None:
    """The blend recomputes the new message and the restored pages before the answer is read: the
    reading is the exact planned view (an observer's fork of it) with those tokens recomputed,
    and not the exact view itself. It is counted as blend forward tokens, and the turn ends with
    the exact K/V back: a restarted server, which rebuilds the cache from the store, answers the
    next question as the live one does."""
    codes = [str(1000 + 111 * n) for n in range(len(FACTS))]
    policy = BlendPolicy(parts=("new", "restored"), budget=1.0)
    engine = engine_on(backend, contextd, "question", policy)
    asked = session_messages(engine, "b", watch=codes)
    candidates = [engine.format.encode(c) for c in codes]
    seen: dict[str, Any] = {}

    class Observer(TurnObserver):
        def view_planned(self, session: Session, backend: Backend, restored: list[int], new_tokens: int,
                         opener: list[int]) -> None:
            exact, blended = backend.fork(), backend.fork()
            chosen = policy.choose(view_parts(session.pager, restored, new_tokens, backend.positions()))
            seen["chosen"], seen["restored"], seen["new"] = chosen, restored, new_tokens
            recompute_scratch(blended, chosen)
            for view in (exact, blended):
                view.prefill(opener)
            seen["exact"] = continuation_logprobs(exact, candidates)[0]
            seen["blended"] = continuation_logprobs(blended, candidates)[0]

    observer = Observer()
    engine.observers.append(observer)
    before = engine.sessions["b"].counters.blend_forward_tokens
    result = turn(engine, "b", asked)
    engine.observers.remove(observer)
    reading = watch_of(engine).reading("b")
    assert reading.restored_pages and sorted(seen["restored"]) == reading.restored_pages
    pages = engine.sessions["b"].pager.pages
    assert result.counters.blend_forward_tokens - before == len(seen["chosen"]) >= \
        sum(pages[i].tokens for i in reading.restored_pages) + seen["new"]
    np.testing.assert_allclose(reading.logprobs, seen["blended"], atol=1e-4)
    assert not np.allclose(reading.logprobs, seen["exact"], atol=1e-3)
    c = result.counters
    assert c.model_forward_tokens == c.new_prefill_tokens + c.decoded_tokens + c.blend_forward_tokens
    assert c.historical_forward_during_restore == 0
    assert engine.backend.recomputed_tokens == 0
    follow = [*asked, {"role": "assistant", "content": engine.sessions["b"].transcript.segments[-1].text},
              {"role": "user", "content": "And the quasar code?"}]
    with restarted_copy(contextd) as copy:
        again = engine_on(backend, copy, "question", policy)
        assert turn(again, "b", follow).content == turn(engine, "b", follow).content
        # The same keys, to float rounding: the two caches hold their tokens in other slots, so the
        # blend's attention sums run in another order.
        np.testing.assert_allclose(again.backend.rotated_keys(), engine.backend.rotated_keys(), atol=1e-4)


def test_the_blend_is_the_default_where_the_model_allows_it_and_refused_where_asked_for_but_impossible(
        backend: Backend, contextd: ContextdProcess) -> None:
    """A model with recurrent layers cannot recompute held tokens: by default it serves without the
    blend; asked for one, the engine refuses to start, saying why."""
    assert engine_on(backend, contextd).blend == DEFAULT_BLEND
    hybrid = load_backend("torch", "tiny-qwen3-next", capacity=1280)
    client = Client(contextd.socket, timeout=60.0)
    plain = Engine(hybrid, ChatFormat(hybrid.tokenizer), client, EngineConfig(budget_tokens=1024, tail_tokens=128))
    assert plain.blend.off
    with pytest.raises(ValueError, match="recurrent"):
        Engine(hybrid, ChatFormat(hybrid.tokenizer), client,
               EngineConfig(budget_tokens=1024, tail_tokens=128, blend=BlendPolicy(parts=("new",))))


@pytest.mark.parametrize("runtime", ["torch", "mlx"])
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-next"])
def test_prefill_logits_are_the_logits_of_prefilling_one_token_at_a_time(runtime: str, model: str) -> None:
    one, chunked = load_backend(runtime, model, capacity=128), load_backend(runtime, model, capacity=128)
    one.prefill([3, 4, 5])
    chunked.prefill([3, 4, 5])
    steps = chunked.prefill_logits([6, 7, 8])
    for i, token in enumerate([6, 7, 8]):
        np.testing.assert_allclose(steps[i], one.prefill([token]), atol=1e-4)
    assert np.array_equal(chunked.last_logits(), steps[-1])
    assert chunked.counters.new_prefill_tokens == one.counters.new_prefill_tokens == 6
