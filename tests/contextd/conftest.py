"""Fixtures that run the real contextd as a separate process on a real Unix socket (serving.launcher)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from contextd.client import Client, pb
from contextd.clock import ENV as CLOCK_ENV
from harness.faults.network import S3Proxy
from harness.rgw import Rgw
from serving.launcher import ContextdProcess

REPO = Path(__file__).resolve().parents[2]


def store_payload(client: Client, session_id: str, page: pb.Page, data: bytes) -> pb.Page:
    """Write a page's payload the way the serving process does (a file beside the daemon, then
    its manifest record) and return the record."""
    blob = client.payloads().write(session_id, page.page_id, data)
    stored = pb.Page()
    stored.CopyFrom(page)
    stored.locator, stored.byte_size, stored.checksum = blob.locator, blob.byte_size, blob.checksum
    client.upsert_pages(session_id, [stored])
    return stored


def states(changes: list[tuple[str, int]], turn: int = 0) -> list[pb.PageStateChange]:
    return [pb.PageStateChange(page_id=page_id, state=state, last_used_turn=turn)  # type: ignore[arg-type]
            for page_id, state in changes]


def short_tempdir() -> Path:
    """Unix socket paths are limited to 107 bytes, so sockets live in a short /tmp folder."""
    return Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))


def in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    """Run `call` in a thread of its own (a call a fault holds back); the list gets its result or its exception."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except Exception as exc:  # noqa: BLE001 - handed to the test, which asserts on it
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


@pytest.fixture
def proxy(rgw: Rgw) -> Iterator[S3Proxy]:
    """A path to the test's object store that can lose a reply, hold a request back or refuse
    requests (harness.faults.network)."""
    path = S3Proxy(rgw.port)
    yield path
    path.close()


class MovedClock:
    """The clock of the daemons a test starts (contextd.clock), moved on by the test: `advance`
    adds seconds to their real clocks (the file is replaced whole, so a daemon never reads half)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0.0

    def advance(self, seconds: float) -> None:
        self.offset += seconds
        temp = self.path.with_suffix(".new")
        temp.write_text(f"{self.offset!r}\n")
        os.replace(temp, self.path)


@pytest.fixture
def clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> MovedClock:
    """Daemons started after this fixture read their time through a clock the test moves."""
    monkeypatch.setenv(CLOCK_ENV, str(tmp_path / "clock"))
    return MovedClock(tmp_path / "clock")


@pytest.fixture
def daemon_factory() -> Iterator[object]:
    made: list[ContextdProcess] = []
    folders: list[Path] = []

    def make(*extra: str, start: bool = True) -> ContextdProcess:
        base = short_tempdir()
        folders.append(base)
        proc = ContextdProcess(root=base / "root", socket=base / "run" / "c.sock", extra=list(extra))
        made.append(proc)
        if start:
            proc.start()
        return proc

    yield make
    for proc in made:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait()
        if proc.client is not None:
            proc.client.close()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def daemon(daemon_factory: object) -> ContextdProcess:
    """A running daemon with no free-space reserve (tests that need one make their own)."""
    return daemon_factory("--reserve-bytes", "0")  # type: ignore[operator, no-any-return]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "contextd.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
