"""A page's id names its history.

After a cut back (a client's edit, a retry, a resample) the regrown pages are other versions of
the same indices. Their payloads must never replace the ones the last session record names
until the record replacing it is durable (contextd deletes a replaced payload right after its
commit). A tiny real model, real contextd processes, nothing of ours faked.
"""

from __future__ import annotations

from typing import Any

import pytest

from backends import Backend, load_backend
from contextd.client import Client, pb
from contextd.wire import PinKind
from controller.pager import PAGE_TOKENS
from serving.engine import ChatRequest, Engine
from serving.launcher import ContextdProcess
from serving.transcript import TranscriptError
from tests.serving.engines import restarted_copy, turn
from tests.serving.test_engine import CONFIG, SYSTEM, engine_on, grow

QUESTION = {"role": "user", "content": "How many times does handler 1 retry?"}


@pytest.fixture(scope="module")
def backend() -> Backend:
    return load_backend("torch", "tiny-llama", capacity=CONFIG.budget_tokens + 256)


def edited(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The client's history with its first message edited, keeping its token count: the session
    is cut back to there and everything after is prefilled again, the same tokens after other ones."""
    assert messages[:2] == [SYSTEM, {"role": "user", "content": "Read the repository and take notes."}]
    return [SYSTEM, {"role": "user", "content": "Read the repository and take Notes."}, *messages[2:]]


def rows(client: Client, session: str) -> dict[str, tuple[str, int, int]]:
    """Every manifest row: page id -> (checksum, size, state)."""
    return {p.page_id: (p.checksum, p.byte_size, int(p.state)) for p in client.query_pages(session)}


def dies_after_its_prefill(engine: Engine, session: str, messages: list[dict[str, Any]]) -> None:
    """A turn that is killed once its prompt is in: after its stores, before its record."""
    steps = engine.chat(ChatRequest(session, messages))
    next(e for e in steps if e.prepared is not None)
    steps.close()
    engine.forget(session)


def test_a_turn_that_dies_after_regrowing_an_edited_history_keeps_every_page_the_record_names(
        backend: Backend, contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd)
    messages = grow(engine, "h", 6)
    client = contextd.client
    assert client is not None
    before = rows(client, "h")
    stored = engine.sessions["h"].counters.stored_pages
    session = engine.sessions["h"]
    dies_after_its_prefill(engine, "h", edited(messages))
    assert session.counters.stored_pages > stored + 3, "the dead turn stored no regrown page: nothing was tested"
    after = rows(client, "h")
    kept = {page_id: after.get(page_id, ("gone", 0, 0))[:2] for page_id in before}
    assert kept == {page_id: row[:2] for page_id, row in before.items()}, \
        "a page the last record names lost its payload to the dead turn's history"
    # a restarted server resumes from the last record, which finds every page it names
    restarted = engine_on(backend, contextd)
    answer = turn(restarted, "h", [*messages, QUESTION])
    notes = restarted.sessions["h"].recovery_notes
    assert len(notes) == 1 and notes[0].startswith("deleted "), notes   # only the dead turn's own pages go
    assert not client.verify("h").corrupt
    # ... and answers as a server that never saw the dead turn does
    twin = engine_on(backend, contextd)
    assert turn(twin, "t", [*grow(twin, "t", 6), QUESTION]).content == answer.content


def test_a_message_hash_contextd_would_refuse_fails_the_turn_before_anything_is_stored(
        backend: Backend, contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd)
    messages = grow(engine, "q", 6)
    client = contextd.client
    assert client is not None
    before, turn_before = rows(client, "q"), client.read_record("q").record.turn
    request = edited(messages)
    hashes = [f"{n:016x}" for n in range(len(request) - 1)] + ["f" * 129]
    with pytest.raises(TranscriptError, match="message_hashes holds at most"):
        for _ in engine.chat(ChatRequest("q", request, message_hashes=hashes)):
            pass
    engine.forget("q")   # what the worker does after a failed turn
    assert rows(client, "q") == before and client.read_record("q").record.turn == turn_before
    # the session goes on from its last record, with nothing to fix
    result = turn(engine, "q", [*messages, QUESTION])
    assert engine.sessions["q"].recovery_notes == [] and result.counters.recovered_pages > 0


def earlier_ids(client: Client, contextd: ContextdProcess, session: str) -> dict[str, str]:
    """Rewrite `session` in contextd as kv-elision stored it before ids carried the history: each
    page under p{index:07d} (and .{tokens} when partial; a partial page had no prefix hash), its
    pins and leases with it. Returns each id -> its earlier one."""
    renamed: dict[str, str] = {}
    earlier: list[pb.Page] = []
    for page in client.query_pages(session):
        full = page.token_end - page.token_start == PAGE_TOKENS
        renamed[page.page_id] = f"p{page.index:07d}" + ("" if full else f".{page.token_end - page.token_start}")
        written = client.payloads().write(session, renamed[page.page_id],
                                          (contextd.root / "store" / page.locator).read_bytes())
        row = pb.Page()
        row.CopyFrom(page)
        row.page_id, row.locator, row.checksum, row.byte_size = (renamed[page.page_id], written.locator,
                                                                 written.checksum, written.byte_size)
        row.prefix_hash = page.prefix_hash if full else ""
        earlier.append(row)
    client.upsert_pages(session, earlier)
    pins, leases = client.query_pins(session), client.query_leases(session)
    client.set_pins(session, add=[(renamed[pin.page_id], PinKind(pin.kind)) for pin in pins],
                    remove=[pin.page_id for pin in pins])
    client.set_leases(session, add=[pb.Lease(page_id=renamed[lease.page_id], until_turn=lease.until_turn,
                                             expires_unix=lease.expires_unix) for lease in leases],
                      remove=[lease.page_id for lease in leases])
    client.delete_pages(session, list(renamed))
    return renamed


def test_a_store_written_under_the_earlier_ids_is_read_then_outgrown(backend: Backend,
                                                                     contextd: ContextdProcess) -> None:
    first = engine_on(backend, contextd)
    messages = [*grow(first, "o", 6), QUESTION]
    with restarted_copy(contextd) as copy:
        client = copy.client
        assert client is not None
        renamed = earlier_ids(client, copy, "o")
        second = engine_on(backend, copy)
        one, two = turn(first, "o", messages), turn(second, "o", messages)
        recovered = second.sessions["o"]
        assert recovered.recovery_notes == [] and two.counters.recovered_pages > 0
        assert two.content == one.content, "the session recovered from the earlier ids answers otherwise"
        assert set(renamed.values()) & {p.page_id for p in recovered.pager.pages}, "no page kept its earlier id"
        # an edit: every page from there on is a new version under a new id, and the earlier
        # versions go once the turn's record no longer names them
        turn(second, "o", edited([*messages, {"role": "assistant", "content": two.content}]))
        assert all("-" in page_id for page_id in rows(client, "o")) and not client.verify("o").corrupt
