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
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import grpc

from contextd._gen import contextd_pb2 as pb
from contextd._gen import contextd_pb2_grpc as pb_grpc
from contextd.blobs import BlobStore, Reserve, StoredBlob
from contextd.errors import BY_CODE, ContextdError, DaemonUnavailable, DataCorrupt, InvalidArgument, StoreFull
from contextd.paths import default_socket, target
from contextd.server import grpc_options

__all__ = ["Client", "Payloads", "pb"]

R = TypeVar("R")
PageState: TypeAlias = pb.PageState


def _raise_typed(exc: grpc.RpcError, socket_path: Path) -> None:
    code = exc.code().name
    detail = exc.details() or code
    if code == "UNAVAILABLE":
        raise DaemonUnavailable(
            f"contextd is not answering on {socket_path} ({detail}); start it with `contextd serve`"
        ) from None
    if code == "RESOURCE_EXHAUSTED" and "message larger than max" in detail:
        raise InvalidArgument(f"request is larger than the transport allows: {detail}") from None
    raise BY_CODE.get(code, ContextdError)(detail) from None


class Client:
    """A connection to one daemon. Thread-safe; cheap calls; reuse one per process."""

    def __init__(self, socket_path: Path | str | None = None, timeout: float = 30.0) -> None:
        self.socket_path = Path(socket_path) if socket_path else default_socket()
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target(self.socket_path), options=grpc_options())
        self._stub = pb_grpc.ContextdStub(self._channel)  # type: ignore[no-untyped-call]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, request: Any, reply: type[R], timeout: float | None = None) -> R:
        try:
            result = getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            _raise_typed(exc, self.socket_path)
            raise AssertionError("unreachable") from None
        assert isinstance(result, reply)
        return result

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

    def update_session(
        self,
        session_id: str,
        *,
        fingerprint: str | None = None,
        turn: int | None = None,
        attention_tokens: int | None = None,
        budget_tokens: int | None = None,
        counters: dict[str, int] | None = None,
    ) -> pb.Session:
        request = pb.UpdateSessionRequest(session_id=session_id, counters=counters or {})
        if fingerprint is not None:
            request.fingerprint = fingerprint
        if turn is not None:
            request.turn = turn
        if attention_tokens is not None:
            request.attention_tokens = attention_tokens
        if budget_tokens is not None:
            request.budget_tokens = budget_tokens
        return self._call("UpdateSession", request, pb.Session)

    def close_session(self, session_id: str) -> pb.Session:
        return self._call("CloseSession", pb.SessionRef(session_id=session_id), pb.Session)

    def delete_session(self, session_id: str) -> pb.DeleteSessionResponse:
        return self._call("DeleteSession", pb.SessionRef(session_id=session_id), pb.DeleteSessionResponse)

    # pages

    def upsert_pages(self, session_id: str, pages: Iterable[pb.Page]) -> pb.WriteAck:
        return self._call(
            "UpsertPages", pb.UpsertPagesRequest(session_id=session_id, pages=list(pages)), pb.WriteAck
        )

    def set_page_states(
        self, session_id: str, changes: Iterable[tuple[str, PageState]], turn: int = 0
    ) -> pb.WriteAck:
        return self._call(
            "SetPageStates",
            pb.SetPageStatesRequest(
                session_id=session_id,
                changes=[
                    pb.PageStateChange(page_id=page_id, state=state, last_used_turn=turn)
                    for page_id, state in changes
                ],
            ),
            pb.WriteAck,
        )

    def delete_pages(self, session_id: str, page_ids: Iterable[str]) -> pb.WriteAck:
        return self._call("DeletePages", pb.DeletePagesRequest(session_id=session_id, page_ids=list(page_ids)),
                          pb.WriteAck)

    def query_pages(
        self, session_id: str, states: Iterable[PageState] = (), page_size: int = 4096
    ) -> list[pb.Page]:
        """Every page of the session in the given states (all states when empty), by page_id."""
        pages: list[pb.Page] = []
        after = ""
        while True:
            reply = self._call(
                "QueryPages",
                pb.QueryPagesRequest(
                    session_id=session_id, states=list(states), start_after=after, limit=page_size
                ),
                pb.QueryPagesResponse,
            )
            pages.extend(reply.pages)
            if not reply.next_after:
                return pages
            after = reply.next_after

    # payloads

    def write_page_data(
        self, session_id: str, page_id: str, data: bytes, dtype: str = "", layer_view: str = ""
    ) -> pb.WriteAck:
        return self._call(
            "WritePageData",
            pb.WritePageDataRequest(
                session_id=session_id, page_id=page_id, data=data, dtype=dtype, layer_view=layer_view
            ),
            pb.WriteAck,
        )

    def read_page_data(self, session_id: str, page_id: str) -> pb.PageData:
        return self._call("ReadPageData", pb.PageRef(session_id=session_id, page_id=page_id), pb.PageData)

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

    # blocks, tags

    def upsert_blocks(self, session_id: str, blocks: Iterable[pb.Block]) -> pb.WriteAck:
        return self._call(
            "UpsertBlocks", pb.UpsertBlocksRequest(session_id=session_id, blocks=list(blocks)), pb.WriteAck
        )

    def query_blocks(self, session_id: str, kind: str = "") -> list[pb.Block]:
        return list(
            self._call(
                "QueryBlocks", pb.QueryBlocksRequest(session_id=session_id, kind=kind), pb.QueryBlocksResponse
            ).blocks
        )

    def set_tags(
        self, session_id: str, add: Iterable[tuple[str, str]] = (), remove: Iterable[tuple[str, str]] = ()
    ) -> pb.WriteAck:
        return self._call(
            "SetTags",
            pb.SetTagsRequest(
                session_id=session_id,
                add=[pb.Tag(block_id=b, tag=t) for b, t in add],
                remove=[pb.Tag(block_id=b, tag=t) for b, t in remove],
            ),
            pb.WriteAck,
        )

    def query_tags(self, session_id: str, tag: str = "", block_id: str = "") -> list[pb.Tag]:
        return list(
            self._call(
                "QueryTags",
                pb.QueryTagsRequest(session_id=session_id, tag=tag, block_id=block_id),
                pb.QueryTagsResponse,
            ).tags
        )

    # pins, leases, scores

    def set_pins(
        self, session_id: str, add: Iterable[tuple[str, str]] = (), remove: Iterable[str] = ()
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

    def set_scores(self, session_id: str, scores: dict[str, float]) -> pb.WriteAck:
        return self._call(
            "SetScores",
            pb.SetScoresRequest(
                session_id=session_id, scores=[pb.Score(page_id=p, usefulness=u) for p, u in scores.items()]
            ),
            pb.WriteAck,
        )

    def query_scores(self, session_id: str) -> dict[str, float]:
        reply = self._call("QueryScores", pb.SessionRef(session_id=session_id), pb.QueryScoresResponse)
        return {s.page_id: s.usefulness for s in reply.scores}

    # ledger, snapshots

    def append_ledger(self, session_id: str, entries: Iterable[pb.LedgerEntry]) -> pb.WriteAck:
        return self._call(
            "AppendLedger", pb.AppendLedgerRequest(session_id=session_id, entries=list(entries)), pb.WriteAck
        )

    def query_ledger(self, session_id: str) -> list[pb.LedgerEntry]:
        return list(
            self._call("QueryLedger", pb.SessionRef(session_id=session_id), pb.QueryLedgerResponse).entries
        )

    def put_snapshot(self, session_id: str, snapshot: pb.Snapshot, data: bytes = b"") -> pb.WriteAck:
        return self._call(
            "PutSnapshot",
            pb.PutSnapshotRequest(session_id=session_id, snapshot=snapshot, data=data),
            pb.WriteAck,
        )

    def query_snapshots(self, session_id: str) -> list[pb.Snapshot]:
        return list(
            self._call(
                "QuerySnapshots", pb.SessionRef(session_id=session_id), pb.QuerySnapshotsResponse
            ).snapshots
        )

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
    """Same-host payload files: write and read without copying through the socket.

    Writes honour the daemon's reserve and quota: when space is short the daemon is asked to
    drop cold pages first, and StoreFull is raised when it cannot. The caller records the
    returned StoredBlob in the manifest with `upsert_pages` (payload first, manifest second, so
    the manifest never points at a file that is not there).
    """

    def __init__(self, client: Client, blobs: BlobStore) -> None:
        self.client = client
        self.blobs = blobs

    def write(self, session_id: str, page_id: str, data: bytes | bytearray | memoryview) -> StoredBlob:
        needed = self.blobs.shortfall(len(data), self.client.status().store_bytes)
        if needed and self.client.reclaim(needed).bytes_freed < needed:
            raise StoreFull(
                f"no room for a {len(data)}-byte page: {needed} bytes short and nothing left to drop"
            )
        return self.blobs.write(session_id, page_id, data)

    def read(self, session_id: str, page: pb.Page) -> bytes:
        """The page's payload, checked; a failure is reported to the daemon and re-raised."""
        try:
            return self.blobs.read(page.locator, page.checksum, page.byte_size)
        except DataCorrupt as exc:
            self.client.report_corrupt(session_id, page.page_id, str(exc))
            raise
