"""The end of a turn and what recovery reads back: a session's record, its transcript segments and
its recurrent-state snapshots.

WriteRecord ends a turn in one transaction: the session's counters, turn and fingerprint, its
record, its transcript cut back and extended (appended, so a turn's cost does not grow with the
session), and its snapshots. With an object store the turn commits only while this contextd holds
the session, and the session is exported after the commit (contextd.holds). ReadRecord returns
the record and every segment, for recovery.

Depends on contextd.holds (the only other verb module it may import: a turn commits under a
hold), contextd.manifest, contextd.payloads, contextd.store, contextd.keys, contextd.records,
contextd.ids, contextd.errors and contextd.wire (`record_refusal`, the rule the server applies too).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from contextd.errors import DataCorrupt, FailedPrecondition, InvalidArgument, NotFound
from contextd.holds import Holds
from contextd.ids import check_id
from contextd.keys import SegmentKey, SessionKey, SnapshotKey, session_scope
from contextd.manifest import check_batch, check_text, commit, session_row
from contextd.payloads import Payloads
from contextd.records import RecordRow, SegmentRow, SnapshotRow
from contextd.store import RECORDS, SEGMENTS, SESSIONS, SNAPSHOTS, CommitInfo, Store, Txn
from contextd.wire import record_refusal


class Turns:
    """The record and snapshot verbs over `store`."""

    def __init__(self, store: Store, payloads: Payloads, holds: Holds) -> None:
        self.store = store
        self.payloads = payloads
        self.holds = holds

    def put_snapshot(self, session_id: str, snapshot: SnapshotRow) -> CommitInfo:
        """Record a snapshot whose payload is already in the store; the slot's previous payload
        is deleted after the commit."""
        self._check_snapshot(session_id, snapshot)
        self.payloads.commit([snapshot.locator])
        replaced: list[str] = []

        def op(txn: Txn) -> None:
            session_row(txn, session_id)
            _put_snapshot(txn, session_id, snapshot, replaced)

        info = commit(self.store, op, "commit the snapshot")[1]
        self.payloads.delete(replaced)
        return info

    def _check_snapshot(self, session_id: str, snapshot: SnapshotRow) -> None:
        slot = check_id(snapshot.slot, "snapshot slot")
        check_text(snapshot.fingerprint, "fingerprint", 256)
        if not snapshot.locator.startswith(session_id + "/"):
            raise InvalidArgument(f"snapshot {slot}: locator is outside session {session_id}")
        if not self.payloads.blobs.exists(snapshot.locator, snapshot.byte_size):
            raise FailedPrecondition(f"snapshot {slot}: no payload of {snapshot.byte_size} bytes at {snapshot.locator}")

    def query_snapshots(self, session_id: str) -> list[SnapshotRow]:
        with self.store.read() as txn:
            session_row(txn, session_id)
            found = [s for _, s in txn.scan(SNAPSHOTS, session_scope(session_id))]
        self.payloads.fetch([(s.locator, s.byte_size, s.checksum) for s in found if s.locator])
        return found

    def write_record(self, session_id: str, record: RecordRow, keep_segments: int, append: Sequence[SegmentRow],
                     snapshots: Sequence[SnapshotRow] = ()) -> CommitInfo:
        """The end of a turn in one transaction: the session's counters, turn and fingerprint, its
        record, its transcript cut back to `keep_segments` segments and extended by `append`, and
        its recurrent snapshots (the slots' previous payloads are deleted after the commit)."""
        refused = record_refusal(record.message_hashes, [segment.text for segment in append])
        if refused:
            raise InvalidArgument(refused)
        if len(snapshots) > 8 or len({s.slot for s in snapshots}) != len(snapshots):
            raise InvalidArgument("at most 8 snapshots, one per slot")
        for snapshot in snapshots:
            self._check_snapshot(session_id, snapshot)
        check_text(record.fingerprint, "fingerprint", 256)
        if len(record.fingerprint_parts) > 8 or any(len(p) > 256 for p in record.fingerprint_parts):
            raise InvalidArgument("fingerprint_parts holds at most 8 strings of at most 256 characters")
        if len(record.counters) > 256 or any(len(name) > 64 for name in record.counters):
            raise InvalidArgument("at most 256 counters, names of at most 64 characters")
        if len(record.resident_pages) != len(record.resident_positions):
            raise InvalidArgument("resident_pages and resident_positions must have one entry each per page")
        check_batch(record.ledger_pages, "ledger_pages")
        check_batch(record.resident_pages, "resident_pages")
        self.holds.before_record(session_id)
        self.payloads.commit([snapshot.locator for snapshot in snapshots])

        def op(txn: Txn) -> int:
            session = session_row(txn, session_id)
            old = txn.get(RECORDS, SessionKey(session_id)) or RecordRow()
            if keep_segments > old.segments:
                raise FailedPrecondition(f"session {session_id} has {old.segments} stored segments; "
                                         f"cannot keep {keep_segments}")
            tokens = old.tokens
            for seq in range(keep_segments, old.segments):
                gone = txn.get(SEGMENTS, SegmentKey(session_id, seq))
                assert gone is not None, "a session's segments are contiguous"
                tokens -= len(gone.token_ids)
                txn.delete(SEGMENTS, SegmentKey(session_id, seq))
            for n, segment in enumerate(append):
                tokens += len(segment.token_ids)
                txn.put(SEGMENTS, SegmentKey(session_id, keep_segments + n), segment)
            txn.put(RECORDS, SessionKey(session_id),
                    replace(record, segments=keep_segments + len(append), tokens=tokens))
            txn.put(SESSIONS, SessionKey(session_id), replace(
                session, turn=record.turn, attention_tokens=record.attention_tokens, fingerprint=record.fingerprint,
                counters=dict(record.counters), updated_unix=time.time()))
            for snapshot in snapshots:
                _put_snapshot(txn, session_id, snapshot, replaced)
            return len(append)

        replaced: list[str] = []
        info = commit(self.store, op, "commit the turn")[1]
        self.payloads.delete(replaced)
        self.holds.publish(session_id)
        return info

    def read_record(self, session_id: str) -> tuple[RecordRow, list[SegmentRow]]:
        with self.store.read() as txn:
            session_row(txn, session_id)
            record = txn.get(RECORDS, SessionKey(session_id))
            if record is None:
                raise NotFound(f"session {session_id} has no record yet (no turn has completed)")
            segments = [s for _, s in txn.scan(SEGMENTS, session_scope(session_id))]
        if len(segments) != record.segments:
            raise DataCorrupt(f"session {session_id}: the record names {record.segments} segments, "
                              f"{len(segments)} are stored")
        return record, segments


def _put_snapshot(txn: Txn, session_id: str, snapshot: SnapshotRow, replaced: list[str]) -> None:
    """Put a checked snapshot in its slot; the slot's previous payload joins `replaced`."""
    key = SnapshotKey(session_id, snapshot.slot)
    old = txn.get(SNAPSHOTS, key)
    if old is not None and old.locator and old.locator != snapshot.locator:
        replaced.append(old.locator)
    txn.put(SNAPSHOTS, key, replace(snapshot, created_unix=time.time()))
