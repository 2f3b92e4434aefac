"""contextd against a real daemon process on a real socket: round trips, streams, crashes, corruption."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from contextd.client import Client, pb
from contextd.errors import FailedPrecondition, InvalidArgument, NotFound, StoreFull
from contextd.wire import PageState, PinKind
from harness.waits import wait_until
from serving.launcher import ContextdProcess
from tests.contextd.conftest import MovedClock, states, store_payload

PAGE_TOKENS = 128


def pages(prefix: str, count: int, start_index: int = 0, state: PageState = PageState.HOT) -> list[pb.Page]:
    return [pb.Page(page_id=f"{prefix}{start_index + i:06d}", index=start_index + i,
                    token_start=(start_index + i) * PAGE_TOKENS, token_end=(start_index + i + 1) * PAGE_TOKENS,
                    original_position=(start_index + i) * PAGE_TOKENS, state=state.value, dtype="float32",
                    layer_view="test-view") for i in range(count)]


def test_batched_upserts_and_state_changes_round_trip(daemon: ContextdProcess) -> None:
    client = daemon.client
    assert client is not None
    client.open_session("s1", model_id="smollm2-135m", budget_tokens=4096, labels={"agent": "pi"})
    ack = client.upsert_pages("s1", pages("p", 300))
    assert ack.applied == 300 and ack.commit_seq > 0
    for page in pages("p", 40):
        store_payload(client, "s1", page, bytes([page.index]) * 4096)
    ack2 = client.set_page_states("s1", states([(f"p{i:06d}", PageState.COLD) for i in range(40)], turn=3))
    assert ack2.commit_seq > ack.commit_seq
    client.set_pins("s1", add=[(f"p{i:06d}", PinKind.SYSTEM) for i in range(40, 45)])

    cold = client.query_pages("s1", [PageState.COLD])
    assert [p.page_id for p in cold] == [f"p{i:06d}" for i in range(40)]
    assert all(p.last_used_turn == 3 and p.locator and len(p.checksum) == 32 for p in cold)
    assert len(client.query_pages("s1", [PageState.HOT])) == 260  # the pinned pages are hot
    assert len(client.query_pages("s1", [PageState.HOT, PageState.COLD])) == 300
    everything = client.query_pages("s1", page_size=7)  # paginated
    assert [p.page_id for p in everything] == [f"p{i:06d}" for i in range(300)]
    # by id: exactly what the full listing says of those pages, in the order asked
    asked = ["p000299", "p000001", "nope", "p000040"]
    by_id = client.get_pages("s1", asked)
    listed = {p.page_id: p for p in everything}
    assert [p.page_id for p in by_id] == ["p000299", "p000001", "p000040"]
    assert all(p == listed[p.page_id] for p in by_id)

    session = client.get_session("s1")
    assert (session.pages.hot, session.pages.cold, session.pages.pinned) == (260, 40, 5)
    assert (session.pages.hot_tokens, session.pages.pinned_tokens) == (260 * PAGE_TOKENS, 5 * PAGE_TOKENS)
    assert session.pages.cold_tokens == 40 * PAGE_TOKENS
    assert session.pages.bytes_on_disk == 40 * 4096
    assert session.labels["agent"] == "pi"

    # a restore: cold -> hot keeps the payload reference and records the score that brought it back
    client.set_page_states("s1", [pb.PageStateChange(page_id="p000001", state=PageState.HOT.value, last_used_turn=4,
                                                     score=2.5)])
    restored = client.get_pages("s1", ["p000001"])[0]
    assert restored.state == PageState.HOT.value and restored.locator == cold[1].locator and restored.score == 2.5
    # ... and with its lease in the same commit; a lease on a page that does not exist undoes it all
    client.set_page_states("s1", [pb.PageStateChange(page_id="p000002", state=PageState.HOT.value)],
                           leases=[pb.Lease(page_id="p000002", until_turn=9)])
    assert client.get_pages("s1", ["p000002"])[0].state == PageState.HOT.value
    assert {lease.page_id: lease.until_turn for lease in client.query_leases("s1")} == {"p000002": 9}
    with pytest.raises(NotFound, match="ghost"):
        client.set_page_states("s1", [pb.PageStateChange(page_id="p000003", state=PageState.HOT.value)],
                               leases=[pb.Lease(page_id="ghost", until_turn=9)])
    assert client.get_pages("s1", ["p000003"])[0].state == PageState.COLD.value
    client.set_leases("s1", remove=["p000002"])
    # a restore from a record the engine kept: committed only while the page is COLD with the
    # payload it read; refused whole otherwise (the evictions in the same commit with it)
    read = cold[4].checksum
    with pytest.raises(FailedPrecondition, match="p000004 is COLD with checksum .* not the COLD payload"):
        client.set_page_states("s1", [pb.PageStateChange(page_id="p000001", state=PageState.COLD.value),
                                      pb.PageStateChange(page_id="p000004", state=PageState.HOT.value,
                                                         restored_checksum=cold[5].checksum)])
    with pytest.raises(FailedPrecondition, match="p000001 is HOT"):
        client.set_page_states("s1", [pb.PageStateChange(page_id="p000001", state=PageState.HOT.value,
                                                         restored_checksum=cold[1].checksum)])
    assert [p.state for p in client.get_pages("s1", ["p000004", "p000001"])] == [PageState.COLD.value,
                                                                                 PageState.HOT.value]
    client.set_page_states("s1", [pb.PageStateChange(page_id="p000004", state=PageState.HOT.value,
                                                     restored_checksum=read)])
    assert client.get_pages("s1", ["p000004"])[0].state == PageState.HOT.value
    path = daemon.root / "store" / restored.locator
    assert path.read_bytes() == bytes([1]) * 4096 and (path.stat().st_mode & 0o777) == 0o600
    assert (path.parent.stat().st_mode & 0o777) == 0o700

    # the other tables
    client.set_pins("s1", add=[("p000041", PinKind.TOOLS)], remove=["p000042", "p000043", "p000044"])
    assert {p.page_id: p.kind for p in client.query_pins("s1")} == {"p000040": "system", "p000041": "tools"}
    assert client.get_session("s1").pages.pinned == 2
    client.set_leases("s1", add=[pb.Lease(page_id="p000001", until_turn=6)])
    assert client.query_leases("s1")[0].until_turn == 6
    blob = client.payloads().write("s1", "snapshot-recurrent", b"state" * 100, suffix="rs")
    client.put_snapshot("s1", pb.Snapshot(slot="recurrent", token_count=1234, fingerprint="f" * 16,
                                          locator=blob.locator, byte_size=blob.byte_size, checksum=blob.checksum))
    snap = client.query_snapshots("s1")[0]
    assert snap.token_count == 1234 and snap.byte_size == 500 and snap.locator == blob.locator
    with pytest.raises(FailedPrecondition, match="no payload"):
        client.put_snapshot("s1", pb.Snapshot(slot="recurrent", locator="s1/gone.rs", byte_size=5, checksum="0" * 32))
    status = client.status("s1")
    assert status.sessions[0].snapshots == 1 and status.store_bytes == 40 * 4096 + 500

    # the session record: counters and turn reach the session; segments are appended and cut back
    record = pb.SessionRecord(turn=4, attention_tokens=3900, fingerprint="f" * 16, fingerprint_parts=["a", "b"],
                              message_hashes=["h1", "h2"], ledger_pages=[3, 7],
                              counters={"restored_pages": 2})
    texts = [("<system>", [1, 2, 3], False), ("hello", [4, 5], False), ("answer", [6], True)]
    client.write_record("s1", record, 0, [pb.TranscriptSegment(text=t, token_ids=i, generated=g) for t, i, g in texts])
    client.write_record("s1", record, 2, [pb.TranscriptSegment(text="again", token_ids=[7, 8, 9], generated=True)])
    with pytest.raises(FailedPrecondition, match="cannot keep 9"):
        client.write_record("s1", record, 9, [])
    back = client.read_record("s1")
    assert [(s.text, list(s.token_ids), s.generated) for s in back.segments] == [
        ("<system>", [1, 2, 3], False), ("hello", [4, 5], False), ("again", [7, 8, 9], True)]
    assert (back.record.segments, back.record.tokens, list(back.record.ledger_pages)) == (3, 8, [3, 7])
    assert list(back.record.message_hashes) == ["h1", "h2"]
    assert client.get_session("s1").counters["restored_pages"] == 2 and client.get_session("s1").turn == 4

    # snapshots committed with the record replace their slots, and the old payload goes after the commit
    newer = client.payloads().write("s1", "snapshot-recurrent", b"later" * 100, suffix="rs")
    row = pb.Snapshot(slot="recurrent", token_count=8, fingerprint="g" * 16, locator=newer.locator,
                      byte_size=newer.byte_size, checksum=newer.checksum)
    with pytest.raises(InvalidArgument, match="one per slot"):
        client.write_record("s1", record, 3, [], [row, row])
    assert client.query_snapshots("s1")[0].locator == blob.locator, "a refused record changed a snapshot"
    client.write_record("s1", record, 3, [], [row])
    assert [(s.slot, s.token_count, s.locator) for s in client.query_snapshots("s1")] == [
        ("recurrent", 8, newer.locator)]
    assert not (daemon.root / "store" / blob.locator).exists()
    client.close_session("s1")
    assert client.list_sessions() == []
    assert [s.session_id for s in client.list_sessions(include_closed=True)] == ["s1"]
    deleted = client.delete_session("s1")
    assert deleted.pages_deleted == 300 and deleted.bytes_freed == 40 * 4096 + 500
    with pytest.raises(NotFound):
        client.get_session("s1")


def test_four_watchers_see_consistent_snapshots_while_10000_pages_commit(daemon: ContextdProcess) -> None:
    client = daemon.client
    assert client is not None
    client.open_session("w", budget_tokens=4096)
    batch, total = 125, 10_000
    seen: list[list[pb.StatusReply]] = [[] for _ in range(4)]
    errors: list[str] = []
    done = threading.Event()
    ready = threading.Barrier(5, timeout=120)   # a reader whose stream failed first must not hang the test

    def reader(slot: int) -> None:
        with Client(daemon.socket) as own:
            first = True
            for reply in own.watch_status("w"):
                if first:
                    ready.wait()
                    first = False
                seen[slot].append(reply)
                s = reply.sessions[0].pages
                n = s.hot + s.cold
                # a half-applied batch would show a page count that is not a whole number of batches,
                # or token aggregates out of step with the page counts
                if n % batch or s.hot_tokens != s.hot * PAGE_TOKENS or s.pinned_tokens != s.pinned * PAGE_TOKENS:
                    errors.append(f"reader {slot}: inconsistent snapshot {s}")
                if n == total and s.pinned == total // batch:
                    return

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    ready.wait()
    for b in range(total // batch):
        client.upsert_pages("w", pages("p", batch, start_index=b * batch))
        client.set_pins("w", add=[(f"p{b * batch:06d}", PinKind.SYSTEM)])
    for t in threads:
        t.join(timeout=120)
    done.set()
    assert not errors, errors[:3]
    for slot, replies in enumerate(seen):
        seqs = [r.commit_seq for r in replies]
        assert seqs == sorted(seqs), f"reader {slot} saw commits out of order"
        counts = [r.sessions[0].pages.hot for r in replies]
        assert counts == sorted(counts)
        assert counts[-1] == total, f"reader {slot} never saw the last commit"
        assert len(replies) > 5, f"reader {slot} saw only {len(replies)} updates"


def test_kill9_during_batches_keeps_every_acknowledged_batch_and_no_half_batch(daemon: ContextdProcess) -> None:
    client = daemon.client
    assert client is not None
    client.open_session("k")
    acked: list[int] = []
    failed: list[BaseException] = []
    batch = 64
    stop = threading.Event()

    def writer() -> None:
        with Client(daemon.socket, timeout=10) as own:
            b = 0
            while not stop.is_set():
                try:
                    own.upsert_pages("k", pages(f"b{b:05d}-", batch))
                except Exception as e:  # the daemon died under us: this batch was never acknowledged
                    failed.append(e)
                    return
                acked.append(b)
                b += 1

    t = threading.Thread(target=writer)
    t.start()
    # A writer that failed before the kill would leave this loop waiting forever (stop 48's CI hang
    # may have been one): it ends with the writer's error instead.
    wait_until(lambda: len(acked) >= 30 or not t.is_alive(), 120, "30 acknowledged batches", poll_s=0.01)
    assert len(acked) >= 30, f"the writer stopped at {len(acked)} batches: {failed}"
    daemon.kill9()
    stop.set()
    t.join(timeout=30)
    client = daemon.start()
    present = client.query_pages("k")
    by_batch: dict[int, int] = {}
    for page in present:
        b = int(page.page_id[1:6])
        by_batch[b] = by_batch.get(b, 0) + 1
    for b in acked:
        assert by_batch.get(b) == batch, f"acknowledged batch {b} lost pages after kill -9"
    assert all(n == batch for n in by_batch.values()), f"half batch after kill -9: {by_batch}"
    s = client.get_session("k").pages
    assert s.hot == len(present) and s.hot_tokens == len(present) * PAGE_TOKENS


def test_flipped_byte_is_caught_by_verify_and_a_corrupt_page_is_never_served_again(daemon: ContextdProcess) -> None:
    from tests.contextd.conftest import run_cli

    client = daemon.client
    assert client is not None
    client.open_session("c")
    stored = {p.page_id: store_payload(client, "c", p, bytes(range(256)) * 64) for p in pages("p", 3)}
    client.set_page_states("c", states([(f"p{i:06d}", PageState.COLD) for i in range(3)]))

    def flip(page_id: str) -> None:
        path = daemon.root / "store" / stored[page_id].locator
        data = bytearray(path.read_bytes())
        data[1000] ^= 0x01
        path.write_bytes(bytes(data))

    # a reader that finds a mismatch (the server's block reader) reports it; the page is then corrupt
    flip("p000000")
    client.set_leases("c", add=[pb.Lease(page_id="p000000", until_turn=5)])  # as a restore leases what it reads
    client.report_corrupt("c", "p000000", "checksum mismatch")
    assert client.query_pages("c", [PageState.CORRUPT])[0].page_id == "p000000"
    assert client.query_leases("c") == []   # a page never served again keeps no lease
    with pytest.raises(FailedPrecondition):  # it cannot be marked cold again without a new payload
        client.set_page_states("c", states([("p000000", PageState.COLD)]))

    flip("p000002")
    result = run_cli("verify", "--socket", str(daemon.socket))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "corrupt: c/p000002" in result.stdout
    assert "1 pages ok" in result.stdout  # p000001 is intact; p000000 was already marked corrupt
    assert {p.page_id for p in client.query_pages("c", [PageState.CORRUPT])} == {"p000000", "p000002"}

    # a missing file is the same failure
    (daemon.root / "store" / stored["p000001"].locator).unlink()
    assert client.verify("c").corrupt[0].page_id == "p000001"
    assert len(client.query_pages("c", [PageState.CORRUPT])) == 3


def test_hostile_and_malformed_requests_get_clear_errors_and_the_daemon_keeps_serving(daemon: ContextdProcess) -> None:
    import socket as socketlib

    import grpc

    client = daemon.client
    assert client is not None
    client.open_session("h")
    with pytest.raises(NotFound, match="no session"):
        client.upsert_pages("nope", pages("p", 1))
    with pytest.raises(NotFound, match="no page"):
        client.set_page_states("h", states([("ghost", PageState.HOT)]))
    with pytest.raises(InvalidArgument, match="not a valid identifier"):
        client.open_session("../../x")
    with pytest.raises(InvalidArgument, match="not a valid identifier"):
        client.upsert_pages("h", [pb.Page(page_id="../../etc/passwd", token_start=0, token_end=1)])
    with pytest.raises(InvalidArgument, match="inverted"):
        client.upsert_pages("h", [pb.Page(page_id="p1", token_start=500, token_end=100)])
    with pytest.raises(InvalidArgument, match="locator"):
        client.upsert_pages("h", [pb.Page(page_id="p2", token_end=1, locator="../../../etc/passwd",
                                          checksum="0" * 32, byte_size=1)])
    with pytest.raises(InvalidArgument, match="empty"):
        client.get_session("")
    with pytest.raises(InvalidArgument, match="state"):
        client.set_page_states("h", states([("p1", 99)]))
    with pytest.raises(InvalidArgument, match="twice"):
        client.upsert_pages("h", pages("d", 1) + pages("d", 1))
    with pytest.raises(InvalidArgument, match="pin kind"):
        client.set_pins("h", add=[("p1", "forever")])  # type: ignore[list-item]
    # a bad request inside a good batch stream does not take the good ones down
    client.upsert_pages("h", pages("ok", 2))
    # oversized message: refused by the daemon's transport with a clear status
    with grpc.insecure_channel(f"unix:{daemon.socket}",
                               options=[("grpc.max_send_message_length", 128 << 20)]) as channel:
        big = channel.unary_unary("/kv_elision.contextd.v1.Contextd/UpsertPages",
                                  request_serializer=pb.UpsertPagesRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as too_big:
            big(pb.UpsertPagesRequest(session_id="h", pages=[pb.Page(page_id="x", layer_view="v" * (65 << 20))]),
                timeout=30)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(InvalidArgument, match="over the transport"):
        client.upsert_pages("h", [pb.Page(page_id="x", layer_view="v" * (65 << 20))])
    # garbage bytes on the socket: the connection is dropped, the daemon is not
    for junk in (b"\x00" * 64, b"GET / HTTP/1.1\r\n\r\n", bytes(range(256)) * 40,
                 b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 100):
        raw = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
        raw.connect(str(daemon.socket))
        raw.sendall(junk)
        raw.settimeout(2)
        try:
            raw.recv(4096)
        except OSError:
            pass
        raw.close()
    # a well-framed call whose body is not a valid message
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        call = channel.unary_unary("/kv_elision.contextd.v1.Contextd/UpsertPages")
        with pytest.raises(grpc.RpcError) as info:
            call(b"\xff\xff\xff\xff\x0f garbage", timeout=5)
        assert info.value.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
        unknown = channel.unary_unary("/kv_elision.contextd.v1.Contextd/NoSuchVerb")
        with pytest.raises(grpc.RpcError) as info:
            unknown(b"", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # still serving, state intact
    assert [p.page_id for p in client.query_pages("h")] == ["ok000000", "ok000001"]
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_second_daemon_on_the_same_root_refuses_to_start(daemon: ContextdProcess) -> None:
    import subprocess
    import sys

    other_socket = daemon.socket.parent / "other.sock"
    result = subprocess.run([sys.executable, "-m", "contextd.cli", "serve", "--root", str(daemon.root), "--socket",
                             str(other_socket)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"already serving {daemon.root}" in result.stderr
    assert daemon.proc is not None and str(daemon.proc.pid) in result.stderr
    assert not other_socket.exists()


def test_socket_is_private_and_sigterm_drains_cleanly(daemon: ContextdProcess) -> None:
    assert (daemon.socket.stat().st_mode & 0o777) == 0o600
    assert (daemon.socket.parent.stat().st_mode & 0o777) == 0o700
    client = daemon.client
    assert client is not None
    client.open_session("t")
    client.upsert_pages("t", pages("p", 10))
    out = daemon.stop()
    assert daemon.proc is not None and daemon.proc.returncode == 0
    assert "stopped cleanly" in out
    assert not daemon.socket.exists()
    client = daemon.start()
    assert len(client.query_pages("t")) == 10


def test_disk_pressure_drops_only_cold_unpinned_unleased_pages_least_recently_used_first(
        daemon_factory: object) -> None:
    size = 64 * 1024
    proc: ContextdProcess = daemon_factory("--reserve-bytes", "0", "--quota-bytes", str(10 * size))  # type: ignore[operator]
    client = proc.client
    assert client is not None
    client.open_session("d")
    records = pages("p", 14)
    client.upsert_pages("d", records)
    for page in records[:10]:
        store_payload(client, "d", page, bytes([page.index]) * size)
    # p0..p5 cold (last used in turns 9, 1, 5, 2, 7, 3), p6 pinned (resident), p7 cold and pinned,
    # p8 cold and leased, p9 hot
    for i, turn in ((0, 9), (1, 1), (2, 5), (3, 2), (4, 7), (5, 3), (7, 1), (8, 1)):
        client.set_page_states("d", states([(f"p{i:06d}", PageState.COLD)], turn=turn))
    client.set_pins("d", add=[("p000006", PinKind.SYSTEM), ("p000007", PinKind.OBJECTIVE)])
    client.set_leases("d", add=[pb.Lease(page_id="p000008", until_turn=5)])
    # p1 is cold, but the last completed turn's record has it in attention (the turn after it
    # evicted p1 failed): the session resumes from that record, so p1 must stay
    client.write_record("d", pb.SessionRecord(turn=4, resident_pages=[1], resident_positions=[128]),
                        0, [])
    # the store is at its quota: each new page must push out the least recently used droppable one
    for n, fill in ((10, b"a"), (11, b"b"), (12, b"c")):
        store_payload(client, "d", records[n], fill * size)
    dropped = [p.page_id for p in client.query_pages("d", [PageState.DROPPED])]
    assert dropped == ["p000002", "p000003", "p000005"], dropped  # last used in turns 2, 3, 5
    # two more droppable pages remain (p0, p4); ask for more than that
    with pytest.raises(StoreFull, match="nothing left to drop"):
        store_payload(client, "d", records[13], b"d" * (4 * size))
    # nothing was dropped by the failed write and every remaining payload still verifies
    assert [p.page_id for p in client.query_pages("d", [PageState.DROPPED])] == dropped
    verified = client.verify("d")
    assert not verified.corrupt and verified.pages_ok == 10
    for page in client.get_pages("d", ["p000001", "p000006", "p000007", "p000008", "p000009"]):
        assert (proc.root / "store" / page.locator).is_file()  # recorded, resident, pinned, leased pages survive
    assert client.status().store_bytes <= 10 * size


def test_reserve_larger_than_free_space_fails_writes_cleanly(daemon_factory: object) -> None:
    proc: ContextdProcess = daemon_factory("--reserve-percent", "99.9")  # type: ignore[operator]
    client = proc.client
    assert client is not None
    client.open_session("r")
    client.upsert_pages("r", pages("p", 1))
    with pytest.raises(StoreFull, match="no room"):
        store_payload(client, "r", pages("p", 1)[0], b"x" * 1024)
    assert not any(Path(proc.root, "store").rglob("*.kv"))
    assert client.query_pages("r")[0].locator == ""


def test_retention_caps_a_session_and_deletes_idle_ones(daemon_factory: object, clock: MovedClock) -> None:
    size = 32 * 1024
    proc: ContextdProcess = daemon_factory("--reserve-bytes", "0", "--session-quota-bytes",  # type: ignore[operator]
                                           str(4 * size), "--max-idle", "2s")
    client = proc.client
    assert client is not None
    client.open_session("q")
    records = pages("p", 8)
    client.upsert_pages("q", records)
    for n, page in enumerate(records[:6]):
        store_payload(client, "q", page, bytes([n]) * size)
        client.set_page_states("q", states([(page.page_id, PageState.COLD)], turn=n + 1))
    # past its quota, the session's least recently used cold pages went first
    dropped = [p.page_id for p in client.query_pages("q", [PageState.DROPPED])]
    assert dropped == ["p000000", "p000001"], dropped
    assert client.get_session("q").pages.bytes_on_disk <= 4 * size
    status = client.status()
    assert status.session_quota_bytes == 4 * size and status.max_idle_s == 2.0
    assert client.gc(dry_run=True).idle_sessions_deleted == 0
    clock.advance(2.5)
    assert client.gc(dry_run=True).idle_sessions_deleted == 1 and client.get_session("q")
    assert client.gc().idle_sessions_deleted == 1
    with pytest.raises(NotFound):
        client.get_session("q")
    assert not (proc.root / "store" / "q").exists()
