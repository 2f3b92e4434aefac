"""contextd against a real daemon process on a real socket: round trips, streams, crashes, corruption."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from contextd.client import Client, pb
from contextd.errors import DataCorrupt, FailedPrecondition, InvalidArgument, NotFound
from tests.contextd.conftest import DaemonProcess

PAGE_TOKENS = 128


def pages(prefix: str, count: int, start_index: int = 0, state: int = pb.HOT) -> list[pb.Page]:
    return [pb.Page(page_id=f"{prefix}{start_index + i:06d}", index=start_index + i,
                    token_start=(start_index + i) * PAGE_TOKENS, token_end=(start_index + i + 1) * PAGE_TOKENS,
                    original_position=(start_index + i) * PAGE_TOKENS, state=state, dtype="float32",
                    layer_view="test-view") for i in range(count)]


def test_batched_upserts_and_state_changes_round_trip(daemon: DaemonProcess) -> None:
    client = daemon.client
    assert client is not None
    client.open_session("s1", model_id="smollm2-135m", budget_tokens=4096, labels={"agent": "pi"})
    ack = client.upsert_pages("s1", pages("p", 300))
    assert ack.applied == 300 and ack.commit_seq > 0
    for i in range(0, 40):
        client.write_page_data("s1", f"p{i:06d}", bytes([i]) * 4096, dtype="float32")
    ack2 = client.set_page_states("s1", [(f"p{i:06d}", pb.COLD) for i in range(40)]
                                  + [(f"p{i:06d}", pb.PINNED) for i in range(40, 45)], turn=3)
    assert ack2.commit_seq > ack.commit_seq

    cold = client.query_pages("s1", [pb.COLD])
    assert [p.page_id for p in cold] == [f"p{i:06d}" for i in range(40)]
    assert all(p.last_used_turn == 3 and p.locator and len(p.checksum) == 32 for p in cold)
    assert len(client.query_pages("s1", [pb.PINNED])) == 5
    assert len(client.query_pages("s1", [pb.HOT, pb.PINNED])) == 260
    everything = client.query_pages("s1", page_size=7)  # paginated
    assert [p.page_id for p in everything] == [f"p{i:06d}" for i in range(300)]

    session = client.get_session("s1")
    assert (session.pages.hot, session.pages.cold, session.pages.pinned) == (255, 40, 5)
    assert session.pages.cold_tokens == 40 * PAGE_TOKENS
    assert session.pages.bytes_on_disk == 40 * 4096
    assert session.labels["agent"] == "pi"

    # a restore: cold -> hot keeps the payload reference
    client.set_page_states("s1", [("p000001", pb.HOT)])
    restored = client.read_page_data("s1", "p000001")
    assert restored.data == bytes([1]) * 4096 and restored.page.state == pb.HOT

    # the other tables
    client.upsert_blocks("s1", [pb.Block(block_id="u1", kind="unit", parent_id="c1", page_ids=["p000000", "p000001"],
                                         token_count=256, summary="読み込んだ設定ファイル"),
                                pb.Block(block_id="c1", kind="cluster", child_ids=["u1"], summary="cluster")])
    assert {b.block_id for b in client.query_blocks("s1")} == {"u1", "c1"}
    assert client.query_blocks("s1", "unit")[0].summary == "読み込んだ設定ファイル"
    client.set_tags("s1", add=[("u1", "config"), ("u1", "error"), ("c1", "config")])
    assert sorted(t.block_id for t in client.query_tags("s1", tag="config")) == ["c1", "u1"]
    client.set_tags("s1", remove=[("u1", "error")])
    assert [t.tag for t in client.query_tags("s1", block_id="u1")] == ["config"]
    client.set_pins("s1", add=[("p000040", "system"), ("p000041", "ledger")])
    assert {p.page_id: p.kind for p in client.query_pins("s1")} == {"p000040": "system", "p000041": "ledger"}
    client.set_leases("s1", add=[pb.Lease(page_id="p000001", until_turn=6)])
    assert client.query_leases("s1")[0].until_turn == 6
    client.set_scores("s1", {"p000002": 0.5, "p000003": 2.0})
    assert client.query_scores("s1") == {"p000002": 0.5, "p000003": 2.0}
    client.append_ledger("s1", [pb.LedgerEntry(turn=1, tool_name="read", call_id="c-1", token_start=10,
                                               token_end=20, page_id="p000000"),
                                pb.LedgerEntry(turn=2, tool_name="bash", call_id="c-2")])
    assert [(e.seq, e.tool_name) for e in client.query_ledger("s1")] == [(1, "read"), (2, "bash")]
    client.put_snapshot("s1", pb.Snapshot(slot="turn-3", token_count=1234, fingerprint="f" * 16), b"state" * 100)
    snap = client.query_snapshots("s1")[0]
    assert snap.token_count == 1234 and snap.byte_size == 500 and snap.locator
    status = client.status("s1")
    assert status.sessions[0].snapshots == 1 and status.store_bytes == 40 * 4096 + 500

    client.update_session("s1", turn=4, attention_tokens=3900, counters={"restored_pages": 2})
    assert client.get_session("s1").counters["restored_pages"] == 2
    client.close_session("s1")
    assert client.list_sessions() == []
    assert [s.session_id for s in client.list_sessions(include_closed=True)] == ["s1"]
    deleted = client.delete_session("s1")
    assert deleted.pages_deleted == 300 and deleted.bytes_freed == 40 * 4096 + 500
    with pytest.raises(NotFound):
        client.get_session("s1")


def test_four_watchers_see_consistent_snapshots_while_10000_pages_commit(daemon: DaemonProcess) -> None:
    client = daemon.client
    assert client is not None
    client.open_session("w", budget_tokens=4096)
    batch, total = 125, 10_000
    seen: list[list[pb.StatusReply]] = [[] for _ in range(4)]
    errors: list[str] = []
    done = threading.Event()
    ready = threading.Barrier(5)

    def reader(slot: int) -> None:
        with Client(daemon.socket) as own:
            first = True
            for reply in own.watch_status("w"):
                if first:
                    ready.wait()
                    first = False
                seen[slot].append(reply)
                s = reply.sessions[0].pages
                n = s.hot + s.cold + s.pinned
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
        client.set_page_states("w", [(f"p{b * batch:06d}", pb.PINNED)])
    for t in threads:
        t.join(timeout=120)
    done.set()
    assert not errors, errors[:3]
    for slot, replies in enumerate(seen):
        seqs = [r.commit_seq for r in replies]
        assert seqs == sorted(seqs), f"reader {slot} saw commits out of order"
        counts = [r.sessions[0].pages.hot + r.sessions[0].pages.pinned for r in replies]
        assert counts == sorted(counts)
        assert counts[-1] == total, f"reader {slot} never saw the last commit"
        assert len(replies) > 5, f"reader {slot} saw only {len(replies)} updates"


def test_kill9_during_batches_keeps_every_acknowledged_batch_and_no_half_batch(daemon: DaemonProcess) -> None:
    client = daemon.client
    assert client is not None
    client.open_session("k")
    acked: list[int] = []
    batch = 64
    stop = threading.Event()

    def writer() -> None:
        with Client(daemon.socket, timeout=10) as own:
            b = 0
            while not stop.is_set():
                try:
                    own.upsert_pages("k", pages(f"b{b:05d}-", batch))
                except Exception:  # the daemon died under us: this batch was never acknowledged
                    return
                acked.append(b)
                b += 1

    t = threading.Thread(target=writer)
    t.start()
    while len(acked) < 30:
        time.sleep(0.01)
    daemon.kill9()
    stop.set()
    t.join(timeout=30)
    client = daemon.restart()
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


def test_flipped_byte_is_caught_by_read_and_by_verify(daemon: DaemonProcess) -> None:
    from tests.contextd.conftest import run_cli

    client = daemon.client
    assert client is not None
    client.open_session("c")
    client.upsert_pages("c", pages("p", 3))
    for i in range(3):
        client.write_page_data("c", f"p{i:06d}", bytes(range(256)) * 64)
    client.set_page_states("c", [(f"p{i:06d}", pb.COLD) for i in range(3)])
    stored = {p.page_id: p for p in client.query_pages("c")}

    def flip(page_id: str) -> None:
        path = daemon.root / "store" / stored[page_id].locator
        data = bytearray(path.read_bytes())
        data[1000] ^= 0x01
        path.write_bytes(bytes(data))

    flip("p000000")
    with pytest.raises(DataCorrupt, match="checksum"):
        client.read_page_data("c", "p000000")
    assert client.query_pages("c", [pb.CORRUPT])[0].page_id == "p000000"
    with pytest.raises(DataCorrupt):  # never served afterwards, even if the file were fixed
        client.read_page_data("c", "p000000")
    with pytest.raises(FailedPrecondition):  # and it cannot be marked cold again without a new payload
        client.set_page_states("c", [("p000000", pb.COLD)])

    flip("p000002")
    result = run_cli("verify", "--socket", str(daemon.socket))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "corrupt: c/p000002" in result.stdout
    assert "1 pages ok" in result.stdout  # p000001 is intact; p000000 was already marked corrupt
    assert {p.page_id for p in client.query_pages("c", [pb.CORRUPT])} == {"p000000", "p000002"}
    assert client.read_page_data("c", "p000001").data == bytes(range(256)) * 64

    # a missing file is the same failure
    (daemon.root / "store" / stored["p000001"].locator).unlink()
    with pytest.raises(DataCorrupt, match="missing"):
        client.read_page_data("c", "p000001")


def test_hostile_and_malformed_requests_get_clear_errors_and_the_daemon_keeps_serving(daemon: DaemonProcess) -> None:
    import socket as socketlib

    import grpc

    client = daemon.client
    assert client is not None
    client.open_session("h")
    with pytest.raises(NotFound, match="no session"):
        client.upsert_pages("nope", pages("p", 1))
    with pytest.raises(NotFound, match="no page"):
        client.set_page_states("h", [("ghost", pb.HOT)])
    with pytest.raises(InvalidArgument, match="not a valid identifier"):
        client.open_session("../../x")
    with pytest.raises(InvalidArgument, match="not a valid identifier"):
        client.upsert_pages("h", [pb.Page(page_id="../../etc/passwd", token_start=0, token_end=1)])
    with pytest.raises(InvalidArgument, match="inverted"):
        client.upsert_pages("h", [pb.Page(page_id="p1", token_start=500, token_end=100)])
    with pytest.raises(InvalidArgument, match="inverted"):
        client.append_ledger("h", [pb.LedgerEntry(tool_name="x", token_start=9, token_end=3)])
    with pytest.raises(InvalidArgument, match="locator"):
        client.upsert_pages("h", [pb.Page(page_id="p2", token_end=1, locator="../../../etc/passwd",
                                          checksum="0" * 32, byte_size=1)])
    with pytest.raises(InvalidArgument, match="empty"):
        client.get_session("")
    with pytest.raises(InvalidArgument, match="state"):
        client.set_page_states("h", [("p1", 99)])
    with pytest.raises(InvalidArgument, match="twice"):
        client.upsert_pages("h", pages("d", 1) + pages("d", 1))
    with pytest.raises(InvalidArgument, match="pin kind"):
        client.set_pins("h", add=[("p1", "forever")])
    # a bad request inside a good batch stream does not take the good ones down
    client.upsert_pages("h", pages("ok", 2))
    # oversized message: refused by the daemon's transport with a clear status
    with grpc.insecure_channel(f"unix:{daemon.socket}",
                               options=[("grpc.max_send_message_length", 128 << 20)]) as channel:
        big = channel.unary_unary("/kv_elision.contextd.v1.Contextd/WritePageData",
                                  request_serializer=pb.WritePageDataRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as too_big:
            big(pb.WritePageDataRequest(session_id="h", page_id="ok000000", data=b"\0" * (65 << 20)), timeout=30)
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(InvalidArgument, match="larger than"):
        client.write_page_data("h", "ok000000", b"\0" * (65 << 20))
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


def test_second_daemon_on_the_same_root_refuses_to_start(daemon: DaemonProcess) -> None:
    import subprocess
    import sys

    other_socket = daemon.socket.parent / "other.sock"
    result = subprocess.run([sys.executable, "-m", "contextd.cli", "serve", "--root", str(daemon.root), "--socket",
                             str(other_socket)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert f"already serving {daemon.root}" in result.stderr
    assert daemon.proc is not None and str(daemon.proc.pid) in result.stderr
    assert not other_socket.exists()


def test_socket_is_private_and_sigterm_drains_cleanly(daemon: DaemonProcess) -> None:
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
    client = daemon.restart()
    assert len(client.query_pages("t")) == 10


def test_disk_pressure_drops_only_cold_unpinned_unleased_pages_least_useful_first(daemon_factory: object) -> None:
    size = 64 * 1024
    proc: DaemonProcess = daemon_factory("--reserve-bytes", "0", "--quota-bytes", str(10 * size))  # type: ignore[operator]
    client = proc.client
    assert client is not None
    client.open_session("d")
    client.upsert_pages("d", pages("p", 14))
    for i in range(10):
        client.write_page_data("d", f"p{i:06d}", bytes([i]) * size)
    # p0..p5 cold, p6 pinned (resident), p7 cold+pinned-entry, p8 cold+leased, p9 hot
    client.set_page_states("d", [(f"p{i:06d}", pb.COLD) for i in (0, 1, 2, 3, 4, 5, 7, 8)])
    client.set_page_states("d", [("p000006", pb.PINNED)])
    client.set_pins("d", add=[("p000006", "system"), ("p000007", "plan")])
    client.set_leases("d", add=[pb.Lease(page_id="p000008", until_turn=5)])
    client.set_scores("d", {"p000000": 9.0, "p000001": 0.1, "p000002": 5.0, "p000003": 0.5, "p000004": 7.0,
                            "p000005": 3.0})
    # the store is at its quota: each new page must push out the least useful droppable one
    client.write_page_data("d", "p000010", b"a" * size)
    client.write_page_data("d", "p000011", b"b" * size)
    client.write_page_data("d", "p000012", b"c" * size)
    dropped = [p.page_id for p in client.query_pages("d", [pb.DROPPED])]
    assert dropped == ["p000001", "p000003", "p000005"], dropped  # usefulness 0.1, 0.5, 3.0
    # three more droppable pages remain (p0, p2, p4); ask for more than that
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED|no room|only"):
        client.write_page_data("d", "p000013", b"d" * (4 * size))
    # nothing was dropped by the failed write and every remaining payload still verifies
    assert [p.page_id for p in client.query_pages("d", [pb.DROPPED])] == dropped
    verified = client.verify("d")
    assert not verified.corrupt and verified.pages_ok == 10
    for page_id in ("p000006", "p000007", "p000008", "p000009"):
        assert client.read_page_data("d", page_id).data  # resident, pinned and leased pages survive
    assert client.status().store_bytes <= 10 * size


def test_reserve_larger_than_free_space_fails_writes_cleanly(daemon_factory: object) -> None:
    proc: DaemonProcess = daemon_factory("--reserve-percent", "99.9")  # type: ignore[operator]
    client = proc.client
    assert client is not None
    client.open_session("r")
    client.upsert_pages("r", pages("p", 1))
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED|needs .* more bytes"):
        client.write_page_data("r", "p000000", b"x" * 1024)
    assert not any(Path(proc.root, "store").rglob("*.kv"))
    assert client.query_pages("r")[0].locator == ""
