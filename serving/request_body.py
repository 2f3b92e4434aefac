"""A chat request's JSON body, parsed in time that follows what is new in it.

An agent sends the whole transcript in every request: about 4 MB of JSON at a million tokens,
and `json.loads` of a whole agent body took time every turn that grew with the session
(docs/journal/2026-11-30-scale.md). Each body repeats the previous one's text up to the end of
its `messages` array and adds messages there. So `BodyParser` keeps, per session, the last body's
text up to that array's closing bracket and the messages parsed from it; a body that begins with
that text has only its new messages and the rest of the object parsed. Anything else is parsed in
full, the same way.

The parse is exact: a body is accepted, and gives the same object, exactly when `json.loads`
would (duplicate keys: the last wins; NaN and Infinity accepted), because the remembered text is
compared in full before its messages are reused, and every other byte goes through the standard
library's own decoder (`JSONDecoder.raw_decode`). Reused messages are the same objects as the
last request's: the engine never modifies a request's messages.

Depends on nothing of ours.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder()
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_AFTER_ITEM = (",", "]", " ", "\t", "\n", "\r")


@dataclass(frozen=True)
class _Remembered:
    """The last body of one session, up to its messages array's closing bracket."""

    opened: int                     # index of the array's opening bracket
    text: str                       # the body's text before the closing bracket
    messages: tuple[Any, ...]


class BodyParser:
    """Parses request bodies, reusing per session (at most `sessions` of them, least recently
    used beyond) the messages the previous body of that session already held."""

    def __init__(self, sessions: int = 16) -> None:
        if sessions < 1:
            raise ValueError("sessions must be at least 1")
        self.sessions = sessions
        self._remembered: OrderedDict[str, _Remembered] = OrderedDict()
        self._lock = threading.Lock()

    def parse(self, raw: bytes, session: str | None) -> Any:
        """The body's JSON value. Raises json.JSONDecodeError (a ValueError), UnicodeDecodeError
        or RecursionError as `json.loads` would for a body it refuses."""
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")   # as json.loads(bytes) decodes
        start = _skip(text, 0)
        if session is None or text[start:start + 1] != "{":
            return json.loads(text)
        with self._lock:
            known = self._remembered.get(session)
        value, remembered = _parse_object(text, start, known)
        if remembered is not None:
            with self._lock:
                self._remembered[session] = remembered
                self._remembered.move_to_end(session)
                while len(self._remembered) > self.sessions:
                    self._remembered.popitem(last=False)
        return value

    def forget(self, session: str) -> None:
        """The server let go of `session`: its next body is parsed whole."""
        with self._lock:
            self._remembered.pop(session, None)


def _skip(text: str, pos: int) -> int:
    match = _WHITESPACE.match(text, pos)
    assert match is not None   # the pattern matches the empty string
    return match.end()


def _expect(text: str, pos: int, char: str, what: str) -> int:
    if text[pos:pos + 1] != char:
        raise json.JSONDecodeError(what, text, pos)
    return _skip(text, pos + 1)


def _parse_object(text: str, pos: int, known: _Remembered | None) -> tuple[dict[str, Any], _Remembered | None]:
    """The object at `pos` (its `{`) and what to remember of its messages array, if it has one."""
    value: dict[str, Any] = {}
    remembered = None
    pos = _skip(text, pos + 1)
    if text[pos:pos + 1] == "}":
        pos += 1
    else:
        while True:
            if text[pos:pos + 1] != '"':
                raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
            key, pos = _DECODER.raw_decode(text, pos)
            pos = _expect(text, _skip(text, pos), ":", "Expecting ':' delimiter")
            if key == "messages" and text[pos:pos + 1] == "[":
                item, pos, remembered = _parse_messages(text, pos, known)
            else:
                item, pos = _DECODER.raw_decode(text, pos)
            value[key] = item
            pos = _skip(text, pos)
            if text[pos:pos + 1] == "}":
                pos += 1
                break
            pos = _expect(text, pos, ",", "Expecting ',' delimiter")
    if _skip(text, pos) != len(text):
        raise json.JSONDecodeError("Extra data", text, _skip(text, pos))
    return value, remembered


def _parse_messages(text: str, opened: int, known: _Remembered | None) -> tuple[list[Any], int, _Remembered]:
    """The array at `opened` (its `[`): (items, index after it, what to remember of it). Items the
    remembered text already held are reused when this body begins with that text."""
    held = len(known.text) if known is not None else 0
    # The remembered text must end where the last remembered item does in this body too: `[1]`
    # then `[12]` share the text `[1`, not the item.
    if known is not None and known.opened == opened and text.startswith(known.text) and \
            text[held:held + 1] in _AFTER_ITEM:
        items, pos = list(known.messages), held
    else:
        items, pos = [], opened + 1
    while True:
        pos = _skip(text, pos)
        if text[pos:pos + 1] == "]":
            return items, pos + 1, _Remembered(opened, text[:pos], tuple(items))
        if items:
            pos = _expect(text, pos, ",", "Expecting ',' delimiter")
        item, pos = _DECODER.raw_decode(text, pos)
        items.append(item)
