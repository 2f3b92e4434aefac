"""A page's id names its history, and a page of another history is never served.

After a cut back (a client's edit, a retry, a resample) the regrown pages are other versions of
the same indices. Their payloads must never replace the ones the last session record names
until the record replacing it is durable (contextd deletes a replaced payload right after its
commit), and a payload whose record names another history than the session's transcript gives
the page (the same tokens after other ones) must never go into attention: not by a restore, not
by a recovery. A tiny real model, real contextd processes, nothing of ours faked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from backends import Backend, load_backend
from contextd.client import Client, pb
from contextd.errors import DataCorrupt
from contextd.wire import PageState, PinKind
from controller.pager import PAGE_TOKENS, Decision
from serving.engine import Engine
from serving.launcher import ContextdProcess
from serving.session import Session
from serving.transcript import TranscriptError
from serving.turn import ChatRequest
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


@dataclass(frozen=True)
class Version:
    """One stored version of a page: its manifest record and its payload's bytes."""

    record: pb.Page
    data: bytes


def version(client: Client, contextd: ContextdProcess, session: Session, index: int) -> Version:
    record = client.get_pages(session.session_id, [session.pager.pages[index].page_id])[0]
    return Version(record, (contextd.root / "store" / record.locator).read_bytes())


def forge(client: Client, session: Session, index: int, other: Version) -> None:
    """Give page `index`'s current version the payload and record of `other`, a version of the
    same tokens after another history: what a store under ids without the history left when a
    dead turn replaced a version the record named, and what another server on the same contextd
    may write."""
    page = session.pager.pages[index]
    written = client.payloads().write(session.session_id, page.page_id, other.data)
    forged = pb.Page()
    forged.CopyFrom(other.record)
    forged.page_id, forged.state = page.page_id, client.get_pages(session.session_id, [page.page_id])[0].state
    forged.locator, forged.checksum, forged.byte_size = written.locator, written.checksum, written.byte_size
    client.upsert_pages(session.session_id, [forged])


def regrown(engine: Engine, client: Client, contextd: ContextdProcess, name: str, state: PageState
            ) -> tuple[list[dict[str, Any]], list[int], dict[int, Version]]:
    """A session moved to another history by an edit that keeps the token count: the client's
    messages now, its full pages past the edit in `state`, and each page's version from before
    the edit (the same tokens, K/V computed after other ones)."""
    messages = grow(engine, name, 6)
    session = engine.sessions[name]
    old_ids, old_hashes = list(session.transcript.ids), list(session.pager.chain.hashes)
    old = {p.index: version(client, contextd, session, p.index) for p in session.pager.pages[1:-1]}
    now = edited(messages)
    now.append({"role": "assistant", "content": turn(engine, name, now).content})
    pager = session.pager
    indices = [p.index for p in pager.pages[1:-1] if p.state is state and p.index in old and p.stored]
    for index in indices:
        page = pager.pages[index]
        assert session.transcript.ids[page.token_start:page.token_end] == old_ids[page.token_start:page.token_end]
        assert pager.chain.hashes[index] != old_hashes[index] and page.tokens == PAGE_TOKENS
    return now, indices, old


def test_a_page_of_another_history_with_the_same_tokens_is_never_restored(
        backend: Backend, contextd: ContextdProcess, caplog: pytest.LogCaptureFixture) -> None:
    engine = engine_on(backend, contextd)
    client = contextd.client
    assert client is not None
    _, cold, old = regrown(engine, client, contextd, "w", PageState.COLD)
    session = engine.sessions["w"]
    index = cold[0]
    forge(client, session, index, old[index])
    page = session.pager.pages[index]
    held = engine.backend.attention_tokens
    assert engine.mover.execute(session, Decision(evict=[], restore=[index], plan_used=False)) == []
    assert engine.backend.attention_tokens == held and page.state is PageState.COLD and not page.stored
    assert client.get_pages("w", [page.page_id])[0].state == PageState.CORRUPT
    assert f"page {page.page_id}: its payload holds K/V computed after another history" in caplog.text


def test_a_recovery_never_fills_a_resident_page_of_another_history(
        backend: Backend, contextd: ContextdProcess) -> None:
    engine = engine_on(backend, contextd)
    client = contextd.client
    assert client is not None
    messages, resident, old = regrown(engine, client, contextd, "r", PageState.HOT)
    assert len(resident) >= 2
    # the manifest changes between recovery's read of it and the fill (another server's write)
    restarted = engine_on(backend, contextd)
    rebuilt = restarted.recovery.rebuild("r", CONFIG.pager_config())
    assert rebuilt is not None and rebuilt.recovery_notes == []
    forge(client, rebuilt, resident[0], old[resident[0]])
    with pytest.raises(DataCorrupt, match="another history"):
        restarted.mover.fill_resident(rebuilt)
    assert client.get_pages("r", [rebuilt.pager.pages[resident[0]].page_id])[0].state == PageState.CORRUPT
    # ... or before it: recovery reads the record, refuses the page, and the session starts over
    # as it does without a corrupt resident page
    forge(client, rebuilt, resident[1], old[resident[1]])
    again = engine_on(backend, contextd)
    result = turn(again, "r", [*messages, QUESTION])
    notes = again.sessions["r"].recovery_notes
    assert any("another history" in note for note in notes) and any("starts over" in note for note in notes), notes
    assert result.counters.recovered_pages == 0 and result.prefilled_tokens == result.prompt_tokens


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
