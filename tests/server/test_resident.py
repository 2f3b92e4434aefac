"""Resident sessions through a real server: with `--resident-sessions 2` two sessions keep their
caches, so a turn for the other one moves no page (nothing is restored from the store), a third
session pushes the least recently used one out (its next turn restores its working set), and
every answer is the one a server holding a single cache gives."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

from serving.launcher import ServerProcess
from tests.server.test_server import SYSTEM, assistant


def opening(name: str) -> list[dict[str, Any]]:
    body = " ".join(f"{name}_{i}" for i in range(600))   # past the 1,024-token budget in two turns
    return [SYSTEM, {"role": "user", "content": f"Notes of {name}:\n{body}\nRemember them."}]


def play(server: ServerProcess, order: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """Each name in `order` asks its session one more question; the answers and each turn's stats."""
    transcripts = {name: opening(name) for name in set(order)}
    answers, stats = [], []
    for turn, name in enumerate(order):
        messages = transcripts[name]
        reply = server.chat(messages, session=name, max_tokens=6)
        assert reply.status == 200, reply.body
        messages += [assistant(reply), {"role": "user", "content": f"Turn {turn}: what did {name} say?"}]
        answers.append(reply.body["choices"][0]["message"]["content"])
        stats.append(server.stats(name))
    return answers, stats


def streamed(server: ServerProcess, session: str, messages: list[dict[str, Any]], max_tokens: int
             ) -> Iterator[tuple[float, str]]:
    """(arrival time, by time.perf_counter, and text) of each chunk of a streamed answer."""
    reply = server.stream(messages, session, max_tokens=max_tokens)
    assert reply.status == 200, reply.error
    for arrived, chunk in reply.chunks():
        yield arrived, "".join(c["delta"].get("content") or "" for c in chunk["choices"])


def test_resident_sessions_switch_without_page_io_and_answer_as_one_cache_does(server_factory: Any) -> None:
    order = ["a", "b", "a", "b", "a", "b", "c", "a", "c", "a"]
    resident: ServerProcess = server_factory("tiny-llama", 1024, "--resident-sessions", "2")
    answers, stats = play(resident, order)
    single: ServerProcess = server_factory("tiny-llama", 1024)
    assert play(single, order)[0] == answers

    recovered = [s["counters"]["recovered_pages"] for s in stats]
    switches = [s["counters"]["session_switches"] for s in stats]
    # turns 2-5 go back and forth between a and b: switches, and nothing read from the store
    assert switches[2] > switches[0] and switches[5] > switches[3]
    assert recovered[2] == recovered[4] == 0 and recovered[3] == recovered[5] == 0
    assert all(s["last_turn"]["activate_ms"] < 50 for s in stats[2:6]), [s["last_turn"] for s in stats]
    # c came in and pushed out a (least recently used then); a's next turn pushed out b and
    # restored a's working set from the store; from then on a and c switch without page I/O
    assert recovered[7] > 0 and recovered[8] == 0 and recovered[9] == recovered[7]
    totals = resident.stats()
    assert sorted(totals["resident_sessions"]) == ["a", "c"]
    for s in stats:
        counters = s["counters"]
        assert counters["historical_forward_during_restore"] == 0
        assert counters["model_forward_tokens"] == \
            counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
    # on one cache every switch restores the other session's working set
    single_stats = single.stats("a")["counters"]
    assert single_stats["recovered_pages"] > 0


def test_a_pushed_out_session_restores_its_working_set(server_factory: Any) -> None:
    resident: ServerProcess = server_factory("tiny-llama", 1024, "--resident-sessions", "2")
    _, stats = play(resident, ["a", "b", "c", "a"])
    assert stats[3]["counters"]["recovered_pages"] > 0   # a was least recently used when c came
    assert sorted(resident.stats()["resident_sessions"]) == ["a", "c"]


def test_a_resident_session_count_below_one_is_refused(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024, "--resident-sessions", "0", start=False)
    try:
        server.start(timeout=60)
    except RuntimeError as exc:
        assert "resident_sessions must be >= 1" in str(exc)
    else:
        raise AssertionError("a server with --resident-sessions 0 started")


def test_a_short_request_is_answered_while_another_session_writes_a_long_answer(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024, "--resident-sessions", "2", "--max-new-tokens", "400")
    long_messages = [SYSTEM, {"role": "user", "content": "Write a long story about a lighthouse keeper."}]
    short_messages = [SYSTEM, {"role": "user", "content": "Say yes."}]
    chunks: list[str] = []
    writing = threading.Event()

    def long_answer() -> None:
        for _, text in streamed(server, "long", long_messages, 400):
            chunks.append(text)
            writing.set()

    streaming = threading.Thread(target=long_answer)
    streaming.start()
    assert writing.wait(60)
    short = server.chat(short_messages, session="short", max_tokens=4)
    written_meanwhile = len(chunks)
    streaming.join()
    assert short.status == 200, short.body
    assert len(chunks) > written_meanwhile + 50   # most of the long answer came after the short one
    # Interleaved, each answer is the one it is alone.
    alone: ServerProcess = server_factory("tiny-llama", 1024, "--max-new-tokens", "400")
    assert alone.chat(long_messages, session="long", max_tokens=400).body["choices"][0]["message"]["content"] \
        == "".join(chunks)
    assert alone.chat(short_messages, session="short", max_tokens=4).body["choices"][0]["message"] \
        == short.body["choices"][0]["message"]


def test_a_short_request_is_answered_while_another_session_prefills_a_long_prompt(server_factory: Any) -> None:
    server: ServerProcess = server_factory("tiny-llama", 1024, "--resident-sessions", "2")
    long_messages = [SYSTEM, {"role": "user", "content": " ".join(f"w{i}" for i in range(4000))}]
    short_messages = [SYSTEM, {"role": "user", "content": "Say yes."}]
    first_text: list[float] = []

    def long_prompt() -> None:
        first_text.extend(arrived for arrived, _ in streamed(server, "long", long_messages, 4))

    prefilling = threading.Thread(target=long_prompt)
    prefilling.start()
    deadline = time.monotonic() + 60
    while "long" not in server.stats()["sessions"]:   # its turn has begun: the prefill is under way
        assert time.monotonic() < deadline
    short = server.chat(short_messages, session="short", max_tokens=4)
    answered = time.perf_counter()
    prefilling.join()
    assert short.status == 200, short.body
    assert first_text and answered < first_text[0]   # it did not wait for the ~10k-token prefill
    assert server.stats("long")["session_tokens"] > 8_000


def test_sessions_decoding_at_once_share_forwards_and_answer_as_each_alone(server_factory: Any) -> None:
    """Three sessions stream at once: their tokens come out of shared forwards (Engine.decode_batch)
    and each answer is the one a server that decodes every session alone gives. (A batched row's
    logits match its own decode's to ~1e-5; greedy picks on tiny-llama are ~1e-1 apart at the
    median, so a flipped pick in these 72 is not expected.)"""
    prompts = {f"s{n}": [SYSTEM, {"role": "user", "content": f"Session {n}: tell me about ships, part {n}."}]
               for n in range(3)}

    def answer_all(server: ServerProcess) -> dict[str, str]:
        answers: dict[str, str] = {}
        start = threading.Barrier(len(prompts))

        def one(session: str) -> None:
            start.wait()
            answers[session] = "".join(text for _, text in streamed(server, session, prompts[session], 24))

        threads = [threading.Thread(target=one, args=(session,)) for session in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return answers

    batching: ServerProcess = server_factory("tiny-llama", 1024, "--resident-sessions", "3")
    together = answer_all(batching)
    for session in prompts:
        counters = batching.stats(session)["counters"]
        assert counters["batched_decode_tokens"] > 0, counters
        assert counters["model_forward_tokens"] == \
            counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
        assert counters["historical_forward_during_restore"] == 0
    alone: ServerProcess = server_factory("tiny-llama", 1024, "--resident-sessions", "3", "--no-batch-decode")
    assert answer_all(alone) == together
    assert alone.stats()["counters"]["batched_decode_tokens"] == 0
