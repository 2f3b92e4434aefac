"""The HTTP server's worker thread under failures: a turn's failure is answered and the worker
serves on, even when cleaning up after it fails too; a failure of the worker's own loop is
answered to every waiting client and to /health, never left as a request that waits forever.

In-process server on the tiny model with a real contextd; the failures are injected into the
engine the worker drives.
"""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from backends import load_backend
from contextd.client import Client
from controller.selectors import HybridSelector
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.http import Server
from serving.launcher import ContextdProcess

CONFIG = EngineConfig(budget_tokens=1024, tail_tokens=256, max_new_tokens=4)
REPLY_S = 120.0   # a turn of the tiny model takes well under a second; this only bounds a hang


@pytest.fixture
def server(contextd: ContextdProcess) -> Iterator[Server]:
    backend = load_backend("torch", "tiny-llama", capacity=CONFIG.budget_tokens + 256)
    engine = Engine(backend, ChatFormat(backend.tokenizer), Client(contextd.socket, timeout=60.0), CONFIG,
                    HybridSelector())
    served = Server(engine, "tiny-llama", "127.0.0.1", 0, str(contextd.socket))
    thread = threading.Thread(target=served.serve_forever, name="test-http", daemon=True)
    thread.start()
    yield served
    served.shutdown()
    thread.join(timeout=60)
    assert not thread.is_alive()


def call(server: Server, method: str, path: str, body: Any = None, session: str = "w") -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=REPLY_S)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json", "X-KV-Session": session})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"null")
    finally:
        conn.close()


def chat(server: Server, text: str, session: str = "w") -> tuple[int, Any]:
    return call(server, "POST", "/v1/chat/completions",
                {"model": "tiny-llama", "messages": [{"role": "user", "content": text}]}, session)


def fail_once(target: Any, name: str, error: Exception) -> list[int]:
    """Make `target.name` raise `error` on its next call only; returns the list its calls land in."""
    real = getattr(target, name)
    calls: list[int] = []

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise error
        return real(*args, **kwargs)

    setattr(target, name, failing)
    return calls


def test_a_turn_that_fails_and_whose_cleanup_fails_too_is_answered_and_the_worker_serves_on(server: Server) -> None:
    engine = server.worker.engine
    status, _ = chat(server, "Say hello.")   # the session and its cache exist: a failure must empty it
    assert status == 200
    rendered = fail_once(engine.format, "render", RuntimeError("injected: the turn fails"))
    emptied = fail_once(engine.mover, "empty", RuntimeError("injected: emptying its cache fails"))

    status, body = chat(server, "Say hello.")
    assert status == 500 and "injected: the turn fails" in body["error"]["message"]

    status, body = chat(server, "Say hello.")   # runs after the failed turn's cleanup: one worker
    assert status == 200, body
    assert rendered and emptied, "the failure did not reach the cleanup"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert server.worker.is_alive() and server.worker.failure is None
    status, health = call(server, "GET", "/health")
    assert status == 200 and health["status"] == "ok"


def test_a_worker_whose_loop_fails_answers_every_client_and_health_says_so(server: Server) -> None:
    worker = server.worker
    status, _ = chat(server, "Say hello.")
    assert status == 200
    fail_once(worker, "_admit", RuntimeError("injected: the loop fails"))

    status, body = chat(server, "Say hello again.")
    assert status == 503, body
    assert body["error"]["type"] == "worker_stopped" and "injected: the loop fails" in body["error"]["message"]
    worker.join(timeout=REPLY_S)
    assert not worker.is_alive()

    status, health = call(server, "GET", "/health")
    assert status == 503 and health["status"] == "worker_stopped"
    status, body = chat(server, "Anyone there?", session="other")
    assert status == 503 and body["error"]["type"] == "worker_stopped"
