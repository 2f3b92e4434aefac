"""The campaign's crash part: the planned kill -9 cases against their twins, the history crash
points (across a client's edit: a cut back and a regrow), then a few crash points through the
real `kv-elision serve` over HTTP.

Depends on harness.faults, benchmarks.stats, serving.launcher and contextd.errors.
"""

from __future__ import annotations

import argparse
import http.client
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.stats import percentile
from harness.faults.crash import CrashCampaign, plan_crashes, plan_history_crashes
from harness.faults.oracle import CaseOutcome, Twins
from harness.faults.processes import Daemon, environ_set
from harness.faults.scenarios import CRASH_ENV, SCENARIOS, messages_for
from harness.faults.zygote import Zygote

HISTORY_CRASH_POINTS = 24   # single crashes while the edit of llama-edit's history is served

HTTP_CRASHES = (("serving.prefill.chunk", 9), ("serving.decode.token", 27), ("serving.evict.removed", 2),
                ("serving.store.payload_written", 8), ("serving.persist.recorded", 5), ("serving.restore.inserted", 1))


def http_crashes(work: Path, log: Callable[[str], None]) -> list[CaseOutcome]:
    """A few crash points through the real thing: `kv-elision serve` started with the crash point,
    a client on HTTP that re-sends what was not answered, the server restarted (its contextd stays
    up), the answers against the same requests to an uncrashed server."""
    from contextd.errors import NotFound
    from serving.launcher import ServerProcess

    scenario = SCENARIOS["llama"]
    extra = ["--tail-tokens", str(scenario.tail), "--max-new-tokens", str(scenario.max_new)]

    def make(name: str) -> Any:
        return ServerProcess(root=work / name, model=scenario.model, budget=scenario.budget, extra=extra)

    def answer(reply: Any) -> str:
        return str(reply.body["choices"][0]["message"]["content"] or "")

    twin_server = make("http-twin")
    with environ_set(CRASH_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        twin_server.start()
    twins: dict[tuple[int, ...], list[str]] = {}

    def twin(sequence: list[int]) -> list[str]:
        if tuple(sequence) not in twins:
            got: dict[int, str] = {}
            out = []
            for i in sequence:
                reply = twin_server.chat(messages_for(scenario.users, got, i), session=f"t{len(twins)}")
                got[i] = answer(reply)
                out.append(got[i])
            twins[tuple(sequence)] = out
        return twins[tuple(sequence)]

    outcomes = []
    try:
        twin(list(range(len(scenario.users))))
        for name, n in HTTP_CRASHES:
            outcome = CaseOutcome(f"http:{name}:{n}", "llama/http")
            started = time.monotonic()
            server = make(f"http-{name}")
            answers: dict[int, str] = {}
            completed: list[int] = []
            try:
                with environ_set(CRASH_ENV, f"{name}:{n}"), environ_set("KV_ELISION_API_KEY", None):
                    server.start()
                i, died_at = 0, None
                while i < len(scenario.users):
                    try:
                        reply = server.chat(messages_for(scenario.users, answers, i), session="h")
                    except (OSError, http.client.HTTPException):
                        died_at = i
                        break
                    if reply.status != 200:
                        outcome.fail(f"request {i}: {reply.status} {str(reply.body)[:200]}")
                        break
                    answers[i] = answer(reply)
                    completed.append(i)
                    i += 1
                if died_at is None:
                    outcome.reached = False
                    continue
                assert server.proc is not None and server.contextd is not None
                server.proc.wait(timeout=60)
                if server.proc.returncode != -signal.SIGKILL:
                    outcome.fail(f"the server ended with {server.proc.returncode}, not at its crash point")
                client = server.contextd.client
                try:
                    turn = int(client.read_record("h").record.turn)
                except NotFound:
                    turn = 0
                if turn == len(completed) + 1:
                    completed.append(died_at)  # it died after its record: the re-send is a retry
                elif turn != len(completed):
                    outcome.fail(f"the record says {turn} turns, the client saw {len(completed)}")
                if client.verify("h").corrupt:
                    outcome.fail("corrupt pages after the crash")
                with environ_set(CRASH_ENV, None), environ_set("KV_ELISION_API_KEY", None):
                    server.start()
                after: list[str] = []
                for j in range(died_at, len(scenario.users)):
                    reply = server.chat(messages_for(scenario.users, answers, j), session="h")
                    if reply.status != 200:
                        outcome.fail(f"after the restart, request {j}: {reply.status} {str(reply.body)[:200]}")
                        break
                    answers[j] = answer(reply)
                    after.append(answers[j])
                    c = reply.body["kv"]
                    if c["model_forward_tokens"] != c["new_prefill_tokens"] + c["decoded_tokens"] \
                            + c["blend_forward_tokens"] or \
                            c["historical_forward_during_restore"]:
                        outcome.fail(f"request {j}: accounting invariant broken")
                want = twin(completed + list(range(died_at, len(scenario.users))))[len(completed):]
                if after != want:
                    outcome.fail(f"answers after the restart {after} != the uncrashed server's {want}")
            finally:
                server.stop()
                outcome.seconds = time.monotonic() - started
                outcomes.append(outcome)
                if not outcome.exact:
                    log(f"  http {name}:{n}: {outcome.problems[0][:300]}")
    finally:
        twin_server.stop()
    return outcomes


def run_crash_part(args: argparse.Namespace, work: Path, zygote: Zygote, log: Callable[[str], None]
                   ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    daemon = Daemon(work / "crash" / "root", work / "crash.sock")
    daemon.start()
    outcomes: list[CaseOutcome] = []
    try:
        twins = Twins(zygote, daemon)
        campaign = CrashCampaign(zygote, daemon, twins)
        names = [n for n in args.scenarios if n in SCENARIOS]
        weights = {"llama": 0.75, "hybrid": 0.25} if len(names) > 1 else {names[0]: 1.0}
        for name in names:
            scenario = SCENARIOS[name]
            plan = plan_crashes(twins, scenario, int(args.crash_points * weights[name] * 1.1))
            log(f"crash: {name}: {len(plan)} cases")
            for n, specs in enumerate(plan):
                outcome = campaign.case(scenario, specs)
                outcome.scope = f"{name}/{outcome.scope}"
                outcomes.append(outcome)
                if not outcome.reached:
                    log(f"  [{n + 1}/{len(plan)}] {outcome.label}: not reached")
                elif not outcome.exact:
                    log(f"  [{n + 1}/{len(plan)}] {outcome.label}: {outcome.problems[0]}")
                elif (n + 1) % 25 == 0:
                    log(f"  [{n + 1}/{len(plan)}] ok so far")
        edited = SCENARIOS["llama-edit"]
        history_plan = plan_history_crashes(twins, edited, HISTORY_CRASH_POINTS)
        log(f"crash: {len(history_plan)} history cases (across {edited.name}'s edit)")
        history = [campaign.case(edited, specs) for specs in history_plan]
        for outcome in history:
            outcome.scope = f"{edited.name}/{outcome.scope}"
            if outcome.reached and not outcome.exact:
                log(f"  history {outcome.label}: {outcome.problems[0]}")
    finally:
        daemon.stop()
    if args.http_crashes:
        log(f"crash: {len(HTTP_CRASHES)} through the real server and HTTP")
        outcomes += http_crashes(work, log)
    reached = [o for o in outcomes if o.reached]
    figures = {"crash_points": len(reached), "crash_recovered_exact": sum(o.exact for o in reached),
               "pages_lost": sum(o.pages_lost for o in reached),
               "half_present_pages": sum(o.half_present for o in reached),
               "crash_unclear_errors": sum(o.unclear_errors for o in reached),
               "crash_points_not_reached": len(outcomes) - len(reached),
               "crash_case_s_p50": round(percentile([o.seconds for o in reached], 50), 2) if reached else 0.0}
    history_reached = [o for o in history if o.reached]
    across = {"points": len(history_reached), "exact": sum(o.exact for o in history_reached),
              "lost": sum(o.pages_lost for o in history_reached)}
    return {**figures, "history_crash_points": across}, reached + history_reached
