"""The server as a user meets it: a real `kv-elision serve` process, a real contextd, real model code.

Fast tests run the tiny random-weight models (SmolLM2's tokenizer and chat template); the long
session on the real SmolLM2 weights is in tests/e2e.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from backends.models import load_tokenizer, resolve
from harness.procfs import alive
from harness.waits import wait_until
from serving.heap import FIRST_GENERATION_THRESHOLD
from serving.launcher import ServerProcess

SYSTEM = {"role": "system", "content": "You are a coding agent. Be brief."}
TOOLS = [{"type": "function", "function": {
    "name": "read", "description": "read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve("smollm2-135m"))


def n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def assistant(reply: Any) -> dict[str, Any]:
    message = reply.body["choices"][0]["message"]
    return {"role": "assistant", "content": message["content"] or "", **({"tool_calls": message["tool_calls"]}
                                                                         if message.get("tool_calls") else {})}


def test_each_turn_prefills_only_the_new_messages(server_factory: Any, tokenizer: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    messages = [SYSTEM, {"role": "user", "content": "Read main.py and tell me what it does."}]
    first = server.chat(messages, session="s1")
    assert first.status == 200, first.body
    assert first.headers["x-kv-session"] == "s1" and "x-kv-rebuilt" not in first.headers
    total_prefilled = int(first.headers["x-kv-prefilled-tokens"])
    for n in range(3):
        user = f"Now step {n}: rerun the tests and report the failures, in detail. " * (n + 1)
        messages = [*messages, assistant(first), {"role": "user", "content": user}]
        first = server.chat(messages, session="s1")
        assert first.status == 200, first.body
        expected = n_tokens(tokenizer, f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")
        assert int(first.headers["x-kv-prefilled-tokens"]) == expected, "re-prefilled something already cached"
        assert "x-kv-rebuilt" not in first.headers
        total_prefilled += expected
    usage = first.body["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - expected
    counters = server.stats("s1")["counters"]
    assert counters["new_prefill_tokens"] == total_prefilled
    assert counters["model_forward_tokens"] == \
        counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
    assert counters["historical_forward_during_restore"] == 0
    assert counters["reprefilled_tokens"] == 0 and counters["rebuilds"] == 0


def test_the_loaded_heap_is_frozen_so_no_collection_walks_the_model(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    reply = server.chat([SYSTEM, {"role": "user", "content": "Read main.py and tell me what it does."}], session="g")
    assert reply.status == 200, reply.body
    heap = server.stats()["heap"]
    # torch, transformers and the model's modules: tens of thousands of objects even for a tiny model
    assert heap["frozen_objects"] > 10_000, heap
    assert heap["thresholds"][0] == FIRST_GENERATION_THRESHOLD
    assert len(heap["collections"]) == 3


def test_fingerprint_mismatches_are_detected_and_nothing_mismatched_is_reused(server_factory: Any, tmp_path: Any
                                                                              ) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    base = [SYSTEM, {"role": "user", "content": "Open the config and list every key."}]
    reply = server.chat(base, session="f", tools=TOOLS)
    messages = [*base, assistant(reply), {"role": "user", "content": "And the defaults?"}]
    assert "x-kv-rebuilt" not in server.chat(messages, session="f", tools=TOOLS).headers

    def rebuilt(reply: Any) -> str:
        assert reply.status == 200, reply.body
        assert reply.body["choices"][0]["message"]["content"] is not None or reply.body["choices"][0]["message"].get(
            "tool_calls")
        return str(reply.headers.get("x-kv-rebuilt", ""))

    edited = [SYSTEM, {"role": "user", "content": "Open the config and list every VALUE."}, *messages[2:]]
    assert "transcript changed" in rebuilt(server.chat(edited, session="f", tools=TOOLS))
    assert "tools changed" in rebuilt(server.chat(edited, session="f", tools=TOOLS[:0] or None))
    assert "thinking changed" in rebuilt(server.chat(edited, session="f", reasoning_effort="high"))
    stats = server.stats("f")["counters"]
    assert stats["rebuilds"] == 3 and stats["reprefilled_tokens"] > 0
    assert stats["model_forward_tokens"] == \
        stats["new_prefill_tokens"] + stats["decoded_tokens"] + stats["blend_forward_tokens"]
    # the same request again reuses everything it can: no rebuild
    again = server.chat([*edited, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}],
                        session="f", reasoning_effort="high")
    assert "x-kv-rebuilt" in again.headers or again.status == 200

    # another chat template: restart the server with it; the session's stored state is refused
    server.stop()
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    server.extra += ["--chat-template", str(template)]
    server.start()
    follow = [*edited, {"role": "assistant", "content": "fine"}, {"role": "user", "content": "go on"}]
    assert "template changed" in rebuilt(server.chat(follow, session="f", reasoning_effort="high"))


def context_headers(hashes: list[str], piece: int = 60_000) -> dict[str, str]:
    """X-KV-Context split the way the extension splits it: -2, -3, ... continue a long value."""
    text = json.dumps({"v": 1, "messages": hashes}, separators=(",", ":"))
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)]
    return {("X-KV-Context" if n == 0 else f"X-KV-Context-{n + 1}"): p for n, p in enumerate(pieces)}


def test_client_context_header_detects_a_rewind(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    m1 = [SYSTEM, {"role": "user", "content": "first"}]
    h = {"X-KV-Session": "r"}

    def ctx(n: int) -> dict[str, str]:
        return {**h, "X-KV-Context": json.dumps({"v": 1, "messages": [f"h{i}" for i in range(n)]})}

    r1 = server.request("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": m1}, headers=ctx(2))
    m2 = [*m1, assistant(r1), {"role": "user", "content": "second"}]
    r2 = server.request("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": m2}, headers=ctx(4))
    assert "x-kv-rebuilt" not in r2.headers
    changed = {**h, "X-KV-Context": json.dumps({"v": 1, "messages": ["h0", "CHANGED", "h2", "h3"]})}
    r3 = server.request("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": m2}, headers=changed)
    assert r3.status == 200 and "client history changed at message 1" in r3.headers["x-kv-rebuilt"]


def test_a_context_header_of_thousands_of_messages_arrives_in_pieces(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    long_ago = [f"{i:016x}" for i in range(8000)]  # 152 KB of hashes: three header pieces
    messages = [SYSTEM, {"role": "user", "content": "first"}]
    headers = {"X-KV-Session": "p", **context_headers([*long_ago, "h0", "h1"])}
    assert "X-KV-Context-3" in headers
    r1 = server.request("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": messages}, headers=headers)
    assert r1.status == 200, r1.body
    messages = [*messages, assistant(r1), {"role": "user", "content": "second"}]
    changed = {"X-KV-Session": "p", **context_headers([*long_ago, "h0", "CHANGED", "h2", "h3"])}
    r2 = server.request("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": messages}, headers=changed)
    assert r2.status == 200 and "client history changed at message 8001" in r2.headers["x-kv-rebuilt"]
    too_many = {"X-KV-Session": "p", **context_headers([f"{i:04x}" for i in range(1200)], piece=100)}
    assert "X-KV-Context-81" in too_many
    r3 = server.request("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": messages}, headers=too_many)
    assert r3.status == 400 and "more than 80 pieces" in r3.body["error"]["message"]


def test_streaming_sends_sse_chunks_usage_and_done(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    reply = server.chat([SYSTEM, {"role": "user", "content": "hello"}], session="st", stream=True,
                        stream_options={"include_usage": True})
    assert reply.status == 200 and reply.headers["content-type"] == "text/event-stream"
    events = [line[6:] for line in reply.body.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[0]["completion_tokens"] >= 1 and usage[0]["prompt_tokens"] > 10
    assert text or finals[0]["choices"][0]["finish_reason"] == "stop"


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    path = "/v1/chat/completions"
    cases = [
        (server.request("POST", path, raw=b"{not json"), 400, "not valid JSON"),
        (server.request("POST", path, {"model": "tiny-llama"}), 400, "messages"),
        (server.request("POST", path, {"model": "gpt-9", "messages": [SYSTEM]}), 404, "not served"),
        (server.request("POST", path, {"model": "tiny-llama", "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "not supported"),
        (server.request("POST", path, {"model": "tiny-llama", "messages": [{"role": "wizard", "content": "x"}]}),
         400, "unsupported role"),
        (server.request("POST", path, {"model": "tiny-llama", "messages": [SYSTEM], "max_tokens": -3}), 400,
         "max_tokens"),
        (server.request("POST", path, {"model": "tiny-llama", "messages": [SYSTEM], "temperature": "hot"}), 400,
         "temperature"),
        (server.request("POST", path, [1, 2, 3]), 400, "JSON object"),
        (server.request("POST", "/v1/nothing", {}), 404, "no route"),
        (server.request("GET", "/v1/kv/stats?session=nobody"), 404, "no session"),
        (server.request("POST", path, {"model": "tiny-llama", "messages": [SYSTEM]},
                        headers={"X-KV-Context": "{broken"}), 400, "X-KV-Context"),
    ]
    for reply, status, text in cases:
        assert reply.status == status, (reply.status, reply.body)
        assert text in reply.body["error"]["message"], reply.body
    assert server.get("/health").body["status"] == "ok"
    models = server.get("/v1/models").body["data"]
    assert models[0]["id"] == "tiny-llama" and models[0]["budget_tokens"] == 1024
    assert server.chat([SYSTEM, {"role": "user", "content": "still there?"}]).status == 200


def test_kill9_mid_turn_then_restart_continues_from_contextd(server_factory: Any, tokenizer: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024, "--max-new-tokens", "4000")
    messages = [SYSTEM, {"role": "user", "content": "Summarise the repository layout. " * 40}]
    for n in range(4):  # grow the session past the budget so pages are cold in the store
        reply = server.chat(messages, session="k", max_tokens=8)
        messages = [*messages, assistant(reply), {"role": "user", "content": f"Part {n}: keep reading. " * 60}]
    before = server.stats("k")
    assert before["pages"]["cold"] > 0
    # a long turn in flight (its first tokens are streaming), then kill -9
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": "tiny-llama", "messages": messages, "max_tokens": 4000, "stream": True}),
        headers={"X-KV-Session": "k", "Content-Type": "application/json", **server.auth_headers()})
    stream = conn.getresponse()
    assert stream.status == 200
    while b'"content"' not in (line := stream.readline()):
        assert line, "the stream ended before its first token"
    server.kill9()
    conn.close()
    server.start()
    again = server.chat(messages, session="k", max_tokens=8)
    assert again.status == 200, again.body
    assert "x-kv-rebuilt" not in again.headers, again.headers["x-kv-rebuilt"]
    last_user = messages[-1]["content"]
    expected = n_tokens(tokenizer, f"<|im_end|>\n<|im_start|>user\n{last_user}<|im_end|>\n<|im_start|>assistant\n")
    assert int(again.headers["x-kv-prefilled-tokens"]) == expected  # only the new message, nothing recomputed
    after = server.stats("k")
    assert after["counters"]["recovered_pages"] > 0
    # The attention selector's index came back from the canonical store, not from memory.
    assert after["lexical_index_pages"] >= before["lexical_index_pages"] > 0
    assert after["counters"]["historical_forward_during_restore"] == 0
    assert after["session_tokens"] > before["session_tokens"]
    from contextd.client import Client
    with Client(server.socket) as client:
        verified = client.verify("k")
        assert not verified.corrupt and verified.pages_ok >= before["pages"]["cold"]


def test_hybrid_model_serves_turns_and_rebuilds_from_a_recurrent_snapshot(server_factory: Any, tokenizer: Any) -> None:
    server: ServerProcess = server_factory("tiny-qwen3-next", 1024)
    messages = [SYSTEM, {"role": "user", "content": "Plan the refactor. " * 30}]
    replies = []
    for n in range(4):
        reply = server.chat(messages, session="h", max_tokens=8)
        assert reply.status == 200, reply.body
        assert "x-kv-rebuilt" not in reply.headers
        replies.append(reply)
        messages = [*messages, assistant(reply), {"role": "user", "content": f"Step {n}. " * 80}]
    stats = server.stats("h")
    assert stats["pages"]["cold"] > 0 and stats["counters"]["historical_forward_during_restore"] == 0
    # edit the last user message sent: the cache goes back to the snapshot before it, not to zero
    edited = [*messages[:-3], {"role": "user", "content": "A different step."}]
    reply = server.chat(edited, session="h", max_tokens=8)
    assert reply.status == 200 and "transcript changed" in reply.headers["x-kv-rebuilt"]
    prefilled = int(reply.headers["x-kv-prefilled-tokens"])
    assert prefilled < stats["session_tokens"] / 2, "rebuilt from scratch instead of from a snapshot"
    counters = server.stats("h")["counters"]
    assert counters["model_forward_tokens"] == \
        counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]


def test_a_client_that_leaves_ends_its_turn_and_the_next_turn_is_served(server_factory: Any) -> None:
    import http.client
    import socket
    import time

    server: ServerProcess = server_factory("tiny-llama", 1024, "--max-new-tokens", "100000")
    messages = [SYSTEM, {"role": "user", "content": "Write the whole history of computing. " * 10}]
    body = {"model": "tiny-llama", "messages": messages, "max_tokens": 100000}
    # Streaming (what Pi does): the client reads the first chunk, then goes away.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 headers={"X-KV-Session": "gone", "Content-Type": "application/json", **server.auth_headers()})
    stream = conn.getresponse()
    assert stream.status == 200
    while b'"content"' not in (line := stream.readline()):
        assert line, "the stream ended before its first token"
    stream.close()  # the response holds the socket open too
    conn.close()
    # The server notices once the answer fills the connection's send buffer; until then the first
    # turn is still decoding, and a phase read now would be its phase, not the next turn's.
    wait_until(lambda: server.stats("gone")["counters"]["cancelled_turns"] == 1, 120, "the first turn to end")
    # Not streaming: the client sends the request and hangs up while the answer is being decoded.
    follow = [*messages, {"role": "assistant", "content": "…"}, {"role": "user", "content": "Again, longer. " * 10}]
    raw = json.dumps({**body, "messages": follow}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        key = server.auth_headers()["Authorization"].encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: " + key + b"\r\nX-KV-Session: gone\r\nContent-Length: "
                     + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        wait_until(lambda: (stats := server.stats("gone"))["counters"]["turns"] == 2
                   and stats.get("turn_phase") == "decode", 120, "the second turn to decode")
    started = time.monotonic()
    reply = server.request("POST", "/v1/chat/completions",
                           {"model": "tiny-llama", "messages": [SYSTEM, {"role": "user", "content": "hi"}],
                            "max_tokens": 4}, headers={"X-KV-Session": "next"}, timeout=180)
    assert reply.status == 200, reply.body
    assert time.monotonic() - started < 120
    counters = server.stats("gone")["counters"]
    assert counters["cancelled_turns"] == 2, counters
    assert counters["decoded_tokens"] < 20000
    assert counters["model_forward_tokens"] == \
        counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]


def test_with_an_api_key_every_route_but_health_wants_the_bearer_token(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024, "--api-key", "s3cret")
    good = {"Authorization": "Bearer s3cret"}
    assert server.get("/health").status == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        for method, path, body in (("GET", "/v1/models", None), ("GET", "/v1/kv/stats", None),
                                   ("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": [SYSTEM]})):
            reply = server.request(method, path, body, headers=headers)
            assert reply.status == 401 and reply.body["error"]["type"] == "invalid_api_key", (path, headers)
    assert server.request("GET", "/v1/models", headers=good).status == 200
    reply = server.request("POST", "/v1/chat/completions", {"model": "tiny-llama", "messages": [
        SYSTEM, {"role": "user", "content": "hi"}], "max_tokens": 2}, headers=good)
    assert reply.status == 200, reply.body


def test_a_watched_answer_is_scored_over_the_cache_it_is_read_from(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    route = "/v1/kv/score"
    bad = [(server.request("POST", route, raw=b"[oops"), 400, "not valid JSON"),
           (server.request("POST", route, {"candidates": ["1"]}), 400, "session"),
           (server.request("POST", route, {"session": "s", "candidates": "1234"}), 400, "list of strings"),
           (server.request("POST", route, {"session": "s", "candidates": []}), 400, "candidate answers"),
           (server.request("POST", route, {"session": "s", "candidates": [" "]}), 400, "candidate answers"),
           (server.request("POST", route, {"session": "s", "candidates": ["1"], "branches": ["bm25"]}), 400,
            "selector names"),
           (server.request("POST", route, {"session": "s", "candidates": ["1"], "branches": "hybrid"}), 400,
            "selector names"),
           (server.request("GET", route), 400, "which session"),
           (server.request("GET", route + "?session=s"), 404, "no watched turn")]
    for reply, status, text in bad:
        assert reply.status == status, (reply.status, reply.body)
        assert text in reply.body["error"]["message"], reply.body
    messages = [SYSTEM, {"role": "user", "content": "The vault code is 4821. Say ok."}]
    plain = server.chat(messages, session="plain")
    watched = server.request("POST", route, {"session": "s", "candidates": ["4821", "1111", "ok"]})
    assert watched.status == 202 and watched.body["watching"] == 3
    answer = server.chat(messages, session="s")
    assert answer.status == 200 and answer.body["choices"][0]["message"] == plain.body["choices"][0]["message"]
    reading = server.get(route + "?session=s").body
    assert reading["candidates"] == ["4821", "1111", "ok"] and len(reading["logprobs"]) == 3
    assert all(lp < 0 for lp in reading["logprobs"]) and reading["scoring_forward_tokens"] > 0
    assert reading["view_ids"] == reading["transcript_ids"], "a short session holds everything in view"
    assert answer.body["kv"]["model_forward_tokens"] == plain.body["kv"]["model_forward_tokens"]
    assert server.get(route + "?session=plain").status == 404
    assert reading["branches"] == {}
    # The next turn answered first in a branch per selector, from the session as it stands.
    messages += [answer.body["choices"][0]["message"], {"role": "user", "content": "What is the vault code?"}]
    watched = server.request("POST", route, {"session": "s", "candidates": ["4821", "1111"],
                                             "branches": ["hybrid", "recency"]})
    assert watched.status == 202
    assert server.chat(messages, session="s").body["choices"][0]["message"] == \
        server.chat(messages, session="plain").body["choices"][0]["message"]
    reading = server.get(route + "?session=s").body
    assert set(reading["branches"]) == {"hybrid", "recency"}
    for branch in reading["branches"].values():
        assert branch["view_ids"] == reading["view_ids"], "nothing is cold: every branch holds the whole session"
        assert branch["logprobs"] == pytest.approx(reading["logprobs"], abs=1e-3)


def test_a_server_started_alone_starts_its_own_contextd_which_ends_with_it(tmp_path: Any) -> None:
    """`kv-elision serve` with nobody answering on its socket spawns a contextd under ROOT/contextd
    and loads its model while that one starts; the daemon answers once the server does, holds the
    turn's session, and stops when the server stops."""
    import subprocess
    import sys

    from contextd.client import Client
    from contextd.paths import SOCKET_NAME
    from serving.launcher import REPO, free_port, stop_process, wait_healthy

    root, port = tmp_path / "root", free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("KV_ELISION_SOCKET", "XDG_RUNTIME_DIR")}
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "serving.cli", "serve", "--model", "tiny-llama", "--budget",
                                 "1024", "--tail-tokens", "256", "--root", str(root), "--port", str(port)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    server = ServerProcess(root=root, model="tiny-llama", port=port, proc=proc)
    try:
        wait_healthy(proc, lambda: server.get("/health").status == 200, 300, "kv-elision serve",
                     lambda: log.read_text(errors="replace"))
        reply = server.chat([SYSTEM, {"role": "user", "content": "Say hi."}], session="alone", max_tokens=2)
        assert reply.status == 200, reply.body
        socket = root / "run" / SOCKET_NAME
        with Client(socket) as client:
            status = client.wait_ready(timeout=5)
        assert status.root == str(root / "contextd") and status.pid not in (0, proc.pid)
        assert [s.session_id for s in status.sessions] == ["alone"]
        daemon_pid = status.pid
    finally:
        stop_process(proc)
    wait_until(lambda: not alive(daemon_pid), 30, f"contextd (pid {daemon_pid}) to end with its server")


def test_a_server_that_cannot_start_leaves_no_contextd_behind(tmp_path: Any) -> None:
    """The launcher starts contextd first; when `kv-elision serve` then refuses its options, the
    launcher's error names the reason and its contextd is stopped too."""
    server = ServerProcess(root=tmp_path / "root", model="tiny-llama", budget=256, extra=["--tail-tokens", "256"])
    with pytest.raises(RuntimeError, match="under 4 pages"):
        server.start(timeout=120)
    assert server.contextd is not None and server.contextd.proc is not None
    assert server.contextd.proc.poll() is not None, "contextd outlived a server that never started"
