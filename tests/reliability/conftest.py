"""Fixtures for the reliability samples (benchmarks.faults, issue 15): one zygote that loaded the
tiny models once and forks a child per run, one contextd for the in-process runs, and one real
`kv-elision serve` for the HTTP samples. Every process is started by serving.launcher or by
harness.faults and ended by pid."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.faults.crash import CrashCampaign
from harness.faults.fuzz import SLOW_CLIENT_TIMEOUT_S
from harness.faults.oracle import Twins
from harness.faults.processes import Daemon, environ_set, short_tempdir
from harness.faults.scenarios import CRASH_ENV, SCENARIOS
from harness.faults.storage import StorageCampaign
from harness.faults.zygote import Zygote
from serving.launcher import ServerProcess


@pytest.fixture(scope="session")
def work() -> Iterator[Path]:
    folder = short_tempdir("kvr-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def zygote(work: Path) -> Iterator[Zygote]:
    z = Zygote(["tiny-llama", "tiny-qwen3-next"], work / "zygote.log")
    yield z
    z.close()


@pytest.fixture(scope="session")
def daemon(work: Path) -> Iterator[Daemon]:
    d = Daemon(work / "root", work / "c.sock")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def twins(zygote: Zygote, daemon: Daemon) -> Twins:
    return Twins(zygote, daemon)


@pytest.fixture(scope="session")
def crashes(zygote: Zygote, daemon: Daemon, twins: Twins) -> CrashCampaign:
    return CrashCampaign(zygote, daemon, twins)


@pytest.fixture(scope="session")
def storage(zygote: Zygote, daemon: Daemon, twins: Twins) -> StorageCampaign:
    return StorageCampaign(zygote, daemon, twins)


@pytest.fixture(scope="session")
def server(work: Path) -> Iterator[ServerProcess]:
    """A real server on the llama scenario's knobs, with its own contextd."""
    sc = SCENARIOS["llama"]
    s = ServerProcess(root=work / "server", model=sc.model, budget=sc.budget,
                      extra=["--tail-tokens", str(sc.tail), "--max-new-tokens", str(sc.max_new),
                             "--client-timeout", str(SLOW_CLIENT_TIMEOUT_S)])
    with environ_set(CRASH_ENV, None), environ_set("KV_ELISION_API_KEY", None):
        s.start()
    yield s
    s.stop()


def explain(outcome: Any) -> str:
    return f"{outcome.label}: " + "; ".join(outcome.problems)
