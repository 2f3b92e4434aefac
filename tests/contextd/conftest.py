"""Fixtures that run the real contextd as a separate process on a real Unix socket."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from contextd.client import Client

REPO = Path(__file__).resolve().parents[2]


@dataclass
class DaemonProcess:
    """A contextd process; `restart()` reuses its root and socket."""

    root: Path
    socket: Path
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[str] | None = None
    client: Client | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "contextd.cli", "serve", "--root", str(self.root), "--socket",
                str(self.socket), *self.extra]

    def start(self) -> Client:
        self.proc = subprocess.Popen(self.command(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.client = Client(self.socket, timeout=60.0)
        try:
            self.client.wait_ready(timeout=30.0)
        except Exception:
            self.proc.kill()
            raise RuntimeError(f"contextd did not start: {self.proc.communicate()[0]}") from None
        return self.client

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> str:
        """SIGTERM, wait, return everything the process printed."""
        if self.client is not None:
            self.client.close()
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        return out

    def restart(self) -> Client:
        if self.client is not None:
            self.client.close()
        return self.start()


def short_tempdir() -> Path:
    """Unix socket paths are limited to 107 bytes, so sockets live in a short /tmp folder."""
    return Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))


@pytest.fixture
def daemon_factory() -> Iterator[object]:
    made: list[DaemonProcess] = []
    folders: list[Path] = []

    def make(*extra: str, start: bool = True) -> DaemonProcess:
        base = short_tempdir()
        folders.append(base)
        proc = DaemonProcess(root=base / "root", socket=base / "run" / "c.sock", extra=list(extra))
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
def daemon(daemon_factory: object) -> DaemonProcess:
    """A running daemon with no free-space reserve (tests that need one make their own)."""
    return daemon_factory("--reserve-bytes", "0")  # type: ignore[operator, no-any-return]


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "contextd.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ))
