"""What both ends of the socket agree on, besides the generated messages: transport options and
limits, the page-state enum and the pin kinds.

These are the tree's only page-state and pin-kind enums: the controller's pager, serving and the
benchmarks use them too (tests/unit/test_layers.py refuses a second copy), so a state crosses to
contextd as its number and a pin kind as its string without a map. The client imports this
module, never the daemon. Depends on the generated contextd._gen modules only.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum

from contextd._gen import contextd_pb2 as pb

__all__ = ["MAX_BATCH", "MAX_MESSAGE_BYTES", "MAX_SEGMENT_TEXT", "MAX_TEXT", "PageState", "PinKind",
           "grpc_options"]

# One gRPC message, either way: a whole session's record (the transcript's token ids, 4 bytes a
# token, and its text) of a million-token session fits with room to spare.
MAX_MESSAGE_BYTES = 64 << 20
MAX_BATCH = 65536             # records in one write request
MAX_TEXT = 64 * 1024          # characters of a reason, a label
MAX_SEGMENT_TEXT = 16 << 20   # characters of one transcript segment (a large tool result)


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
