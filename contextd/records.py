"""The daemon's typed values: every row it keeps in LMDB, and what its verbs return.

Each row is a frozen, slotted dataclass whose fields carry the proto's field names, so the
service converts a row to and from its message by name and mypy checks every field the daemon
touches. `stored()` is the msgpack map a row is kept as and `load()` reads one back: the fields
go in declaration order, which is the order the schema-2 daemon wrote its dicts in, so the bytes
in LMDB are unchanged; a field renamed since then keeps its schema-2 key (`field(metadata=
{"stored": ...})`), a field an older row lacks takes its default, and a stored key no field
names is left out. tests/contextd/test_records.py holds rows encoded the schema-2 way.

Depends on contextd.wire (PageState, PinKind) and contextd.errors only.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from typing import Any, Self

from contextd.errors import InvalidArgument
from contextd.wire import PageState, PinKind

Convert = Callable[[Any], Any] | None  # None: msgpack keeps the value as it is


def _converters(hint: Any) -> tuple[Convert, Convert]:
    """How a field of this type is loaded from msgpack, and how it is stored."""
    if typing.get_origin(hint) is tuple:
        return tuple, None
    if isinstance(hint, type) and issubclass(hint, Row):
        return hint.load, hint.stored
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint, (lambda member: member.value)
    return None, None


# per row type, per field: its name, its stored name, how it is loaded, how it is stored
_PLANS: dict[type, tuple[tuple[str, str, Convert, Convert], ...]] = {}


def _plan(cls: type) -> tuple[tuple[str, str, Convert, Convert], ...]:
    if cls not in _PLANS:
        hints = typing.get_type_hints(cls)
        _PLANS[cls] = tuple((f.name, str(f.metadata.get("stored", f.name)), *_converters(hints[f.name]))
                            for f in fields(cls))
    return _PLANS[cls]


class Row:
    """What every row shares: its stored map and the way back."""

    __slots__ = ()

    def stored(self) -> dict[str, Any]:
        values = {}
        for name, stored, _, store in _plan(type(self)):
            value = getattr(self, name)
            values[stored] = value if store is None else store(value)
        return values

    @classmethod
    def load(cls, data: Mapping[str, Any]) -> Self:
        values = {}
        for name, stored, load, _ in _plan(cls):
            if stored in data:
                values[name] = data[stored] if load is None else load(data[stored])
        return cls(**values)


@dataclass(frozen=True, slots=True)
class Meta(Row):
    schema_version: int = 0
    commit_seq: int = 0
    created_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class PageCounts(Row):
    """A session's page-count aggregates, kept in step with its manifest and its pins.

    One count per state; `pinned` is not a state but the hot pages that carry a pin (a part of
    `hot`, as `pinned_tokens` is of `hot_tokens`): a pinned page is in attention like any other
    hot page, and the pin only says it never leaves."""

    hot: int = 0
    cold: int = 0
    pinned: int = 0
    dropped: int = 0
    corrupt: int = 0
    hot_tokens: int = 0
    cold_tokens: int = 0
    pinned_tokens: int = 0
    bytes_on_disk: int = 0

    def plus(self, page: PageRow, pinned: bool, sign: int) -> PageCounts:
        """These counts with one page's contribution added (sign=1) or removed (sign=-1);
        `pinned`: the page carries a pin."""
        tokens = sign * (page.token_end - page.token_start)
        changes = {page.state.name.lower(): getattr(self, page.state.name.lower()) + sign}
        if page.state in _TOKEN_FIELDS:
            changes[_TOKEN_FIELDS[page.state]] = getattr(self, _TOKEN_FIELDS[page.state]) + tokens
        if pinned and page.state == PageState.HOT:
            changes.update(pinned=self.pinned + sign, pinned_tokens=self.pinned_tokens + tokens)
        if page.locator:
            changes["bytes_on_disk"] = self.bytes_on_disk + sign * page.byte_size
        return replace(self, **changes)


_TOKEN_FIELDS = {PageState.HOT: "hot_tokens", PageState.COLD: "cold_tokens"}


@dataclass(frozen=True, slots=True)
class SessionRow(Row):
    session_id: str
    created_unix: float = 0.0
    turn: int = 0
    attention_tokens: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    pages: PageCounts = PageCounts()
    model_id: str = ""
    fingerprint: str = ""
    budget_tokens: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    closed: bool = False
    updated_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class PageRow(Row):
    """One page of the KV manifest."""

    page_id: str
    index: int = 0
    token_start: int = 0
    token_end: int = 0
    original_position: int = 0
    state: PageState = PageState.HOT
    locator: str = ""
    byte_size: int = 0
    checksum: str = ""
    dtype: str = ""
    layer_view: str = ""
    updated_unix: float = 0.0
    last_used_turn: int = 0
    score: float = 0.0
    corrupt_reason: str = ""
    prefix_hash: str = ""   # chain hash of the token ids up to the page's end (full pages; "" if none)


@dataclass(frozen=True, slots=True)
class StateChange:
    """A request to move one page (not stored: the page's row is)."""

    page_id: str
    state: PageState
    last_used_turn: int = 0
    score: float = 0.0
    restored_checksum: str = ""   # the payload a restore read: the page must be COLD with it


@dataclass(frozen=True, slots=True)
class PinRow(Row):
    """A pin on the page its key names: the engine keeps the page in attention and contextd never
    drops or deletes it. Not a page state: a pinned page is HOT (counted in `PageCounts.pinned`)."""

    kind: PinKind

    def check(self, page_id: str) -> None:
        """Nothing beyond its type: the service parsed the kind into a PinKind, refusing others."""


@dataclass(frozen=True, slots=True)
class LeaseRow(Row):
    """A lease on the page its key names: it holds while every bound it sets holds."""

    until_turn: int = 0
    expires_unix: float = 0.0

    def check(self, page_id: str) -> None:
        if self.expires_unix < 0:
            raise InvalidArgument("a lease cannot expire before the epoch")
        if not self.until_turn and not self.expires_unix:
            raise InvalidArgument(f"lease on {page_id} needs until_turn, expires_unix or both")

    def active(self, turn: int, now: float) -> bool:
        """turn < until_turn and now < expires_unix, for each bound that is set."""
        if self.until_turn and turn >= self.until_turn:
            return False
        return not (self.expires_unix and now >= self.expires_unix)


@dataclass(frozen=True, slots=True)
class SnapshotRow(Row):
    """A recurrent-state snapshot slot; its payload is a file in the canonical store."""

    slot: str
    token_count: int = 0
    fingerprint: str = ""
    locator: str = ""
    byte_size: int = 0
    checksum: str = ""
    created_unix: float = 0.0


@dataclass(frozen=True, slots=True)
class RecordRow(Row):
    """A session's record as of its last completed turn (its segments are rows of their own)."""

    turn: int = 0
    attention_tokens: int = 0
    fingerprint: str = ""
    segments: int = 0
    tokens: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    fingerprint_parts: tuple[str, ...] = ()
    message_hashes: tuple[str, ...] = ()
    ledger_pages: tuple[int, ...] = ()
    resident_pages: tuple[int, ...] = ()
    resident_positions: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class SegmentRow(Row):
    """One transcript segment."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    generated: bool = False
    opener: bool = False


@dataclass(frozen=True, slots=True)
class HoldRow(Row):
    """This contextd's hold on a session it exports to the object store (contextd.handover): the
    holder object as this contextd last wrote it (its ETag included) and the transcript chunks
    the state it names is made of."""

    token: int = 0
    node: str = ""
    model_id: str = ""
    state: str = ""
    busy_until: float = 0.0
    etag: str = ""
    chunks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Hold:
    """What HoldSession did: the token this server holds the session with (0 without an object
    store), whether the session changed hands to it (its rows were replaced by the state the
    previous holder exported: the serving process must drop what it keeps of the session in
    memory), and which contextd held it before."""

    token: int
    adopted: bool
    previous_node: str


@dataclass(frozen=True, slots=True)
class SessionStatus:
    session_id: str
    model_id: str
    budget_tokens: int
    attention_tokens: int
    turn: int
    pages: PageCounts
    snapshots: int
    closed: bool
    counters: dict[str, int]


@dataclass(frozen=True, slots=True)
class Status:
    commit_seq: int
    last_commit_ms: float
    store_bytes: int
    free_bytes: int
    reserve_bytes: int
    quota_bytes: int
    session_quota_bytes: int
    max_idle_s: float
    sync_mode: str
    root: str
    pid: int
    uptime_s: float
    sessions: tuple[SessionStatus, ...]
    schema_version: int
    object_store: str = ""
    cached_bytes: int = 0
    cache_limit_bytes: int = 0
    objects_uploaded: int = 0
    objects_fetched: int = 0
    bytes_uploaded: int = 0
    bytes_fetched: int = 0
    node: str = ""


@dataclass(frozen=True, slots=True)
class GcResult:
    orphan_files_removed: int = 0
    temp_files_removed: int = 0
    leases_expired: int = 0
    bytes_freed: int = 0
    idle_sessions_deleted: int = 0
    orphan_objects_removed: int = 0
    object_bytes_freed: int = 0


@dataclass(frozen=True, slots=True)
class Branch:
    """What BranchSession made: the new session, the manifest rows it copied, the bytes it shares."""

    session: SessionRow
    pages: int
    shared_bytes: int


@dataclass(frozen=True, slots=True)
class PageRef:
    session_id: str
    page_id: str


@dataclass(frozen=True, slots=True)
class VerifyResult:
    pages_checked: int
    pages_ok: int
    corrupt: tuple[PageRef, ...]
    snapshots_checked: int
    bytes_read: int
