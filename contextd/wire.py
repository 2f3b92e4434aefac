"""What both ends of the socket agree on, besides the generated messages: transport options and
limits, the page-state enum and the pin kinds.

The client imports this module, never the daemon. Depends on the generated contextd._gen modules
only.
"""

from __future__ import annotations

from enum import IntEnum

from contextd._gen import contextd_pb2 as pb

__all__ = ["MAX_BATCH", "MAX_MESSAGE_BYTES", "MAX_SEGMENT_TEXT", "MAX_TEXT", "PIN_KINDS", "PageState",
           "grpc_options"]

# One gRPC message, either way: a whole session's record (the transcript's token ids, 4 bytes a
# token, and its text) of a million-token session fits with room to spare.
MAX_MESSAGE_BYTES = 64 << 20
MAX_BATCH = 65536             # records in one write request
MAX_TEXT = 64 * 1024          # characters of a summary, a reason, a label
MAX_SEGMENT_TEXT = 16 << 20   # characters of one transcript segment (a large tool result)

PIN_KINDS = ("system", "tools", "objective")


class PageState(IntEnum):
    """The proto's PageState, by name and number (the one encoding of a page's state)."""

    HOT = pb.HOT
    COLD = pb.COLD
    PINNED = pb.PINNED
    DROPPED = pb.DROPPED
    CORRUPT = pb.CORRUPT


def grpc_options() -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
