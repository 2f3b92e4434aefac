"""What both ends of the socket agree on, besides the generated messages: transport options and
limits, the page-state enum and the pin kinds.

These are the tree's only page-state and pin-kind enums: the controller's pager, serving and the
benchmarks use them too (tests/unit/test_layers.py refuses a second copy), so a state crosses to
contextd as its number and a pin kind as its string without a map. The client imports this
module, never the daemon. Depends on the generated contextd._gen modules only.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum, StrEnum

from contextd._gen import contextd_pb2 as pb

__all__ = ["MAX_BATCH", "MAX_MESSAGE_BYTES", "MAX_MESSAGE_HASH", "MAX_SEGMENT_TEXT", "MAX_TEXT", "PageState",
           "PinKind", "grpc_options", "record_refusal"]

# One gRPC message, either way: a whole session's record (the transcript's token ids, 4 bytes a
# token, and its text) of a million-token session fits with room to spare.
MAX_MESSAGE_BYTES = 64 << 20
MAX_BATCH = 65536             # records in one write request
MAX_TEXT = 64 * 1024          # characters of a reason, a label
MAX_SEGMENT_TEXT = 16 << 20   # characters of one transcript segment (a large tool result)
MAX_MESSAGE_HASH = 128        # characters of one of the client's message hashes in a session record


class PageState(IntEnum):
    """The proto's PageState, by name and number: where a page's K/V are. Pinned and leased are
    not states but rows in the pins and leases tables: a pinned page is HOT."""

    HOT = pb.HOT
    COLD = pb.COLD
    DROPPED = pb.DROPPED
    CORRUPT = pb.CORRUPT


class PinKind(StrEnum):
    """A hard pin's kind, as the proto's Pin.kind spells it: the system prompt, the tool schemas,
    the opening objective."""

    SYSTEM = "system"
    TOOLS = "tools"
    OBJECTIVE = "objective"


def grpc_options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


def record_refusal(message_hashes: Sequence[str], segment_texts: Sequence[str]) -> str:
    """Why WriteRecord refuses a session record holding the client's `message_hashes` with new
    transcript segments of `segment_texts` ("" when it takes them). Both ends apply this one
    rule: contextd at the commit, and the server before a turn stores anything, so input from a
    client that contextd would refuse at the end of the turn fails the turn before any durable
    change (the turn's record is its last write)."""
    if len(message_hashes) > MAX_BATCH or max(map(len, message_hashes), default=0) > MAX_MESSAGE_HASH:
        return f"message_hashes holds at most {MAX_BATCH} strings of at most {MAX_MESSAGE_HASH} characters"
    if len(segment_texts) > MAX_BATCH:
        return f"{len(segment_texts)} segments in one request; at most {MAX_BATCH} are allowed"
    longest = max(map(len, segment_texts), default=0)
    if longest > MAX_SEGMENT_TEXT:
        return f"segment text is {longest} characters long; at most {MAX_SEGMENT_TEXT} are allowed"
    return ""
