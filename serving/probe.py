"""What each selector would restore for a question, without answering it (`probe`): the measure
benchmarks.selectors and the retrieval tests take of selectors side by side.

The question is prefilled exactly as a turn prefills it (serving.prompt), every selector is asked
over the same state, and the question is then taken back out and the pages it pushed out put
back with the leases they had, so the session is left as it was. It drives the engine from the
outside, between turns; the turn's code does not know it exists. Depends on serving.engine,
serving.prompt, serving.transcript, controller and contextd.client.
"""

from __future__ import annotations

from dataclasses import dataclass

from contextd.client import pb
from controller.pager import Decision
from controller.selectors import Selector
from serving.engine import Engine
from serving.prompt import begin_message, prompt_pieces
from serving.transcript import TranscriptError, align
from serving.turn import ChatRequest


@dataclass(frozen=True)
class ProbeResult:
    restore: list[int]
    resident: list[int]
    decided_ms: float
    note: str
    controller_forward_tokens: int  # what the selector's scoring forwards took (rerank)


def probe(engine: Engine, request: ChatRequest, selectors: list[Selector]) -> dict[str, ProbeResult]:
    """Prefill the request's new messages, ask each selector what it would restore, then take the
    new tokens back out: nothing is generated and the session is left as it was. For measuring
    selectors (benchmarks.selectors and the retrieval tests)."""
    fingerprint = engine.format.fingerprint(request.tools, request.thinking)
    session = engine.activate(request.session_id, fingerprint)
    rendering = engine.format.render(request.messages, request.tools, request.thinking, session.transcript.generated,
                                     session.render_memo)
    alignment = align(session.transcript, fingerprint, rendering.text, request.message_hashes)
    if alignment.rebuild or not alignment.new_text:
        raise TranscriptError("a probe must extend the cached transcript")
    segments_before = len(session.transcript.segments)
    resident_before = set(session.pager.resident)
    leases_before = [page.lease_until_turn for page in session.pager.pages]
    new_tokens = 0
    for piece in prompt_pieces(engine.format, session, request, rendering, alignment.new_text):
        if piece.segment.opener:
            continue  # as in a turn: the plan is made before the answer's opening is prefilled
        begin_message(session, piece)
        for _ in engine.prefill(session, piece.segment, piece.pin, logits=False):
            pass   # a probe runs alone: nothing to interleave at its pauses
        new_tokens += len(piece.segment.ids)
    pager = session.pager
    if session.key_index is None and any(s.uses_key_index for s in selectors):
        session.key_index = engine.new_key_index()
    if session.lexical_index is None and any(s.uses_lexical_index for s in selectors):
        session.lexical_index = engine.new_lexical_index()
    engine.recovery.index_stored_pages(session)
    context = engine.selection_context(session, new_tokens)
    results: dict[str, ProbeResult] = {}
    for selector in selectors:
        scored = session.counters.controller_forward_tokens
        selection = selector.select(context)
        restore: list[int] = []
        if selection.plan is not None:
            cleaned, rejected = pager.validate(selection.plan)
            restore = [] if rejected else cleaned.restore
        results[selector.name] = ProbeResult(
            restore=restore, resident=list(pager.resident), decided_ms=selection.decided_ms, note=selection.note,
            controller_forward_tokens=session.counters.controller_forward_tokens - scored)
    engine.mover.cut(session, segments_before)
    resident_now = set(session.pager.resident)
    back = engine.mover.execute(session, Decision(evict=sorted(resident_now - resident_before),
                                                  restore=sorted(resident_before - resident_now), plan_used=False))
    # Putting pages back is an undo, not a selector's restore: they keep the leases they had,
    # or every probe after the first would find the room taken by the pages the question's
    # prefill pushed out (3 probes in, a 5,000-token session at budget 2,048 had room for no page).
    for index in back:
        pager.lease(index, leases_before[index])
    if back:
        engine.contextd.set_leases(
            session.session_id,
            add=[pb.Lease(page_id=pager.pages[i].page_id, until_turn=leases_before[i]) for i in back
                 if leases_before[i] > pager.turn],
            remove=[pager.pages[i].page_id for i in back if leases_before[i] <= pager.turn])
    return results
