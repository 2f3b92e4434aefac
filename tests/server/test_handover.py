"""A session moving between two real servers (each its own process, contextd and root, standing in
for two machines) that share one real S3 store (Ceph RGW, tests/objectstore.py): the next turn on
the other server adopts the session and answers from restored pages only, with the tokens a
server that never moved gives; a request while another server's turn runs is refused (409); and
a server that stalls past its lease while the session moves loses that turn, never the session."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from harness.rgw import Rgw
from harness.waits import wait_until
from serving.launcher import ContextdProcess, ServerProcess
from tests.objectstore import bucket
from tests.server.test_resident import opening

QUESTIONS = ["What did a say first?", "Repeat a_3.", "Which word came last?", "Say a_7 again.", "And a_9?",
             "Count to three."]


def shared_server(server_factory: Any, rgw: Rgw, url: str, *extra: str) -> ServerProcess:
    server: ServerProcess = server_factory("tiny-llama", 1024, *extra, start=False)
    server.contextd = ContextdProcess(server.root / "contextd", server.socket, log=server.root / "contextd.log",
                                      extra=["--object-store", url, "--object-endpoint", rgw.endpoint,
                                             "--object-deadline", "5"])
    return server.start()


class Conversation:
    """One client's session "a", each turn sent to the server of its choice."""

    def __init__(self) -> None:
        self.messages = opening("a")

    def ask(self, server: ServerProcess, question: str, wait_s: float = 0.0) -> tuple[str, int]:
        """Send `question`; for up to `wait_s`, again while another server holds the session (a
        refusal comes before the turn starts and changes nothing)."""
        replies = []

        def not_held() -> bool:
            replies.append(server.chat([*self.messages, {"role": "user", "content": question}], session="a",
                                       max_tokens=6))
            return not (replies[-1].status == 409 and replies[-1].body["error"]["type"] == "session_held_elsewhere")

        wait_until(not_held, wait_s, "the session's lease elsewhere to run out", poll_s=0.5)
        reply = replies[-1]
        assert reply.status == 200, reply.body
        text = reply.body["choices"][0]["message"]["content"]
        self.messages += [{"role": "user", "content": question}, {"role": "assistant", "content": text}]
        return text, int(reply.headers["x-kv-prefilled-tokens"])


def test_a_session_moves_between_servers_with_the_tokens_of_one_that_never_moved_and_a_stalled_holder_loses_its_turn(
        server_factory: Any, rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> None:
    url = bucket(rgw, monkeypatch).config.url
    a = shared_server(server_factory, rgw, url, "--session-lease", "2", "--max-new-tokens", "400")
    b = shared_server(server_factory, rgw, url, "--session-lease", "2")
    twin: ServerProcess = server_factory("tiny-llama", 1024)
    moving, still = Conversation(), Conversation()
    for question, server in zip(QUESTIONS[:4], (a, a, b, a), strict=True):
        moved, prefilled = moving.ask(server, question)
        alone, twin_prefilled = still.ask(twin, question)
        assert moved == alone and prefilled == twin_prefilled, (question, moved, alone, prefilled, twin_prefilled)
    for server, adoptions in ((b, 1), (a, 2)):   # the session's counters travel with it
        counters = server.stats("a")["counters"]
        assert counters["adoptions"] == adoptions and counters["historical_forward_during_restore"] == 0
        assert counters["model_forward_tokens"] == \
            counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
        assert counters["recovered_pages"] > 0 and counters["reprefilled_tokens"] == 0

    long = a.stream([*moving.messages, {"role": "user", "content": "Write a long story."}], session="a",
                    max_tokens=400)
    assert long.status == 200
    chunks = long.chunks()
    next(chunks)                                             # a's turn is running: its lease is held
    assert a.proc is not None
    os.kill(a.proc.pid, signal.SIGSTOP)                      # and a stalls
    try:
        busy = b.chat([*moving.messages, {"role": "user", "content": QUESTIONS[4]}], session="a", max_tokens=6)
        assert busy.status == 409 and busy.body["error"]["type"] == "session_held_elsewhere", busy.body
        # Once a's lease runs out, b takes the session over (a renewal a sent just before it stopped
        # may land late on a loaded machine: its lease then runs up to 2 s more).
        assert moving.ask(b, QUESTIONS[4], wait_s=15) == still.ask(twin, QUESTIONS[4])
    finally:
        os.kill(a.proc.pid, signal.SIGCONT)
    rest = [chunk for _, chunk in chunks]                    # a's renewal is refused: its turn fails
    assert any("session_held_elsewhere" in str(chunk) for chunk in rest), rest[-3:]
    assert moving.ask(a, QUESTIONS[5]) == still.ask(twin, QUESTIONS[5])   # and a takes it back, exactly
    assert a.stats("a")["counters"]["historical_forward_during_restore"] == 0


def test_a_completed_turn_leaves_no_lease_behind_however_long_it_took(
        server_factory: Any, rgw: Rgw, monkeypatch: pytest.MonkeyPatch) -> None:
    """A turn longer than a third of its lease renews it on the way; the record that completes the
    turn ends the lease, and nothing after it takes the lease again, so the next server is served
    at once (a renewal as the answer went out used to hold the session for one more lease)."""
    url = bucket(rgw, monkeypatch).config.url
    a = shared_server(server_factory, rgw, url, "--session-lease", "0.3")
    b = shared_server(server_factory, rgw, url, "--session-lease", "0.3")
    conversation = Conversation()
    for question, server in zip(QUESTIONS[:4], (a, b, a, b), strict=True):
        conversation.ask(server, question)   # no wait: a 409 fails the test
    assert b.stats("a")["counters"]["adoptions"] == 3   # the session's counters travel with it
