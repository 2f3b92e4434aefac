"""A named crash point kills its process at the N-th hit, and only there."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from tests.contextd.conftest import REPO

SCRIPT = ("from contextd import crashpoints\n"
          "for n in range(5):\n"
          "    crashpoints.reached('elsewhere')\n"
          "    crashpoints.reached('here')\n"
          "    print(n, flush=True)\n")


def run(spec: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "KV_ELISION_CRASH_AT": spec})


def test_the_nth_hit_is_a_sigkill_and_nothing_else_dies() -> None:
    died = run("here:3")
    assert died.returncode == -signal.SIGKILL and died.stdout.split() == ["0", "1"]
    assert run("").returncode == 0 and run("").stdout.split() == ["0", "1", "2", "3", "4"]
    assert run("nowhere:1").returncode == 0
    bad = run("here:0")
    assert bad.returncode == 1 and "NAME:N" in bad.stderr
