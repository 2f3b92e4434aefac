"""Identifier rules for sessions, pages, tags and snapshot slots.

Identifiers become LMDB key parts (contextd.keys) and file names in the canonical store, so they
are checked at the socket before anything else touches them. Depends on contextd.errors only.
"""

from __future__ import annotations

import re

from contextd.errors import InvalidArgument

MAX_ID_LENGTH = 128
_ID = re.compile(r"[A-Za-z0-9_:\-][A-Za-z0-9._:\-]{0,127}")


def check_id(value: str, what: str) -> str:
    """Return value when it is a valid identifier, else raise InvalidArgument naming `what`.

    Allowed: 1-128 characters from [A-Za-z0-9._:-], not starting with '.', so no identifier can
    be empty, hidden, or climb out of its folder ("../../x" is refused).
    """
    if not value:
        raise InvalidArgument(f"{what} is empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidArgument(f"{what} is {len(value)} characters long; at most {MAX_ID_LENGTH} are allowed")
    if _ID.fullmatch(value) is None:
        raise InvalidArgument(
            f"{what} {value[:40]!r} is not a valid identifier: use 1-{MAX_ID_LENGTH} characters from "
            "[A-Za-z0-9._:-], not starting with '.'"
        )
    return value

