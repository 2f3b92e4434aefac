"""contextd's verbs: sessions, pages, payloads, blocks, pins, leases, snapshots, records, status.

Records are plain dicts whose keys are the proto field names (the service layer converts), so a
record in LMDB reads the same as the message on the wire. Every write verb is one operation in
the store's group commit: applied whole or not at all.

Page life cycle (enforced here, whatever the caller asks):
  HOT/PINNED -> COLD      only when the page has a stored payload (it is written before it leaves)
  COLD -> HOT/PINNED      a restore
  COLD -> DROPPED         only by the pressure policy, and never when pinned or leased
  any -> CORRUPT          when a read or `verify` finds the payload missing or mismatched
  DROPPED/CORRUPT -> HOT  the engine recomputed it; the stale payload reference is cleared

Session records carry page-count aggregates updated in the same transaction as the pages, so
`status` costs O(sessions) and is always consistent with the manifest.

Depends on contextd.store, contextd.blobs, contextd.ids, contextd.errors; no gRPC types.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contextd.blobs import TEMP_PREFIX, BlobStore, Reserve
from contextd.errors import DataCorrupt, FailedPrecondition, InvalidArgument, NotFound, StoreFull
from contextd.ids import check_id, key, prefix
from contextd.store import SCHEMA_VERSION, CommitInfo, Store, SyncMode, Txn
from contextd.wire import MAX_BATCH, MAX_SEGMENT_TEXT, MAX_TEXT, PIN_KINDS, PageState

Record = dict[str, Any]

HOT, COLD, PINNED, DROPPED, CORRUPT = (PageState.HOT, PageState.COLD, PageState.PINNED, PageState.DROPPED,
                                       PageState.CORRUPT)
STATE_NAMES = {s: s.name.lower() for s in PageState}
COUNT_KEYS = ("hot", "cold", "pinned", "dropped", "corrupt", "hot_tokens", "cold_tokens", "pinned_tokens",
              "bytes_on_disk")
BLOCK_KINDS = ("unit", "cluster")

PAGE_FIELDS = ("page_id", "index", "token_start", "token_end", "original_position", "state", "locator",
               "byte_size", "checksum", "dtype", "layer_view", "block_id", "updated_unix", "last_used_turn", "score")


def _empty_counts() -> Record:
    return {k: 0 for k in COUNT_KEYS}


_TOKEN_KEYS = {HOT: "hot_tokens", COLD: "cold_tokens", PINNED: "pinned_tokens"}


def _account(counts: Record, page: Record, sign: int) -> None:
    """Add (sign=1) or remove (sign=-1) one page's contribution to a session's aggregates."""
    state = page["state"]
    counts[STATE_NAMES[state]] += sign
    tokens_key = _TOKEN_KEYS.get(state)
    if tokens_key is not None:
        counts[tokens_key] += sign * (page["token_end"] - page["token_start"])
    if page["locator"]:
        counts["bytes_on_disk"] += sign * page["byte_size"]


def _check_text(value: str, what: str, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {limit} are allowed")
    return value


def _check_batch(items: list[Any], what: str) -> None:
    if len(items) > MAX_BATCH:
        raise InvalidArgument(f"{len(items)} {what} in one request; at most {MAX_BATCH} are allowed")


@dataclass(frozen=True)
class Retention:
    """What a user keeps, on top of the free-space reserve and the store's total quota: a cap on
    each session's payloads (its least recently used cold pages are dropped past it) and an idle
    age past which a whole session is deleted (by `gc` and by the daemon's own sweep)."""

    session_quota_bytes: int = 0
    max_idle_s: float = 0.0

    def __post_init__(self) -> None:
        if self.session_quota_bytes < 0 or self.max_idle_s < 0:
            raise InvalidArgument("retention limits must not be negative")


@dataclass(frozen=True)
class DaemonConfig:
    root: Path
    sync: SyncMode = SyncMode.FULL
    reserve: Reserve = Reserve()
    retention: Retention = Retention()
    map_size: int = 1 << 34

    def __post_init__(self) -> None:
        if self.map_size < 1 << 20:
            raise InvalidArgument("map size must be at least 1 MiB")


class Daemon:
    """The verbs over one root: `ROOT/db` (LMDB) and `ROOT/store` (payload files)."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.started = time.time()
        self.store = Store(config.root / "db", config.sync, config.map_size)
        self.blobs = BlobStore(config.root / "store", config.reserve)
        # Payload writes and the drops that make room for them are serialised, so two writers
        # cannot both count the same free bytes.
        self._space_lock = threading.RLock()

    def close(self) -> None:
        self.store.close()

    # ----------------------------------------------------------------- sessions

    def _session(self, txn: Txn, session_id: str) -> Record:
        record = txn.get("sessions", key(check_id(session_id, "session_id")))
        if record is None:
            raise NotFound(f"no session {session_id!r}")
        return record

    def open_session(self, request: Record) -> Record:
        session_id = check_id(request["session_id"], "session_id")
        _check_text(request.get("fingerprint", ""), "fingerprint", 256)
        _check_text(request.get("model_id", ""), "model_id", 512)
        labels = request.get("labels", {})
        if len(labels) > 64:
            raise InvalidArgument("at most 64 labels per session")

        def op(txn: Txn) -> Record:
            now = time.time()
            record = txn.get("sessions", key(session_id))
            if record is None:
                record = {"session_id": session_id, "created_unix": now, "turn": 0, "attention_tokens": 0,
                          "counters": {}, "pages": _empty_counts(), "model_id": "", "fingerprint": "",
                          "budget_tokens": 0, "labels": {}}
            record["closed"] = False
            for name in ("model_id", "fingerprint", "budget_tokens"):
                if request.get(name):
                    record[name] = request[name]
            record["labels"].update(labels)
            record["updated_unix"] = now
            txn.put("sessions", key(session_id), record)
            return record

        return self.store.write(op)[0]

    def get_session(self, session_id: str) -> Record:
        with self.store.read() as txn:
            return self._session(txn, session_id)

    def list_sessions(self, include_closed: bool) -> list[Record]:
        with self.store.read() as txn:
            return [r for _, r in txn.scan("sessions", b"") if include_closed or not r["closed"]]

    def close_session(self, session_id: str) -> Record:
        def op(txn: Txn) -> Record:
            record = self._session(txn, session_id)
            record["closed"] = True
            record["updated_unix"] = time.time()
            txn.put("sessions", key(session_id), record)
            return record

        return self.store.write(op)[0]

    def delete_session(self, session_id: str) -> tuple[int, int]:
        def op(txn: Txn) -> int:
            self._session(txn, session_id)
            pages = txn.delete_prefix("kv_manifest", prefix(session_id))
            for table in ("page_state", "blocks", "pins", "leases", "snapshots", "records", "segments"):
                txn.delete_prefix(table, prefix(session_id))
            txn.delete("sessions", key(session_id))
            return pages

        pages, _ = self.store.write(op)
        # Files go after the commit: a crash in between leaves orphans for `gc`, never a
        # manifest entry pointing at nothing.
        return pages, self.blobs.delete_session(session_id)

    # ----------------------------------------------------------------- pages

    def _check_page(self, session_id: str, page: Record) -> Record:
        check_id(page["page_id"], "page_id")
        if page["token_end"] < page["token_start"]:
            raise InvalidArgument(
                f"page {page['page_id']}: token range [{page['token_start']}, {page['token_end']}) is inverted")
        if page["state"] == 0:
            page["state"] = HOT
        if page["state"] not in STATE_NAMES:
            raise InvalidArgument(f"page {page['page_id']}: unknown state {page['state']}")
        if page["block_id"]:
            check_id(page["block_id"], "block_id")
        for name in ("dtype", "layer_view"):
            _check_text(page[name], name, 256)
        if page["locator"]:
            if not page["locator"].startswith(session_id + "/"):
                raise InvalidArgument(f"page {page['page_id']}: locator is outside session {session_id}")
            if len(page["checksum"]) != 32 or any(c not in "0123456789abcdef" for c in page["checksum"]):
                raise InvalidArgument(f"page {page['page_id']}: checksum must be 32 lowercase hex digits")
            if not self.blobs.exists(page["locator"], page["byte_size"]):
                raise FailedPrecondition(
                    f"page {page['page_id']}: no payload of {page['byte_size']} bytes at {page['locator']}")
        elif page["state"] == COLD:
            raise FailedPrecondition(f"page {page['page_id']}: a cold page needs a stored payload")
        if page["state"] in (DROPPED, CORRUPT):
            raise InvalidArgument(f"page {page['page_id']}: only contextd marks pages dropped or corrupt")
        return page

    @staticmethod
    def _put_page(txn: Txn, session_id: str, counts: Record, old: Record | None, page: Record) -> None:
        if old is not None:
            _account(counts, old, -1)
            txn.delete("page_state", key(session_id, str(int(old["state"])), old["page_id"]))
        _account(counts, page, 1)
        txn.put("kv_manifest", key(session_id, page["page_id"]), page)
        txn.put_raw("page_state", key(session_id, str(int(page["state"])), page["page_id"]))

    def upsert_pages(self, session_id: str, pages: list[Record]) -> CommitInfo:
        _check_batch(pages, "pages")
        checked = [self._check_page(session_id, dict(p)) for p in pages]
        if len({p["page_id"] for p in checked}) != len(checked):
            raise InvalidArgument("a page_id appears twice in one batch")
        replaced: list[str] = []

        def op(txn: Txn) -> int:
            session = self._session(txn, session_id)
            counts = session["pages"]
            now = time.time()
            for page in checked:
                old = txn.get("kv_manifest", key(session_id, page["page_id"]))
                if old is not None and old["locator"] and old["locator"] != page["locator"]:
                    replaced.append(old["locator"])
                page["updated_unix"] = now
                self._put_page(txn, session_id, counts, old, page)
            txn.put("sessions", key(session_id), session)
            return len(checked)

        info = self.store.write(op)[1]
        for locator in replaced:
            self.blobs.delete(locator)
        quota = self.config.retention.session_quota_bytes
        if quota:
            over = self.get_session(session_id)["pages"]["bytes_on_disk"] - quota
            if over > 0:
                self.reclaim(over, session_id, partial=True)
        return info

    def set_page_states(self, session_id: str, changes: list[Record]) -> CommitInfo:
        _check_batch(changes, "state changes")
        for change in changes:
            check_id(change["page_id"], "page_id")
            if change.get("score", 0.0) != change.get("score", 0.0):
                raise InvalidArgument(f"page {change['page_id']}: score is NaN")
            if change["state"] not in (HOT, COLD, PINNED):
                raise InvalidArgument(
                    f"page {change['page_id']}: state must be HOT, COLD or PINNED (got {change['state']})")

        def op(txn: Txn) -> int:
            session = self._session(txn, session_id)
            counts = session["pages"]
            now = time.time()
            for change in changes:
                old = txn.get("kv_manifest", key(session_id, change["page_id"]))
                if old is None:
                    raise NotFound(f"session {session_id} has no page {change['page_id']!r}")
                page = dict(old)
                page["state"] = change["state"]
                page["updated_unix"] = now
                if change.get("last_used_turn"):
                    page["last_used_turn"] = change["last_used_turn"]
                if page["state"] in (HOT, PINNED) and old["state"] == COLD:
                    page["score"] = float(change.get("score", 0.0))
                if page["state"] == COLD and (not page["locator"] or old["state"] in (DROPPED, CORRUPT)):
                    raise FailedPrecondition(
                        f"page {page['page_id']} has no valid stored payload; write it before marking it cold")
                if old["state"] in (DROPPED, CORRUPT):
                    page.update(locator="", checksum="", byte_size=0)
                self._put_page(txn, session_id, counts, old, page)
            txn.put("sessions", key(session_id), session)
            return len(changes)

        return self.store.write(op)[1]

    def delete_pages(self, session_id: str, page_ids: list[str]) -> CommitInfo:
        _check_batch(page_ids, "pages")
        for page_id in page_ids:
            check_id(page_id, "page_id")
        removed: list[str] = []

        def op(txn: Txn) -> int:
            session = self._session(txn, session_id)
            now = time.time()
            for page_id in page_ids:
                page = txn.get("kv_manifest", key(session_id, page_id))
                if page is None:
                    raise NotFound(f"session {session_id} has no page {page_id!r}")
                # the owner deletes what its record no longer names: only pins and leases hold a page here
                if not self._may_drop(txn, session_id, page, session["turn"], now, recorded=set()):
                    raise FailedPrecondition(f"page {page_id} is pinned or leased; it cannot be deleted")
                _account(session["pages"], page, -1)
                txn.delete("kv_manifest", key(session_id, page_id))
                txn.delete("page_state", key(session_id, str(int(page["state"])), page_id))
                if page["locator"]:
                    removed.append(page["locator"])
            txn.put("sessions", key(session_id), session)
            return len(page_ids)

        info = self.store.write(op)[1]
        for locator in removed:
            self.blobs.delete(locator)
        return info

    def query_pages(self, session_id: str, states: list[int], start_after: str, limit: int
                    ) -> tuple[list[Record], str]:
        for state in states:
            if state not in STATE_NAMES:
                raise InvalidArgument(f"unknown state {state}")
        if start_after:
            check_id(start_after, "start_after")
        pages: list[Record] = []
        with self.store.read() as txn:
            self._session(txn, session_id)
            if not states:
                after = key(session_id, start_after) if start_after else None
                for _, page in txn.scan("kv_manifest", prefix(session_id), after):
                    pages.append(page)
                    if limit and len(pages) > limit:
                        break
            else:
                for state in sorted(set(states)):
                    for state_key in txn.scan_keys("page_state", prefix(session_id, str(int(state)))):
                        page_id = state_key.rsplit(b"\x00", 1)[1].decode()
                        if start_after and page_id <= start_after:
                            continue
                        indexed = txn.get("kv_manifest", key(session_id, page_id))
                        assert indexed is not None, "page_state index points at a missing page"
                        pages.append(indexed)
                pages.sort(key=lambda p: str(p["page_id"]))
        if limit and len(pages) > limit:
            return pages[:limit], str(pages[limit - 1]["page_id"])
        return pages, ""

    def get_pages(self, session_id: str, page_ids: list[str]) -> list[Record]:
        """The named pages that exist, in the order asked: one lookup each, whatever the session's size."""
        _check_batch(page_ids, "pages")
        for page_id in page_ids:
            check_id(page_id, "page_id")
        with self.store.read() as txn:
            self._session(txn, session_id)
            found = [txn.get("kv_manifest", key(session_id, page_id)) for page_id in page_ids]
        return [page for page in found if page is not None]

    # ----------------------------------------------------------------- payloads

    def _store_bytes(self, txn: Txn) -> int:
        total = 0
        for _, session in txn.scan("sessions", b""):
            total += session["pages"]["bytes_on_disk"]
        for _, snap in txn.scan("snapshots", b""):
            total += snap["byte_size"]
        return total

    def make_room(self, incoming: int) -> None:
        """Drop cold payloads until `incoming` bytes fit, or raise StoreFull having dropped nothing."""
        with self.store.read() as txn:
            needed = self.blobs.shortfall(incoming, self._store_bytes(txn))
        if needed:
            freed = self.reclaim(needed)[0]
            if freed < needed:
                raise StoreFull(
                    f"the store needs {needed} more bytes for a {incoming}-byte write and only {freed} could "
                    f"be freed from cold, unpinned, unleased pages (free {self.blobs.free_bytes()}, "
                    f"reserve {self.blobs.reserve_bytes()}, quota {self.blobs.reserve.quota_bytes or 'none'})")

    def _droppable(self, txn: Txn, session_id: str) -> list[tuple[int, float, str, str, int]]:
        """Cold payloads that may go (of one session, or of all), least recently used first:
        (last_used_turn, updated, session, page, size)."""
        now = time.time()
        candidates = []
        scope = [self._session(txn, session_id)] if session_id else [s for _, s in txn.scan("sessions", b"")]
        for session in scope:
            sid = session["session_id"]
            recorded = _recorded_resident(txn, sid)
            for state_key in txn.scan_keys("page_state", prefix(sid, str(int(COLD)))):
                page_id = state_key.rsplit(b"\x00", 1)[1].decode()
                page = txn.get("kv_manifest", key(sid, page_id))
                assert page is not None
                if not self._may_drop(txn, sid, page, session["turn"], now, recorded):
                    continue
                candidates.append((page["last_used_turn"], page["updated_unix"], sid, page_id, page["byte_size"]))
        candidates.sort()
        return candidates

    @staticmethod
    def _may_drop(txn: Txn, sid: str, page: Record, turn: int, now: float, recorded: set[int]) -> bool:
        """Not pinned, not leased, and not in attention at the end of the last completed turn: a
        turn that fails after evicting a page (a 507) leaves it COLD in the manifest, yet the
        session resumes from that turn's record, which needs the page back exactly."""
        if page["index"] in recorded or txn.has("pins", key(sid, page["page_id"])):
            return False
        lease = txn.get("leases", key(sid, page["page_id"]))
        return lease is None or not _lease_active(lease, turn, now)

    def reclaim(self, bytes_needed: int, session_id: str = "", partial: bool = False
                ) -> tuple[int, list[tuple[str, str]]]:
        """Drop the least recently used cold, unpinned, unleased payloads (of `session_id`, or of
        every session) until bytes_needed are freed.

        Nothing resident (hot or pinned) and nothing pinned or leased is ever dropped. When the
        droppable pages cannot cover bytes_needed, none is dropped and (0, []) is returned, unless
        `partial` (a session over its quota gives up what it can).
        """
        with self._space_lock:
            with self.store.read() as txn:
                candidates = self._droppable(txn, session_id)
            chosen: list[tuple[str, str]] = []
            planned = 0
            for _, _, sid, page_id, size in candidates:
                if planned >= bytes_needed:
                    break
                chosen.append((sid, page_id))
                planned += size
            if planned < bytes_needed and not partial:
                return 0, []

            def op(txn: Txn) -> list[str]:
                now = time.time()
                locators = []
                recorded: dict[str, set[int]] = {}
                for sid, page_id in chosen:
                    session = self._session(txn, sid)
                    page = txn.get("kv_manifest", key(sid, page_id))
                    if sid not in recorded:
                        recorded[sid] = _recorded_resident(txn, sid)
                    # Re-check inside the write: the page may have been restored or pinned since.
                    if page is None or page["state"] != COLD or not self._may_drop(txn, sid, page, session["turn"],
                                                                                    now, recorded[sid]):
                        continue
                    locators.append(page["locator"])
                    new = dict(page, state=DROPPED, locator="", checksum="", byte_size=0, updated_unix=now)
                    self._put_page(txn, sid, session["pages"], page, new)
                    txn.put("sessions", key(sid), session)
                return locators

            locators = self.store.write(op)[0]
            return sum(self.blobs.delete(loc) for loc in locators), chosen

    def mark_corrupt(self, session_id: str, page_id: str, reason: str) -> CommitInfo:
        def op(txn: Txn) -> None:
            session = self._session(txn, session_id)
            old = txn.get("kv_manifest", key(session_id, check_id(page_id, "page_id")))
            if old is None:
                raise NotFound(f"session {session_id} has no page {page_id!r}")
            if old["state"] == CORRUPT:
                return
            page = dict(old, state=CORRUPT, updated_unix=time.time(), corrupt_reason=reason[:512])
            self._put_page(txn, session_id, session["pages"], old, page)
            txn.put("sessions", key(session_id), session)

        return self.store.write(op)[1]

    # ----------------------------------------------------------------- blocks

    def upsert_blocks(self, session_id: str, blocks: list[Record]) -> CommitInfo:
        _check_batch(blocks, "blocks")
        for block in blocks:
            check_id(block["block_id"], "block_id")
            if block["kind"] not in BLOCK_KINDS:
                raise InvalidArgument(f"block {block['block_id']}: kind must be 'unit' or 'cluster'")
            if block["parent_id"]:
                check_id(block["parent_id"], "parent_id")
            for ref in (*block["page_ids"], *block["child_ids"]):
                check_id(ref, "page or child id")
            _check_text(block["summary"], "summary")

        def op(txn: Txn) -> int:
            self._session(txn, session_id)
            for block in blocks:
                txn.put("blocks", key(session_id, block["block_id"]), block)
            return len(blocks)

        return self.store.write(op)[1]

    def query_blocks(self, session_id: str, kind: str) -> list[Record]:
        with self.store.read() as txn:
            self._session(txn, session_id)
            return [b for _, b in txn.scan("blocks", prefix(session_id)) if not kind or b["kind"] == kind]

    # ----------------------------------------------------------------- pins, leases

    def set_pins(self, session_id: str, add: list[Record], remove: list[str]) -> CommitInfo:
        _check_batch(add + [{}] * len(remove), "pins")
        for pin in add:
            check_id(pin["page_id"], "page_id")
            if pin["kind"] not in PIN_KINDS:
                raise InvalidArgument(f"pin kind {pin['kind']!r} is not one of {', '.join(PIN_KINDS)}")
        for page_id in remove:
            check_id(page_id, "page_id")

        def op(txn: Txn) -> int:
            self._session(txn, session_id)
            for page_id in remove:
                txn.delete("pins", key(session_id, page_id))
            for pin in add:
                if not txn.has("kv_manifest", key(session_id, pin["page_id"])):
                    raise NotFound(f"cannot pin unknown page {pin['page_id']!r}")
                txn.put("pins", key(session_id, pin["page_id"]), {"kind": pin["kind"]})
            return len(add) + len(remove)

        return self.store.write(op)[1]

    def query_pins(self, session_id: str) -> list[Record]:
        with self.store.read() as txn:
            self._session(txn, session_id)
            return [{"page_id": k.split(b"\x00")[1].decode(), "kind": r["kind"]}
                    for k, r in txn.scan("pins", prefix(session_id))]

    def set_leases(self, session_id: str, add: list[Record], remove: list[str]) -> CommitInfo:
        _check_batch(add + [{}] * len(remove), "leases")
        for lease in add:
            check_id(lease["page_id"], "page_id")
            if lease["expires_unix"] < 0:
                raise InvalidArgument("a lease cannot expire before the epoch")
            if not lease["until_turn"] and not lease["expires_unix"]:
                raise InvalidArgument(f"lease on {lease['page_id']} needs until_turn, expires_unix or both")
        for page_id in remove:
            check_id(page_id, "page_id")

        def op(txn: Txn) -> int:
            self._session(txn, session_id)
            for page_id in remove:
                txn.delete("leases", key(session_id, page_id))
            for lease in add:
                if not txn.has("kv_manifest", key(session_id, lease["page_id"])):
                    raise NotFound(f"cannot lease unknown page {lease['page_id']!r}")
                txn.put("leases", key(session_id, lease["page_id"]),
                        {"until_turn": lease["until_turn"], "expires_unix": lease["expires_unix"]})
            return len(add) + len(remove)

        return self.store.write(op)[1]

    def query_leases(self, session_id: str) -> list[Record]:
        with self.store.read() as txn:
            self._session(txn, session_id)
            return [dict(r, page_id=k.split(b"\x00")[1].decode()) for k, r in txn.scan("leases", prefix(session_id))]

    # ----------------------------------------------------------------- snapshots, records

    def put_snapshot(self, session_id: str, snapshot: Record) -> CommitInfo:
        """Record a snapshot whose payload is already in the store; the slot's previous payload
        is deleted after the commit."""
        self._check_snapshot(session_id, snapshot)
        replaced: list[str] = []

        def op(txn: Txn) -> None:
            self._session(txn, session_id)
            self._put_snapshot(txn, session_id, snapshot, replaced)

        info = self.store.write(op)[1]
        for old_locator in replaced:
            self.blobs.delete(old_locator)
        return info

    def _check_snapshot(self, session_id: str, snapshot: Record) -> None:
        slot = check_id(snapshot["slot"], "snapshot slot")
        _check_text(snapshot["fingerprint"], "fingerprint", 256)
        locator = snapshot["locator"]
        if not locator.startswith(session_id + "/"):
            raise InvalidArgument(f"snapshot {slot}: locator is outside session {session_id}")
        if not self.blobs.exists(locator, snapshot["byte_size"]):
            raise FailedPrecondition(f"snapshot {slot}: no payload of {snapshot['byte_size']} bytes at {locator}")

    @staticmethod
    def _put_snapshot(txn: Txn, session_id: str, snapshot: Record, replaced: list[str]) -> None:
        """Put a checked snapshot in its slot; the slot's previous payload joins `replaced`."""
        old = txn.get("snapshots", key(session_id, snapshot["slot"]))
        if old is not None and old["locator"] and old["locator"] != snapshot["locator"]:
            replaced.append(old["locator"])
        txn.put("snapshots", key(session_id, snapshot["slot"]), dict(snapshot, created_unix=time.time()))

    def query_snapshots(self, session_id: str) -> list[Record]:
        with self.store.read() as txn:
            self._session(txn, session_id)
            return [r for _, r in txn.scan("snapshots", prefix(session_id))]

    def write_record(self, session_id: str, record: Record, keep_segments: int, append: list[Record],
                     snapshots: Sequence[Record] = ()) -> CommitInfo:
        """The end of a turn in one transaction: the session's counters, turn and fingerprint, its
        record, its transcript cut back to `keep_segments` segments and extended by `append`, and
        its recurrent snapshots (the slots' previous payloads are deleted after the commit)."""
        _check_batch(append, "segments")
        if len(snapshots) > 8 or len({s["slot"] for s in snapshots}) != len(snapshots):
            raise InvalidArgument("at most 8 snapshots, one per slot")
        for snapshot in snapshots:
            self._check_snapshot(session_id, snapshot)
        _check_text(record["fingerprint"], "fingerprint", 256)
        check_id(record["unit_salt"], "unit_salt")
        if len(record["fingerprint_parts"]) > 8 or any(len(p) > 256 for p in record["fingerprint_parts"]):
            raise InvalidArgument("fingerprint_parts holds at most 8 strings of at most 256 characters")
        if any(len(h) > 128 for h in record["message_hashes"]) or len(record["message_hashes"]) > MAX_BATCH:
            raise InvalidArgument("message_hashes holds at most 65536 strings of at most 128 characters")
        if len(record["counters"]) > 256 or any(len(name) > 64 for name in record["counters"]):
            raise InvalidArgument("at most 256 counters, names of at most 64 characters")
        if len(record["resident_pages"]) != len(record["resident_positions"]):
            raise InvalidArgument("resident_pages and resident_positions must have one entry each per page")
        for name in ("ledger_pages", "resident_pages"):
            _check_batch(record[name], name)
        for segment in append:
            _check_text(segment["text"], "segment text", MAX_SEGMENT_TEXT)

        def op(txn: Txn) -> int:
            session = self._session(txn, session_id)
            old = txn.get("records", key(session_id)) or {"segments": 0, "tokens": 0}
            if keep_segments > old["segments"]:
                raise FailedPrecondition(f"session {session_id} has {old['segments']} stored segments; "
                                         f"cannot keep {keep_segments}")
            tokens = old["tokens"]
            for seq in range(keep_segments, old["segments"]):
                gone = txn.get("segments", key(session_id, f"{seq:012d}"))
                assert gone is not None, "a session's segments are contiguous"
                tokens -= len(gone["token_ids"])
                txn.delete("segments", key(session_id, f"{seq:012d}"))
            for n, segment in enumerate(append):
                tokens += len(segment["token_ids"])
                txn.put("segments", key(session_id, f"{keep_segments + n:012d}"), segment)
            txn.put("records", key(session_id), dict(record, segments=keep_segments + len(append), tokens=tokens))
            for name in ("turn", "attention_tokens", "fingerprint"):
                session[name] = record[name]
            session["counters"] = dict(record["counters"])
            session["updated_unix"] = time.time()
            txn.put("sessions", key(session_id), session)
            for snapshot in snapshots:
                self._put_snapshot(txn, session_id, snapshot, replaced)
            return len(append)

        replaced: list[str] = []
        info = self.store.write(op)[1]
        for old_locator in replaced:
            self.blobs.delete(old_locator)
        return info

    def read_record(self, session_id: str) -> tuple[Record, list[Record]]:
        with self.store.read() as txn:
            self._session(txn, session_id)
            record = txn.get("records", key(session_id))
            if record is None:
                raise NotFound(f"session {session_id} has no record yet (no turn has completed)")
            segments = [s for _, s in txn.scan("segments", prefix(session_id))]
        if len(segments) != record["segments"]:
            raise DataCorrupt(f"session {session_id}: the record names {record['segments']} segments, "
                              f"{len(segments)} are stored")
        return record, segments

    # ----------------------------------------------------------------- status, gc, verify

    def status(self, session_id: str, include_closed: bool) -> Record:
        with self.store.read() as txn:
            meta = txn.get("meta", b"meta") or {}
            if session_id:
                sessions = [self._session(txn, session_id)]
            else:
                sessions = [r for _, r in txn.scan("sessions", b"") if include_closed or not r["closed"]]
            rows = []
            for s in sessions:
                snaps = sum(1 for _ in txn.scan_keys("snapshots", prefix(s["session_id"])))
                rows.append({"session_id": s["session_id"], "model_id": s["model_id"],
                             "budget_tokens": s["budget_tokens"], "attention_tokens": s["attention_tokens"],
                             "turn": s["turn"], "pages": s["pages"], "snapshots": snaps, "closed": s["closed"],
                             "counters": s["counters"]})
            store_bytes = self._store_bytes(txn)
        return {"commit_seq": meta.get("commit_seq", 0), "last_commit_ms": self.store.last_commit_ms,
                "store_bytes": store_bytes, "free_bytes": self.blobs.free_bytes(),
                "reserve_bytes": self.blobs.reserve_bytes(), "quota_bytes": self.blobs.reserve.quota_bytes,
                "session_quota_bytes": self.config.retention.session_quota_bytes,
                "max_idle_s": self.config.retention.max_idle_s,
                "sync_mode": self.config.sync.value, "root": str(self.config.root), "pid": os.getpid(),
                "uptime_s": time.time() - self.started, "sessions": rows, "schema_version": SCHEMA_VERSION}

    def idle_sessions(self) -> list[str]:
        """Sessions idle for longer than the retention's max idle age (none without one)."""
        max_idle = self.config.retention.max_idle_s
        if not max_idle:
            return []
        cutoff = time.time() - max_idle
        with self.store.read() as txn:
            return [s["session_id"] for _, s in txn.scan("sessions", b"") if s["updated_unix"] < cutoff]

    def _referenced_locators(self) -> set[str]:
        with self.store.read() as txn:
            refs = {p["locator"] for _, p in txn.scan("kv_manifest", b"") if p["locator"]}
            refs |= {s["locator"] for _, s in txn.scan("snapshots", b"") if s["locator"]}
        return refs

    def gc(self, dry_run: bool) -> Record:
        """Remove payload files no manifest entry points at, stale temporary files, expired leases."""
        result = {"orphan_files_removed": 0, "temp_files_removed": 0, "leases_expired": 0, "bytes_freed": 0,
                  "idle_sessions_deleted": 0}
        for session_id in self.idle_sessions():
            result["idle_sessions_deleted"] += 1
            if not dry_run:
                result["bytes_freed"] += self.delete_session(session_id)[1]
        with self._space_lock:
            refs = self._referenced_locators()
            grace = time.time() - 60.0  # a temp file younger than this may be a write in flight
            for locator, path in self.blobs.files():
                name = path.name
                is_temp = name.startswith(TEMP_PREFIX)
                if locator in refs or (is_temp and path.stat().st_mtime > grace):
                    continue
                if not is_temp and path.stat().st_mtime > grace:
                    continue  # written by an engine whose manifest upsert may not have landed yet
                result["temp_files_removed" if is_temp else "orphan_files_removed"] += 1
                result["bytes_freed"] += path.stat().st_size
                if not dry_run:
                    path.unlink(missing_ok=True)

        def op(txn: Txn) -> int:
            now = time.time()
            expired = 0
            for _, session in txn.scan("sessions", b""):
                sid = session["session_id"]
                for lease_key, lease in list(txn.scan("leases", prefix(sid))):
                    if not _lease_active(lease, session["turn"], now):
                        expired += 1
                        if not dry_run:
                            txn.delete("leases", lease_key)
            return expired

        result["leases_expired"] = self.store.write(op)[0]
        return result

    def verify(self, session_id: str) -> Record:
        """Re-read and re-checksum every stored payload; mark failures corrupt."""
        result: Record = {"pages_checked": 0, "pages_ok": 0, "corrupt": [], "snapshots_checked": 0,
                          "bytes_read": 0}
        with self.store.read() as txn:
            if session_id:
                self._session(txn, session_id)
            scope = prefix(session_id) if session_id else b""
            pages = [(k.split(b"\x00")[0].decode(), p) for k, p in txn.scan("kv_manifest", scope) if p["locator"]
                     and p["state"] != CORRUPT]
            snapshots = [(k.split(b"\x00")[0].decode(), s) for k, s in txn.scan("snapshots", scope)
                         if s["locator"]]
        for sid, page in pages:
            result["pages_checked"] += 1
            try:
                self.blobs.read(page["locator"], page["checksum"], page["byte_size"])
            except DataCorrupt as exc:
                self.mark_corrupt(sid, page["page_id"], str(exc))
                result["corrupt"].append({"session_id": sid, "page_id": page["page_id"]})
                continue
            result["pages_ok"] += 1
            result["bytes_read"] += page["byte_size"]
        for sid, snap in snapshots:
            result["snapshots_checked"] += 1
            try:
                self.blobs.read(snap["locator"], snap["checksum"], snap["byte_size"])
            except DataCorrupt:
                result["corrupt"].append({"session_id": sid, "page_id": f"snapshot:{snap['slot']}"})
                continue
            result["bytes_read"] += snap["byte_size"]
        return result


def _recorded_resident(txn: Txn, session_id: str) -> set[int]:
    """Indexes of the pages in attention at the end of the session's last completed turn."""
    record = txn.get("records", key(session_id))
    return set(record["resident_pages"]) if record is not None else set()


def _lease_active(lease: Record, turn: int, now: float) -> bool:
    """A lease holds while every bound it sets holds: turn < until_turn, now < expires_unix."""
    if lease["until_turn"] and turn >= lease["until_turn"]:
        return False
    return not (lease["expires_unix"] and now >= lease["expires_unix"])
