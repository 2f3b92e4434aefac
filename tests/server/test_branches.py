"""Branches through a real server: a new session id that sends another session's messages up to a
point and then its own (Pi's /fork, a resumed branch) starts from the parent's stored pages,
prefills only what follows the fork, leaves the parent as it was, and answers exactly as the
parent rewound to that point answers (both come from the same stored record)."""

from __future__ import annotations

from typing import Any

from contextd.client import Client
from serving.launcher import ServerProcess
from tests.server.test_server import SYSTEM, assistant

WORDS = ("parser", "ledger", "socket", "budget", "lease", "anchor", "replica", "cursor", "buffer", "kernel")


def grow(server: ServerProcess, session: str, turns: int) -> list[dict[str, Any]]:
    """A session past the budget: each turn reads a ~400-token file of its own."""
    messages: list[dict[str, Any]] = [SYSTEM]
    for turn in range(turns):
        body = " ".join(f"{WORDS[(turn + i) % len(WORDS)]}{turn}_{i}" for i in range(160))
        messages.append({"role": "user", "content": f"File {turn}:\n{body}\nWhat does file {turn} define?"})
        reply = server.chat(messages, session=session, max_tokens=8)
        assert reply.status == 200, reply.body
        messages.append(assistant(reply))
    return messages


def test_a_branch_prefills_only_what_follows_the_fork_and_answers_as_its_parent_rewound(
        server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    history = grow(server, "parent", turns=8)
    parent_before = server.stats("parent")
    assert parent_before["pages"]["cold"] > 0
    fork = [*history[:11], {"role": "user", "content": "Which file defined ledger4_1?"}]

    branch = server.chat(fork, session="child", max_tokens=8)
    assert branch.status == 200, branch.body
    assert "x-kv-rebuilt" not in branch.headers
    usage = branch.body["usage"]
    prefilled = int(branch.headers["x-kv-prefilled-tokens"])
    assert prefilled <= 0.1 * usage["prompt_tokens"], (prefilled, usage)
    counters = server.stats("child")["counters"]
    assert counters["branches"] == 1 and counters["branch_kept_tokens"] == usage["prompt_tokens"] - prefilled
    assert counters["new_prefill_tokens"] == prefilled and counters["rebuilds"] == 0
    assert counters["historical_forward_during_restore"] == 0
    assert counters["model_forward_tokens"] == \
        counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
    with Client(server.socket) as client:
        assert client.get_session("child").labels["branch_of"] == "parent"
        assert not client.verify("child").corrupt

    # The parent is as it was, and goes on from there: its next turn prefills only its new message.
    parent_after = server.stats("parent")
    assert parent_after["session_tokens"] == parent_before["session_tokens"]
    assert parent_after["counters"]["turns"] == parent_before["counters"]["turns"]
    onward = server.chat([*history, {"role": "user", "content": "And file 7?"}], session="parent", max_tokens=8)
    assert onward.status == 200 and "x-kv-rebuilt" not in onward.headers
    assert int(onward.headers["x-kv-prefilled-tokens"]) < 40

    # The reference: the same session built the same way on a server of its own, restarted (so it
    # comes from its stored record, as the branch did) and rewound to the fork: the same tokens.
    twin_server: ServerProcess = server_factory("tiny-llama", 1024)
    assert grow(twin_server, "twin", turns=8) == history
    twin_server.stop()
    twin_server.start()
    rewound = twin_server.chat(fork, session="twin", max_tokens=8)
    assert rewound.status == 200, rewound.body
    assert rewound.body["choices"][0]["message"] == branch.body["choices"][0]["message"]


def test_a_session_that_shares_no_stored_pages_does_not_branch(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024)
    grow(server, "first", turns=3)
    other = [{"role": "system", "content": "A different agent with a different prompt entirely."},
             {"role": "user", "content": "hello"}]
    reply = server.chat(other, session="stranger", max_tokens=4)
    assert reply.status == 200
    assert server.stats("stranger")["counters"]["branches"] == 0
