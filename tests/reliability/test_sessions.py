"""Fast samples of concurrency and isolation (benchmarks.faults part 4): four sessions (a main
agent and three subagents) interleaved through one engine and through one real server, each
answering exactly as it does alone, no forward pass spent on a switch, attention after every turn
holding that session's own pages and nothing else; and contextd killed under a live server."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from harness.faults.oracle import Twins
from harness.faults.processes import Daemon, environ_set
from harness.faults.scenarios import CRASH_ENV, SCENARIOS, messages_for, session_scenarios
from harness.faults.sessions import job_sessions, server_sessions
from harness.faults.zygote import Zygote
from harness.waits import outage, wait_until
from serving.launcher import ServerProcess
from tests.reliability.conftest import explain


def test_four_sessions_interleaved_answer_as_alone_and_never_see_each_other(
        zygote: Zygote, daemon: Daemon, twins: Twins) -> None:
    scenarios = session_scenarios(4)
    solo = [twins.run(sc, range(len(sc.users))) for sc in scenarios]
    schedule = [k for k, sc in enumerate(scenarios) for _ in sc.users]
    random.Random(4).shuffle(schedule)
    result = zygote.run(job_sessions, {"socket": str(daemon.socket), "scenarios": [sc.name for sc in scenarios],
                                     "sessions": [f"iso-{sc.name}" for sc in scenarios], "schedule": schedule})
    assert result.status == 0, result.error
    acks = result.of("ack")
    assert len(acks) == len(schedule)
    for ack in acks:
        assert ack["checks"]["ok"], ack["checks"]["why"]  # attention == this session's resident pages
        assert ack["content"] == solo[ack["session"]][ack["ack"]]["content"]
        assert ack["forward_not_fed"] == 0
    done = result.of("done")[0]
    assert done["switches"] >= 8
    solo_prefill = sum(t[-1]["checks"]["counters"]["new_prefill_tokens"] for t in solo)
    assert done["totals"]["new_prefill_tokens"] == solo_prefill, "a switch cost prefill"


@pytest.mark.slow
def test_four_clients_at_once_through_one_server(work: Path) -> None:
    figures, outcomes = server_sessions(work, lambda _: None, restarts=False)
    assert all(o.exact for o in outcomes), [explain(o) for o in outcomes if not o.exact]
    assert figures["server_session_mismatches"] == 0 and figures["server_cross_session_leaks"] == 0
    assert figures["server_switch_prefill_tokens"] == 0


def test_contextd_killed_under_a_live_server_fails_the_turn_in_flight_with_503_and_loses_nothing(
        server: ServerProcess) -> None:
    sc = SCENARIOS["llama"]
    daemon = server.contextd
    assert daemon is not None
    answers: dict[int, str] = {}
    for i in range(2):
        reply = server.chat(messages_for(sc.users, answers, i), session="kd")
        assert reply.status == 200, reply.body
        answers[i] = reply.body["choices"][0]["message"]["content"] or ""
    daemon.stop()
    with environ_set(CRASH_ENV, "contextd.commit.begin:1"):  # dies at the first commit of the next turn
        daemon.start()
    failed = server.chat(messages_for(sc.users, answers, 2), session="kd")
    assert failed.status == 503 and failed.body["error"]["type"] == "contextd_down", failed.body
    assert daemon.exited(timeout=30)
    with environ_set(CRASH_ENV, None):
        daemon.start()
    replies = []

    def answered() -> bool:   # the client re-sends, as Pi does
        replies.append(server.chat(messages_for(sc.users, answers, 2), session="kd"))
        assert replies[-1].status in (200, 503), replies[-1].body
        return replies[-1].status == 200

    wait_until(answered, 30, "the re-sent turn to be answered", poll_s=0.25)
    reply = replies[-1]
    assert daemon.client is not None
    assert daemon.client.read_record("kd").record.turn == 3 and not daemon.client.verify("kd").corrupt
    c = reply.body["kv"]
    assert c["model_forward_tokens"] == c["new_prefill_tokens"] + c["decoded_tokens"] + c["blend_forward_tokens"]
    assert c["historical_forward_during_restore"] == 0


@pytest.mark.slow
def test_after_a_contextd_outage_the_next_request_succeeds(server: ServerProcess) -> None:
    daemon = server.contextd
    assert daemon is not None
    assert server.chat([{"role": "user", "content": "hello"}], session="outage", max_tokens=1).status == 200
    daemon.kill9()
    for _ in range(3):
        assert server.chat([{"role": "user", "content": "hello again"}], session="outage-2", max_tokens=1).status == 503
    outage(12)  # gRPC's default backoff would next try the socket about 16 s after the outage began
    with environ_set(CRASH_ENV, None):
        daemon.start()
    # The channel's own backoff (contextd.client.RECONNECT) finds the socket within a second.
    wait_until(lambda: server.chat([{"role": "user", "content": "hello again"}], session="outage-2",
                                   max_tokens=1).status == 200, 2.0, "a turn answered after the outage")


def test_session_switches_are_counted(server: ServerProcess) -> None:
    sc = SCENARIOS["llama"]
    for sid in ("sw-a", "sw-b", "sw-a"):  # sw-a has resident pages when it comes back
        reply = server.chat([{"role": "user", "content": sc.users[1]}], session=sid, max_tokens=1)
        assert reply.status == 200
    assert server.stats("sw-a")["counters"]["recovered_pages"] > 0
    assert server.stats()["counters"]["session_switches"] >= 2
