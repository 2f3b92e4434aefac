"""The gRPC edge: proto messages in, daemon verbs called, proto messages out.

Every request is validated before it reaches the store (the daemon re-checks what it must), and
every failure leaves as a gRPC status with a message a person can act on: typed contextd errors
map to their codes, anything unexpected to INTERNAL with the daemon still serving.

Rows (contextd.records) carry their message's field names, so one pair of functions converts
every message to its row and back by name: `_row` (repeated fields to tuples, maps to dicts, enum
numbers to the wire.py enums, refusing unknown numbers) and `_message`; a pin's kind is parsed
into wire.PinKind the same way.

Depends on contextd.daemon, contextd.pages (Mark: a pin or a lease), contextd.records,
contextd.store (the pins and leases tables), contextd.wire, contextd.errors and the generated
contextd._gen modules.
"""

from __future__ import annotations

import logging
import re
import threading
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields, is_dataclass
from enum import Enum, IntEnum
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from contextd._gen import contextd_pb2 as pb
from contextd._gen import contextd_pb2_grpc as pb_grpc
from contextd.clock import Deadline, within
from contextd.daemon import Daemon
from contextd.errors import ContextdError, InvalidArgument
from contextd.pages import Mark
from contextd.records import (
    LeaseRow,
    PageRow,
    PinRow,
    RecordRow,
    SegmentRow,
    SnapshotRow,
    StateChange,
)
from contextd.store import LEASES, PINS, CommitInfo, Table
from contextd.wire import PageState, PinKind

log = logging.getLogger("contextd")

MAX_WATCHERS = 32
WATCH_POLL_S = 0.5

R = TypeVar("R")
M = TypeVar("M", bound=Message)

_HINTS: dict[type, dict[str, Any]] = {}


def _enum(kind: type[Enum], value: int | str, what: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        words = " ".join(re.findall("[A-Z][a-z]*", kind.__name__)).lower()
        raise InvalidArgument(f"{what}: unknown {words} {value!r}") from None


def _row(row_type: type[R], msg: Message, what: str, **given: Any) -> R:
    """The row of `msg`'s fields of the same names; `given` fields are taken as they are. A row
    field the message lacks keeps its default."""
    if row_type not in _HINTS:
        _HINTS[row_type] = typing.get_type_hints(row_type)
    hints = _HINTS[row_type]
    values = dict(given)
    for f in fields(row_type):  # type: ignore[arg-type]
        if f.name in values or f.name not in msg.DESCRIPTOR.fields_by_name:
            continue
        value, hint = getattr(msg, f.name), hints[f.name]
        origin = typing.get_origin(hint)
        if origin is tuple:
            value = tuple(value)
        elif origin is dict:
            value = dict(value)
        elif isinstance(hint, type) and issubclass(hint, IntEnum):
            value = _enum(hint, value, what)
        values[f.name] = value
    return row_type(**values)


def _plain(value: Any) -> Any:
    """A row's value as a message constructor takes it."""
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _message(msg_type: type[M], row: Any, **given: Any) -> M:
    """The message of `row`'s fields of the same names (those the message has), and `given`."""
    names = msg_type.DESCRIPTOR.fields_by_name
    return msg_type(**{f.name: _plain(getattr(row, f.name)) for f in fields(row) if f.name in names}, **given)


def _page(msg: pb.Page) -> PageRow:
    """A page as the engine sent it; an unset state is HOT."""
    return _row(PageRow, msg, f"page {msg.page_id}", state=_enum(PageState, msg.state or PageState.HOT,
                                                                  f"page {msg.page_id}"))


def _ack(info: CommitInfo, applied: int) -> pb.WriteAck:
    return pb.WriteAck(commit_seq=info.commit_seq, applied=applied, commit_ms=info.commit_ms)


class ContextdService(pb_grpc.ContextdServicer):
    """Each method: validate, call the daemon, convert; errors become gRPC statuses."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._watchers = threading.BoundedSemaphore(MAX_WATCHERS)
        self._stopping = threading.Event()

    def stop_watchers(self) -> None:
        self._stopping.set()

    def _call(self, context: grpc.ServicerContext, fn: Callable[[], R]) -> R:
        """`fn` within the call's deadline (contextd.clock: every wait of the call honours it, and
        nothing commits after it); its errors become gRPC statuses."""
        try:
            with within(Deadline.after(self.daemon.config.clock, context.time_remaining())):
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
        return self._call(context, lambda: _message(pb.Session, self.daemon.open_session(
            request.session_id, request.model_id, request.fingerprint, request.budget_tokens, request.labels)))

    def GetSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.Session:
        return self._call(context, lambda: _message(pb.Session, self.daemon.get_session(request.session_id)))

    def ListSessions(self, request: pb.ListSessionsRequest, context: grpc.ServicerContext
                     ) -> pb.ListSessionsResponse:
        return self._call(context, lambda: pb.ListSessionsResponse(
            sessions=[_message(pb.Session, s) for s in self.daemon.list_sessions(request.include_closed)]))

    def CloseSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.Session:
        return self._call(context, lambda: _message(pb.Session, self.daemon.close_session(request.session_id)))

    def DeleteSession(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.DeleteSessionResponse:
        def run() -> pb.DeleteSessionResponse:
            pages, freed = self.daemon.delete_session(request.session_id)
            return pb.DeleteSessionResponse(pages_deleted=pages, bytes_freed=freed)
        return self._call(context, run)

    # branches

    def FindPrefix(self, request: pb.FindPrefixRequest, context: grpc.ServicerContext) -> pb.FindPrefixResponse:
        def run() -> pb.FindPrefixResponse:
            session_id, pages = self.daemon.find_prefix(request.model_id, request.fingerprint,
                                                        list(request.prefix_hashes))
            return pb.FindPrefixResponse(session_id=session_id, pages=pages)
        return self._call(context, run)

    def BranchSession(self, request: pb.BranchSessionRequest, context: grpc.ServicerContext
                      ) -> pb.BranchSessionResponse:
        def run() -> pb.BranchSessionResponse:
            branch = self.daemon.branch_session(request.session_id, request.parent_id)
            return pb.BranchSessionResponse(session=_message(pb.Session, branch.session), pages=branch.pages,
                                            shared_bytes=branch.shared_bytes)
        return self._call(context, run)

    def HoldSession(self, request: pb.HoldSessionRequest, context: grpc.ServicerContext) -> pb.HoldSessionResponse:
        def run() -> pb.HoldSessionResponse:
            hold = self.daemon.hold_session(request.session_id, request.model_id, request.lease_s or 30.0,
                                            renew=request.renew, release=request.release)
            return pb.HoldSessionResponse(token=hold.token, adopted=hold.adopted, previous_node=hold.previous_node)
        return self._call(context, run)

    # pages

    def UpsertPages(self, request: pb.UpsertPagesRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        return self._call(context, lambda: _ack(self.daemon.upsert_pages(
            request.session_id, [_page(p) for p in request.pages]), len(request.pages)))

    def SetPageStates(self, request: pb.SetPageStatesRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        return self._call(context, lambda: _ack(self.daemon.set_page_states(
            request.session_id, [_row(StateChange, c, f"page {c.page_id}") for c in request.changes],
            [(lease.page_id, _row(LeaseRow, lease, f"lease on {lease.page_id}")) for lease in request.leases]),
            len(request.changes) + len(request.leases)))

    def DeletePages(self, request: pb.DeletePagesRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        page_ids = list(request.page_ids)
        return self._call(context, lambda: _ack(self.daemon.delete_pages(request.session_id, page_ids),
                                                len(page_ids)))

    def QueryPages(self, request: pb.QueryPagesRequest, context: grpc.ServicerContext) -> pb.QueryPagesResponse:
        def run() -> pb.QueryPagesResponse:
            states = [_enum(PageState, s, "query") for s in request.states]
            pages, next_after = self.daemon.query_pages(request.session_id, states, request.start_after,
                                                        request.limit)
            return pb.QueryPagesResponse(pages=[_message(pb.Page, p) for p in pages], next_after=next_after)
        return self._call(context, run)

    def GetPages(self, request: pb.GetPagesRequest, context: grpc.ServicerContext) -> pb.QueryPagesResponse:
        return self._call(context, lambda: pb.QueryPagesResponse(pages=[
            _message(pb.Page, p) for p in self.daemon.get_pages(request.session_id, list(request.page_ids))]))

    # payloads

    def ReportCorrupt(self, request: pb.ReportCorruptRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        return self._call(context, lambda: _ack(*self.daemon.report_corrupt(
            request.session_id, request.page_id, request.reason)))

    def Reclaim(self, request: pb.ReclaimRequest, context: grpc.ServicerContext) -> pb.ReclaimResponse:
        def run() -> pb.ReclaimResponse:
            freed, dropped = self.daemon.reclaim(request.bytes_needed)
            return pb.ReclaimResponse(bytes_freed=freed, free_bytes=self.daemon.blobs.free_bytes(),
                                      reserve_bytes=self.daemon.blobs.reserve_bytes(),
                                      dropped=[pb.PageRef(session_id=s, page_id=p) for s, p in dropped])
        return self._call(context, run)

    # pins, leases: one table of marks on pages each

    def _set_marks(self, context: grpc.ServicerContext, table: Table[Any, Mark], session_id: str,
                   add: Callable[[], list[tuple[str, Mark]]], remove: Sequence[str]) -> pb.WriteAck:
        """`add` parses the marks to add inside the call, so a malformed one is INVALID_ARGUMENT."""
        def run() -> pb.WriteAck:
            marks = add()
            return _ack(self.daemon.set_marks(table, session_id, marks, list(remove)), len(marks) + len(remove))
        return self._call(context, run)

    def SetPins(self, request: pb.SetPinsRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        return self._set_marks(context, PINS, request.session_id, lambda: [
            (p.page_id, PinRow(_enum(PinKind, p.kind, f"pin on {p.page_id}"))) for p in request.add], request.remove)

    def SetLeases(self, request: pb.SetLeasesRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        return self._set_marks(context, LEASES, request.session_id, lambda: [
            (lease.page_id, _row(LeaseRow, lease, f"lease on {lease.page_id}")) for lease in request.add],
            request.remove)

    def QueryPins(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.QueryPinsResponse:
        return self._call(context, lambda: pb.QueryPinsResponse(pins=[
            _message(pb.Pin, pin, page_id=page_id) for page_id, pin in self.daemon.query_marks(PINS, request.session_id)
        ]))

    def QueryLeases(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.QueryLeasesResponse:
        return self._call(context, lambda: pb.QueryLeasesResponse(leases=[
            _message(pb.Lease, lease, page_id=page_id)
            for page_id, lease in self.daemon.query_marks(LEASES, request.session_id)]))

    # snapshots, records

    def PutSnapshot(self, request: pb.PutSnapshotRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        return self._call(context, lambda: _ack(self.daemon.put_snapshot(
            request.session_id, _row(SnapshotRow, request.snapshot, "snapshot")), 1))

    def QuerySnapshots(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.QuerySnapshotsResponse:
        return self._call(context, lambda: pb.QuerySnapshotsResponse(snapshots=[
            _message(pb.Snapshot, s) for s in self.daemon.query_snapshots(request.session_id)]))

    def WriteRecord(self, request: pb.WriteRecordRequest, context: grpc.ServicerContext) -> pb.WriteAck:
        return self._call(context, lambda: _ack(self.daemon.write_record(
            request.session_id, _row(RecordRow, request.record, "record"), request.keep_segments,
            [_row(SegmentRow, s, "segment") for s in request.append],
            [_row(SnapshotRow, s, "snapshot") for s in request.snapshots]), len(request.append)))

    def ReadRecord(self, request: pb.SessionRef, context: grpc.ServicerContext) -> pb.RecordReply:
        def run() -> pb.RecordReply:
            record, segments = self.daemon.read_record(request.session_id)
            return pb.RecordReply(record=_message(pb.SessionRecord, record),
                                  segments=[_message(pb.TranscriptSegment, s) for s in segments])
        return self._call(context, run)

    # status, maintenance

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusReply:
        return self._call(context, lambda: _message(pb.StatusReply, self.daemon.status(
            request.session_id, request.include_closed)))

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
                reply = self._call(context, lambda: _message(pb.StatusReply, self.daemon.status(
                    request.session_id, request.include_closed)))
                seen = reply.commit_seq
                yield reply
        finally:
            self._watchers.release()

    def Gc(self, request: pb.GcRequest, context: grpc.ServicerContext) -> pb.GcReply:
        return self._call(context, lambda: _message(pb.GcReply, self.daemon.gc(request.dry_run)))

    def Verify(self, request: pb.VerifyRequest, context: grpc.ServicerContext) -> pb.VerifyReply:
        return self._call(context, lambda: _message(pb.VerifyReply, self.daemon.verify(request.session_id)))
