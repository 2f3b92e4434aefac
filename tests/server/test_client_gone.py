"""A client that is gone, whichever way it went: one that stops reading its stream (stalled past
--client-timeout), one that hangs up while its prompt is still being prefilled. Either way the
turn ends for nobody no later than its next step. A real `kv-elision serve` on the tiny model, a
real contextd, raw sockets.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from contextd.client import Client
from harness.waits import wait_until
from serving.launcher import ServerProcess

SYSTEM = {"role": "system", "content": "You are a coding agent. Be brief."}


def raw_chat(server: ServerProcess, session: str, body: dict[str, Any], sock: socket.socket) -> None:
    data = json.dumps({"model": server.model, **body}).encode()
    key = server.auth_headers()["Authorization"]
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Authorization: {key}\r\nX-KV-Session: {session}\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)


def test_a_stream_whose_client_stops_reading_ends_its_turn(server_factory: Any) -> None:
    """A client that keeps its connection but reads nothing more: once a write has waited
    --client-timeout, the client is gone and its turn ends at the next token (it decoded on to
    max_tokens for nobody: the write's timeout was not taken for a client that left)."""
    server: ServerProcess = server_factory("tiny-llama", 1024, "--client-timeout", "2", "--max-new-tokens", "100000")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connecting: a small window
    sock.connect(("127.0.0.1", server.port))
    try:
        raw_chat(server, "stall", {"messages": [SYSTEM, {"role": "user", "content": "Tell me everything."}],
                                   "max_tokens": 100000, "stream": True}, sock)
        sock.settimeout(60)
        assert sock.recv(64).startswith(b"HTTP/1.1 200 "), "the stream did not start"

        def cancelled() -> bool:
            return int(server.stats("stall")["counters"]["cancelled_turns"]) == 1

        wait_until(cancelled, 90, "the turn of a client that stopped reading to end")
        counters = server.stats("stall")["counters"]
        assert counters["decoded_tokens"] < 100000
        assert counters["model_forward_tokens"] == \
            counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
    finally:
        sock.close()
    assert server.chat([SYSTEM, {"role": "user", "content": "hi"}], session="next", max_tokens=2).status == 200


def test_a_client_that_leaves_during_its_prefill_ends_the_turn_before_its_prompt_is_in(server_factory: Any) -> None:
    """The prompt is long enough that its prefill takes many steps; the client hangs up once the
    turn has started. The turn ends between two prefill chunks, before any token is decoded, and
    the worker takes the next request; the session's next turn starts from what contextd holds.
    Before, the whole prompt was prefilled and one token decoded for nobody, and the next request
    waited for it all."""
    server: ServerProcess = server_factory("tiny-llama", 1024)
    prompt = [SYSTEM, {"role": "user", "content": "alpha beta gamma delta " * 20000}]   # ~80,000 tokens
    contextd = Client(server.socket)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            raw_chat(server, "left", {"messages": prompt, "max_tokens": 4}, sock)
            wait_until(lambda: "left" in {s.session_id for s in contextd.status().sessions}, 60,
                       "the turn to start")
        reply = server.chat([SYSTEM, {"role": "user", "content": "hi"}], session="next", max_tokens=2)
        assert reply.status == 200, reply.body
        left = server.request("GET", "/v1/kv/stats?session=left")
        assert left.status == 404, f"the turn of a client that left during its prefill completed: {left.body}"
        totals = server.stats()["counters"]
        assert totals["cancelled_turns"] == 1 and totals["turns"] == 2, totals
    finally:
        contextd.close()
    again = server.chat([SYSTEM, {"role": "user", "content": "Start over."}], session="left", max_tokens=2)
    assert again.status == 200, again.body
    counters = server.stats("left")["counters"]
    assert counters["turns"] == 1
    assert counters["model_forward_tokens"] == \
        counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
