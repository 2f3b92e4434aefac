"""The model's eviction advice in the engine (`--evict-order model`): a tiny real model, a real
contextd process. Of the oldest pages the pager may evict, the least likely under the last user
message leave first; pages are scored over the K/V they hold in attention, which is the K/V a
restore brings back; the host's rules and the forward accounting hold."""

from __future__ import annotations

import dataclasses

import pytest

from backends import Backend, load_backend
from contextd.client import Client
from contextd.wire import PageState
from controller.rerank import mean_logprob
from controller.selectors import RecencySelector
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.launcher import ContextdProcess
from tests.serving.engines import AGENT_SYSTEM as SYSTEM
from tests.serving.engines import evicts_the_least_scored_of_the_window, file_turn, turn

CONFIG = EngineConfig(budget_tokens=2048, tail_tokens=256, max_new_tokens=1, evict_order="model")


@pytest.fixture(scope="module")
def backend() -> Backend:
    return load_backend("torch", "tiny-llama", capacity=CONFIG.budget_tokens + 256)


def engine_on(backend: Backend, contextd: ContextdProcess, config: EngineConfig = CONFIG) -> Engine:
    fresh = backend.fork()
    fresh.reset()
    # No restores: a restored page's lease would keep it out of the order this is about.
    return Engine(fresh, ChatFormat(fresh.tokenizer), Client(contextd.socket, timeout=60.0), config,
                  RecencySelector())


def test_the_least_likely_of_the_oldest_pages_leave_first_and_the_accounting_holds(
        backend: Backend, contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd)
    messages: list[dict[str, object]] = [SYSTEM, {"role": "user", "content": "What does handler retry_limit do?"}]
    turn(engine, "e", messages)
    session = engine.sessions["e"]
    advice = session.eviction
    assert advice is not None and advice.focus
    for n in range(8):
        messages += file_turn(n)
        turn(engine, "e", messages)
    evicts_the_least_scored_of_the_window(engine, session)
    counters = session.counters
    assert counters.controller_forward_tokens > 0
    assert counters.historical_forward_during_restore == 0
    assert counters.model_forward_tokens == \
        counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens
    assert counters.peak_attention_tokens <= CONFIG.budget_tokens
    client = contextd.client
    assert client is not None
    assert {p.page_id: int(p.state) for p in client.query_pages("e")} == {
        p.page_id: int(p.state) for p in session.pager.pages}
    # A page scored while held, scored again from its stored payload after it left: the same K/V.
    cold = [p for p in advice.scores if session.pager.pages[p].state is PageState.COLD][:3]
    assert cold
    for page in cold:
        stored = engine.mover.score_pages(session, [page], advice.focus)
        assert len(stored[page]) == len(advice.focus)   # after the user opening: the first token counts too
        assert mean_logprob(stored[page]) == pytest.approx(advice.scores[page], abs=1e-4)


def test_without_advice_the_pager_keeps_its_order_and_scores_nothing(backend: Backend,
                                                                      contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd, dataclasses.replace(CONFIG, evict_order="recency"))
    messages: list[dict[str, object]] = [SYSTEM, {"role": "user", "content": "What does handler retry_limit do?"}]
    turn(engine, "r", messages)
    session = engine.sessions["r"]
    assert session.eviction is None
    for n in range(6):
        window = session.pager.evictable()
        messages += file_turn(n)
        turn(engine, "r", messages)
        evicted = [p for p in window if not session.pager.pages[p].resident]
        assert evicted == window[:len(evicted)]   # oldest first
    assert session.counters.controller_forward_tokens == 0


def test_after_a_cut_every_kept_score_is_of_the_page_as_it_is_now(backend: Backend, contextd: ContextdProcess) -> None:
    with pytest.raises(ValueError, match="evict_order"):
        EngineConfig(evict_order="lru")
    engine = engine_on(backend, contextd)
    messages: list[dict[str, object]] = [SYSTEM, {"role": "user", "content": "What does handler retry_limit do?"}]
    turn(engine, "c", messages)
    for n in range(6):
        messages += file_turn(n)
        turn(engine, "c", messages)
    session = engine.sessions["c"]
    advice = session.eviction
    assert advice is not None and advice.scores
    focus = list(advice.focus)
    # An earlier tool result changed (the client edited its history): the session is cut back there
    # and prefilled again from it; the user message, and so the focus, stay the same.
    edited = [dict(m) for m in messages]
    edited[7]["content"] = "# f2.py\n" + "other_value = 3\n" * 40
    before = dict(advice.scores)
    turn(engine, "c", edited)
    assert session.counters.rebuilds >= 1 and advice.focus == focus
    segments = session.transcript.segments
    edited_at = next(k for k, segment in enumerate(segments) if "other_value" in segment.text)
    cut_page = sum(len(segment.ids) for segment in segments[:edited_at]) // 128
    assert any(p < cut_page and advice.scores[p] == before[p] for p in advice.scores), "no score survived the cut"
    assert any(p >= cut_page for p in before), "no page the cut rewrote had a score to lose"
    for page, score in advice.scores.items():
        if session.pager.pages[page].resident:
            now = engine.mover.score_held(session, [page], focus)[page]
        else:
            now = engine.mover.score_pages(session, [page], focus)[page]
        assert mean_logprob(now) == pytest.approx(score, abs=1e-4), page


def test_a_restarted_server_takes_the_focus_from_the_request(backend: Backend, contextd: ContextdProcess) -> None:
    """The focus is kept in memory: a new engine (a restarted server) finds none, and in a tool loop
    the next user message may be many turns away, so it takes the request's last user message."""
    engine = engine_on(backend, contextd)
    messages: list[dict[str, object]] = [SYSTEM, {"role": "user", "content": "What does handler retry_limit do?"}]
    turn(engine, "s", messages)
    focus = engine.sessions["s"].eviction.focus   # type: ignore[union-attr]
    restarted = engine_on(backend, contextd)
    messages += file_turn(0)
    turn(restarted, "s", messages)
    advice = restarted.sessions["s"].eviction
    assert advice is not None and advice.focus == focus


def test_the_attention_order_evicts_the_least_attended_and_reads_no_forward_of_its_own(
        backend: Backend, contextd: ContextdProcess) -> None:
    """`--evict-order attention`: the turns' own forwards report their weights; a user message
    votes on the pages before it (and its own rank with the page it read most), a tool result
    does not; of the oldest evictable pages the least attended leave first; no scoring forward,
    the accounting holds; a cut forgets the scores of the pages it rewrites."""
    engine = engine_on(backend, contextd, dataclasses.replace(CONFIG, evict_order="attention"))
    messages: list[dict[str, object]] = [SYSTEM, {"role": "user", "content": "What does handler retry_limit do?"}]
    turn(engine, "a", messages)
    session = engine.sessions["a"]
    order = session.attention
    assert order is not None and session.eviction is None
    for n in range(8):
        scored = set(order.scores)
        messages += file_turn(n)
        turn(engine, "a", messages)
        assert set(order.scores) <= scored, "a tool result voted"   # (a cut may forget a page)
        if n % 2:
            messages.append({"role": "user", "content": f"What is value_{n - 1} in f{n - 1}.py?"})
            turn(engine, "a", messages)
            assert set(order.scores) - scored, "a user message did not vote"
    assert len(order.scores) > 8
    evicts_the_least_scored_of_the_window(engine, session)
    counters = session.counters
    assert counters.controller_forward_tokens == 0 and counters.historical_forward_during_restore == 0
    assert counters.model_forward_tokens == \
        counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens
    # A cut (how an edited history is rebuilt) forgets the scores of every page it rewrites; the
    # pages read again are scored again.
    segments = session.transcript.segments
    keep = next(k for k, segment in enumerate(segments) if "# f2.py" in segment.text)
    cut_page = sum(len(segment.ids) for segment in segments[:keep]) // 128
    assert any(p >= cut_page for p in order.scores)
    engine.mover.cut(session, keep)
    assert order.scores and all(p < cut_page for p in order.scores)
    turn(engine, "a", messages)
    assert any(p >= cut_page for p in order.scores)
    counters = session.counters
    assert counters.historical_forward_during_restore == 0 and counters.model_forward_tokens == \
        counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens
