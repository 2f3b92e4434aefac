"""A request body parsed past the messages its session's last body held gives exactly what
`json.loads` gives, refuses exactly what it refuses, and reuses only text it compared in full."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.request_body import BodyParser


def body(messages: list[Any], **extra: Any) -> bytes:
    return json.dumps({"model": "m", "messages": messages, **extra}).encode()


def turns(count: int) -> list[list[dict[str, Any]]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}]
    out = []
    for n in range(count):
        messages = messages + [{"role": "user", "content": f"question {n} \u00e9\n\"quoted\""},
                               {"role": "assistant", "content": f"answer {n}"}]
        out.append(messages)
    return out


def test_each_body_of_a_growing_session_parses_as_json_loads_does_and_reuses_the_last_messages() -> None:
    parser = BodyParser()
    previous: list[Any] | None = None
    for n, messages in enumerate(turns(6)):
        raw = body(messages, stream=n % 2 == 0, tools=[{"type": "function"}])
        parsed = parser.parse(raw, "a")
        assert parsed == json.loads(raw)
        if previous is not None:
            assert all(new is old for new, old in zip(parsed["messages"], previous, strict=False))
        previous = parsed["messages"]


def test_nothing_is_reused_across_sessions_or_after_the_remembered_text_changed() -> None:
    parser = BodyParser()
    first, second = turns(2)
    parser.parse(body(first), "a")
    other = parser.parse(body(second), "b")
    assert other == json.loads(body(second))
    edited = [dict(m) for m in second]
    edited[1]["content"] = "changed"
    parsed = parser.parse(body(edited), "a")
    assert parsed["messages"][1]["content"] == "changed" and parsed == json.loads(body(edited))
    fewer = parser.parse(body(first[:1]), "a")
    assert fewer == json.loads(body(first[:1]))


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "messages": [{"a": 1},]}', b'{"model": "m", "messages": [{"a": 1}', b'{"messages": [] } x',
    b'{"messages": [1 2]}', b'{"messages": [], }', b'{messages: []}', b'{"messages" []}', b"", b"\xff",
])
def test_a_body_json_loads_refuses_is_refused_after_a_remembered_one_too(raw: bytes) -> None:
    parser = BodyParser()
    parser.parse(b'{"model": "m", "messages": [{"a": 1}]}', "a")
    with pytest.raises(ValueError):
        json.loads(raw)
    with pytest.raises(ValueError):
        parser.parse(raw, "a")


def test_sessions_beyond_the_limit_are_forgotten_oldest_first() -> None:
    parser = BodyParser(sessions=2)
    for session in ("a", "b", "c"):
        parser.parse(body([{"role": "user", "content": session}]), session)
    assert list(parser._remembered) == ["b", "c"]
    with pytest.raises(ValueError, match="at least 1"):
        BodyParser(sessions=0)


def test_a_session_the_server_lets_go_is_forgotten() -> None:
    parser = BodyParser()
    for session in ("a", "b"):
        parser.parse(body([{"role": "user", "content": session}]), session)
    parser.forget("a")
    parser.forget("never-seen")
    assert list(parser._remembered) == ["b"]


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(first=st.lists(JSON, max_size=4), added=st.lists(JSON, max_size=3), extra=st.dictionaries(
    st.sampled_from(["model", "tools", "stream", "messages"]), JSON, max_size=3), indent=st.sampled_from([None, 1]))
def test_any_pair_of_bodies_parses_as_json_loads_does(first: list[Any], added: list[Any], extra: dict[str, Any],
                                                     indent: int | None) -> None:
    parser = BodyParser()
    for messages in (first, first + added):
        raw = json.dumps({"messages": messages, **extra}, indent=indent).encode()
        assert parser.parse(raw, "s") == json.loads(raw)


def test_a_repeated_key_keeps_its_last_value_as_json_loads_does() -> None:
    parser = BodyParser()
    parser.parse(b'{"messages": [1]}', "a")
    raw = b'{"messages": [1, 2], "messages": [3]}'
    assert parser.parse(raw, "a") == json.loads(raw) == {"messages": [3]}


@pytest.mark.parametrize("first, second", [
    (b'{"messages": [1]}', b'{"messages": [12]}'),
    (b'{"messages": [2.5]}', b'{"messages": [2.5e3, 1]}'),
    (b'{"messages": [1 ]}', b'{"messages": [1 , 2]}'),
])
def test_a_remembered_last_item_is_reused_only_where_it_ends_in_the_new_body_too(first: bytes, second: bytes) -> None:
    parser = BodyParser()
    parser.parse(first, "a")
    assert parser.parse(second, "a") == json.loads(second)


@pytest.mark.parametrize("raw", [
    '{"messages": [{"role": "user", "content": "\u00e9"}]}'.encode("utf-16"),
    '{"messages": []}'.encode("utf-32-le"), b'\xef\xbb\xbf{"messages": []}', b'"\xed\xa0\x80"',
])
def test_bodies_are_decoded_as_json_loads_decodes_bytes(raw: bytes) -> None:
    parser = BodyParser()
    assert parser.parse(raw, "a") == json.loads(raw)
    assert parser.parse(raw, None) == json.loads(raw)
