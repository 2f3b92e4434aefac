"""Sessions: several sessions through one engine (the "sessions" job) and 4 clients through a real
`kv-elision serve`, each session's answers against the same session alone; contextd killed and
restarted under a live server.

Depends on serving.launcher, contextd.errors, the driver and the campaign's oracle, processes and
scenarios.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from contextd.wire import PageState
from harness.faults.driver import Driver
from harness.faults.oracle import CONTEXTD_DOWN_STATUS, CaseOutcome
from harness.faults.processes import environ_set
from harness.faults.scenarios import CRASH_ENV, IO_FAULT_ENV, SCENARIOS, Scenario, messages_for, session_scenarios
from harness.faults.zygote import Reporter


def job_sessions(rep: Reporter, loaded: dict[str, tuple[Any, Any]], p: dict[str, Any]) -> None:
    """Several sessions through one engine in the order `schedule` gives (session index per turn):
    after every turn, attention must hold exactly that session's resident pages."""
    drivers: list[Driver] = []
    first = Driver(loaded, {"scenario": p["scenarios"][0], "socket": p["socket"], "session": p["sessions"][0]})
    for n, (scenario, sid) in enumerate(zip(p["scenarios"], p["sessions"], strict=True)):
        if n == 0:
            drivers.append(first)
            continue
        other = object.__new__(Driver)  # same engine and worker, another session and scenario
        other.__dict__.update(first.__dict__, scenario=SCENARIOS[scenario], sid=sid)
        drivers.append(other)
    answers: list[dict[int, str]] = [{} for _ in drivers]
    engine = first.engine
    active: str | None = None
    switches = 0
    for k in p["schedule"]:
        d = drivers[k]
        i = len(answers[k])
        before = engine.backend.counters.copy()
        status, result = d.turn(messages_for(d.scenario.users, answers[k], i))
        if status != 200:
            raise RuntimeError(f"session {d.sid} request {i}: {status} {result}")
        after = engine.backend.counters
        switches += int(active is not None and active != d.sid)
        active = d.sid
        answers[k][i] = result.content
        forward = after.model_forward_tokens - before.model_forward_tokens
        fed = sum(getattr(after, name) - getattr(before, name)
                  for name in ("new_prefill_tokens", "decoded_tokens", "blend_forward_tokens"))
        rep.event(ack=i, session=k, content=result.content, checks=d.checks(), prefilled=result.prefilled_tokens,
                  forward_not_fed=forward - fed, counters=engine.totals.as_dict())
    rep.event(done=True, switches=switches, totals=engine.totals.as_dict())


def server_sessions(work: Path, log: Callable[[str], None], restarts: bool = True
                    ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    """The same through a real `kv-elision serve`: 4 client threads at once, each session's answers
    against the same session run alone; then (`restarts`) contextd killed and restarted under the
    live server."""
    from serving.launcher import ServerProcess

    outcomes: list[CaseOutcome] = []
    scenarios = session_scenarios(4)
    server = ServerProcess(root=work / "sessions-server", model="tiny-llama", budget=768,
                           extra=["--tail-tokens", "128", "--max-new-tokens", "6"])
    with environ_set(CRASH_ENV, None), environ_set(IO_FAULT_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        server.start()
    figures: dict[str, Any] = {}
    try:
        def run(sc: Scenario, sid: str, into: dict[int, Any]) -> None:
            answers: dict[int, str] = {}
            for i in range(len(sc.users)):
                reply = server.chat(messages_for(sc.users, answers, i), session=sid)
                into[i] = reply
                if reply.status != 200:
                    return
                answers[i] = reply.body["choices"][0]["message"]["content"] or ""

        solo: list[dict[int, Any]] = [{} for _ in scenarios]
        for k, sc in enumerate(scenarios):
            run(sc, f"solo-{k}", solo[k])
        together: list[dict[int, Any]] = [{} for _ in scenarios]
        threads = [threading.Thread(target=run, args=(sc, f"mixed-{k}", together[k])) for k, sc in enumerate(scenarios)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcome = CaseOutcome("4 clients, 4 sessions, one server", "sessions/server")
        mismatches = leaks = 0
        client = server.contextd.client if server.contextd is not None else None
        for k, sc in enumerate(scenarios):
            for i in range(len(sc.users)):
                a, b = solo[k].get(i), together[k].get(i)
                if a is None or b is None or a.status != 200 or b.status != 200:
                    outcome.fail(f"session {k} request {i}: {getattr(b, 'status', None)}")
                    continue
                if a.body["choices"][0]["message"] != b.body["choices"][0]["message"]:
                    mismatches += 1
                    outcome.fail(f"session {k} request {i}: answer differs from the session alone")
            stats = server.stats(f"mixed-{k}")
            c = stats["counters"]
            if c["model_forward_tokens"] != c["new_prefill_tokens"] + c["decoded_tokens"] \
                    + c["blend_forward_tokens"] or \
                    c["historical_forward_during_restore"]:
                outcome.fail(f"session {k}: accounting invariant broken: {c}")
            if client is not None:
                manifest = client.query_pages(f"mixed-{k}")
                hot = sum(p.token_end - p.token_start for p in manifest if PageState(p.state) is PageState.HOT)
                if hot != stats["hot_tokens"] or stats["attention_tokens"] > stats["budget_tokens"]:
                    leaks += 1
                    outcome.fail(f"session {k}: the manifest holds {hot} resident tokens, "
                                 f"the server {stats['hot_tokens']}")
        totals = server.stats()["counters"]
        solo_prefill = sum(server.stats(f"solo-{k}")["counters"]["new_prefill_tokens"] for k in range(len(scenarios)))
        mixed_prefill = sum(server.stats(f"mixed-{k}")["counters"]["new_prefill_tokens"] for k in range(len(scenarios)))
        if totals["model_forward_tokens"] != totals["new_prefill_tokens"] + totals["decoded_tokens"] \
                + totals["blend_forward_tokens"]:
            outcome.fail("server totals: model_forward_tokens != new_prefill_tokens + decoded_tokens "
                         "+ blend_forward_tokens")
        figures.update(server_interleaved_turns=sum(len(t) for t in together), server_session_mismatches=mismatches,
                       server_cross_session_leaks=leaks, server_switch_prefill_tokens=mixed_prefill - solo_prefill,
                       server_recovered_pages=totals["recovered_pages"],
                       session_switch_counter="session_switches" in totals)
        outcomes.append(outcome)
        log(f"sessions: server: {figures['server_interleaved_turns']} concurrent turns, {mismatches} answers off")
        if restarts:
            found, more = contextd_restarts(server, log)
            figures.update(found)
            outcomes += more
    finally:
        server.stop()
    return figures, outcomes


def _send(server: Any, messages: list[dict[str, Any]], sid: str, box: dict[str, Any]) -> None:
    box["r"] = server.chat(messages, session=sid)


def contextd_restarts(server: Any, log: Callable[[str], None]) -> tuple[dict[str, Any], list[CaseOutcome]]:
    """contextd dies under a serving server (at a commit, at a random moment of a turn, and for a
    long outage): the turn in flight fails with 503, and once contextd is back the next request
    succeeds (a client re-sends as Pi does, every 0.25 s); nothing acknowledged is lost."""
    from contextd.errors import NotFound

    sc = SCENARIOS["llama"]
    outcomes: list[CaseOutcome] = []
    in_flight_503 = lost = 0
    reconnect: list[float] = []
    daemon = server.contextd
    for n, how in enumerate(["contextd.commit.begin:4", "contextd.commit.durable:9", "kill:0.05", "kill:0.2",
                             "outage:20"]):
        sid = f"restart-{n}"
        outcome = CaseOutcome(f"contextd killed ({how}) under a live server", "sessions/contextd")
        answers: dict[int, str] = {}
        statuses: list[int] = []
        daemon.stop()
        with environ_set(CRASH_ENV, how if how.startswith("contextd.") else None):
            daemon.start()
        i = 0
        killed = False
        back_at: float | None = None
        while i < len(sc.users) and len(statuses) < 200:
            box: dict[str, Any] = {}
            request = messages_for(sc.users, answers, i)
            thread = threading.Thread(target=_send, args=(server, request, sid, box))
            thread.start()
            if how.split(":")[0] in ("kill", "outage") and i == 2 and not killed:
                time.sleep(float(how.split(":")[1]) if how.startswith("kill") else 0.05)
                daemon.kill9()
                killed = True
            thread.join()
            reply = box["r"]
            statuses.append(reply.status)
            if reply.status == 200:
                if back_at is not None:
                    reconnect.append(time.monotonic() - back_at)
                    back_at = None
                answers[i] = reply.body["choices"][0]["message"]["content"] or ""
                i += 1
                continue
            if reply.status == CONTEXTD_DOWN_STATUS and back_at is None:
                in_flight_503 += 1
            elif reply.status != CONTEXTD_DOWN_STATUS:
                outcome.fail(f"request {i} failed with {reply.status}, not {CONTEXTD_DOWN_STATUS}: "
                             f"{str(reply.body)[:200]}")
            if not daemon.running:
                if how.startswith("outage"):
                    time.sleep(float(how.split(":")[1]))  # contextd stays down a while, then comes back
                daemon.start()
                back_at = time.monotonic()
            time.sleep(0.25)
        if i < len(sc.users):
            outcome.fail(f"the session did not get past request {i}: statuses {statuses[:12]}...")
        if reconnect and reconnect[-1] > 2.0:
            outcome.fail(f"contextd was back, but the server answered {CONTEXTD_DOWN_STATUS} for "
                         f"{reconnect[-1]:.1f} s more (gRPC reconnect backoff)")
        if daemon.running and daemon.client is not None:
            try:
                turn = int(daemon.client.read_record(sid).record.turn)
                corrupt = list(daemon.client.verify(sid).corrupt)
            except NotFound:
                turn, corrupt = 0, []
            if turn < len(answers) or corrupt:
                lost += 1
                outcome.fail(f"after the restart the record has {turn} turns for {len(answers)} answered, "
                             f"{len(corrupt)} corrupt pages")
        if CONTEXTD_DOWN_STATUS not in statuses:
            outcome.fail(f"no request failed with {CONTEXTD_DOWN_STATUS} although contextd died ({statuses})")
        outcome.statuses = statuses
        outcomes.append(outcome)
    daemon.stop()
    with environ_set(CRASH_ENV, None):
        daemon.start()
    log(f"sessions: contextd restarts: {in_flight_503} turns in flight answered 503, {lost} sessions lost something, "
        f"back to serving {max(reconnect, default=0):.1f} s at most after contextd was")
    return {"contextd_restarts": 5, "contextd_restart_503": in_flight_503, "contextd_restart_lost": lost,
            "contextd_reconnect_s_max": round(max(reconnect, default=0.0), 2)}, outcomes
