"""SIGTERM drains: a real `kv-elision serve` process with the contextd it started itself.

The server stops accepting connections, answers the turns that have not started with a 503, lets
the turn in flight run until --drain-timeout and then cuts it at its next token (written through
like any other cancelled turn, its answer's end sent to the client), and stops contextd last.
Before, contextd was stopped while the worker was still closing the turn, and the process
exited with the turn neither answered nor recorded.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from contextd.client import Client
from contextd.paths import SOCKET_NAME
from harness.procfs import alive
from harness.rgw import Rgw
from harness.waits import wait_until
from serving.launcher import REPO, ServerProcess, free_port, wait_healthy
from tests.objectstore import bucket
from tests.server.test_handover import Conversation, shared_server

SYSTEM = {"role": "system", "content": "You are a coding agent. Be brief."}
QUESTION = [SYSTEM, {"role": "user", "content": "Tell me the whole history of computing."}]


def serve(root: Path, port: int, log: Path) -> ServerProcess:
    """`kv-elision serve` as a user starts it: nobody answers on its socket, so it starts contextd."""
    env = {k: v for k, v in os.environ.items() if k not in ("KV_ELISION_SOCKET", "XDG_RUNTIME_DIR",
                                                            "KV_ELISION_API_KEY")}
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", "--model", "tiny-llama", "--budget",
                                 "1024", "--tail-tokens", "256", "--max-new-tokens", "100000", "--drain-timeout", "5",
                                 "--root", str(root), "--port", str(port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(root=root, model="tiny-llama", port=port, proc=proc)
    wait_healthy(proc, lambda: server.get("/health").status == 200, 300, "kv-elision serve",
                 lambda: log.read_text(errors="replace"))
    return server


def first_token(server: ServerProcess, messages: list[dict[str, Any]], session: str) -> Any:
    """A long streamed turn, read up to its first token; the rest of its chunks."""
    running = server.stream(messages, session=session, max_tokens=100000)
    assert running.status == 200, running.error
    chunks = running.chunks()
    next(chunk for _, chunk in chunks if chunk["choices"] and chunk["choices"][0]["delta"].get("content"))
    return chunks


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return False
    except (ConnectionRefusedError, ConnectionResetError):   # a reset: the listening socket closed under it
        return True


def test_sigterm_drains_the_turn_in_flight_then_stops_contextd(tmp_path: Any) -> None:
    root, port, log = tmp_path / "root", free_port(), tmp_path / "server.log"
    server = serve(root, port, log)
    assert server.proc is not None
    with Client(root / "run" / SOCKET_NAME) as client:
        daemon_pid = client.wait_ready(timeout=5).pid
    queued = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        chunks = first_token(server, QUESTION, "t")
        queued.request("POST", "/v1/chat/completions", json.dumps({"model": "tiny-llama", "messages": QUESTION}),
                       headers={"Content-Type": "application/json", "X-KV-Session": "q", **server.auth_headers()})
        wait_until(lambda: server.get("/health").body["queued_turns"] == 1, 60, "the second turn to be queued")

        server.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refused(port), 30, "the draining server to refuse connections")
        refusal = queued.getresponse()
        assert refusal.status == 503 and b"stopping" in refusal.read()
        rest = [chunk for _, chunk in chunks]
        assert rest and rest[-1]["choices"][0]["finish_reason"] == "cancelled" and "kv" in rest[-1], rest[-2:]
        assert server.proc.wait(timeout=60) == 0, log.read_text(errors="replace")[-3000:]
    finally:
        queued.close()
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()
    wait_until(lambda: not alive(daemon_pid), 30, f"contextd (pid {daemon_pid}) to end with its server")
    text = log.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]

    again = serve(root, port, log)
    assert again.proc is not None
    try:   # the next turn of the session finds the cut turn recorded, its counters included
        reply = again.chat([*QUESTION, {"role": "assistant", "content": "…"}, {"role": "user", "content": "Go on."}],
                           session="t", max_tokens=2)
        assert reply.status == 200, reply.body
        counters = again.stats("t")["counters"]
        assert counters["turns"] == 2 and counters["cancelled_turns"] == 1, counters
        assert counters["model_forward_tokens"] == \
            counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
    finally:
        again.proc.send_signal(signal.SIGTERM)
        assert again.proc.wait(timeout=60) == 0


def test_sigterm_mid_turn_leaves_no_session_lease_behind(server_factory: Any, rgw: Rgw,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Two servers share an object store; one is stopped mid-turn. Its turn is cut and written
    through, which ends its lease on the session, so the other server takes the session at once
    rather than after the lease (a minute here) runs out."""
    url = bucket(rgw, monkeypatch).config.url
    a = shared_server(server_factory, rgw, url, "--session-lease", "60", "--max-new-tokens", "100000",
                      "--drain-timeout", "1")
    b = shared_server(server_factory, rgw, url, "--session-lease", "60")
    conversation = Conversation()
    conversation.ask(a, "What did a say first?")
    chunks = first_token(a, [*conversation.messages, {"role": "user", "content": "Write a long story."}], "a")
    assert a.proc is not None
    a.proc.send_signal(signal.SIGTERM)
    rest = [chunk for _, chunk in chunks]
    assert rest and rest[-1]["choices"][0]["finish_reason"] == "cancelled", rest[-2:]
    assert a.proc.wait(timeout=60) == 0, a.log_tail()
    reply = b.chat([*conversation.messages, {"role": "user", "content": "Repeat a_3."}], session="a", max_tokens=4)
    assert reply.status == 200, reply.body
    assert b.stats("a")["counters"]["adoptions"] == 1
