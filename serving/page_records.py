"""What contextd's records say about a session's payloads: which stored payload a manifest record
names, whether it is COLD with one, whether it holds this page's history or another's
(`foreign`), and the slots of a hybrid's recurrent snapshots.

Apart from the page mover because recovery (serving.recovery) reads the same records to bring a
session back, and neither should reach into the other for them. Depends on contextd.client's
messages, contextd.wire, controller.pager and serving.session; moves nothing.
"""

from __future__ import annotations

from enum import StrEnum

from contextd.client import pb
from contextd.wire import PageState
from controller.pager import Page
from serving.session import StoredPayload


class SnapshotSlot(StrEnum):
    """The recurrent snapshots a hybrid's session keeps in contextd, by slot name."""

    END_OF_TURN = "recurrent"
    # The state before the newest turn opener. A client that did not receive an answer (a crash
    # after the record was written) re-sends the turn; a hybrid cannot cut its recurrent state
    # back, so without this second slot the whole session would be prefilled again.
    BEFORE_ANSWER = "recurrent-before-answer"


def stored_payload(record: pb.Page) -> StoredPayload:
    """The payload a manifest record names."""
    return StoredPayload(record.locator, record.checksum, record.byte_size, record.prefix_hash)


def foreign(page: Page, payload: StoredPayload) -> str:
    """Why `payload` is not `page`'s (its record names another history than the session's
    transcript gives the page), or "". The checksum, the model and the page's own token ids
    cannot tell: after an edit that keeps the token count, a later page holds the same tokens
    with K/V computed after other ones. A page recovery found under the id an earlier version
    of kv-elision gave it (`Page.stored_as`) may have no prefix hash (partial pages and stores
    from before contextd's schema 4 had none); its token ids are then all there is to check."""
    if payload.prefix_hash == page.prefix_hash or (page.stored_as and not payload.prefix_hash):
        return ""
    return (f"its payload holds K/V computed after another history (prefix hash "
            f"{payload.prefix_hash or 'none'}, where the session's transcript gives {page.prefix_hash})")


def cold_payload(record: pb.Page | None) -> StoredPayload | None:
    """The payload of a page contextd holds COLD with one, else None: what a restore or a score reads."""
    if record is None or PageState(record.state) is not PageState.COLD or not record.locator:
        return None
    return stored_payload(record)
