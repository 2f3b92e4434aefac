"""Rows written the schema-2 way (plain msgpack maps, keys joined by NUL, straight into LMDB) load
into today's typed rows, today's rows and keys encode to the same bytes less the fields schema 4
dropped (and with the page's prefix hash it added), a schema-2 database is brought to today's
schema once when it is opened (schema 3: its PINNED pages become HOT pages with their pins;
schema 4: the summaries table and each row's unit fields are gone), and every row of a deleted
session goes with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lmdb
import pytest

from contextd.blobs import Reserve
from contextd.daemon import Daemon, DaemonConfig
from contextd.errors import ContextdError, DataCorrupt, NotFound
from contextd.keys import EVERYTHING, PageKey, SegmentKey, SessionKey, StateKey
from contextd.records import (
    LeaseRow,
    PageCounts,
    PageRow,
    PinRow,
    RecordRow,
    SegmentRow,
    SessionRow,
    SnapshotRow,
)
from contextd.store import LEASES, MANIFEST, PAGE_STATES, PINS, RECORDS, RETIRED, SCHEMA_VERSION, TABLES, encode
from contextd.wire import PageState, PinKind

NOW = 1_790_000_000.0


def old_key(*parts: str) -> bytes:
    """How the schema-2 daemon built every key (contextd.ids.key)."""
    return "\x00".join(parts).encode()


def old_page(page_id: str, index: int, state: int, **extra: Any) -> dict[str, Any]:
    """A manifest row as the schema-2 service built it (the proto's field names, in order)."""
    page = {"page_id": page_id, "index": index, "token_start": index * 128, "token_end": index * 128 + 128,
            "original_position": index * 128, "state": state, "locator": "", "byte_size": 0, "checksum": "",
            "dtype": "float32", "layer_view": "v", "block_id": "", "updated_unix": NOW, "last_used_turn": 3,
            "score": 0.5}
    page.update(extra)
    return page


COUNTS = {"hot": 1, "cold": 0, "pinned": 0, "dropped": 0, "corrupt": 1, "hot_tokens": 128, "cold_tokens": 0,
          "pinned_tokens": 0, "bytes_on_disk": 0}
SESSION = {"session_id": "s", "created_unix": NOW, "turn": 4, "attention_tokens": 256, "counters": {"turns": 4},
           "pages": COUNTS, "model_id": "m", "fingerprint": "f", "budget_tokens": 1024, "labels": {"who": "me"},
           "closed": False, "updated_unix": NOW}
HOT_PAGE = old_page("p0", 0, int(PageState.HOT))
CORRUPT_PAGE = old_page("p1", 1, int(PageState.CORRUPT), corrupt_reason="checksum mismatch")
PINNED_PAGE = old_page("p2", 2, 3)  # schema 2's PINNED state, a proto number reserved since
UNIT = {"block_id": "u1", "kind": "unit", "parent_id": "c1", "page_ids": ["p0", "p1"], "child_ids": [],
        "token_count": 256, "summary": "a unit"}
CLUSTER = {"block_id": "c1", "kind": "cluster", "parent_id": "", "page_ids": [], "child_ids": ["u1"],
           "token_count": 0, "summary": ""}
SNAPSHOT = {"slot": "recurrent", "token_count": 256, "fingerprint": "f", "locator": "s/snap.rs", "byte_size": 10,
            "checksum": "0" * 32, "created_unix": NOW}
RECORD = {"turn": 4, "attention_tokens": 256, "fingerprint": "f", "unit_salt": "salt", "segments": 2,
          "tokens": 3, "counters": {"turns": 4}, "fingerprint_parts": ["a", "b"], "message_hashes": ["h"],
          "ledger_pages": [0], "resident_pages": [0], "resident_positions": [0]}
DROPPED_IN_4 = ("block_id", "unit_salt")  # a page's unit and a record's unit salt
SEGMENTS = [{"text": "hi", "token_ids": [1, 2], "generated": False, "opener": False},
            {"text": "!", "token_ids": [3], "generated": True, "opener": False}]


def write_schema_2(db: Path, pinned: tuple[dict[str, Any], ...] = (), counts: dict[str, Any] = COUNTS,
                   version: int = 2) -> None:
    """Fill a database the way the schema-2 daemon left it; `pinned` pages are in the PINNED state
    with an objective pin each, `counts` are the session's stored counts."""
    names = [*(t.name for t in TABLES), *RETIRED]
    env = lmdb.open(str(db), max_dbs=len(names) + 1, subdir=True)
    dbs = {name: env.open_db(name.encode()) for name in names}
    manifest = (HOT_PAGE, CORRUPT_PAGE, *pinned)
    rows: list[tuple[str, bytes, dict[str, Any]]] = [
        ("meta", b"meta", {"schema_version": version, "commit_seq": 7, "created_unix": NOW}),
        ("sessions", old_key("s"), {**SESSION, "pages": counts}),
        *[("kv_manifest", old_key("s", page["page_id"]), page) for page in manifest],
        *[("pins", old_key("s", page["page_id"]), {"kind": "objective"}) for page in pinned],
        ("blocks", old_key("s", "u1"), UNIT),
        ("blocks", old_key("s", "c1"), CLUSTER),
        ("pins", old_key("s", "p0"), {"kind": "system"}),
        ("leases", old_key("s", "p0"), {"until_turn": 9, "expires_unix": 0.0}),
        ("snapshots", old_key("s", "recurrent"), SNAPSHOT),
        ("records", old_key("s"), RECORD),
        *[("segments", old_key("s", f"{n:012d}"), segment) for n, segment in enumerate(SEGMENTS)],
    ]
    with env.begin(write=True) as txn:
        for table, key, row in rows:
            txn.put(key, encode(row), db=dbs[table])
        for page in manifest:
            txn.put(old_key("s", str(page["state"]), page["page_id"]), b"", db=dbs["page_state"])
    env.close()


def test_a_schema_2_database_reads_as_typed_rows(tmp_path: Path) -> None:
    write_schema_2(tmp_path / "db")
    daemon = Daemon(DaemonConfig(tmp_path, reserve=Reserve(bytes=0)))
    try:
        session = daemon.get_session("s")
        # schema 3 counts the pinned hot page p0 as pinned (schema 2 counted only PINNED pages)
        migrated = PageCounts(**{**COUNTS, "pinned": 1, "pinned_tokens": 128})
        assert session == SessionRow("s", NOW, 4, 256, {"turns": 4}, migrated, "m", "f", 1024,
                                     {"who": "me"}, False, NOW)
        pages, _ = daemon.query_pages("s", [], "", 0)
        assert [(p.page_id, p.state, p.corrupt_reason) for p in pages] == [
            ("p0", PageState.HOT, ""), ("p1", PageState.CORRUPT, "checksum mismatch")]
        assert [p.page_id for p in daemon.query_pages("s", [PageState.CORRUPT], "", 0)[0]] == ["p1"]
        assert daemon.query_marks(PINS, "s") == [("p0", PinRow(PinKind.SYSTEM))]
        assert daemon.query_marks(LEASES, "s") == [("p0", LeaseRow(9, 0.0))]
        assert daemon.query_snapshots("s") == [SnapshotRow("recurrent", 256, "f", "s/snap.rs", 10, "0" * 32, NOW)]
        record, segments = daemon.read_record("s")
        assert record == RecordRow(4, 256, "f", 2, 3, {"turns": 4}, ("a", "b"), ("h",), (0,), (0,), (0,))
        assert segments == [SegmentRow("hi", (1, 2)), SegmentRow("!", (3,), generated=True)]
        status = daemon.status("", include_closed=False)
        assert status.commit_seq == 7 and status.sessions[0].snapshots == 1 and status.schema_version == 4
        with daemon.store.read() as txn:  # schema 4: no row keeps a unit field
            stored = [data for table in (MANIFEST, RECORDS) for _, data in txn.scan_stored(table, EVERYTHING)]
            assert stored and not [data for data in stored if set(DROPPED_IN_4) & set(data)]
        # the old rows go on working: a write moves the hot page, the counts follow
        daemon.set_marks(PINS, "s", [], ["p0"])
        daemon.set_marks(LEASES, "s", [], ["p0"])
        daemon.delete_pages("s", ["p0"])
        assert daemon.get_session("s").pages == PageCounts(**{**COUNTS, "hot": 0, "hot_tokens": 0})
    finally:
        daemon.close()
    env = lmdb.open(str(tmp_path / "db"), max_dbs=len(TABLES) + len(RETIRED) + 1, subdir=True)
    try:
        with pytest.raises(lmdb.NotFoundError):  # the summaries table went with its rows
            env.open_db(b"blocks", create=False)
    finally:
        env.close()


def test_a_schema_2_pinned_page_becomes_hot_with_its_pin_once(tmp_path: Path) -> None:
    """PINNED was a state until schema 3: its pages turn HOT (row and state index), their pins stay,
    and the session's counts are recomputed, `hot` now including the pinned pages."""
    write_schema_2(tmp_path / "db", pinned=(PINNED_PAGE,), counts={**COUNTS, "pinned": 1, "pinned_tokens": 128})
    expected = PageCounts(hot=2, pinned=2, corrupt=1, hot_tokens=256, pinned_tokens=256)
    for _ in range(2):  # the second open finds today's schema and changes nothing
        daemon = Daemon(DaemonConfig(tmp_path, reserve=Reserve(bytes=0)))
        try:
            assert daemon.status("", include_closed=False).schema_version == SCHEMA_VERSION == 4
            pages, _ = daemon.query_pages("s", [], "", 0)
            assert [(p.page_id, p.state) for p in pages] == [
                ("p0", PageState.HOT), ("p1", PageState.CORRUPT), ("p2", PageState.HOT)]
            assert [p.page_id for p in daemon.query_pages("s", [PageState.HOT], "", 0)[0]] == ["p0", "p2"]
            with daemon.store.read() as txn:  # no key of state 3 is left: each one parses
                assert len(list(txn.scan_keys(PAGE_STATES, EVERYTHING))) == 3
            assert daemon.query_marks(PINS, "s") == [("p0", PinRow(PinKind.SYSTEM)), ("p2", PinRow(PinKind.OBJECTIVE))]
            assert daemon.get_session("s").pages == expected
        finally:
            daemon.close()
    daemon = Daemon(DaemonConfig(tmp_path, reserve=Reserve(bytes=0)))
    try:
        # from here the pins table alone says what is pinned: unpinned, p2 stays hot
        daemon.set_marks(PINS, "s", [], ["p2"])
        daemon.set_marks(PINS, "s", [("p1", PinRow(PinKind.TOOLS))], [])  # not hot: not counted
        assert daemon.get_session("s").pages == PageCounts(hot=2, pinned=1, corrupt=1, hot_tokens=256,
                                                           pinned_tokens=128)
    finally:
        daemon.close()


def test_a_database_of_a_newer_schema_is_refused(tmp_path: Path) -> None:
    write_schema_2(tmp_path / "db", version=SCHEMA_VERSION + 1)
    with pytest.raises(ContextdError, match="cannot open it"):
        Daemon(DaemonConfig(tmp_path, reserve=Reserve(bytes=0)))


@pytest.mark.parametrize("row, stored", [
    (SessionRow("s", NOW, 4, 256, {"turns": 4}, PageCounts(**COUNTS), "m", "f", 1024, {"who": "me"}, False, NOW),
     SESSION),
    (PageRow("p1", 1, 128, 256, 128, PageState.CORRUPT, "", 0, "", "float32", "v", NOW, 3, 0.5,
             "checksum mismatch"), CORRUPT_PAGE),
    (PinRow(PinKind.SYSTEM), {"kind": "system"}),
    (LeaseRow(9, 0.0), {"until_turn": 9, "expires_unix": 0.0}),
    (SnapshotRow("recurrent", 256, "f", "s/snap.rs", 10, "0" * 32, NOW), SNAPSHOT),
    (RecordRow(4, 256, "f", 2, 3, {"turns": 4}, ("a", "b"), ("h",), (0,), (0,), (0,)), RECORD),
    (SegmentRow("!", (3,), generated=True), SEGMENTS[1]),
])
def test_rows_encode_to_the_schema_2_bytes_with_the_changes_of_schema_4(row: Any, stored: dict[str, Any]) -> None:
    expected = {k: v for k, v in stored.items() if k not in DROPPED_IN_4}
    if isinstance(row, PageRow):
        expected["prefix_hash"] = ""  # added in schema 4: the prefix index's key
    assert encode(row.stored()) == encode(expected)
    assert type(row).load(stored) == row


def test_keys_are_the_schema_2_bytes_and_parse_back() -> None:
    assert PageKey("s", "p0").encode() == old_key("s", "p0")
    assert StateKey("s", PageState.COLD, "p0").encode() == old_key("s", "2", "p0")
    assert SegmentKey("s", 12).encode() == old_key("s", "000000000012")
    assert SessionKey("s").encode() == old_key("s")
    assert StateKey.parse(old_key("s", "2", "p0")) == StateKey("s", PageState.COLD, "p0")
    assert SegmentKey.parse(old_key("s", "000000000012")) == SegmentKey("s", 12)
    with pytest.raises(DataCorrupt, match="parts"):
        PageKey.parse(old_key("s"))


def test_a_deleted_session_leaves_no_record_behind(tmp_path: Path) -> None:
    """The record row sits under the bare session key, outside the session's scope of keys."""
    daemon = Daemon(DaemonConfig(tmp_path, reserve=Reserve(bytes=0)))
    try:
        daemon.open_session("s")
        daemon.write_record("s", RecordRow(turn=1), 0, [SegmentRow("hi", (1,))])
        daemon.delete_session("s")
        daemon.open_session("s")
        with pytest.raises(NotFound, match="no record"):
            daemon.read_record("s")
    finally:
        daemon.close()
