"""LMDB keys: one typed key per kind of row, owning both its encoding and its parsing.

A key is its fields in order, joined by NUL: identifiers as they are (NUL cannot occur in one,
see contextd.ids), a page state as its number, a segment's sequence number as 12 digits so keys
sort in transcript order. Every key but a `PrefixKey` starts with its session, so `session_scope`
selects exactly one session's rows in any table but `prefixes`, and `state_scope` one session's
pages in one state; `prefix_scope` selects the pages of every session that end one token prefix.

Depends on contextd.wire (PageState) and contextd.errors only.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Any, Self

from contextd.errors import DataCorrupt
from contextd.wire import PageState

SEP = b"\x00"
EVERYTHING = b""  # the scope of every row of a table


def _encode_part(value: str | int) -> bytes:
    if isinstance(value, PageState):
        return str(int(value)).encode()
    if isinstance(value, int):
        return f"{value:012d}".encode()
    return value.encode()


_HINTS: dict[type, tuple[Any, ...]] = {}


def _hints(cls: type) -> tuple[Any, ...]:
    """A key type's part types, in order, resolved once."""
    if cls not in _HINTS:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = tuple(hints[f.name] for f in fields(cls))
    return _HINTS[cls]


class Key:
    """What every key shares: the bytes it is stored under and the way back."""

    __slots__ = ()

    def encode(self) -> bytes:
        return SEP.join(_encode_part(getattr(self, f.name)) for f in fields(self))  # type: ignore[arg-type]

    @classmethod
    def parse(cls, raw: bytes) -> Self:
        parts = raw.split(SEP)
        hints = _hints(cls)
        if len(parts) != len(hints):
            raise DataCorrupt(f"key {raw!r} does not have the {len(hints)} parts of a {cls.__name__}")
        return cls(*(hint(int(part)) if hint is not str else part.decode() for hint, part in zip(hints, parts,
                                                                                                 strict=True)))


@dataclass(frozen=True, slots=True)
class MetaKey(Key):
    """The one row of the meta table."""

    name: str = "meta"


@dataclass(frozen=True, slots=True)
class SessionKey(Key):
    """A session's own row: `sessions`, `records`."""

    session_id: str


@dataclass(frozen=True, slots=True)
class PageKey(Key):
    """A page of a session: `kv_manifest`, `pins`, `leases`."""

    session_id: str
    page_id: str


@dataclass(frozen=True, slots=True)
class StateKey(Key):
    """The index of a session's pages by state: `page_state`."""

    session_id: str
    state: PageState
    page_id: str


@dataclass(frozen=True, slots=True)
class SnapshotKey(Key):
    session_id: str
    slot: str


@dataclass(frozen=True, slots=True)
class SegmentKey(Key):
    """The seq-th segment of a session's transcript."""

    session_id: str
    seq: int


@dataclass(frozen=True, slots=True)
class PrefixKey(Key):
    """A stored full page by the chain hash of every token id up to its end: `prefixes`. Keyed by
    the hash first, so the sessions whose histories begin with the same tokens sit together."""

    prefix_hash: str
    session_id: str
    page_id: str


def session_scope(session_id: str) -> bytes:
    """The prefix of every row of one session, in any table."""
    return session_id.encode() + SEP


def prefix_scope(prefix_hash: str) -> bytes:
    """The prefix of every page that ends the token prefix `prefix_hash`, in `prefixes`."""
    return prefix_hash.encode() + SEP


def state_scope(session_id: str, state: PageState) -> bytes:
    """The prefix of one session's pages in one state, in `page_state`."""
    return session_scope(session_id) + _encode_part(state) + SEP
