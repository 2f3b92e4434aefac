"""Fast samples of the storage faults (benchmarks.faults part 2): refused writes at the file-I/O
seam (contextd/blobs.py fault injection: it works where mounting a tmpfs does not), a real full
tmpfs where mounting is allowed, and payloads damaged on disk. The promise: a clear error (507
full, 503 unavailable) or a correct answer, a corrupt byte never in attention, nothing
half-present, and the session going on exactly once the fault is gone."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from contextd import blobs
from contextd.errors import StoreFull
from contextd.keys import SegmentKey
from contextd.records import SegmentRow
from contextd.store import SEGMENTS, Store
from harness.faults.oracle import CaseOutcome, Twins
from harness.faults.processes import Daemon
from harness.faults.scenarios import SCENARIOS
from harness.faults.storage import StorageCampaign, StorageCase, tmpfs, tmpfs_allowed
from tests.reliability.conftest import explain

LLAMA = SCENARIOS["llama"]


# ------------------------------------------------------------------ the seam itself


@pytest.fixture
def armed() -> Iterator[None]:
    yield None
    blobs.clear_fault()


def test_a_fault_fires_at_the_nth_operation_and_then_stops(tmp_path: Path, armed: None) -> None:
    store = blobs.BlobStore(tmp_path / "store")
    fault = blobs.inject("fsync", errno.EIO, nth=2, times=1)
    store.write("s", "p1", b"one")
    with pytest.raises(OSError) as failed:
        store.write("s", "p2", b"two")
    assert failed.value.errno == errno.EIO and not isinstance(failed.value, StoreFull)
    stored = store.write("s", "p3", b"three")
    assert (fault.seen, fault.fired) == (3, 1)
    assert store.read(stored.locator, stored.checksum, 5) == b"three"
    assert sorted(p.name.split(".")[0] for p in (tmp_path / "store" / "s").iterdir()) == ["p1", "p3"]


@pytest.mark.parametrize("op", ["mkdir", "open", "write", "fsync", "rename", "dirsync"])
def test_a_full_disk_is_store_full_and_leaves_no_file_behind(tmp_path: Path, armed: None, op: str) -> None:
    store = blobs.BlobStore(tmp_path / "store")
    blobs.inject(op, errno.ENOSPC)
    with pytest.raises(StoreFull, match="No space left"):
        store.write("s", "p1", [memoryview(b"abc"), memoryview(b"def")])
    folder = tmp_path / "store" / "s"
    left = sorted(p.name for p in folder.iterdir()) if folder.exists() else []
    # a failed fsync of the folder comes after the rename: the file is whole, just not recorded (gc's orphan)
    assert left == ([] if op != "dirsync" else [left[0]]) and not any(n.startswith(blobs.TEMP_PREFIX) for n in left)


def test_the_environment_arms_a_fault_in_a_process_and_rejects_nonsense() -> None:
    assert blobs._parse_fault("write:ENOSPC:3:0") == blobs.IOFault("write", errno.ENOSPC, 3, 0)
    assert blobs._parse_fault("") is None
    for bad in ("write", "write:NOPE", "rename:EIO:x", "read:EIO", "write:EIO:0"):
        with pytest.raises(ValueError):
            blobs._parse_fault(bad)


def test_a_database_that_cannot_grow_is_store_full_and_keeps_what_was_committed(tmp_path: Path) -> None:
    store = Store(tmp_path / "db", map_size=1 << 20)  # a 1 MiB map: LMDB's "disk" fills at once
    try:
        store.write(lambda txn: txn.put(SEGMENTS, SegmentKey("kept", 0), SegmentRow("committed before")))
        with pytest.raises(StoreFull, match="cannot grow"):
            store.write(lambda txn: [txn.put(SEGMENTS, SegmentKey("full", i), SegmentRow("x" * 4096))
                                     for i in range(1000)])
        store.write(lambda txn: txn.put(SEGMENTS, SegmentKey("after", 0), SegmentRow("room enough for a small one")))
        with store.read() as txn:
            assert txn.get(SEGMENTS, SegmentKey("kept", 0)) == SegmentRow("committed before")
            assert txn.get(SEGMENTS, SegmentKey("full", 0)) is None
            assert txn.get(SEGMENTS, SegmentKey("after", 0)) is not None
    finally:
        store.close()


# ------------------------------------------------------------------ through the serving engine


def case(storage: StorageCampaign, twins: Twins, kind: str, label: str, request: str,
         actions: list[list[object]], expect: int = 0) -> CaseOutcome:
    return storage.case(StorageCase(label, "llama", kind, {request: actions}, expect=expect))


def evicting(twins: Twins) -> str:
    return str(next(i for i, a in enumerate(twins.plain(LLAMA)) if a["hits"].get("serving.evict.removed")))


def test_a_damaged_cold_page_is_reported_and_never_served(storage: StorageCampaign,
                                                          twins: Twins) -> None:
    plain = twins.plain(LLAMA)
    i, page = next((i, p) for i, a in enumerate(plain) if i > 0 for p in a["inserted"]
                   if [r for r in plain[i - 1]["manifest"] if r[0] == p and r[1] == 2])
    for how in ("flip", "torn", "missing"):
        outcome = case(storage, twins, "damage", f"{how} cold page", str(i), [["corrupt", page, how]])
        assert outcome.reached and outcome.exact, explain(outcome)
        assert outcome.served_corrupt == 0 and outcome.caught and outcome.intact


def test_a_full_disk_mid_turn_answers_507(storage: StorageCampaign, twins: Twins) -> None:
    outcome = case(storage, twins, "write", "ENOSPC on write", evicting(twins),
                   [["inject", "write", "ENOSPC", 1, 1]], expect=507)
    assert outcome.reached and outcome.statuses[:1] == [507], explain(outcome)
    assert outcome.caught and outcome.served_corrupt == 0 and outcome.half_present == 0


def test_once_space_returns_the_session_goes_on_exactly(storage: StorageCampaign, twins: Twins) -> None:
    # the second payload of the write-through of request 2 (a turn that moves no page) finds the disk full
    outcome = case(storage, twins, "write", "ENOSPC on the second rename", "2",
                   [["inject", "rename", "ENOSPC", 2, 1]], expect=507)
    assert outcome.reached and outcome.statuses[:1] == [507], explain(outcome)
    assert outcome.intact and outcome.statuses == [507], explain(outcome)


@pytest.mark.parametrize("error", ["EIO", "EROFS"])
def test_a_failing_or_read_only_disk_answers_503(storage: StorageCampaign, twins: Twins,
                                                 error: str) -> None:
    outcome = case(storage, twins, "write", f"{error} on fsync", evicting(twins),
                   [["inject", "fsync", error, 1, 1]], expect=503)
    assert outcome.reached and outcome.statuses[:1] == [503], explain(outcome)


def test_a_damaged_resident_page_starts_the_session_over_in_the_same_request(storage: StorageCampaign,
                                                                            twins: Twins) -> None:
    last = str(len(LLAMA.users) - 1)
    outcome = case(storage, twins, "damage", "flip resident page", last, [["corrupt", "@resident", "flip"], ["forget"]])
    assert outcome.reached and outcome.exact and outcome.statuses == [], explain(outcome)


def test_a_damaged_recurrent_snapshot_does_not_wedge_the_session(storage: StorageCampaign) -> None:
    last = str(len(SCENARIOS["hybrid"].users) - 1)
    outcome = storage.case(StorageCase("flip snapshot", "hybrid", "damage",
                                       {last: [["corrupt", "@snapshot", "flip"], ["forget"]]}))
    assert outcome.reached and outcome.intact, explain(outcome)


# ------------------------------------------------------------------ a real full filesystem


@pytest.fixture
def mounting(work: Path) -> None:
    if os.geteuid() != 0 or not tmpfs_allowed(work):
        pytest.skip("mounting a tmpfs is not allowed here (the injected ENOSPC above stands for it)")


def tmpfs_case(storage: StorageCampaign, twins: Twins, work: Path, scope: str, leave: int,
               name: str) -> CaseOutcome:
    base = work / name
    root = base / "root"
    mount_at = root / "store" if scope == "store" else root
    with tmpfs(mount_at, 64):
        daemon = Daemon(root, base / "c.sock")
        daemon.start()
        try:
            i = evicting(twins)
            return storage.case(StorageCase(f"tmpfs {scope} full", "llama", "write",
                                            {i: [["fill", str(mount_at), leave]]}, {i: [["unfill", str(mount_at)]]},
                                            expect=507, daemon=daemon))
        finally:
            daemon.stop()


def test_a_real_full_store_filesystem_is_handled(storage: StorageCampaign, twins: Twins, work: Path,
                                                 mounting: None) -> None:
    outcome = tmpfs_case(storage, twins, work, "store", 0, "full-store")
    # 507, and once space is back the session goes on exactly as its twin's: nothing its last record needs was dropped
    assert outcome.reached and outcome.caught and outcome.intact, explain(outcome)
    assert outcome.served_corrupt == 0 and outcome.half_present == 0


def test_a_full_disk_under_the_database_answers_507(storage: StorageCampaign, twins: Twins, work: Path,
                                                    mounting: None) -> None:
    outcome = tmpfs_case(storage, twins, work, "root", 160 << 10, "full-root")
    assert outcome.reached and outcome.unclear_errors == 0, explain(outcome)
