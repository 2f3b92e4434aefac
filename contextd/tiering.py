"""Two tiers: the object store holds every committed payload, the store folder is a bounded cache.

With an object store configured (`contextd serve --object-store s3://...`), the daemon calls this
module at each point where a payload changes hands:

- **commit**: a payload the serving process wrote to the folder is uploaded before the manifest
  row (or snapshot, or record) that names it commits, so every row names a payload the durable
  tier holds, and a page leaves attention only once the object store has it;
- **read**: `GetPages` and `QuerySnapshots` bring back whatever they name that the folder lacks
  (evicted, or never here: a session adopted from another machine), checksum checked, before the
  caller reads the files;
- **delete**: a dropped or replaced payload's folder copy goes at once (`uncache`), its object at
  the session's next publish (contextd.handover: the exported state may name it until then); a
  deleted session's payloads go from both tiers (best effort in the object store: a failure there
  leaves an orphan object and is logged, it does not undo the commit);
- **branch**: a child's payloads are server-side copies in the object store and hard links in the
  folder (only for the files the folder holds).

The folder keeps at most `cache_bytes` of committed payloads, least recently used out (a read or a
commit uses a payload). Files not yet committed are never evicted: they are the only copy. Nor is
a payload a read is fetching or has handed out within READ_HOLD_S (on the daemon's clock): the
caller reads the files after the reply (the server reads one chunk of pages while it asks for the
next), so neither the bound nor disk pressure (`evict`) may take them from under it; the folder
then holds more than its bound until the holds end.

Dependency rules: contextd.blobs, contextd.clock, contextd.objects, contextd.errors; called by the
daemon only.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from contextd.blobs import BlobStore
from contextd.clock import Clock
from contextd.errors import ContextdError, DataCorrupt, InvalidArgument
from contextd.objects import ObjectStore

__all__ = ["ObjectTier", "Wanted"]

log = logging.getLogger("contextd.tiering")

T = TypeVar("T")
MARKER = ".object-tier"          # in the store folder: the object store this root's payloads live in
TRANSFERS = 4                    # payloads moved at once: a restore of 8 pages is two round trips, not eight
READ_HOLD_S = 60.0               # how long a payload handed out for reading stays in the folder, at least

# A payload to have in the folder: (locator, size, checksum).
Wanted = tuple[str, int, str]


class ObjectTier:
    """The object store behind the folder `blobs`. Thread-safe."""

    def __init__(self, objects: ObjectStore, blobs: BlobStore, cache_bytes: int, clock: Clock | None = None) -> None:
        if cache_bytes < 0:
            raise InvalidArgument("the local cache size must not be negative")
        self.objects = objects
        self.blobs = blobs
        self.cache_bytes = cache_bytes
        self.clock = clock or Clock()
        self._cached: OrderedDict[str, int] = OrderedDict()   # committed payloads in the folder, LRU first
        self._reading: Counter[str] = Counter()   # payloads a fetch is bringing in, by fetches under way
        self._held: dict[str, float] = {}         # payloads handed out for reading -> end of the hold (monotonic)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(TRANSFERS, thread_name_prefix="contextd-tier")
        self.uploaded = self.bytes_uploaded = 0   # payloads uploaded since the start (status)
        self.fetched = self.bytes_fetched = 0     # payloads downloaded back into the folder

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(self._cached.values())

    def status(self) -> dict[str, Any]:
        """The tier's figures, as contextd's Status reports them."""
        with self._lock:
            moved = {"objects_uploaded": self.uploaded, "objects_fetched": self.fetched,
                     "bytes_uploaded": self.bytes_uploaded, "bytes_fetched": self.bytes_fetched}
        return {"object_store": self.objects.config.url, "cached_bytes": self.cached_bytes,
                "cache_limit_bytes": self.cache_bytes, **moved}

    def start(self, committed: Iterable[tuple[str, int]]) -> None:
        """At the daemon's start, with every payload the rows name: the bucket is there, the folder's
        copies are known to the cache (oldest file first), and a root that kept its payloads only in
        the folder until now has them all uploaded before it serves (the marker then names the store)."""
        self.objects.ensure_bucket()
        marker = self.blobs.root / MARKER
        url = self.objects.config.url
        if marker.exists() and marker.read_text().strip() != url:
            raise InvalidArgument(f"the payloads under {self.blobs.root} are durable in "
                                  f"{marker.read_text().strip()}, not {url}")
        present = [(locator, size, path.stat().st_mtime) for locator, size in committed
                   if (path := self.blobs.path(locator)).exists()]
        if not marker.exists():
            self._each(lambda item: None if self.objects.exists(item[0], item[1])
                       else self.objects.upload(item[0], self.blobs.path(item[0])), present)
            marker.write_text(url + "\n")
            log.info("uploaded this root's %d payloads to %s", len(present), url)
        with self._lock:
            for locator, size, _ in sorted(present, key=lambda item: item[2]):
                self._cached[locator] = size
        self.trim(set())

    def _each(self, work: Callable[[T], object], items: Sequence[T]) -> None:
        """`work` on every item, TRANSFERS at a time, each in the caller's context (its call's
        deadline: contextd.clock); the first failure is raised once all have ended."""
        failures = [f.exception() for f in [self._pool.submit(contextvars.copy_context().run, work, item)
                                            for item in items]]
        for failure in failures:
            if failure is not None:
                raise failure

    def commit(self, locators: Sequence[str]) -> None:
        """Upload payloads the folder holds and the object store does not know yet (about to be
        named by a commit). TierUnavailable when the store does not take them in time."""
        with self._lock:
            todo = [locator for locator in dict.fromkeys(locators) if locator not in self._cached]
        self._each(lambda locator: self.objects.upload(locator, self.blobs.path(locator)), todo)
        with self._lock:
            for locator in locators:
                self._cached[locator] = self.blobs.path(locator).stat().st_size
                self._cached.move_to_end(locator)
            self.uploaded += len(todo)
            self.bytes_uploaded += sum(self._cached[locator] for locator in todo)
        self.trim(set(locators))

    def fetch(self, wanted: Sequence[Wanted], hold: bool = True) -> dict[str, str]:
        """Have every payload of `wanted` in the folder, downloading the missing ones, and with
        `hold` keep them there for READ_HOLD_S once handed out (the caller reads them after this
        returns; a caller that reads them itself holds nothing, or `verify` would hold the whole
        store). Returns the ones the object store lost or holds other bytes of (locator -> why;
        they stay out of the folder); TierUnavailable when the store does not answer in time."""
        lost: dict[str, str] = {}
        locators = [locator for locator, _, _ in wanted]

        def download(item: Wanted) -> None:
            try:
                self.objects.download(item[0], self.blobs.path(item[0]), item[1], item[2])
            except DataCorrupt as exc:
                lost[item[0]] = str(exc)

        # Marked before the folder is looked at: an eviction takes a file and its name under the
        # lock, so a copy seen here stays until the hold ends, and a copy taken is downloaded.
        with self._lock:
            self._reading.update(locators)
        try:
            missing = [w for w in wanted if not self.blobs.exists(w[0], w[1])]
            self._each(download, missing)
            with self._lock:
                self.fetched += len(missing) - len(lost)
                self.bytes_fetched += sum(size for locator, size, _ in missing if locator not in lost)
                self._end_holds()
                until = self.clock.monotonic() + READ_HOLD_S
                for locator, size, _ in wanted:
                    if locator not in lost:
                        self._cached[locator] = size
                        self._cached.move_to_end(locator)
                        if hold:
                            self._held[locator] = until
        finally:
            with self._lock:
                self._reading -= Counter(locators)
        self.trim(set(locators))
        return lost

    def delete(self, locators: Sequence[str]) -> int:
        """Remove payloads from both tiers; return the folder's bytes freed."""
        freed = self.uncache(locators)
        for locator in locators:
            self._delete_object(locator)
        return freed

    def uncache(self, locators: Sequence[str]) -> int:
        """Remove payloads' folder copies only (their objects stay); return the bytes freed."""
        with self._lock:
            for locator in locators:
                self._cached.pop(locator, None)
        return sum(self.blobs.delete(locator) for locator in locators)

    def _delete_object(self, locator: str) -> None:
        """Delete an object; when the store does not answer, it stays behind as an orphan (logged)."""
        try:
            self.objects.delete(locator)
        except ContextdError as exc:
            log.warning("payload %s stays in the object store as an orphan: %s", locator, exc)

    def forget_session(self, session_id: str, locators: Sequence[str]) -> int:
        """A deleted session's payloads, from both tiers; the folder's bytes freed."""
        freed = self.delete(locators)
        return freed + self.blobs.delete_session(session_id)

    def copy(self, locators: Sequence[str], session_id: str) -> dict[str, str]:
        """A branch's payloads: a server-side copy each in the object store (all or nothing), and a
        hard link each in the folder for the files it holds. Returns old locator -> new."""
        moved = {locator: self.blobs.shared_locator(locator, session_id) for locator in locators}
        try:
            self._each(lambda item: self.objects.copy(item[0], item[1]), list(moved.items()))
        except BaseException:
            for target in moved.values():
                self._delete_object(target)
            raise
        local = [locator for locator in locators if self.blobs.path(locator).exists()]
        linked = self.blobs.link(local, session_id)
        with self._lock:
            for target in linked.values():
                self._cached[target] = self.blobs.path(target).stat().st_size
        return moved

    def _end_holds(self) -> None:
        """Forget the holds that have ended (under the lock)."""
        now = self.clock.monotonic()
        for locator in [locator for locator, until in self._held.items() if until <= now]:
            del self._held[locator]

    def _reads(self) -> set[str]:
        """The payloads a read is fetching, or has handed out and whose hold runs (under the lock)."""
        self._end_holds()
        return set(self._reading) | set(self._held)

    def evict(self, bytes_needed: int, protect: set[str]) -> int:
        """Remove committed payloads' folder copies, least recently used first, until
        `bytes_needed` are freed (or none is left); return the bytes freed. Neither `protect` nor
        a payload a read is fetching or holds is taken."""
        freed = 0
        while freed < bytes_needed:
            with self._lock:
                reads = self._reads()
                locator = next((loc for loc in self._cached if loc not in protect and loc not in reads), None)
                if locator is None:
                    break
                self._cached.pop(locator)
                freed += self.blobs.delete(locator)
        return freed

    def trim(self, protect: set[str]) -> int:
        """Keep the folder's committed payloads within `cache_bytes` (0: no bound)."""
        if not self.cache_bytes:
            return 0
        return self.evict(self.cached_bytes - self.cache_bytes, protect)
