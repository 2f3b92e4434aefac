"""The processes a campaign starts and how: contextd (restartable with a crash point, watched so
that one that dies at its crash point comes back at once), the environment they inherit, and
short working folders (Unix socket paths are limited to 107 bytes).

Every process is ended by its pid (serving.launcher). Depends on serving.launcher.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from harness.faults.scenarios import CRASH_ENV, IO_FAULT_ENV
from serving.launcher import ContextdProcess


def campaign_env(**extra: str) -> dict[str, str]:
    """The environment for processes the campaign starts: no crash point, fault or key inherited."""
    env = {k: v for k, v in os.environ.items() if k not in (CRASH_ENV, IO_FAULT_ENV, "KV_ELISION_API_KEY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    return env


@contextlib.contextmanager
def environ_set(name: str, value: str | None) -> Iterator[None]:
    """`name=value` in this process's environment while a child process is started."""
    old = os.environ.pop(name, None)
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        os.environ.pop(name, None)
        if old is not None:
            os.environ[name] = old


def short_tempdir(prefix: str = "kvf-") -> Path:
    """Unix socket paths are limited to 107 bytes: campaign folders live in /tmp."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


class Daemon:
    """The campaign's contextd: a ContextdProcess (serving.launcher) on a root, restartable with a
    crash point, watched so that one that dies at its crash point comes back at once."""

    def __init__(self, root: Path, socket_path: Path, extra: Sequence[str] = ("--reserve-bytes", "0")) -> None:

        self.process = ContextdProcess(root, socket_path, extra=list(extra), log=root.parent / "contextd.log")
        root.mkdir(parents=True, exist_ok=True)
        self.crashed = 0
        self._watch: threading.Thread | None = None
        self._stop_watch = threading.Event()

    @property
    def socket(self) -> Path:
        return self.process.socket

    @property
    def client(self) -> Any:
        return self.process.client

    def start(self, crash: str | None = None) -> None:
        with environ_set(CRASH_ENV, crash):
            self.process.start()

    def stop(self) -> None:
        self.unwatch()
        if self.process.running:
            self.process.stop()

    def restart(self, crash: str | None = None) -> None:
        self.stop()
        self.start(crash)

    def watch(self) -> None:
        """Restart (with no crash point) as soon as the process dies."""
        self._stop_watch.clear()

        def loop() -> None:
            while not self._stop_watch.is_set():
                proc = self.process.proc
                if proc is not None and proc.poll() is not None:
                    self.crashed += 1
                    self.start()
                    return
                time.sleep(0.02)

        self._watch = threading.Thread(target=loop, daemon=True)
        self._watch.start()

    def unwatch(self) -> None:
        self._stop_watch.set()
        if self._watch is not None:
            self._watch.join()
            self._watch = None
