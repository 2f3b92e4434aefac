"""The object tier against a real S3 store: a single-node Ceph RGW that the suite starts
(harness/rgw.py; `make test` installs Debian's ceph-mon, ceph-osd and radosgw).

contextd runs with `--object-store s3://BUCKET`: a payload is in the object store before the
manifest row that names it commits, the store folder is a bounded cache whose losses come back on
the next read, a payload whose bytes changed in the object store is refused (its page marked
corrupt), and an object store that is down, stalls or dies in the middle of a transfer fails a
commit (or a read) with a clear error, committing (or marking) nothing, until it answers again."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from contextd.client import Client, pb
from contextd.errors import DeadlineExceeded, InvalidArgument, NotFound, TierUnavailable
from contextd.objects import ObjectStore, ObjectStoreConfig
from contextd.tiering import READ_HOLD_S
from contextd.wire import PageState
from harness.faults.network import WAIT_S, S3Proxy, StallingProxy
from harness.rgw import Rgw
from serving.launcher import ContextdProcess
from tests.objectstore import bucket

from .conftest import MovedClock, in_thread, store_payload

PAYLOAD = (6 << 20) // 4   # 1.5 MiB: one PUT each
BIG = (11 << 20) + 12345  # past two 5 MiB parts: a multipart upload


@pytest.fixture
def s3(rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> ObjectStore:
    return bucket(rgw, monkeypatch)


def tiered(daemon_factory: Any, s3: ObjectStore, *extra: str, endpoint: str = "") -> tuple[ContextdProcess, Client]:
    """A daemon keeping its payloads in `s3` (through `endpoint` when given), with session "s" open."""
    proc: ContextdProcess = daemon_factory("--reserve-bytes", "0", "--object-store", s3.config.url,
                                           "--object-endpoint", endpoint or s3.config.endpoint, *extra)
    assert proc.client is not None
    proc.client.open_session("s", model_id="m")
    return proc, proc.client


def page(n: int) -> pb.Page:
    return pb.Page(page_id=f"p{n}", token_start=128 * n, token_end=128 * (n + 1), state=PageState.COLD.value,
                   dtype="float32", layer_view="v")


def data(n: int, size: int = PAYLOAD) -> bytes:
    return (bytes([n % 251]) * 4096 + uuid.uuid4().bytes * 16)[:size].ljust(size, b"x")


def folder_files(proc: ContextdProcess) -> list[Path]:
    return sorted(p for p in (proc.root / "store").rglob("*") if p.is_file() and not p.name.startswith("."))


def test_a_committed_payload_is_in_the_object_store_and_comes_back_when_the_folder_loses_it(
        daemon_factory: Any, s3: ObjectStore) -> None:
    _, client = tiered(daemon_factory, s3)
    small, big = data(1), data(2, BIG)
    records = [store_payload(client, "s", page(1), small), store_payload(client, "s", page(2), big)]
    for record, payload in zip(records, (small, big), strict=True):
        assert s3.exists(record.locator, len(payload))
        client.payloads().path(record.locator).unlink()      # the folder lost it
    got = client.get_pages("s", ["p1", "p2"])
    assert [r.state for r in got] == [PageState.COLD.value] * 2
    assert client.payloads().path(got[0].locator).read_bytes() == small
    assert client.payloads().path(got[1].locator).read_bytes() == big
    assert client.verify().pages_ok == 2
    # deleting the session deletes its objects too
    client.delete_session("s")
    assert not s3.exists(records[0].locator, len(small))


def test_the_folder_keeps_at_most_its_cache_bytes_and_fetches_the_rest(daemon_factory: Any, s3: ObjectStore) -> None:
    proc, client = tiered(daemon_factory, s3, "--cache-bytes", str(3 * PAYLOAD))
    payloads = {n: data(n) for n in range(6)}
    for n, payload in payloads.items():
        store_payload(client, "s", page(n), payload)
    assert len(folder_files(proc)) == 3          # the three used last
    for n in (0, 1, 2):
        (record,) = client.get_pages("s", [f"p{n}"])
        assert client.payloads().path(record.locator).read_bytes() == payloads[n]
    assert len(folder_files(proc)) == 3
    assert client.verify().pages_ok == 6
    status = client.status()
    assert status.object_store == s3.config.url and status.objects_uploaded == 6
    # the three read last are held for their reader a while: verify's own reads go past the bound by one
    assert status.objects_fetched >= 3 and status.cached_bytes <= 4 * PAYLOAD


def test_payloads_handed_out_for_reading_stay_in_the_folder_until_their_hold_ends(
        daemon_factory: Any, s3: ObjectStore, clock: MovedClock) -> None:
    """A reader reads what GetPages handed out after the reply: the server's fill reads one chunk
    of pages while it asks for the next. Neither the cache's bound (the next chunk's fetch) nor
    disk pressure (a reclaim) takes a payload handed out until its read hold has ended on the
    daemon's clock; then they may, and the object store gives the payload back."""
    proc, client = tiered(daemon_factory, s3, "--cache-bytes", str(2 * PAYLOAD))
    payloads = {f"p{n}": data(n) for n in range(4)}
    for n in range(4):
        store_payload(client, "s", page(n), payloads[f"p{n}"])
    first = client.get_pages("s", ["p0", "p1"])       # chunk n, read while...
    second = client.get_pages("s", ["p2", "p3"])      # ...chunk n + 1 is asked for
    client.reclaim(8 * PAYLOAD)                       # and the disk runs short meanwhile
    for record in [*first, *second]:
        assert client.payloads().path(record.locator).read_bytes() == payloads[record.page_id]
    clock.advance(READ_HOLD_S + 1)
    client.reclaim(8 * PAYLOAD)
    assert folder_files(proc) == []
    got = client.get_pages("s", ["p0", "p3"])
    assert [client.payloads().path(r.locator).read_bytes() for r in got] == [payloads["p0"], payloads["p3"]]
    assert [p.state for p in client.query_pages("s")] == [PageState.COLD.value] * 4


def test_a_page_whose_folder_copy_is_lost_or_damaged_is_fetched_again_not_marked_corrupt(
        daemon_factory: Any, s3: ObjectStore) -> None:
    """A reader reports a page whose folder copy went (evicted under it) or is damaged: the folder
    is only a cache, so contextd fetches the object store's copy, checked, and the page stays
    whole. A copy that is whole yet found wrong by the reader (it holds other tokens than the
    page's) is marked corrupt as before."""
    _, client = tiered(daemon_factory, s3)
    payloads = [data(n) for n in range(3)]
    records = [store_payload(client, "s", page(n), payloads[n]) for n in range(3)]
    client.payloads().path(records[0].locator).unlink()
    damaged = client.payloads().path(records[1].locator)
    damaged.write_bytes(b"\xff" + damaged.read_bytes()[1:])
    for record in records:
        client.report_corrupt("s", record.page_id, "the reader's checks failed")
    got = client.get_pages("s", ["p0", "p1", "p2"])
    assert [p.state for p in got] == [PageState.COLD.value] * 2 + [PageState.CORRUPT.value]
    assert [client.payloads().path(r.locator).read_bytes() for r in got[:2]] == payloads[:2]


def test_a_payload_changed_in_the_object_store_is_refused_and_its_page_marked_corrupt(
        daemon_factory: Any, s3: ObjectStore) -> None:
    _, client = tiered(daemon_factory, s3)
    record = store_payload(client, "s", page(1), data(1))
    s3.client.put_object(Bucket=s3.config.bucket, Key=s3.key(record.locator), Body=data(9))   # same size, other bytes
    client.payloads().path(record.locator).unlink()
    (got,) = client.get_pages("s", ["p1"])
    assert got.state == PageState.CORRUPT.value
    assert not client.payloads().path(record.locator).exists()


def test_an_object_store_that_is_down_fails_the_commit_typed_and_it_goes_through_once_back(
        daemon_factory: Any, own_rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> None:
    rgw = own_rgw
    s3 = bucket(rgw, monkeypatch)
    _, client = tiered(daemon_factory, s3, "--object-deadline", "2")
    store_payload(client, "s", page(1), data(1))
    blob = client.payloads().write("s", "p2", data(2))
    record = pb.Page()
    record.CopyFrom(page(2))
    record.locator, record.byte_size, record.checksum = blob.locator, blob.byte_size, blob.checksum
    rgw.kill_gateway()
    try:
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match="object store"):
            client.upsert_pages("s", [record])
        assert time.monotonic() - started < 15
        assert [p.page_id for p in client.query_pages("s")] == ["p1"]     # nothing was committed
    finally:
        rgw.restart_gateway()
    client.upsert_pages("s", [record])
    assert s3.exists(record.locator, record.byte_size)
    assert client.verify().pages_ok == 2


def test_a_stalled_object_store_fails_the_commit_after_its_deadline(daemon_factory: Any, s3: ObjectStore,
                                                                    rgw: Rgw) -> None:
    proxy = StallingProxy(rgw.port)
    try:
        _, client = tiered(daemon_factory, s3, "--object-deadline", "2", endpoint=f"http://127.0.0.1:{proxy.port}")
        store_payload(client, "s", page(1), data(1))
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(TierUnavailable, match="did not take"):
            store_payload(client, "s", page(2), data(2))
        assert time.monotonic() - started < 20
        assert [p.page_id for p in client.query_pages("s")] == ["p1"]
        proxy.resume()
        store_payload(client, "s", page(2), data(2))
        assert client.verify().pages_ok == 2
    finally:
        proxy.close()


def test_an_object_store_killed_mid_read_and_mid_write_loses_nothing_and_both_go_through_once_back(
        daemon_factory: Any, own_rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> None:
    s3 = bucket(own_rgw, monkeypatch)
    proxy = StallingProxy(own_rgw.port, bytes_per_s=8 << 20)   # an 11 MiB payload takes ~1.4 s each way
    try:
        proc, client = tiered(daemon_factory, s3, "--object-deadline", "3", endpoint=f"http://127.0.0.1:{proxy.port}")
        first, second = data(1, BIG), data(2, BIG)
        stored = store_payload(client, "s", page(1), first)
        client.payloads().path(stored.locator).unlink()          # the next read downloads it

        def killed_midway(call: Any) -> None:
            killer = threading.Timer(0.5, own_rgw.kill_gateway)
            killer.start()
            try:
                with pytest.raises(TierUnavailable, match="object store"):
                    call()
            finally:
                killer.join()

        killed_midway(lambda: client.get_pages("s", ["p1"]))
        assert [(p.page_id, p.state) for p in client.query_pages("s")] == [("p1", PageState.COLD.value)]
        assert folder_files(proc) == [], folder_files(proc)      # no half-downloaded file left
        own_rgw.restart_gateway()
        blob = client.payloads().write("s", "p2", second)
        record = pb.Page()
        record.CopyFrom(page(2))
        record.locator, record.byte_size, record.checksum = blob.locator, blob.byte_size, blob.checksum
        killed_midway(lambda: client.upsert_pages("s", [record]))   # a multipart upload cut in its middle
        assert [p.page_id for p in client.query_pages("s")] == ["p1"]   # nothing committed
        own_rgw.restart_gateway()
        assert not s3.exists(record.locator, record.byte_size)    # no half object
        client.upsert_pages("s", [record])                        # the same write goes through
        got = client.get_pages("s", ["p1", "p2"])
        assert [client.payloads().path(r.locator).read_bytes() for r in got] == [first, second]
        assert client.verify().pages_ok == 2
    finally:
        proxy.close()


def test_a_root_moves_to_the_object_store_at_start_and_keeps_to_it(daemon_factory: Any, s3: ObjectStore) -> None:
    local = daemon_factory("--reserve-bytes", "0")
    client: Client = local.client
    client.open_session("s", model_id="m")
    record = store_payload(client, "s", page(1), data(1))
    local.proc.terminate()
    local.proc.wait(timeout=120)
    # the same root with an object store: its payloads go up before it serves
    moved = ContextdProcess(root=local.root, socket=local.socket,
                            extra=["--reserve-bytes", "0", "--object-store", s3.config.url, "--object-endpoint",
                                   s3.config.endpoint])
    try:
        moved.start()
        assert s3.exists(record.locator, record.byte_size)
        moved.stop()
        # and it stays with that store: another one is refused with the reason
        other = ContextdProcess(root=local.root, socket=local.socket, extra=[
            "--object-store", "s3://another-bucket", "--object-endpoint", s3.config.endpoint])
        with pytest.raises(RuntimeError, match="durable in"):
            other.start(timeout=10)
    finally:
        moved.stop()


def test_object_store_settings_are_checked() -> None:
    for url in ("s3://", "http://bucket", "s3://Upper", "s3://b"):
        with pytest.raises(InvalidArgument):
            ObjectStoreConfig(url=url)
    with pytest.raises(InvalidArgument, match="endpoint"):
        ObjectStoreConfig(url="s3://bucket", endpoint="127.0.0.1:7480")
    with pytest.raises(InvalidArgument, match="parts"):
        ObjectStoreConfig(url="s3://bucket", part_bytes=1 << 20)


def test_a_turn_answered_by_the_object_store_after_the_callers_deadline_is_not_committed(
        daemon_factory: Any, s3: ObjectStore, proxy: S3Proxy, clock: MovedClock) -> None:
    """The client gives up on a call at its deadline and fails the turn, while contextd may still
    be waiting on the object store. A turn whose snapshot upload is answered only after the
    caller's deadline (on the daemon's clock) is refused, not committed; sent again in time, it is."""
    _, client = tiered(daemon_factory, s3, endpoint=proxy.endpoint)
    store_payload(client, "s", page(1), data(1))
    blob = client.payloads().write("s", "snapshot-recurrent", b"state" * 100, suffix="rs")
    snapshot = pb.Snapshot(slot="recurrent", token_count=128, fingerprint="f", locator=blob.locator,
                           byte_size=blob.byte_size, checksum=blob.checksum)
    record = pb.SessionRecord(turn=1, fingerprint="f")
    segment = pb.TranscriptSegment(text="user 1", token_ids=[1, 2])
    upload = proxy.hold("PUT", f"/payloads/{blob.locator}")
    with Client(client.socket_path, timeout=20.0) as engine:
        thread, outcome = in_thread(lambda: engine.write_record("s", record, 0, [segment], [snapshot]))
        upload.wait()
        clock.advance(21)                      # the engine's deadline passes while the upload waits
        upload.release()
        thread.join(WAIT_S)
    assert len(outcome) == 1 and isinstance(outcome[0], DeadlineExceeded), outcome
    with pytest.raises(NotFound):
        client.read_record("s")
    assert list(client.query_snapshots("s")) == []
    client.write_record("s", record, 0, [segment], [snapshot])
    assert client.read_record("s").record.turn == 1 and len(client.query_snapshots("s")) == 1


def test_an_object_store_that_is_down_fails_a_call_at_the_callers_deadline_not_the_stores(
        daemon_factory: Any, s3: ObjectStore, proxy: S3Proxy, clock: MovedClock) -> None:
    """Every wait has the caller's deadline: with `--object-deadline` far away, a store that refuses
    every upload fails the call once the caller's deadline has passed on the daemon's clock."""
    _, client = tiered(daemon_factory, s3, "--object-deadline", "600", endpoint=proxy.endpoint)
    blob = client.payloads().write("s", "p1", data(1))
    record = pb.Page()
    record.CopyFrom(page(1))
    record.locator, record.byte_size, record.checksum = blob.locator, blob.byte_size, blob.checksum
    down = proxy.refuse("PUT", "/payloads/s/")
    with Client(client.socket_path, timeout=30.0) as engine:
        thread, outcome = in_thread(lambda: engine.upsert_pages("s", [record]))
        down.wait()
        clock.advance(31)
        thread.join(WAIT_S)
    assert len(outcome) == 1 and isinstance(outcome[0], TierUnavailable), outcome
    assert "deadline" in str(outcome[0]) and client.query_pages("s") == []
    down.release()
    client.upsert_pages("s", [record])
    assert [p.page_id for p in client.query_pages("s")] == ["p1"]
