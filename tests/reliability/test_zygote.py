"""The zygote's parent side never waits without a deadline: a zygote that stops answering is
stopped, and the caller gets an error with the zygote's log instead of a hung campaign."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from harness.faults.driver import job_drive
from harness.faults.zygote import Zygote, job_name


def test_a_zygote_that_stops_answering_is_stopped_with_an_error(tmp_path: Path) -> None:
    zygote = Zygote([], tmp_path / "zygote.log", answer_grace_s=1.0)
    try:
        os.kill(zygote.proc.pid, signal.SIGSTOP)   # alive, but it reads and answers nothing
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="no answer in 2 s"):
            zygote.run(job_drive, {}, timeout=1.0)
        assert time.monotonic() - started < 30
        assert zygote.proc.poll() is not None
    finally:
        zygote.close()


def test_a_job_is_named_by_its_function_and_nothing_else_is_run(tmp_path: Path) -> None:
    """The zygote imports the job a caller names; a name that is not a campaign job gets an
    error answer, and the zygote goes on serving."""
    assert job_name(job_drive) == "harness.faults.driver:job_drive"
    zygote = Zygote([], tmp_path / "zygote.log")
    try:
        assert zygote.proc.stdin is not None
        zygote.proc.stdin.write(b'{"job": "os:system", "params": {}, "timeout": 5}\n')
        zygote.proc.stdin.flush()
        refused = zygote._line(30.0)
        assert b"not a campaign job" in refused and zygote.proc.poll() is None
    finally:
        zygote.close()
