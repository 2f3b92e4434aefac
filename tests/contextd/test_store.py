"""The LMDB layer on its own (real LMDB in a temp folder): records, checksums, group commit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from contextd.errors import DataCorrupt, InvalidArgument
from contextd.ids import check_id
from contextd.keys import SessionKey
from contextd.records import SessionRow
from contextd.store import SESSIONS, Store, SyncMode, Txn, encode


def test_a_failing_operation_aborts_alone_inside_a_batch(tmp_path: Path) -> None:
    store = Store(tmp_path / "db")
    gate = threading.Event()
    results: dict[int, object] = {}

    def op(i: int):  # type: ignore[no-untyped-def]
        def run(txn: Txn) -> int:
            txn.put(SESSIONS, SessionKey(f"s{i}"), SessionRow(f"s{i}", turn=i))
            if i % 3 == 0:
                raise InvalidArgument(f"op {i} refused")
            return i
        return run

    def worker(i: int) -> None:
        gate.wait()
        try:
            results[i] = store.write(op(i))[0]
        except InvalidArgument as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join()
    with store.read() as txn:
        for i in range(30):
            stored = txn.get(SESSIONS, SessionKey(f"s{i}"))
            if i % 3 == 0:
                assert isinstance(results[i], InvalidArgument) and stored is None
            else:
                assert results[i] == i and stored == SessionRow(f"s{i}", turn=i)
    assert store.commit_seq <= 30  # concurrent writers shared commits
    store.close()


def test_a_damaged_record_is_reported_not_decoded(tmp_path: Path) -> None:
    store = Store(tmp_path / "db", SyncMode.NONE)

    def put_damaged(txn: Txn) -> None:
        value = bytearray(encode(SessionRow("x", turn=1).stored()))
        value[-1] ^= 0xFF
        txn._txn.put(SessionKey("x").encode(), bytes(value), db=store.dbs[SESSIONS.name])

    store.write(put_damaged)
    with store.read() as txn, pytest.raises(DataCorrupt, match="checksum"):
        txn.get(SESSIONS, SessionKey("x"))
    store.close()


@pytest.mark.parametrize("bad", ["", ".hidden", "../../x", "a/b", "a b", "x" * 129, "nul\x00", "é"])
def test_identifiers_that_could_escape_or_collide_are_refused(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        check_id(bad, "page_id")


def test_sync_mode_names() -> None:
    assert SyncMode.parse("meta") is SyncMode.META
    with pytest.raises(InvalidArgument, match="full, meta, none"):
        SyncMode.parse("fast")
