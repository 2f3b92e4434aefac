"""The engine tests' shared parts: a real contextd process per test, and one turn run to its end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.launcher import ContextdProcess


@pytest.fixture
def contextd() -> Iterator[ContextdProcess]:
    base = Path(tempfile.mkdtemp(prefix="kve-", dir="/tmp"))
    daemon = ContextdProcess(base / "root", base / "c.sock", extra=["--reserve-bytes", "0"])
    daemon.start()
    yield daemon
    daemon.stop()
    shutil.rmtree(base, ignore_errors=True)
