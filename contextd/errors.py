"""Typed contextd failures, shared by the daemon and its clients.

Each error maps to one gRPC status code at the socket, and the client maps the code back, so a
caller catches the same class on either side. Depends on nothing of ours.
"""

from __future__ import annotations


class ContextdError(Exception):
    """Base class; `code` names the gRPC status code it travels as."""

    code = "UNKNOWN"


class InvalidArgument(ContextdError):
    """The request is malformed: a bad identifier, a negative or inverted range, a missing field."""

    code = "INVALID_ARGUMENT"


class NotFound(ContextdError):
    """A session, page or block named by the request does not exist."""

    code = "NOT_FOUND"


class FailedPrecondition(ContextdError):
    """The request is well formed but not allowed now (e.g. a page marked cold with no payload)."""

    code = "FAILED_PRECONDITION"


class StoreFull(ContextdError):
    """The canonical store cannot take the write without eating into the free-space reserve,
    and nothing more can be dropped. Nothing already stored was touched."""

    code = "RESOURCE_EXHAUSTED"


class DataCorrupt(ContextdError):
    """A stored payload is missing or failed its checksum; it is marked corrupt and never served."""

    code = "DATA_LOSS"


class DaemonUnavailable(ContextdError):
    """No daemon answers on the socket."""

    code = "UNAVAILABLE"


class TierUnavailable(ContextdError):
    """The object store, the durable tier, did not take or give a payload in time (down, stalled,
    refusing). Nothing was committed: the manifest names only payloads the tier holds, and a
    page whose upload failed stays where it was. ABORTED, not UNAVAILABLE: that one means the
    daemon itself is not answering."""

    code = "ABORTED"


class SessionHeld(ContextdError):
    """Another server holds the session (contextd.handover): it is serving a turn of it now, or it
    took the session over since this server's lease began, and this server's write was refused (a
    fenced, stale holder). Nothing of the refused write reached the object store."""

    code = "PERMISSION_DENIED"


class DeadlineExceeded(ContextdError):
    """The caller's deadline passed before the call could commit, so it committed nothing: the
    client has given up on it (or is about to) and takes it as failed, so a commit after that
    would put in the session what the client thinks is not there (contextd.clock). The same code
    comes back when the client's own deadline ends the call."""

    code = "DEADLINE_EXCEEDED"


class AlreadyRunning(ContextdError):
    """Another daemon already serves this root."""

    code = "ALREADY_EXISTS"


BY_CODE: dict[str, type[ContextdError]] = {
    cls.code: cls
    for cls in (InvalidArgument, NotFound, FailedPrecondition, StoreFull, DataCorrupt, DaemonUnavailable,
                TierUnavailable, SessionHeld, DeadlineExceeded, AlreadyRunning)
}
