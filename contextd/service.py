"""The gRPC edge: proto messages in, daemon verbs called, proto messages out.

Every request is validated before it reaches the store (the daemon re-checks what it must), and
every failure leaves as a gRPC status with a message a person can act on: typed contextd errors
map to their codes, anything unexpected to INTERNAL with the daemon still serving.

Depends on contextd.daemon, contextd.errors and the generated contextd._gen modules.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from contextd._gen import contextd_pb2 as pb
from contextd._gen import contextd_pb2_grpc as pb_grpc
from contextd.daemon import COUNT_KEYS, PAGE_FIELDS, Daemon, Record
from contextd.errors import ContextdError
from contextd.store import CommitInfo

log = logging.getLogger("contextd")

BLOCK_FIELDS = ("block_id", "kind", "parent_id", "page_ids", "child_ids", "token_count", "summary")
RECORD_SCALARS = ("turn", "attention_tokens", "fingerprint", "unit_salt", "segments", "tokens")
RECORD_LISTS = ("fingerprint_parts", "message_hashes", "ledger_pages", "resident_pages", "resident_positions")
SNAPSHOT_FIELDS = ("slot", "token_count", "fingerprint", "locator", "byte_size", "checksum", "created_unix")
SESSION_SCALARS = ("session_id", "model_id", "fingerprint", "budget_tokens", "closed", "created_unix",
                   "updated_unix", "turn", "attention_tokens")
MAX_WATCHERS = 32
WATCH_POLL_S = 0.5

R = TypeVar("R")


def _fields(msg: Any, names: tuple[str, ...]) -> Record:
    return {name: getattr(msg, name) for name in names}


def _fields_with_lists(msg: Any, names: tuple[str, ...], lists: tuple[str, ...]) -> Record:
    record = _fields(msg, names)
    for name in lists:
        record[name] = list(record[name])
    return record


def _page(record: Record) -> pb.Page:
    return pb.Page(**{name: record[name] for name in PAGE_FIELDS})


def _record_fields(msg: pb.SessionRecord) -> Record:
    record = _fields(msg, RECORD_SCALARS)
    record.update(counters=dict(msg.counters), **{name: list(getattr(msg, name)) for name in RECORD_LISTS})
    return record


def _counts(record: Record) -> pb.PageCounts:
    return pb.PageCounts(**{name: record[name] for name in COUNT_KEYS})


def _session(record: Record) -> pb.Session:
    return pb.Session(**{name: record[name] for name in SESSION_SCALARS}, counters=record["counters"],
                      labels=record["labels"], pages=_counts(record["pages"]))


def _ack(info: CommitInfo, applied: int) -> pb.WriteAck:
    return pb.WriteAck(commit_seq=info.commit_seq, applied=applied, commit_ms=info.commit_ms)


def _status(record: Record) -> pb.StatusReply:
    sessions = [pb.SessionStatus(session_id=s["session_id"], model_id=s["model_id"],
                                 budget_tokens=s["budget_tokens"], attention_tokens=s["attention_tokens"],
                                 turn=s["turn"], pages=_counts(s["pages"]), snapshots=s["snapshots"],
                                 closed=s["closed"], counters=s["counters"]) for s in record["sessions"]]
    scalars = {k: v for k, v in record.items() if k != "sessions"}
    return pb.StatusReply(**scalars, sessions=sessions)


class ContextdService(pb_grpc.ContextdServicer):
    """Each method: validate, call the daemon, convert; errors become gRPC statuses."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._watchers = threading.BoundedSemaphore(MAX_WATCHERS)
        self._stopping = threading.Event()

    def stop_watchers(self) -> None:
        self._stopping.set()

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], R]) -> R:
        try:
            return fn()
        except ContextdError as exc:
            context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}")
        except Exception as exc:  # noqa: BLE001 - the daemon keeps serving whatever one request does
            log.exception("internal error")
            context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
        raise AssertionError("context.abort returned")

    # sessions

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext) -> pb.Session:
        return self._call(context, lambda: _session(self.daemon.open_session(
            {"session_id": request.session_id, "model_id": request.model_id, "fingerprint": request.fingerprint,
             "budget_tokens": request.budget_tokens, "labels": dict(request.labels)})))

    def GetSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.Session:
        return self._call(context, lambda: _session(self.daemon.get_session(request.session_id)))

    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext
                     ) -> pb.ListSessionsResponse:
        return self._call(context, lambda: pb.ListSessionsResponse(
            sessions=[_session(s) for s in self.daemon.list_sessions(request.include_closed)]))

    def CloseSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.Session:
        return self._call(context, lambda: _session(self.daemon.close_session(request.session_id)))

    def DeleteSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.DeleteSessionResponse:
        def run() -> pb.DeleteSessionResponse:
            pages, freed = self.daemon.delete_session(request.session_id)
            return pb.DeleteSessionResponse(pages_deleted=pages, bytes_freed=freed)
        return self._call(context, run)

    # pages

    def UpsertPages(self, request: pb.UpsertPagesRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        pages = [_fields(p, PAGE_FIELDS) for p in request.pages]
        return self._call(context, lambda: _ack(self.daemon.upsert_pages(request.session_id, pages), len(pages)))

    def SetPageStates(self, request: pb.SetPageStatesRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        changes = [{"page_id": c.page_id, "state": c.state, "last_used_turn": c.last_used_turn, "score": c.score}
                   for c in request.changes]
        return self._call(context, lambda: _ack(self.daemon.set_page_states(request.session_id, changes),
                                                len(changes)))

    def DeletePages(self, request: pb.DeletePagesRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        page_ids = list(request.page_ids)
        return self._call(context, lambda: _ack(self.daemon.delete_pages(request.session_id, page_ids),
                                                len(page_ids)))

    def QueryPages(self, request: pb.QueryPagesRequest, context: grpc.ServicerContext) -> pb.QueryPagesResponse:
        def run() -> pb.QueryPagesResponse:
            pages, next_after = self.daemon.query_pages(request.session_id, list(request.states),
                                                        request.start_after, request.limit)
            return pb.QueryPagesResponse(pages=[_page(p) for p in pages], next_after=next_after)
        return self._call(context, run)

    def GetPages(self, request: pb.GetPagesRequest, context: grpc.ServicerContext) -> pb.QueryPagesResponse:
        return self._call(context, lambda: pb.QueryPagesResponse(pages=[
            _page(p) for p in self.daemon.get_pages(request.session_id, list(request.page_ids))]))

    # payloads

    def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        return self._call(context, lambda: _ack(self.daemon.mark_corrupt(
            request.session_id, request.page_id, request.reason), 1))

    def Reclaim(self, request: pb.ReclaimRequest, context: grpc.ServicerContext) -> pb.ReclaimResponse:
        def run() -> pb.ReclaimResponse:
            freed, dropped = self.daemon.reclaim(request.bytes_needed)
            return pb.ReclaimResponse(bytes_freed=freed, free_bytes=self.daemon.blobs.free_bytes(),
                                      reserve_bytes=self.daemon.blobs.reserve_bytes(),
                                      dropped=[pb.PageRef(session_id=s, page_id=p) for s, p in dropped])
        return self._call(context, run)

    # blocks

    def UpsertBlocks(self, request: pb.UpsertBlocksRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        blocks = [_fields_with_lists(b, BLOCK_FIELDS, ("page_ids", "child_ids")) for b in request.blocks]
        return self._call(context, lambda: _ack(self.daemon.upsert_blocks(request.session_id, blocks), len(blocks)))

    def QueryBlocks(self, request: pb.QueryBlocksRequest, context: grpc.ServicerContext) -> pb.QueryBlocksResponse:
        return self._call(context, lambda: pb.QueryBlocksResponse(blocks=[
            pb.Block(**b) for b in self.daemon.query_blocks(request.session_id, request.kind)]))

    # pins, leases

    def SetPins(self, request: pb.SetPinsRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        add = [{"page_id": p.page_id, "kind": p.kind} for p in request.add]
        remove = list(request.remove)
        return self._call(context, lambda: _ack(self.daemon.set_pins(request.session_id, add, remove),
                                                len(add) + len(remove)))

    def QueryPins(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.QueryPinsResponse:
        return self._call(context, lambda: pb.QueryPinsResponse(
            pins=[pb.Pin(**p) for p in self.daemon.query_pins(request.session_id)]))

    def SetLeases(self, request: pb.SetLeasesRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        add = [{"page_id": lease.page_id, "until_turn": lease.until_turn, "expires_unix": lease.expires_unix}
               for lease in request.add]
        remove = list(request.remove)
        return self._call(context, lambda: _ack(self.daemon.set_leases(request.session_id, add, remove),
                                                len(add) + len(remove)))

    def QueryLeases(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.QueryLeasesResponse:
        return self._call(context, lambda: pb.QueryLeasesResponse(
            leases=[pb.Lease(**lease) for lease in self.daemon.query_leases(request.session_id)]))

    # snapshots, records

    def PutSnapshot(self, request: pb.PutSnapshotRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        snapshot = _fields(request.snapshot, SNAPSHOT_FIELDS)
        return self._call(context, lambda: _ack(self.daemon.put_snapshot(request.session_id, snapshot), 1))

    def QuerySnapshots(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.QuerySnapshotsResponse:
        return self._call(context, lambda: pb.QuerySnapshotsResponse(snapshots=[
            pb.Snapshot(**{k: s[k] for k in SNAPSHOT_FIELDS})
            for s in self.daemon.query_snapshots(request.session_id)]))

    def WriteRecord(self, request: pb.WriteRecordRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        record = _record_fields(request.record)
        append = [{"text": s.text, "token_ids": list(s.token_ids), "generated": s.generated, "opener": s.opener}
                  for s in request.append]
        snapshots = [_fields(s, SNAPSHOT_FIELDS) for s in request.snapshots]
        return self._call(context, lambda: _ack(self.daemon.write_record(
            request.session_id, record, request.keep_segments, append, snapshots), len(append)))

    def ReadRecord(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.RecordReply:
        def run() -> pb.RecordReply:
            record, segments = self.daemon.read_record(request.session_id)
            return pb.RecordReply(
                record=pb.SessionRecord(**{k: record[k] for k in RECORD_SCALARS + RECORD_LISTS},
                                        counters=record["counters"]),
                segments=[pb.TranscriptSegment(text=s["text"], token_ids=s["token_ids"], generated=s["generated"],
                                               opener=s["opener"]) for s in segments])
        return self._call(context, run)

    # status, maintenance

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self._call(context, lambda: _status(self.daemon.status(request.session_id, request.include_closed)))

    def WatchStatus(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> Iterator[pb.StatusReply]:
        """One status per commit (coalesced when commits come faster than a reader takes them)."""
        if not self._watchers.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"too many status watchers (at most {MAX_WATCHERS}); poll Status instead")
        try:
            seen = -1
            while context.is_active() and not self._stopping.is_set():
                if seen >= 0:
                    newest = self.daemon.store.wait_for_commit(seen, WATCH_POLL_S)
                    if newest <= seen:
                        continue
                reply = self._call(context, lambda: _status(
                    self.daemon.status(request.session_id, request.include_closed)))
                seen = reply.commit_seq
                yield reply
        finally:
            self._watchers.release()

    def Gc(self, request: pb.GcRequest, context: grpc.ServicerContext) -> pb.GcReply:
        return self._call(context, lambda: pb.GcReply(**self.daemon.gc(request.dry_run)))

    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyReply:
        def run() -> pb.VerifyReply:
            result = self.daemon.verify(request.session_id)
            corrupt = [pb.PageRef(**c) for c in result.pop("corrupt")]
            return pb.VerifyReply(**result, corrupt=corrupt)
        return self._call(context, run)

