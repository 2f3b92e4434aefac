"""Sessions moving between contextd daemons (standing in for servers on other machines) that share
one real S3 store (Ceph RGW, tests/objectstore.py): each committed turn exports the session, a
second daemon on another root adopts it by id with the exact rows and payloads, a lease keeps two
daemons from holding one session at once, and a stale holder's write is refused (fencing)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from contextd.client import Client, pb
from contextd.errors import ContextdError, FailedPrecondition, SessionHeld
from contextd.handover import Holder
from contextd.objects import ObjectStore
from contextd.wire import PageState, PinKind
from harness.faults.network import WAIT_S, S3Proxy
from harness.rgw import Rgw
from serving.launcher import ContextdProcess
from tests.objectstore import bucket

from .conftest import MovedClock, in_thread, store_payload
from .test_object_tier import data, page, tiered


@pytest.fixture
def s3(rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    return bucket(rgw, monkeypatch)


def server(daemon_factory: Any, s3: ObjectStore) -> Client:
    proc: ContextdProcess = daemon_factory("--reserve-bytes", "0", "--object-store", s3.config.url,
                                           "--object-endpoint", s3.config.endpoint)
    assert proc.client is not None
    return proc.client


def turn(client: Client, n: int, keep: int, *texts: str) -> None:
    client.write_record("s", pb.SessionRecord(turn=n, attention_tokens=128 * n, fingerprint="f",
                                              counters={"turns": n}), keep_segments=keep,
                        append=[pb.TranscriptSegment(text=t, token_ids=[n, len(t)]) for t in texts])


def first_turn(client: Client) -> list[bytes]:
    """Session "s" on `client`'s daemon: three stored pages (one pinned) and a completed turn."""
    payloads = [data(n) for n in range(3)]
    for n, payload in enumerate(payloads):
        store_payload(client, "s", page(n), payload)
    client.set_pins("s", add=[("p0", PinKind.SYSTEM)])
    turn(client, 1, 0, "system", "user 1", "answer 1")
    return payloads


def rows(client: Client) -> tuple[Any, ...]:
    session = client.get_session("s")
    record = client.read_record("s")
    pages = sorted((p.page_id, p.state, p.locator, p.checksum) for p in client.get_pages("s", ["p0", "p1", "p2", "p3"]))
    return (session.turn, session.pages, record.record.turn, [s.text for s in record.segments], pages,
            [(p.page_id, p.kind) for p in client.query_pins("s")])


def object_keys(s3: ObjectStore) -> set[str]:
    listed = s3.client.list_objects_v2(Bucket=s3.config.bucket)
    return {item["Key"] for item in listed.get("Contents", [])}


def test_a_second_daemon_adopts_a_session_with_its_rows_and_payloads(daemon_factory: Any, s3: ObjectStore) -> None:
    _, a = tiered(daemon_factory, s3)
    payloads = first_turn(a)
    b = server(daemon_factory, s3)
    hold = b.hold_session("s", "m", 30)
    assert hold.adopted and hold.token == 2 and hold.previous_node == a.status().node != b.status().node
    assert rows(b) == rows(a)
    for got, payload in zip(b.get_pages("s", ["p0", "p1", "p2"]), payloads, strict=True):
        assert b.payloads().path(got.locator).read_bytes() == payload   # downloaded into b's folder
    assert b.verify().pages_ok == 3
    # b's next turn is exported in its turn, and a third daemon adopting sees it
    store_payload(b, "s", page(3), data(3))
    turn(b, 2, 3, "user 2", "answer 2")
    c = server(daemon_factory, s3)
    assert c.hold_session("s", "m", 30).adopted
    assert rows(c) == rows(b) and c.read_record("s").record.turn == 2
    with pytest.raises(FailedPrecondition, match="model"):
        server(daemon_factory, s3).hold_session("s", "another-model", 30)


def race(clients: list[Client], session_id: str) -> list[str]:
    """Each client asks to hold `session_id` at the same moment: "held" or "refused" for each."""
    outcomes: list[str] = []
    gate = threading.Barrier(len(clients))

    def hold(client: Client) -> None:
        gate.wait()
        try:
            client.hold_session(session_id, "m", 30)
            outcomes.append("held")
        except SessionHeld:
            outcomes.append("refused")

    threads = [threading.Thread(target=hold, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_a_running_lease_keeps_the_session_and_two_daemons_racing_get_one_each_time(
        daemon_factory: Any, s3: ObjectStore) -> None:
    _, a = tiered(daemon_factory, s3)
    first_turn(a)
    assert not a.hold_session("s", "m", 30).adopted       # a's own lease, renewed
    b = server(daemon_factory, s3)
    with pytest.raises(SessionHeld, match="serving a turn on"):
        b.hold_session("s", "m", 30)
    a.hold_session("s", "m", 30, release=True)             # a turn that failed ends its lease at once
    assert b.hold_session("s", "m", 30).adopted
    with pytest.raises(SessionHeld, match="taken over"):
        a.hold_session("s", "m", 30, release=True)         # only the holder can release
    # a brand-new session, and one both adopt: of two daemons racing, one holds it and one is refused
    for session_id in ("fresh", "s"):
        racers = [server(daemon_factory, s3) for _ in range(2)]
        if session_id == "s":
            turn(b, 2, 3, "user 2", "answer 2")              # the commit ends b's lease
        outcomes = race(racers, session_id)
        assert sorted(outcomes) == ["held", "refused"], (session_id, outcomes)


def test_a_stale_holders_write_is_refused_and_its_pages_go_when_it_adopts_again(
        clock: MovedClock, daemon_factory: Any, s3: ObjectStore) -> None:
    _, a = tiered(daemon_factory, s3)
    first_turn(a)
    a.hold_session("s", "m", 0.5)                           # a's next turn, which stalls past its lease
    clock.advance(0.8)
    b = server(daemon_factory, s3)
    assert b.hold_session("s", "m", 30).adopted
    with pytest.raises(SessionHeld, match="taken over"):
        a.hold_session("s", "m", 30, renew=True)             # a renewal never takes the session back
    late = store_payload(a, "s", page(3), data(9))           # the stale holder goes on writing
    with pytest.raises(SessionHeld, match="refused"):
        turn(a, 2, 3, "user 2 on a", "answer 2 on a")
    assert s3.exists(late.locator, late.byte_size)           # uploaded, but named by no state
    store_payload(b, "s", page(3), data(3))
    turn(b, 2, 3, "user 2 on b", "answer 2 on b")            # b's turn is the one the session keeps
    assert a.hold_session("s", "m", 30).adopted              # a takes it back: b's state replaces a's rows
    assert rows(a) == rows(b)
    assert a.read_record("s").segments[-1].text == "answer 2 on b"
    assert not s3.exists(late.locator, late.byte_size)       # the refused turn's page is gone from both tiers
    assert not a.payloads().path(late.locator).exists()


def test_object_deletes_wait_for_the_publish_and_a_non_holder_deletes_only_its_copy(
        daemon_factory: Any, s3: ObjectStore) -> None:
    _, a = tiered(daemon_factory, s3)
    first_turn(a)
    old = a.get_pages("s", ["p1"])[0]
    store_payload(a, "s", page(1), data(7))   # p1 replaced: the exported state still names the old payload
    assert s3.exists(old.locator, old.byte_size) and not a.payloads().path(old.locator).exists()
    turn(a, 2, 3, "user 2")
    assert not s3.exists(old.locator, old.byte_size)         # gone once no state names it
    b = server(daemon_factory, s3)
    b.hold_session("s", "m", 30)
    turn(b, 3, 4, "user 3")
    before = object_keys(s3)
    a.delete_session("s")                                    # a no longer holds it: only a's copy goes
    assert object_keys(s3) == before
    assert b.verify().pages_ok == 3
    b.delete_session("s")                                    # the holder deletes it everywhere
    holder_key = s3.session_key("s", "holder")
    assert {key for key in object_keys(s3) if "/s/" in key} == {holder_key}   # but its tombstone
    tombstone = s3.read_object(holder_key)
    assert tombstone is not None and Holder.parse(*tombstone, holder_key).deleted
    assert not a.hold_session("s", "m", 30).adopted          # a claim after it starts the session afresh
    with pytest.raises(ContextdError, match="no session"):
        a.get_session("s")


def test_bad_holds_are_refused_clearly(daemon_factory: Any, s3: ObjectStore) -> None:
    _, a = tiered(daemon_factory, s3)
    for lease in (-1.0, 1e9):
        with pytest.raises(ContextdError, match="lease"):
            a.hold_session("s", "m", lease)
    with pytest.raises(ContextdError, match="session_id"):
        a.hold_session("../x", "m", 30)


def test_gc_removes_the_objects_nothing_names_and_keeps_what_an_exported_state_still_does(
        daemon_factory: Any, s3: ObjectStore) -> None:
    proc, a = tiered(daemon_factory, s3, "--object-gc-grace", "0")
    first_turn(a)
    old = a.get_pages("s", ["p1"])[0]
    store_payload(a, "s", page(1), data(7))   # the exported state names the old p1 until the next publish
    proc.stop()
    a = proc.start()                          # and the restart forgets that delete
    b = server(daemon_factory, s3)
    b.open_session("t", model_id="m")
    turn_t = pb.SessionRecord(turn=1, fingerprint="f")
    b.write_record("t", turn_t, keep_segments=0, append=[])          # b holds session t
    junk = {name: s3.key(f"{name}/junk.0123456789abcdef.kv") for name in ("s", "gone", "t")}
    for key in junk.values():                 # a refused turn's upload, a deleted session's, b's own
        s3.client.put_object(Bucket=s3.config.bucket, Key=key, Body=b"x" * 100)
    assert a.gc(dry_run=True).orphan_objects_removed == 2 and object_keys(s3) >= set(junk.values())
    reply = a.gc()
    assert reply.orphan_objects_removed == 2 and reply.object_bytes_freed == 200
    left = object_keys(s3)
    assert junk["t"] in left and junk["s"] not in left and junk["gone"] not in left
    assert s3.key(old.locator) in left        # still named by the state another server would adopt
    turn(a, 2, 3, "user 2")                   # a new state: nothing names the old p1 any more
    assert a.gc().orphan_objects_removed == 1 and s3.key(old.locator) not in object_keys(s3)
    assert b.hold_session("s", "m", 30).adopted and b.verify().pages_ok == 3


def test_a_turn_puts_up_only_the_manifest_chunks_whose_pages_changed(daemon_factory: Any, s3: ObjectStore) -> None:
    """The manifest goes up in chunks of CHUNK_PAGES page indexes, named by their content: a turn
    that changes one page's row (and appends a page) puts up the chunks holding those two and the
    new state, not the whole manifest, and an adopter still reads every row."""
    from contextd.handover import CHUNK_PAGES

    _, a = tiered(daemon_factory, s3)
    n = 3 * CHUNK_PAGES
    a.upsert_pages("s", [pb.Page(page_id=f"q{i:05d}", index=i, token_start=128 * i, token_end=128 * (i + 1),
                                 state=PageState.HOT.value) for i in range(n)])
    turn(a, 1, 0, "one")
    chunks = {k for k in object_keys(s3) if "/pages/" in k}
    assert len(chunks) == 3
    a.set_page_states("s", [pb.PageStateChange(page_id=f"q{CHUNK_PAGES + 5:05d}", state=PageState.HOT.value,
                                               last_used_turn=9)], [])
    a.upsert_pages("s", [pb.Page(page_id=f"q{n:05d}", index=n, token_start=128 * n, token_end=128 * (n + 1),
                                 state=PageState.HOT.value)])
    turn(a, 2, 1, "two")
    after = {k for k in object_keys(s3) if "/pages/" in k}
    assert len(after) == 4 and len(after & chunks) == 2   # chunks 0 and 2 as they were, 1 changed, 3 new
    b = server(daemon_factory, s3)
    assert b.hold_session("s", "m", 30).adopted
    ids = [f"q{i:05d}" for i in range(n + 1)]
    assert [(p.page_id, p.last_used_turn) for p in b.get_pages("s", ids)] == \
        [(p.page_id, p.last_used_turn) for p in a.get_pages("s", ids)]
    assert b.get_session("s").pages == a.get_session("s").pages


def test_a_publish_whose_reply_is_lost_keeps_its_turn_and_every_adopter_reads_it(
        daemon_factory: Any, s3: ObjectStore, proxy: S3Proxy) -> None:
    """The holder's conditional PUT is applied and its reply lost; the retry's 412 is the write's own
    doing: the turn stands and nothing the holder names is deleted. A claim's lost reply likewise
    takes the session once (one more token), not twice."""
    _, a = tiered(daemon_factory, s3, endpoint=proxy.endpoint)
    first_turn(a)
    lost = proxy.lose_reply("PUT", "/sessions/s/holder")
    turn(a, 2, 3, "user 2", "answer 2")
    assert lost.reached.is_set() and lost.status == 200          # applied; a never saw it
    b = server(daemon_factory, s3)
    assert b.hold_session("s", "m", 30).adopted
    assert rows(b) == rows(a) and b.read_record("s").record.turn == 2
    turn(b, 3, 4, "user 3")
    lost = proxy.lose_reply("PUT", "/sessions/s/holder")
    hold = a.hold_session("s", "m", 30)
    assert lost.status == 200 and hold.adopted and hold.token == 3
    assert a.read_record("s").record.turn == 3


def test_a_publish_whose_reply_is_lost_and_whose_session_is_taken_before_its_retry_deletes_nothing_named(
        daemon_factory: Any, s3: ObjectStore, proxy: S3Proxy) -> None:
    """Between the applied publish and its retry another server takes the session (its lease ended
    with the publish): the retry's 412 is then that server's doing, yet the holder still names the
    state the publish put up, so that state stays for the next adopter."""
    _, a = tiered(daemon_factory, s3, endpoint=proxy.endpoint)
    first_turn(a)
    b, c = server(daemon_factory, s3), server(daemon_factory, s3)
    lost = proxy.lose_reply("PUT", "/sessions/s/holder")
    retry = proxy.hold("PUT", "/sessions/s/holder")
    thread, outcome = in_thread(lambda: turn(a, 2, 3, "user 2", "answer 2"))
    retry.wait()
    assert lost.status == 200
    assert b.hold_session("s", "m", 30).adopted                    # b holds the state a just published
    b.hold_session("s", "m", 30, release=True)                     # and its turn fails
    retry.release()
    thread.join(WAIT_S)
    assert outcome == [None]
    assert c.hold_session("s", "m", 30).adopted
    assert c.read_record("s").record.turn == 2 and rows(c) == rows(a)


def test_a_delete_racing_another_servers_claim_leaves_that_server_its_session(
        daemon_factory: Any, s3: ObjectStore, proxy: S3Proxy) -> None:
    """The holder deletes the session while another server takes it over (the lease ended with
    the last turn): the store decides which came first. Here the claim does, so the delete
    removes only the deleting server's copy, and the claimant keeps every object it names."""
    _, a = tiered(daemon_factory, s3, endpoint=proxy.endpoint)
    first_turn(a)
    b = server(daemon_factory, s3)
    write = proxy.hold("PUT|DELETE", "/sessions/s/")               # the delete's first write to the session
    thread, outcome = in_thread(lambda: a.delete_session("s"))
    write.wait()
    assert b.hold_session("s", "m", 30).adopted
    write.release()
    thread.join(WAIT_S)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    assert b.verify().pages_ok == 3
    turn(b, 2, 3, "user 2")
    assert b.read_record("s").record.turn == 2
    c = server(daemon_factory, s3)
    assert c.hold_session("s", "m", 30).adopted and rows(c) == rows(b)
