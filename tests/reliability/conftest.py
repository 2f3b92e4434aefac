"""Fixtures for the reliability samples (benchmarks.faults, issue 15): one zygote that loaded the
tiny models once and forks a child per run, one contextd for the in-process runs, and one real
`kv-elision serve` for the HTTP samples. Every process is started by serving.launcher or by
benchmarks.faults and ended by pid."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import faults
from serving.launcher import ServerProcess


@pytest.fixture(scope="session")
def work() -> Iterator[Path]:
    folder = faults.short_tempdir("kvr-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def zygote(work: Path) -> Iterator[faults.Zygote]:
    z = faults.Zygote(["tiny-llama", "tiny-qwen3-next"], work / "zygote.log")
    yield z
    z.close()


@pytest.fixture(scope="session")
def daemon(work: Path) -> Iterator[faults.Daemon]:
    d = faults.Daemon(work / "root", work / "c.sock")
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def twins(zygote: faults.Zygote, daemon: faults.Daemon) -> faults.Twins:
    return faults.Twins(zygote, daemon)


@pytest.fixture(scope="session")
def crashes(zygote: faults.Zygote, daemon: faults.Daemon, twins: faults.Twins) -> faults.CrashCampaign:
    return faults.CrashCampaign(zygote, daemon, twins)


@pytest.fixture(scope="session")
def storage(zygote: faults.Zygote, daemon: faults.Daemon, twins: faults.Twins) -> faults.StorageCampaign:
    return faults.StorageCampaign(zygote, daemon, twins)


@pytest.fixture(scope="session")
def server(work: Path) -> Iterator[ServerProcess]:
    """A real server on the llama scenario's knobs, with its own contextd."""
    sc = faults.SCENARIOS["llama"]
    s = ServerProcess(root=work / "server", model=sc.model, budget=sc.budget,
                      extra=["--tail-tokens", str(sc.tail), "--max-new-tokens", str(sc.max_new),
                             "--client-timeout", str(faults.SLOW_CLIENT_TIMEOUT_S)])
    with faults._env(faults.CRASH_ENV, None), faults._env("KV_ELISION_API_KEY", None):
        s.start()
    yield s
    s.stop()


def explain(outcome: Any) -> str:
    return f"{outcome.label}: " + "; ".join(outcome.problems)
