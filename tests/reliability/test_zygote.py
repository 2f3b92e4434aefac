"""The zygote's parent side never waits without a deadline: a zygote that stops answering is
stopped, and the caller gets an error with the zygote's log instead of a hung campaign."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from harness.faults.zygote import Zygote


def test_a_zygote_that_stops_answering_is_stopped_with_an_error(tmp_path: Path) -> None:
    zygote = Zygote([], tmp_path / "zygote.log", answer_grace_s=1.0)
    try:
        os.kill(zygote.proc.pid, signal.SIGSTOP)   # alive, but it reads and answers nothing
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="no answer in 2 s"):
            zygote.run("drive", {}, timeout=1.0)
        assert time.monotonic() - started < 30
        assert zygote.proc.poll() is not None
    finally:
        zygote.close()
