"""Hostile and broken clients (benchmarks.faults part `connections`) on a real server: every
hostile Content-Length refused before the client timeout could fire, slowloris clients let go at
--client-timeout while /health answers, and a client that stops reading its stream has its turn
ended. The campaign runs the same cases (harness.faults.connections)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.faults.connections import CLIENT_TIMEOUT_S, hostile_content_length, slowloris, stopped_reading
from harness.faults.processes import environ_set
from harness.faults.scenarios import CRASH_ENV
from serving.launcher import ServerProcess


@pytest.fixture(scope="module")
def connections_server(work: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(root=work / "connections", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "100000",
                                  "--client-timeout", str(CLIENT_TIMEOUT_S)])
    with environ_set(CRASH_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        server.start()
    yield server
    server.stop()


def test_every_hostile_content_length_is_refused_at_once(connections_server: ServerProcess) -> None:
    found = hostile_content_length(connections_server)
    assert found.held == found.cases >= 12, found.problems


def test_slowloris_clients_are_let_go_at_the_client_timeout(connections_server: ServerProcess) -> None:
    found = slowloris(connections_server)
    assert found.held == found.cases == 2, found.problems


@pytest.mark.slow
def test_a_client_that_stops_reading_has_its_turn_ended(connections_server: ServerProcess) -> None:
    found = stopped_reading(connections_server)
    assert found.held == found.cases == 1, found.problems
