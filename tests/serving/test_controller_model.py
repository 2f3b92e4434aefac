"""A separate controller model scores pages (serving.scoring): tiny real models, a real contextd
process. The serving model here is hybrid (tiny-qwen3-next: recurrent layers), which cannot score
pages apart itself; the controller (tiny-llama, full attention, the same tokenizer family) reads
each page's text on its own, keeps its K/V, and from then on forwards only the question."""

from __future__ import annotations

import pytest

from backends import Backend, UnsupportedModelError, load_backend
from contextd.client import Client
from controller.selectors import RecencySelector, RerankSelector
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.launcher import ContextdProcess
from serving.probe import probe
from serving.scoring import ControllerConfig, ControllerScorer
from serving.session import Session
from serving.turn import ChatRequest, TurnEvent
from tests.serving.engines import AGENT_SYSTEM as SYSTEM
from tests.serving.engines import evicts_the_least_scored_of_the_window, file_turn, turn

CONFIG = EngineConfig(budget_tokens=2048, tail_tokens=256, max_new_tokens=1, evict_order="model")
ASK = {"role": "user", "content": "What does handler retry_limit do?"}


@pytest.fixture(scope="module")
def serving() -> Backend:
    return load_backend("torch", "tiny-qwen3-next", capacity=CONFIG.budget_tokens + 256)


@pytest.fixture(scope="module")
def controller() -> Backend:
    return load_backend("torch", "tiny-llama", capacity=ControllerConfig.max_page_tokens)


def engine_on(serving: Backend, contextd: ContextdProcess, scorer: ControllerScorer | None,
              config: EngineConfig = CONFIG) -> Engine:
    fresh = serving.fork()
    fresh.reset()
    return Engine(fresh, ChatFormat(fresh.tokenizer), Client(contextd.socket, timeout=60.0), config,
                  RecencySelector(), scorer)


def grown(engine: Engine, session_id: str, files: int) -> list[dict[str, object]]:
    messages: list[dict[str, object]] = [SYSTEM, ASK]
    turn(engine, session_id, messages)
    for n in range(files):
        messages += file_turn(n)
        turn(engine, session_id, messages)
    return messages


def test_a_page_is_read_once_when_stored_and_scored_from_its_text_alone(serving: Backend, controller: Backend,
                                                                         contextd: ContextdProcess) -> None:
    scorer = ControllerScorer(controller, serving.tokenizer)
    engine = engine_on(serving, contextd, scorer)
    grown(engine, "t", 4)
    session = engine.sessions["t"]
    advice = session.eviction
    assert advice is not None and advice.focus
    full = [p.index for p in session.pager.pages if p.tokens == 128]
    texts = {tuple(session.transcript.ids[p.token_start:p.token_end]) for p in session.pager.pages if p.tokens == 128}
    assert scorer.cached_pages == len(texts) and not session.unread_pages   # read at the end of their turns
    assert session.read_ahead_ms > 0   # after the answer was out
    pages = full[:3]
    before = session.counters.controller_forward_tokens
    scored = engine.mover.score_by_controller(session, pages, advice.focus)
    # The same scores from scratch: a fresh controller prefills each page's text alone, then the
    # controller's own template opens a user turn and the question follows; only the question's
    # tokens count, its first one included.
    opening = ChatFormat(controller.tokenizer).user_opening
    assert scorer.opening == opening and controller.tokenizer.decode(opening) == "<|im_end|>\n<|im_start|>user\n"
    alone = controller.fork()
    tokenizer = serving.tokenizer
    question = controller.tokenizer.encode(tokenizer.decode(advice.focus, skip_special_tokens=True),
                                           add_special_tokens=False)
    for page in pages:
        ids = session.transcript.ids[session.pager.pages[page].token_start:session.pager.pages[page].token_end]
        text_ids = controller.tokenizer.encode(tokenizer.decode(list(ids), skip_special_tokens=True))
        alone.reset()
        alone.prefill(text_ids)
        expected, _ = alone.score_after_blocks([alone.save_block(0, len(text_ids))], opening + question)
        assert len(scored[page]) == len(question)
        assert scored[page] == pytest.approx(expected[0][len(opening) - 1:], abs=1e-4), page
    # Read already: scoring them forwards the opening and the question only, once per page; a
    # controller that has not read them prefills each first.
    assert session.counters.controller_forward_tokens - before == len(pages) * (len(opening) + len(question))
    _, fresh = ControllerScorer(controller, serving.tokenizer).score(session, pages, advice.focus)
    assert fresh > len(pages) * (len(question) + 100)


def test_the_pages_a_turn_stored_are_read_after_its_answer_with_a_pause_between_two(
        serving: Backend, controller: Backend, contextd: ContextdProcess) -> None:
    """Read-ahead holds the worker one page at a time: after the final event, a pause follows
    each page read but the last (the server's worker lets other sessions and stats readers in
    there), and the turn ends once every page it stored is read."""
    scorer = ControllerScorer(controller, serving.tokenizer)
    engine = engine_on(serving, contextd, scorer)
    messages = grown(engine, "p", 1) + file_turn(1) + file_turn(2)
    unread = 0
    after: list[TurnEvent] | None = None
    for event in engine.chat(ChatRequest("p", messages)):
        if event.final is not None:
            unread, after = len(set(engine.sessions["p"].unread_pages)), []
        elif after is not None:
            after.append(event)
    session = engine.sessions["p"]
    assert unread >= 2 and after is not None
    assert len(after) == unread - 1 and all(e.pause for e in after)
    assert not session.unread_pages and session.read_ahead_ms > 0


def test_on_a_hybrid_model_the_advice_orders_evictions_and_history_is_never_forwarded(
        serving: Backend, controller: Backend, contextd: ContextdProcess) -> None:
    with pytest.raises(ValueError, match="eviction order 'model'.*full-attention --controller-model"):
        engine_on(serving, contextd, None)
    client = Client(contextd.socket)
    try:
        with pytest.raises(ValueError, match="rerank selector.*full-attention --controller-model"):
            Engine(serving, ChatFormat(serving.tokenizer), client, EngineConfig(budget_tokens=2048), RerankSelector())
    finally:
        client.close()
    engine = engine_on(serving, contextd, ControllerScorer(controller, serving.tokenizer))
    grown(engine, "h", 8)
    session = engine.sessions["h"]
    evicts_the_least_scored_of_the_window(engine, session)
    counters = session.counters
    assert counters.evicted_pages > 0 and counters.controller_forward_tokens > 0
    assert counters.historical_forward_during_restore == 0
    assert counters.model_forward_tokens == \
        counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens
    assert counters.peak_attention_tokens <= CONFIG.budget_tokens


def test_the_reranker_scores_cold_pages_of_a_hybrid_model(serving: Backend, controller: Backend,
                                                          contextd: ContextdProcess) -> None:
    engine = engine_on(serving, contextd, ControllerScorer(controller, serving.tokenizer),
                       EngineConfig(budget_tokens=2048, tail_tokens=256, max_new_tokens=1))
    messages = grown(engine, "r", 10)
    question = {"role": "user", "content": "Which is larger, value_1 in f1.py or value_2 in f2.py?"}
    probed = probe(engine, ChatRequest("r", [*messages, question]), [RerankSelector()])["rerank"]
    assert "candidates kept" in probed.note, probed.note
    assert probed.restore and probed.controller_forward_tokens > 0
    counters = engine.sessions["r"].counters
    assert counters.historical_forward_during_restore == 0
    assert counters.model_forward_tokens == \
        counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens


def test_the_controller_keeps_what_its_memory_holds_and_reads_again_what_it_let_go(
        serving: Backend, controller: Backend, contextd: ContextdProcess) -> None:
    engine = engine_on(serving, contextd, ControllerScorer(controller, serving.tokenizer))
    grown(engine, "m", 3)
    session = engine.sessions["m"]
    focus = session.eviction.focus   # type: ignore[union-attr]
    pages = [p.index for p in session.pager.pages if p.tokens == 128][:3]
    sizes = [page_bytes(controller, serving, session, page, focus) for page in pages]
    small = ControllerScorer(controller, serving.tokenizer, ControllerConfig(cache_bytes=sizes[1] + sizes[2]))
    _, first = small.score(session, pages, focus)
    assert small.cached_pages == 2
    _, again = small.score(session, pages[1:], focus)    # both still held: the question alone
    _, evicted = small.score(session, pages[:1], focus)  # let go: read again
    assert again < evicted < first
    with pytest.raises(ValueError, match="cache_bytes"):
        ControllerConfig(cache_bytes=-1)


def page_bytes(controller: Backend, serving: Backend, session: Session, page: int, focus: list[int]) -> int:
    """What the controller's K/V of one page takes in its memory."""
    alone = ControllerScorer(controller, serving.tokenizer)
    alone.score(session, [page], focus)
    assert alone.cached_pages == 1
    return alone.cached_bytes


def test_a_controller_that_cannot_score_pages_apart_is_refused(serving: Backend) -> None:
    with pytest.raises(UnsupportedModelError, match="full attention"):
        ControllerScorer(serving, serving.tokenizer)
