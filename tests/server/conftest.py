"""Fixtures that run the real `kv-elision serve` process (with its own contextd) on a free port.

Every server and contextd a test starts is ended by the launcher, by pid (serving.launcher)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from serving.launcher import ServerProcess


@pytest.fixture
def server_factory() -> Iterator[Any]:
    made: list[ServerProcess] = []
    folders: list[Path] = []

    def make(model: str = "tiny-llama", budget: int = 1024, *extra: str, start: bool = True) -> ServerProcess:
        base = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
        folders.append(base)
        server = ServerProcess(root=base / "root", model=model, budget=budget,
                               extra=["--tail-tokens", "256", "--max-new-tokens", "16", *extra])
        made.append(server)
        if start:
            server.start()
        return server

    yield make
    for server in made:
        server.stop()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
