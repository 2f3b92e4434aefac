"""The one typed contextd client: the engine, the CLI, tests and status readers all use it.

Calls return the generated protobuf messages; failures raise the contextd error classes (the
gRPC status code is mapped back), so a caller never handles grpc.RpcError. For payloads on the
same host, `payloads()` gives direct file access to the canonical store (no copy through the
socket) with the same checksums and the daemon's reserve, which is how the engine restores a
page in a few milliseconds.

Depends on contextd.errors, contextd.blobs, contextd.paths and the generated modules.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc

from contextd._gen import contextd_pb2 as pb
from contextd._gen import contextd_pb2_grpc as pb_grpc
from contextd.blobs import BlobStore, Reserve, StoredBlob
from contextd.errors import BY_CODE, ContextdError, DaemonUnavailable, InvalidArgument, StoreFull
from contextd.paths import default_socket, target
from contextd.wire import MAX_MESSAGE_BYTES, PageState, PinKind, grpc_options

__all__ = ["Client", "Payloads", "Pending", "pb"]

R = TypeVar("R")


def _raise_typed(exc: grpc.RpcError, socket_path: Path) -> None:
    """The contextd error class of the call's status code (requests over the transport's limit
    are refused before they are sent, so RESOURCE_EXHAUSTED is always the store's)."""
    code = exc.code().name
    detail = exc.details() or code
    if code == "UNAVAILABLE":
        raise DaemonUnavailable(
            f"contextd is not answering on {socket_path} ({detail}); start it with `contextd serve`"
        ) from None
    raise BY_CODE.get(code, ContextdError)(detail) from None


class Pending(Generic[R]):
    """A call under way; `result()` waits for its reply or raises its contextd error."""

    def __init__(self, future: grpc.Future, reply: type[R], socket_path: Path) -> None:
        self._future = future
        self._reply = reply
        self._socket_path = socket_path

    def result(self) -> R:
        try:
            result = self._future.result()
        except grpc.RpcError as exc:
            _raise_typed(exc, self._socket_path)
            raise AssertionError("unreachable") from None
        assert isinstance(result, self._reply)
        return result


# How soon a channel tries the socket again after contextd went away. gRPC's default backoff (1 s,
# x1.6 per attempt, up to 120 s) would keep failing calls for minutes after a long outage although
# the daemon is back; a connect on a local socket is cheap, so try every quarter second at most.
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
             ("grpc.max_reconnect_backoff_ms", 250)]


class Client:
    """A connection to one daemon. Thread-safe; cheap calls; reuse one per process."""

    def __init__(self, socket_path: Path | str | None = None, timeout: float = 30.0) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket()
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target(self.socket_path), options=grpc_options() + RECONNECT)
        self._stub = pb_grpc.ContextdStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, reply: type[R], timeout: float | None = None) -> R:
        self._check_size(method, request)
        try:
            result = getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            _raise_typed(exc, self.socket_path)
            raise AssertionError("unreachable") from None
        assert isinstance(result, reply)
        return result

    def _start(self, method: str, request: Any, reply: type[R]) -> Pending[R]:
        """Send a call and return at once: gRPC's own threads carry it, so the caller's work
        beside it does not share the interpreter lock with a Python thread making the call."""
        self._check_size(method, request)
        return Pending(getattr(self._stub, method).future(request, timeout=self.timeout), reply, self.socket_path)

    @staticmethod
    def _check_size(method: str, request: Any) -> None:
        size = request.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise InvalidArgument(f"{method} request of {size} bytes is over the transport's {MAX_MESSAGE_BYTES}")

    def wait_ready(self, timeout: float = 30.0) -> pb.StatusReply:
        """Block until the daemon answers Status, or raise DaemonUnavailable."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                reply: pb.StatusReply = self._call("Status", pb.StatusRequest(), pb.StatusReply, timeout=2.0)
                return reply
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    # sessions

    def open_session(
        self,
        session_id: str,
        model_id: str = "",
        fingerprint: str = "",
        budget_tokens: int = 0,
        labels: dict[str, str] | None = None,
    ) -> pb.Session:
        return self._call(
            "OpenSession",
            pb.OpenSessionRequest(
                session_id=session_id,
                model_id=model_id,
                fingerprint=fingerprint,
                budget_tokens=budget_tokens,
                labels=labels or {},
            ),
            pb.Session,
        )

    def get_session(self, session_id: str) -> pb.Session:
        return self._call("GetSession", pb.SessionRef(session_id=session_id), pb.Session)

    def list_sessions(self, include_closed: bool = False) -> list[pb.Session]:
        return list(
            self._call(
                "ListSessions", pb.ListSessionsRequest(include_closed=include_closed), pb.ListSessionsResponse
            ).sessions
        )

    def close_session(self, session_id: str) -> pb.Session:
        return self._call("CloseSession", pb.SessionRef(session_id=session_id), pb.Session)

    def delete_session(self, session_id: str) -> pb.DeleteSessionResponse:
        return self._call("DeleteSession", pb.SessionRef(session_id=session_id), pb.DeleteSessionResponse)

    # branches

    def find_prefix(self, model_id: str, fingerprint: str, prefix_hashes: Sequence[str]) -> pb.FindPrefixResponse:
        """The session whose stored pages begin `prefix_hashes` furthest, and how many pages."""
        return self._call("FindPrefix", pb.FindPrefixRequest(model_id=model_id, fingerprint=fingerprint,
                                                             prefix_hashes=list(prefix_hashes)), pb.FindPrefixResponse)

    def branch_session(self, session_id: str, parent_id: str) -> pb.BranchSessionResponse:
        """Make `session_id` a copy of `parent_id` that shares its payloads."""
        return self._call("BranchSession", pb.BranchSessionRequest(session_id=session_id, parent_id=parent_id),
                          pb.BranchSessionResponse)

    def hold_session(self, session_id: str, model_id: str = "", lease_s: float = 30.0,
                     renew: bool = False, release: bool = False) -> pb.HoldSessionResponse:
        """Hold `session_id` for a turn of `lease_s` seconds; `adopted` when it changed hands to this
        daemon. With `renew`, only this daemon's own lease is renewed (SessionHeld otherwise); with
        `release`, it ends now."""
        return self._call("HoldSession", pb.HoldSessionRequest(session_id=session_id, model_id=model_id,
                                                               lease_s=lease_s, renew=renew, release=release),
                          pb.HoldSessionResponse)

    # pages

    def upsert_pages(self, session_id: str, pages: Iterable[pb.Page]) -> pb.WriteAck:
        return self._call(
            "UpsertPages", pb.UpsertPagesRequest(session_id=session_id, pages=list(pages)), pb.WriteAck
        )

    def set_page_states(self, session_id: str, changes: Iterable[pb.PageStateChange],
                        leases: Iterable[pb.Lease] = ()) -> pb.WriteAck:
        """Page state changes and, in the same commit, leases put on pages."""
        return self.start_set_page_states(session_id, changes, leases).result()

    def start_set_page_states(self, session_id: str, changes: Iterable[pb.PageStateChange],
                              leases: Iterable[pb.Lease] = ()) -> Pending[pb.WriteAck]:
        """`set_page_states`, sent without waiting for the reply."""
        return self._start("SetPageStates", pb.SetPageStatesRequest(session_id=session_id, changes=list(changes),
                                                                    leases=list(leases)), pb.WriteAck)

    def delete_pages(self, session_id: str, page_ids: Iterable[str]) -> pb.WriteAck:
        return self._call("DeletePages", pb.DeletePagesRequest(session_id=session_id, page_ids=list(page_ids)),
                          pb.WriteAck)

    def get_pages(self, session_id: str, page_ids: Iterable[str]) -> list[pb.Page]:
        """The named pages that exist, in the order asked."""
        return list(self.start_get_pages(session_id, page_ids).result().pages)

    def start_get_pages(self, session_id: str, page_ids: Iterable[str]) -> Pending[pb.QueryPagesResponse]:
        """`get_pages`, sent without waiting for the reply (its `.pages`): with an object store,
        contextd brings the payloads into the folder meanwhile."""
        return self._start("GetPages", pb.GetPagesRequest(session_id=session_id, page_ids=list(page_ids)),
                           pb.QueryPagesResponse)

    def query_pages(
        self, session_id: str, states: Iterable[PageState] = (), page_size: int = 4096
    ) -> list[pb.Page]:
        """Every page of the session in the given states (all states when empty), by page_id."""
        pages: list[pb.Page] = []
        after = ""
        wanted = [s.name for s in states]
        while True:
            reply = self._call(
                "QueryPages",
                pb.QueryPagesRequest(
                    session_id=session_id, states=wanted, start_after=after, limit=page_size
                ),
                pb.QueryPagesResponse,
            )
            pages.extend(reply.pages)
            if not reply.next_after:
                return pages
            after = reply.next_after

    # payloads

    def report_corrupt(self, session_id: str, page_id: str, reason: str) -> pb.WriteAck:
        return self._call(
            "ReportCorrupt",
            pb.ReportCorruptRequest(session_id=session_id, page_id=page_id, reason=reason),
            pb.WriteAck,
        )

    def reclaim(self, bytes_needed: int) -> pb.ReclaimResponse:
        return self._call("Reclaim", pb.ReclaimRequest(bytes_needed=bytes_needed), pb.ReclaimResponse)

    def payloads(self) -> Payloads:
        """Direct access to the daemon's canonical store (same host only)."""
        status = self.status()
        reserve = Reserve(bytes=status.reserve_bytes, quota_bytes=status.quota_bytes)
        return Payloads(self, BlobStore(Path(status.root) / "store", reserve))

    # pins, leases

    def set_pins(
        self, session_id: str, add: Iterable[tuple[str, PinKind]] = (), remove: Iterable[str] = ()
    ) -> pb.WriteAck:
        return self._call(
            "SetPins",
            pb.SetPinsRequest(
                session_id=session_id, add=[pb.Pin(page_id=p, kind=k) for p, k in add], remove=list(remove)
            ),
            pb.WriteAck,
        )

    def query_pins(self, session_id: str) -> list[pb.Pin]:
        return list(self._call("QueryPins", pb.SessionRef(session_id=session_id), pb.QueryPinsResponse).pins)

    def set_leases(
        self, session_id: str, add: Iterable[pb.Lease] = (), remove: Iterable[str] = ()
    ) -> pb.WriteAck:
        return self._call(
            "SetLeases",
            pb.SetLeasesRequest(session_id=session_id, add=list(add), remove=list(remove)),
            pb.WriteAck,
        )

    def query_leases(self, session_id: str) -> list[pb.Lease]:
        return list(
            self._call("QueryLeases", pb.SessionRef(session_id=session_id), pb.QueryLeasesResponse).leases
        )

    # snapshots, records

    def put_snapshot(self, session_id: str, snapshot: pb.Snapshot) -> pb.WriteAck:
        return self._call("PutSnapshot", pb.PutSnapshotRequest(session_id=session_id, snapshot=snapshot), pb.WriteAck)

    def query_snapshots(self, session_id: str) -> list[pb.Snapshot]:
        return list(
            self._call(
                "QuerySnapshots", pb.SessionRef(session_id=session_id), pb.QuerySnapshotsResponse
            ).snapshots
        )

    def write_record(self, session_id: str, record: pb.SessionRecord, keep_segments: int,
                     append: Iterable[pb.TranscriptSegment], snapshots: Iterable[pb.Snapshot] = ()) -> pb.WriteAck:
        return self._call("WriteRecord", pb.WriteRecordRequest(
            session_id=session_id, record=record, keep_segments=keep_segments, append=list(append),
            snapshots=list(snapshots)), pb.WriteAck)

    def read_record(self, session_id: str) -> pb.RecordReply:
        return self._call("ReadRecord", pb.SessionRef(session_id=session_id), pb.RecordReply)

    # status, maintenance

    def status(self, session_id: str = "", include_closed: bool = False) -> pb.StatusReply:
        return self._call(
            "Status", pb.StatusRequest(session_id=session_id, include_closed=include_closed), pb.StatusReply
        )

    def watch_status(self, session_id: str = "", include_closed: bool = False) -> Iterator[pb.StatusReply]:
        """Status now, then once per commit, until the daemon stops or the caller breaks off."""
        stream = self._stub.WatchStatus(
            pb.StatusRequest(session_id=session_id, include_closed=include_closed)
        )
        try:
            yield from stream
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return
            _raise_typed(exc, self.socket_path)
        finally:
            stream.cancel()

    def gc(self, dry_run: bool = False) -> pb.GcReply:
        return self._call("Gc", pb.GcRequest(dry_run=dry_run), pb.GcReply, timeout=600.0)

    def verify(self, session_id: str = "") -> pb.VerifyReply:
        return self._call("Verify", pb.VerifyRequest(session_id=session_id), pb.VerifyReply, timeout=3600.0)


class Payloads:
    """Same-host payload files: written and read without copying them through the socket.

    Writes honour the daemon's reserve and quota: when space is short the daemon is asked to
    drop cold pages first, and StoreFull is raised when it cannot. The caller records the
    returned StoredBlob in the manifest with `upsert_pages` / `put_snapshot` (payload first,
    manifest second, so the manifest never points at a file that is not there). Readers verify
    the manifest's checksum themselves (backends' block reader does it while streaming) and
    report a mismatch with `report_corrupt`.
    """

    def __init__(self, client: Client, blobs: BlobStore) -> None:
        self.client = client
        self.blobs = blobs

    def write(self, session_id: str, name: str, data: bytes | Sequence[memoryview], suffix: str = "kv",
              sync_folder: bool = True) -> StoredBlob:
        size = len(data) if isinstance(data, bytes) else sum(len(memoryview(p).cast("B")) for p in data)
        # The store's own size only matters under a quota; free space is read here, not asked for.
        store_bytes = self.client.status().store_bytes if self.blobs.reserve.quota_bytes else 0
        needed = self.blobs.shortfall(size, store_bytes)
        if needed and self.client.reclaim(needed).bytes_freed < needed:
            raise StoreFull(f"no room for a {size}-byte payload: {needed} bytes short and nothing left to drop")
        return self.blobs.write(session_id, name, data, suffix, sync_folder)

    def sync_folder(self, session_id: str) -> None:
        """Make the names of payloads written with `sync_folder=False` durable (before recording them)."""
        self.blobs.sync_folder(session_id)

    def path(self, locator: str) -> Path:
        return self.blobs.path(locator)
