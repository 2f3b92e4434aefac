"""Hostile and broken clients on a real server's connections: a body length that is not one plain
number (refused at once, not after the client timeout), a slowloris client that trickles its
headers or body a byte at a time (let go at --client-timeout however steadily it trickles, while
/health still answers), and a client that stops reading its stream (its turn ends once a write
has waited --client-timeout, and the next request is served).

Each function is one kind of case, counted (`Cases`); tests/server/test_connections.py and
test_client_gone.py pin the same behaviour one case at a time.

Depends on serving.launcher (the server and its key) and the standard library.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CLIENT_TIMEOUT_S", "Cases", "hostile_content_length", "slowloris", "stopped_reading"]

CLIENT_TIMEOUT_S = 3.0   # the connections server's --client-timeout
SLACK_S = 10.0           # past a deadline, for a busy 2-core machine
TRICKLE_S = 0.5          # a slowloris byte this often: far under any per-read timeout
# Content-Length values a server must refuse before reading a body: one decimal number or nothing.
HOSTILE_LENGTHS = (["-1"], ["abc"], ["+2"], ["2_0"], ["0x2"], ["2, 2"], ["2", "3"], ["1e3"], [""],
                   [str(1 << 62)], ["99999999999999999999999999"])


@dataclass
class Cases:
    """How many cases of a kind ran, how many held, and what the others did."""

    cases: int = 0
    held: int = 0
    problems: list[str] = field(default_factory=list)

    def note(self, ok: bool, what: str) -> None:
        self.cases += 1
        self.held += ok
        if not ok:
            self.problems.append(what)


def _head(server: Any, extra: bytes = b"") -> bytes:
    auth = "".join(f"{k}: {v}\r\n" for k, v in server.auth_headers().items()).encode()
    return b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + auth + extra


def _answer(sock: socket.socket, wait_s: float) -> bytes:
    """What the server sends before it closes the connection or `wait_s` seconds pass."""
    deadline = time.monotonic() + wait_s
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


def hostile_content_length(server: Any) -> Cases:
    """Each hostile Content-Length (and a chunked body) with the client's side kept open: a 400,
    411 or 413 must come back before the client timeout could have fired, and the connection close."""
    found = Cases()
    bodies = [b"".join(f"Content-Length: {value}\r\n".encode() for value in values) for values in HOSTILE_LENGTHS]
    for headers in [*bodies, b"Transfer-Encoding: chunked\r\n"]:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", server.port), timeout=CLIENT_TIMEOUT_S + SLACK_S) as sock:
            sock.sendall(_head(server, headers) + b"\r\n{}")
            reply = _answer(sock, CLIENT_TIMEOUT_S + SLACK_S)
        took = time.monotonic() - started
        status = reply.split(b" ", 2)[1] if reply.startswith(b"HTTP/1.1 ") else b""
        found.note(status in (b"400", b"411", b"413") and took < CLIENT_TIMEOUT_S,
                   f"{headers!r}: {reply[:80]!r} after {took:.1f} s")
    return found


def slowloris(server: Any) -> Cases:
    """A client that sends its headers, or its body, a byte every TRICKLE_S: let go (an answer or
    the connection closed) within --client-timeout of its start plus slack, and /health answers
    another client meanwhile."""
    found = Cases()
    for part in ("headers", "body"):
        head = _head(server, b"Content-Length: 100000\r\n\r\n" if part == "body" else b"")
        started = time.monotonic()
        let_go = False
        health = 0
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head)
            while not let_go and time.monotonic() - started < CLIENT_TIMEOUT_S + SLACK_S:
                try:
                    sock.sendall(b"a")
                except OSError:
                    let_go = True
                    break
                if not health:
                    health = int(server.get("/health").status)
                sock.settimeout(TRICKLE_S)   # the pace of the trickle: the next byte when nothing came back
                try:
                    sock.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    pass
                let_go = True
        took = time.monotonic() - started
        found.note(let_go and health == 200, f"trickled {part}: let go {let_go} after {took:.1f} s, /health {health}")
    return found


def stopped_reading(server: Any, session: str = "stopped-reading") -> Cases:
    """A streamed turn whose client keeps its connection and reads nothing (a small receive
    window): the turn is ended as cancelled within the deadline, its accounting holds, and the
    next request is answered. The server needs --max-new-tokens far above what fills the socket's
    buffers."""
    found = Cases()
    data = json.dumps({"model": server.model, "max_tokens": 100000, "stream": True, "messages": [
        {"role": "system", "content": "You are a coding agent. Be brief."},
        {"role": "user", "content": "Tell me everything."}]}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # before connecting: a small window
    sock.connect(("127.0.0.1", server.port))
    deadline = 90.0
    started = time.monotonic()
    ended = False
    try:
        sock.sendall(_head(server, f"X-KV-Session: {session}\r\nContent-Length: {len(data)}\r\n\r\n".encode()) + data)
        sock.settimeout(60)
        if sock.recv(64).startswith(b"HTTP/1.1 200 "):
            while not ended and time.monotonic() - started < deadline:
                reply = server.request("GET", f"/v1/kv/stats?session={session}", timeout=30.0)
                ended = reply.status == 200 and int(reply.body["counters"]["cancelled_turns"]) == 1
                if not ended:
                    time.sleep(0.2)   # a poll's pace (the deadline bounds the wait)
    finally:
        sock.close()
    counters = server.stats(session)["counters"] if ended else {}
    # The blend (controller.blend) recomputes held tokens in place: forward tokens of their own.
    exact = bool(counters) and counters["model_forward_tokens"] == counters["new_prefill_tokens"] + \
        counters["decoded_tokens"] + counters.get("blend_forward_tokens", 0)
    after = server.chat([{"role": "user", "content": "hi"}], session=f"{session}-next", max_tokens=2)
    found.note(ended and exact and after.status == 200,
               f"turn ended {ended} after {time.monotonic() - started:.1f} s, accounting {exact}, "
               f"next request {after.status}")
    return found
