"""The server's connections as a hostile or broken client meets them: a body length that is not
one plain number, a client that sends its request a byte at a time, more connections than the
server keeps threads for. A real `kv-elision serve` on the tiny model, raw sockets.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest

from serving.http import MAX_CONNECTIONS
from serving.launcher import ServerProcess

CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def answer(sock: socket.socket, wait_s: float) -> bytes:
    """What the server sends before it closes the connection or `wait_s` seconds pass."""
    deadline = time.monotonic() + wait_s
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            break
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.mark.parametrize("lengths", [["-1"], ["abc"], ["+2"], ["2_0"], ["0x2"], ["2, 2"], ["2", "3"]])
def test_a_content_length_that_is_not_one_decimal_number_is_refused_at_once(server_factory: Any,
                                                                            lengths: list[str]) -> None:
    """`Content-Length: -1` once read the body to the end of the stream, past the 32 MiB limit:
    the client that keeps its side open held the thread until its timeout, with no answer."""
    server: ServerProcess = server_factory("tiny-llama", 1024)
    headers = b"".join(f"Content-Length: {value}\r\n".encode() for value in lengths)
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(CHAT + headers + b"\r\n{}")
        reply = answer(sock, 10.0)
    assert reply.startswith(b"HTTP/1.1 400 "), reply[:200]
    assert b"Content-Length" in reply, reply


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_client_that_trickles_its_request_is_cut_off_at_the_deadline(server_factory: Any, part: str) -> None:
    """A byte every half second never lets a per-read timeout of 2 s expire; the whole request
    (headers and body) must still arrive within --client-timeout of its start."""
    server: ServerProcess = server_factory("tiny-llama", 1024, "--client-timeout", "2")
    head = CHAT + (b"Content-Length: 100000\r\n\r\n" if part == "body" else b"")
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head)
        let_go = False
        while not let_go and time.monotonic() - started < 15:
            try:
                sock.sendall(b"a")
            except OSError:
                let_go = True
                break
            sock.settimeout(0.5)
            try:
                sock.recv(1 << 16)   # an answer, or the end of the stream
            except TimeoutError:
                continue
            except OSError:
                pass
            let_go = True
    assert let_go, f"a client trickling its {part} was still held after 15 s"


def test_connections_past_the_bound_are_refused_and_the_slots_come_back(server_factory: Any) -> None:
    """Every connection holds a thread while it is open: past MAX_CONNECTIONS a new one gets a 503
    at once instead of one more thread; once the idle ones leave, the server answers again."""
    server: ServerProcess = server_factory("tiny-llama", 1024)
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CONNECTIONS)]
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            reply = answer(extra, 10.0)
        assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
        assert b"connections" in reply
    finally:
        for sock in idle:
            sock.close()
    deadline = time.monotonic() + 30
    while not healthy(server):
        assert time.monotonic() < deadline, "the slots of closed connections did not come back"


def healthy(server: ServerProcess) -> bool:
    try:
        return server.get("/health").status == 200
    except OSError:   # refused while the slots are still held
        return False
