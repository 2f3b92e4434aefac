"""Fast samples of the crash campaign (benchmarks.faults part 1): kill -9 at named crash points of
the server and of contextd, restart, and hold the session against an uncrashed twin fed the same
completed turns: every acknowledged turn and page present and verifying, nothing half-present,
the manifest the twin's, the accounting invariant, and every later answer the twin's.

The whole campaign (220+ points, six of them through a real `kv-elision serve` over HTTP) is
`python -m benchmarks.faults --parts crash`; a real server killed mid-turn over HTTP is also
tests/server/test_server.py::test_kill9_mid_turn_then_restart_continues_from_contextd."""

from __future__ import annotations

import pytest

from harness.faults.crash import SERVER_POINTS, CrashCampaign, CrashSpec, hit_in, plan_crashes, plan_history_crashes
from harness.faults.oracle import Twins
from harness.faults.scenarios import SCENARIOS
from tests.reliability.conftest import explain

LLAMA = SCENARIOS["llama"]
HYBRID = SCENARIOS["hybrid"]
EDITED = SCENARIOS["llama-edit"]


def test_the_twin_reaches_every_crash_point(twins: Twins) -> None:
    plain = twins.plain(LLAMA)
    reached = {name for ack in plain for name in ack["hits"]}
    assert set(SERVER_POINTS) <= reached, set(SERVER_POINTS) - reached
    assert sum(ack["commits"] for ack in plain) > 20
    assert any(ack["inserted"] for ack in plain), "no restore in the scenario: restores would go untested"
    assert len(plan_crashes(twins, LLAMA, 165)) >= 150


@pytest.mark.parametrize("spec", [
    ("serving.prefill.chunk", 1, 1), ("serving.decode.token", 1, 4), ("serving.store.payload_written", 2, 1),
    ("serving.blob.temp_written", 2, 2), ("serving.blob.renamed", 1, 1), ("serving.store.recorded", 2, 1),
    ("serving.persist.pages_stored", 2, 1), ("serving.persist.recorded", 2, 1)],
    ids=lambda s: f"{s[0]}@request{s[1]}")
def test_a_server_crash_before_pages_move_recovers_exactly(twins: Twins, crashes: CrashCampaign,
                                                           spec: tuple[str, int, int]) -> None:
    name, request, k = spec
    n = hit_in(twins.plain(LLAMA), name, request, k)
    outcome = crashes.case(LLAMA, [CrashSpec("server", name, n)])
    assert outcome.reached and outcome.exact, explain(outcome)
    assert outcome.pages_lost == 0 and outcome.half_present == 0


@pytest.mark.parametrize("point,n", [("contextd.commit.begin", 5), ("contextd.commit.durable", 9)])
def test_contextd_dies_mid_commit_the_turn_fails_with_503_and_the_session_recovers(
        crashes: CrashCampaign, point: str, n: int) -> None:
    outcome = crashes.case(LLAMA, [CrashSpec("contextd", point, n)])
    assert outcome.reached and outcome.exact, explain(outcome)
    assert outcome.unclear_errors == 0


def test_a_crash_while_resident_pages_stream_back_recovers_exactly(twins: Twins,
                                                                   crashes: CrashCampaign) -> None:
    first = hit_in(twins.plain(LLAMA), "serving.store.recorded", 2)
    outcome = crashes.case(LLAMA, [CrashSpec("server", "serving.store.recorded", first),
                                   CrashSpec("server", "serving.recover.resident_page", 2)])
    assert outcome.reached and outcome.exact, explain(outcome)


def test_a_hybrid_crash_mid_prefill_recovers_exactly(twins: Twins, crashes: CrashCampaign) -> None:
    n = hit_in(twins.plain(HYBRID), "serving.prefill.chunk", 2)
    outcome = crashes.case(HYBRID, [CrashSpec("server", "serving.prefill.chunk", n)])
    assert outcome.reached and outcome.exact, explain(outcome)


def test_a_crash_after_the_turn_moved_pages_recovers_exactly(twins: Twins,
                                                             crashes: CrashCampaign) -> None:
    plain = twins.plain(LLAMA)
    request = next(i for i, ack in enumerate(plain) if ack["inserted"])  # a turn that evicts and restores
    n = hit_in(plain, "serving.decode.token", request, 2)
    outcome = crashes.case(LLAMA, [CrashSpec("server", "serving.decode.token", n)])
    assert outcome.reached and outcome.exact, explain(outcome)


def test_a_hybrid_turn_resent_after_its_record_costs_only_the_opener(twins: Twins,
                                                                    crashes: CrashCampaign) -> None:
    n = hit_in(twins.plain(HYBRID), "serving.persist.recorded", 3)
    outcome = crashes.case(HYBRID, [CrashSpec("server", "serving.persist.recorded", n)])
    assert outcome.reached and outcome.exact, explain(outcome)



def test_the_edited_history_is_cut_back_and_regrown_past_the_budget(twins: Twins) -> None:
    assert EDITED.edit is not None
    plain = twins.plain(EDITED)
    during = plain[EDITED.edit.at]
    assert "transcript changed" in during["rebuilt"], during["rebuilt"]
    assert during["hits"].get("serving.evict.removed", 0) >= 2, "no regrown page was evicted: nothing stored mid-turn"
    assert len(plan_history_crashes(twins, EDITED, 24)) >= 20


@pytest.mark.parametrize("name,k", [("serving.store.recorded", 2), ("serving.persist.pages_stored", 1),
                                    ("serving.blob.renamed", 3)])
def test_a_crash_after_regrown_pages_are_stored_loses_no_page_of_the_last_record(
        twins: Twins, crashes: CrashCampaign, name: str, k: int) -> None:
    assert EDITED.edit is not None
    n = hit_in(twins.plain(EDITED), name, EDITED.edit.at, k)
    outcome = crashes.case(EDITED, [CrashSpec("server", name, n)])
    assert outcome.reached and outcome.exact, explain(outcome)
    assert outcome.pages_lost == 0 and outcome.half_present == 0
