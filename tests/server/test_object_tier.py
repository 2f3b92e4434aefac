"""A real server whose contextd keeps every payload in a real S3 store (Ceph RGW, tests/objectstore.py)
with a store folder far smaller than the session: pages evicted to the object store come back
through it (fetched on the restore's GetPages), every answer is the one a server on local disk
gives, and an object store that goes down mid-session answers 503 for the turn, loses nothing,
and the session answers again (the same tokens) once the store is back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contextd.clock import ENV as CLOCK_ENV
from harness.faults.network import WAIT_S, S3Proxy
from harness.rgw import Rgw
from serving.launcher import ContextdProcess, ServerProcess
from tests.contextd.conftest import MovedClock, in_thread
from tests.objectstore import bucket
from tests.server.test_resident import opening

QUESTIONS = ["What did a say first?", "Repeat a_3.", "Which word came last?"]


def tiered_server(server_factory: Any, rgw: Rgw, monkeypatch: pytest.MonkeyPatch, cache_bytes: int,
                  endpoint: str = "") -> ServerProcess:
    """A server whose contextd keeps its payloads in a fresh bucket of `rgw` (reached through
    `endpoint` when given: a harness.faults.network proxy)."""
    s3 = bucket(rgw, monkeypatch)
    server: ServerProcess = server_factory("tiny-llama", 1024, start=False)
    server.contextd = ContextdProcess(server.root / "contextd", server.socket, log=server.root / "contextd.log",
                                      extra=["--object-store", s3.config.url,
                                             "--object-endpoint", endpoint or rgw.endpoint,
                                             "--object-deadline", "2", "--cache-bytes", str(cache_bytes)])
    return server.start()


def folder_bytes(server: ServerProcess) -> int:
    store = server.root / "contextd" / "store"
    return sum(p.stat().st_size for p in store.rglob("*") if p.is_file() and not p.name.startswith("."))


def ask(server: ServerProcess, messages: list[dict[str, Any]], question: str) -> tuple[int, str, dict[str, Any]]:
    reply = server.chat([*messages, {"role": "user", "content": question}], session="a", max_tokens=6)
    text = reply.body["choices"][0]["message"]["content"] if reply.status == 200 else ""
    return reply.status, text, reply.body


def test_pages_come_back_through_the_object_store_and_answers_equal_a_local_servers(
        server_factory: Any, rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = 64 << 10
    tiered = tiered_server(server_factory, rgw, monkeypatch, cache)
    local: ServerProcess = server_factory("tiny-llama", 1024)
    answers: dict[str, list[str]] = {"tiered": [], "local": []}
    for name, server in (("tiered", tiered), ("local", local)):
        messages = opening("a")
        for question in QUESTIONS:
            status, text, body = ask(server, messages, question)
            assert status == 200, body
            answers[name].append(text)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
    assert answers["tiered"] == answers["local"]
    counters = tiered.stats("a")["counters"]
    assert counters["restored_pages"] > 0 and counters["historical_forward_during_restore"] == 0
    assert counters["model_forward_tokens"] == \
        counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
    stored = counters["stored_bytes"]
    assert stored > 4 * cache and folder_bytes(tiered) <= cache + stored // counters["stored_pages"] * 8
    assert tiered.contextd is not None and tiered.contextd.client is not None
    status = tiered.contextd.client.status()
    assert status.objects_fetched > 0 and status.objects_uploaded >= counters["stored_pages"]
    # past the bound only by the payloads of the last commit or read, which are never evicted by it
    assert status.cached_bytes <= cache + 8 * stored // counters["stored_pages"]
    assert status.cache_limit_bytes == cache


def test_an_object_store_down_mid_session_fails_the_turn_and_loses_nothing(
        server_factory: Any, own_rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> None:
    tiered = tiered_server(server_factory, own_rgw, monkeypatch, 0)
    local: ServerProcess = server_factory("tiny-llama", 1024)
    messages = {"tiered": opening("a"), "local": opening("a")}

    def turn(name: str, server: ServerProcess, question: str) -> str:
        status, text, body = ask(server, messages[name], question)
        assert status == 200, body
        messages[name] += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
        return text

    assert turn("tiered", tiered, QUESTIONS[0]) == turn("local", local, QUESTIONS[0])
    own_rgw.kill_gateway()
    status, _, body = ask(tiered, messages["tiered"], QUESTIONS[1])
    assert status == 503 and body["error"]["type"] == "object_store_unavailable", body
    assert "object store" in body["error"]["message"]
    own_rgw.restart_gateway()
    for question in QUESTIONS[1:]:
        assert turn("tiered", tiered, question) == turn("local", local, question)
    counters = tiered.stats("a")["counters"]
    assert counters["historical_forward_during_restore"] == 0



def test_a_turn_whose_contextd_call_outlives_its_deadline_answers_503_and_the_retry_goes_through(
        server_factory: Any, rgw: Rgw, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """contextd refuses to commit a call whose caller has given up on it (DeadlineExceeded): the
    turn committed nothing, so the client is told to send it again (503), not that the server
    broke (500); sent again, it goes through. The upload the turn's write-through waits on is held
    back while contextd's clock passes the call's deadline (contextd.clock), then let go."""
    monkeypatch.setenv(CLOCK_ENV, str(tmp_path / "clock"))
    clock = MovedClock(tmp_path / "clock")
    proxy = S3Proxy(rgw.port)
    try:
        server = tiered_server(server_factory, rgw, monkeypatch, 0, endpoint=proxy.endpoint)
        messages = [{"role": "user", "content": "Say something."}]
        upload = proxy.hold("PUT", "/payloads/late/")
        thread, outcome = in_thread(lambda: server.chat(messages, session="late", max_tokens=2))
        upload.wait()
        clock.advance(31)    # past the server's 30 s contextd call deadline, on contextd's clock
        upload.release()
        thread.join(WAIT_S)
        assert len(outcome) == 1, "the turn did not end"
        reply = outcome[0]
        assert reply.status == 503 and reply.body["error"]["type"] == "contextd_deadline_exceeded", reply.body
        assert "retry: send it again" in reply.body["error"]["message"], reply.body
        again = server.chat(messages, session="late", max_tokens=2)
        assert again.status == 200, again.body
    finally:
        proxy.close()
