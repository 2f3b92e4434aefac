"""The payloads as the verbs see them, with or without an object store behind the folder.

Without an object store the folder (contextd.blobs) is the canonical store. With one
(contextd.tiering), payloads are uploaded before the commit that names them, brought back into the
folder by the reads that name them, and deleted from both tiers; the folder is then a bounded
cache. A payload's object is deleted only once a publish stops naming it (contextd.handover):
the state the holder names until then still names it, and an adopter must find it. `Payloads`
keeps those deferred deletes, per session, until contextd.holds publishes or adopts the session,
contextd.sessions deletes it, or contextd.retention's `gc` asks what they still name.

The verbs call `commit` before a commit names payloads, `delete` after a commit stopped naming
them and `fetch` before a reader opens them, so the order that keeps the manifest from ever
naming a payload that is not stored lives here once.

Depends on contextd.blobs, contextd.tiering and contextd.errors; never on the store or a verb's
module (it sees locators, not rows).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from contextd.blobs import BlobStore
from contextd.errors import DataCorrupt
from contextd.tiering import ObjectTier, Wanted


class Payloads:
    """The folder (`blobs`) and, with an object store, the tier in front of it (`tier`)."""

    def __init__(self, blobs: BlobStore, tier: ObjectTier | None) -> None:
        self.blobs = blobs
        self.tier = tier
        # session -> payload objects its manifest stopped naming, deleted at its next publish
        self._unpublished: dict[str, set[str]] = {}
        self._unpublished_lock = threading.Lock()

    def commit(self, locators: Sequence[str]) -> None:
        """Before a commit names them: the payloads are in the durable tier (uploaded, with an
        object store; already, without)."""
        if self.tier is not None and locators:
            self.tier.commit(locators)

    def delete(self, locators: Sequence[str]) -> int:
        """After a commit stopped naming them: the payloads' files go; the folder's bytes freed.
        With an object store their objects go at the session's next publish, not now: the state
        the holder names until then still names them, and an adopter must find them."""
        if self.tier is None:
            return sum(self.blobs.delete(locator) for locator in locators)
        with self._unpublished_lock:
            for locator in locators:
                self._unpublished.setdefault(locator.split("/", 1)[0], set()).add(locator)
        return self.tier.uncache(locators)

    def discard(self, locators: Sequence[str]) -> None:
        """Payloads no committed row names, or no longer names in any state an adopter can read:
        gone from both tiers now."""
        if self.tier is not None:
            self.tier.delete(locators)
        else:
            for locator in locators:
                self.blobs.delete(locator)

    def fetch(self, wanted: Sequence[Wanted], hold: bool = True) -> dict[str, str]:
        """Before a reader opens them: the payloads are in the folder (downloaded, with an object
        store), and with `hold` they stay there a while for a reader after this call (ObjectTier.fetch).
        Returns those the object store lost or holds other bytes of (locator -> why): they
        stay out of the folder, and their pages are marked corrupt by the caller."""
        if self.tier is None or not wanted:
            return {}
        return self.tier.fetch(wanted, hold)

    def share(self, locators: Sequence[str], session_id: str) -> dict[str, str]:
        """The payloads as `session_id`'s too (a branch): hard links in its folder, or with an
        object store copies in both tiers; locator -> the new session's locator."""
        if self.tier is None:
            return self.blobs.link(locators, session_id)
        return self.tier.copy(locators, session_id)

    def damaged_in_folder(self, wanted: Wanted) -> bool:
        """Whether the folder's copy of a payload is missing or fails its size or checksum."""
        locator, size, checksum = wanted
        try:
            self.blobs.read(locator, checksum, size)
        except DataCorrupt:
            return True
        return False

    def refetch(self, wanted: Wanted, hold: bool = True) -> dict[str, str]:
        """With an object store, after the folder's copy failed its checks: that copy goes and the
        object store's is fetched, checked, in its place; what `fetch` returns."""
        assert self.tier is not None
        self.tier.uncache([wanted[0]])
        return self.tier.fetch([wanted], hold)

    def check(self, wanted: Wanted) -> None:
        """Read a payload whole and check its size and checksum (verify); DataCorrupt when it is
        lost. With an object store a folder copy that is missing or damaged is not a loss: it goes,
        and the object store's copy is fetched and checked in its place. Nothing is held for a
        reader afterwards: this is the read."""
        locator, size, checksum = wanted
        for reason in self.fetch([wanted], hold=False).values():
            raise DataCorrupt(reason)
        try:
            self.blobs.read(locator, checksum, size)
        except DataCorrupt:
            if self.tier is None:
                raise
            for reason in self.refetch(wanted, hold=False).values():
                raise DataCorrupt(reason) from None

    def take_unpublished(self, session_id: str) -> set[str]:
        """The session's deferred deletes, no longer deferred: the caller deletes what of them no
        state names (a publish, an adoption) or the whole session."""
        with self._unpublished_lock:
            return self._unpublished.pop(session_id, set())

    def unpublished(self, session_id: str) -> set[str]:
        """The session's deferred deletes, left deferred (`gc` keeps their objects)."""
        with self._unpublished_lock:
            return set(self._unpublished.get(session_id, set()))

    def delete_session(self, session_id: str, named: Sequence[str], objects: bool) -> int:
        """After a commit removed a session's rows: its folder goes and, with an object store and
        `objects`, the objects of `named` too. Without `objects` (another server took the session:
        its objects are that server's) only this root's copies go. Returns the folder's bytes freed."""
        if self.tier is None:
            return self.blobs.delete_session(session_id)
        if not objects:
            return self.tier.uncache(named) + self.blobs.delete_session(session_id)
        return self.tier.forget_session(session_id, named)
