"""Branches in contextd, against a real daemon process on a real socket: the prefix index finds
the session whose stored pages begin a token prefix furthest, and a branch is a copy of its
parent that shares every payload file (hard links) and outlives the parent."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from contextd.client import Client, pb
from contextd.errors import FailedPrecondition, InvalidArgument, NotFound, StoreFull
from contextd.wire import PageState, PinKind
from serving.launcher import ContextdProcess
from tests.contextd.conftest import states, store_payload

MODEL, FINGERPRINT = "smollm2-135m", "f" * 16


def chain(tag: str, count: int) -> list[str]:
    """Stand-ins for page chain hashes: 16 hex digits each, the first `count` of a history `tag`."""
    return [f"{tag}{i:015x}" for i in range(count)]


def parent_session(client: Client, session_id: str, hashes: list[str], record: bool = True) -> None:
    """A session with one stored page per hash (the first pinned, the last two cold), a record with
    two segments and a recurrent snapshot."""
    client.open_session(session_id, model_id=MODEL, fingerprint=FINGERPRINT, budget_tokens=4096)
    for i, prefix_hash in enumerate(hashes):
        page = pb.Page(page_id=f"p{i:06d}", index=i, token_start=i * 128, token_end=(i + 1) * 128,
                       original_position=i * 128, dtype="float32", layer_view="v", prefix_hash=prefix_hash)
        store_payload(client, session_id, page, bytes([i + 1]) * 4096)
    client.set_page_states(session_id, states([(f"p{i:06d}", PageState.COLD) for i in
                                               range(len(hashes) - 2, len(hashes))], turn=1))
    client.set_pins(session_id, add=[("p000000", PinKind.SYSTEM)])
    if record:
        blob = client.payloads().write(session_id, "snapshot-recurrent", b"state" * 100, suffix="rs")
        snapshot = pb.Snapshot(slot="end_of_turn", token_count=len(hashes) * 128, fingerprint="s" * 16,
                               locator=blob.locator, byte_size=blob.byte_size, checksum=blob.checksum)
        client.write_record(session_id, pb.SessionRecord(turn=3, fingerprint=FINGERPRINT,
                                                         counters={"turns": 3}, resident_pages=[0, 1],
                                                         resident_positions=[0, 128]),
                            0, [pb.TranscriptSegment(text="hello", token_ids=[1, 2]),
                                pb.TranscriptSegment(text="answer", token_ids=[3], generated=True)],
                            snapshots=[snapshot])


def test_the_prefix_index_finds_the_furthest_matching_session_of_the_same_model_and_fingerprint(
        daemon: ContextdProcess) -> None:
    client = daemon.client
    assert client is not None
    parent_session(client, "short", chain("a", 3))
    parent_session(client, "long", chain("a", 6))
    parent_session(client, "other", chain("b", 6))
    parent_session(client, "unfinished", chain("a", 8), record=False)  # no completed turn: not a parent
    asked = [*chain("a", 5), *chain("c", 3)]
    assert (client.find_prefix(MODEL, FINGERPRINT, asked).session_id,
            client.find_prefix(MODEL, FINGERPRINT, asked).pages) == ("long", 5)
    assert client.find_prefix(MODEL, FINGERPRINT, chain("a", 2)).pages == 2
    assert client.find_prefix(MODEL, FINGERPRINT, chain("c", 4)).session_id == ""
    assert client.find_prefix("another-model", FINGERPRINT, asked).pages == 0
    assert client.find_prefix(MODEL, "0" * 16, asked).pages == 0
    assert client.find_prefix(MODEL, FINGERPRINT, []).pages == 0
    # a page that leaves the store leaves the index: the match stops before it
    client.delete_pages("long", ["p000005"])
    client.close_session("short")
    found = client.find_prefix(MODEL, FINGERPRINT, chain("a", 6))
    assert (found.session_id, found.pages) == ("long", 5)
    client.delete_session("long")
    assert client.find_prefix(MODEL, FINGERPRINT, chain("a", 6)).pages == 0  # "short" is closed
    with pytest.raises(InvalidArgument, match="prefix_hash"):
        client.upsert_pages("other", [pb.Page(page_id="bad", prefix_hash="not hex")])


def test_a_branch_shares_its_parents_payloads_and_outlives_it(daemon: ContextdProcess) -> None:
    client = daemon.client
    assert client is not None
    parent_session(client, "parent", chain("a", 5))
    reply = client.branch_session("child", "parent")
    assert reply.pages == 5 and reply.shared_bytes == 5 * 4096 + 500
    child = client.get_session("child")
    assert child.labels["branch_of"] == "parent" and dict(child.counters) == {}
    assert child.pages == client.get_session("parent").pages
    record = client.read_record("child")
    assert [s.text for s in record.segments] == ["hello", "answer"] and list(record.record.resident_pages) == [0, 1]
    assert dict(record.record.counters) == {}
    assert {p.page_id: p.kind for p in client.query_pins("child")} == {"p000000": "system"}
    assert [p.page_id for p in client.query_pages("child", [PageState.COLD])] == ["p000003", "p000004"]
    store = daemon.root / "store"
    for mine, theirs in zip(client.query_pages("child"), client.query_pages("parent"), strict=True):
        assert mine.locator.startswith("child/") and mine.checksum == theirs.checksum
        assert os.stat(store / mine.locator).st_ino == os.stat(store / theirs.locator).st_ino
        assert os.stat(store / mine.locator).st_nlink == 2
    snapshot = client.query_snapshots("child")[0]
    assert snapshot.locator.startswith("child/") and snapshot.token_count == 5 * 128
    assert client.find_prefix(MODEL, FINGERPRINT, chain("a", 5)).pages == 5
    assert client.gc(dry_run=False).orphan_files_removed == 0

    freed = client.delete_session("parent").bytes_freed
    assert freed == 0  # every file is the child's too
    verified = client.verify("child")
    assert verified.pages_ok == 5 and not verified.corrupt and verified.snapshots_checked == 1
    assert client.find_prefix(MODEL, FINGERPRINT, chain("a", 5)).session_id == "child"
    assert client.delete_session("child").bytes_freed == 5 * 4096 + 500


def test_bad_branches_get_clear_errors_and_change_nothing(daemon: ContextdProcess) -> None:
    client = daemon.client
    assert client is not None
    parent_session(client, "parent", chain("a", 2))
    parent_session(client, "busy", chain("b", 2))
    parent_session(client, "fresh", chain("c", 2), record=False)
    with pytest.raises(FailedPrecondition, match="exists"):
        client.branch_session("busy", "parent")
    with pytest.raises(InvalidArgument, match="itself"):
        client.branch_session("parent", "parent")
    with pytest.raises(NotFound, match="ghost"):
        client.branch_session("child", "ghost")
    with pytest.raises(FailedPrecondition, match="no completed turn"):
        client.branch_session("child", "fresh")
    with pytest.raises(InvalidArgument):
        client.branch_session("../x", "parent")
    assert "child" not in {s.session_id for s in client.list_sessions(include_closed=True)}
    assert not (daemon.root / "store" / "child").exists() or not any((daemon.root / "store" / "child").iterdir())
    assert client.query_pages("busy")[0].locator.startswith("busy/")


def test_a_branch_that_cannot_link_every_payload_leaves_nothing_behind(tmp_path: Path) -> None:
    from contextd import blobs
    from contextd.blobs import Reserve
    from contextd.daemon import Daemon, DaemonConfig
    from contextd.records import PageRow, RecordRow, SegmentRow

    daemon = Daemon(DaemonConfig(tmp_path, reserve=Reserve(bytes=0)))
    try:
        daemon.open_session("parent", model_id=MODEL, fingerprint=FINGERPRINT)
        for i, prefix_hash in enumerate(chain("a", 4)):
            stored = daemon.blobs.write("parent", f"p{i:06d}", bytes([i]) * 1024)
            daemon.upsert_pages("parent", [PageRow(f"p{i:06d}", i, i * 128, (i + 1) * 128, i * 128,
                                                   locator=stored.locator, byte_size=stored.byte_size,
                                                   checksum=stored.checksum, prefix_hash=prefix_hash)])
        daemon.write_record("parent", RecordRow(turn=1, fingerprint=FINGERPRINT), 0, [SegmentRow("hi", (1,))])
        blobs.inject("link", errno.ENOSPC, nth=3)
        try:
            with pytest.raises(StoreFull, match="nothing was shared"):
                daemon.branch_session("child", "parent")
        finally:
            blobs.clear_fault()
        assert "child" not in {s.session_id for s in daemon.list_sessions(include_closed=True)}
        assert not any((tmp_path / "store" / "child").glob("*"))
        assert daemon.verify("parent").pages_ok == 4
        assert daemon.branch_session("child", "parent").pages == 4   # and once the disk has room, it does
    finally:
        daemon.close()
