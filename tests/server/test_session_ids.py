"""Session ids at the HTTP edge: a real `kv-elision serve` on the tiny model, a real contextd.

An id either names one session exactly as sent or is refused with a 400 that says what an id may
hold (contextd's rule: 1-128 of [A-Za-z0-9._:-], not starting with '.'). It is never rewritten, so
two clients' ids never become one session, and nothing a client names reaches contextd to fail
there as a 500.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from contextd.ids import MAX_ID_LENGTH
from serving.launcher import ServerProcess

SYSTEM = {"role": "system", "content": "You are a coding agent. Be brief."}
USER = {"role": "user", "content": "Say hi."}


def refused(reply: Any) -> bool:
    error = reply.body.get("error", {}) if isinstance(reply.body, dict) else {}
    return reply.status == 400 and error.get("type") == "invalid_request_error" and \
        "[A-Za-z0-9._:-]" in error.get("message", "")


def test_ids_outside_the_rule_are_refused_with_a_400_and_never_merged(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    # Non-ASCII letters and digits passed `str.isalnum` and failed in contextd (500); "a/b" and
    # "a b" were both rewritten to "a-b", ".x" to "x", and a 129-character id cut to 128: one
    # session for two clients.
    for session in ["café", "a²", "a/b", "a b", ".x", "x" * (MAX_ID_LENGTH + 1)]:
        for header in ("X-KV-Session", "X-Session-Affinity"):
            reply = server.request("POST", "/v1/chat/completions", {"model": server.model, "messages": [SYSTEM, USER],
                                                                    "max_tokens": 2}, headers={header: session})
            assert refused(reply), (session, header, reply.status, reply.body)
        for route in ("/v1/kv/stats", "/v1/kv/pages", "/v1/kv/score"):
            reply = server.request("GET", f"{route}?session={quote(session, safe='')}")
            assert refused(reply), (session, route, reply.status, reply.body)
        reply = server.request("POST", "/v1/kv/score", {"session": session, "candidates": ["hi"]})
        assert refused(reply), (session, reply.status, reply.body)
    assert server.stats()["counters"]["turns"] == 0, "a refused id ran a turn"

    longest = "a" * MAX_ID_LENGTH
    for session in ["0193c0de-7f2a-7b3c-9d4e-5f6a7b8c9d0e", "pi:session_1.2-x", longest]:
        reply = server.chat([SYSTEM, USER], session=session, max_tokens=2)
        assert reply.status == 200 and reply.headers["x-kv-session"] == session, (session, reply.body)
        assert server.stats(session)["counters"]["turns"] == 1


def test_a_watch_with_branches_refuses_an_id_its_branches_cannot_extend(server_factory: Any) -> None:
    """Each branch of a watched turn is a session named `ID-branch-<12 hex digits>`: an id longer
    than 108 characters made every branch id too long for contextd, and the branches were
    skipped with a line in the log while the watch said 202."""
    server: ServerProcess = server_factory("tiny-llama", 1024)
    fits = "b" * (MAX_ID_LENGTH - len("-branch-") - 12)
    watch = {"candidates": ["hi"], "branches": ["hybrid"]}
    reply = server.request("POST", "/v1/kv/score", {**watch, "session": fits + "b"})
    assert reply.status == 400 and "branches" in reply.body["error"]["message"], reply.body
    assert server.chat([SYSTEM, USER], session=fits, max_tokens=2).status == 200
    assert server.request("POST", "/v1/kv/score", {**watch, "session": fits}).status == 202
    reply = server.chat([SYSTEM, USER, {"role": "assistant", "content": "hi"}, {"role": "user", "content": "Again."}],
                        session=fits, max_tokens=2)
    assert reply.status == 200, reply.body
    assert set(server.get(f"/v1/kv/score?session={fits}").body["branches"]) == {"hybrid"}
