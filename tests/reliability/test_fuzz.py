"""Fast samples of the fuzzing (benchmarks.faults part 3): Hypothesis-generated malformed HTTP
requests to a real server, malformed gRPC requests and raw bytes to a real contextd. Both keep
serving; every answer is a clear 4xx (gRPC: a status that names the caller's mistake); memory
stays bounded. The campaign sends 10,000 of each; these send a few hundred. Every answer must be
clear."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from harness.faults.fuzz import SLOW_CLIENT_TIMEOUT_S, fuzz_grpc, fuzz_http, http_exchange
from harness.procfs import status_field
from serving.launcher import ServerProcess


def test_malformed_http_gets_clear_answers_and_the_server_keeps_serving(server: ServerProcess) -> None:
    assert server.proc is not None
    rss = status_field(server.proc.pid, "VmRSS", gone=0)
    tally = fuzz_http(server.port, 300, seed=7, alive=lambda: server.get("/health").status == 200,
                      auth=server.auth_headers())
    assert not tally.unclear, tally.unclear
    assert server.get("/health").status == 200 and server.proc.poll() is None
    assert status_field(server.proc.pid, "VmRSS", gone=0) - rss < 200 << 10, "the server grew by more than 200 MiB"
    assert tally.answered.get("400", 0) > 100
    assert tally.answered.get("401", 0) < tally.sent // 10, "most requests never got past the key check"


def test_malformed_grpc_and_raw_bytes_get_a_status_and_contextd_keeps_serving(server: ServerProcess) -> None:
    assert server.contextd is not None and server.contextd.proc is not None and server.contextd.client is not None
    rss = status_field(server.contextd.proc.pid, "VmRSS", gone=0)
    tally = fuzz_grpc(server.socket, 600, seed=3)
    assert not tally.unclear, tally.unclear
    assert server.contextd.proc.poll() is None and server.contextd.client.status().pid == server.contextd.proc.pid
    assert status_field(server.contextd.proc.pid, "VmRSS", gone=0) - rss < 100 << 10
    assert tally.answered.get("INVALID_ARGUMENT", 0) > 100


def exchange(server: ServerProcess, body: bytes, headers: str = "") -> tuple[int | None, Any]:
    """One raw POST with the server's key (else every answer is the 401 before the body is read)."""
    headers = "".join(f"{name}: {value}\r\n" for name, value in server.auth_headers().items()) + headers
    raw = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n{headers}"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    status, data = http_exchange(server.port, raw)
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


def test_a_deeply_nested_body_gets_a_400(server: ServerProcess) -> None:
    status, body = exchange(server, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_a_malformed_tool_call_in_the_history_gets_a_400(server: ServerProcess) -> None:
    body = {"model": server.model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [{"function": 5}]},
        {"role": "user", "content": "and?"}]}
    status, reply = exchange(server, json.dumps(body).encode())
    assert status == 400, reply


def test_a_request_line_of_non_ascii_whitespace_gets_a_400(server: ServerProcess) -> None:
    status, _ = http_exchange(server.port, b"\xa0\r\n\r\n")
    assert status == 400


def test_a_client_that_stops_mid_request_is_let_go(server: ServerProcess) -> None:
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    try:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"mess")
        deadline = time.monotonic() + SLOW_CLIENT_TIMEOUT_S + 10
        gone = False
        conn.settimeout(1.0)
        while time.monotonic() < deadline and not gone:
            try:
                conn.recv(1 << 12)  # an answer (408, 400) or the connection closed: let go either way
            except TimeoutError:
                continue
            except OSError:
                pass
            gone = True
        assert gone, "still held 10 s after its --client-timeout"
    finally:
        conn.close()


def test_an_undecodable_grpc_body_is_invalid_argument(server: ServerProcess) -> None:
    import grpc

    from contextd.paths import target

    with grpc.insecure_channel(target(Path(server.socket))) as channel:
        call = channel.unary_unary("/kv_elision.contextd.v1.Contextd/UpsertPages")
        with pytest.raises(grpc.RpcError) as failed:
            call(b"\xff\xff\xff", timeout=10)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
