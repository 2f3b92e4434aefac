"""The zygote: a process that loaded the tiny models once and forks one child per job, so hundreds
of kill -9 restarts fit in minutes (a fork is far cheaper than loading a model:
docs/journal/2026-11-30-fault-campaign.md).

    python -m harness.faults.zygote tiny-llama tiny-qwen3-next

reads one job per stdin line and answers one line per job: the child's exit status and every event
it reported. A job is named by its function ("harness.faults.driver:job_drive"): the zygote
imports the campaign's job modules only when a caller names one, so it depends on none of them.
Depends on backends, serving.chat_format and harness.faults.processes.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.faults.processes import campaign_env
from serving.launcher import REPO, stop_process

# Loading the tiny models takes seconds (docs/journal/2026-11-30-fault-campaign.md); a zygote that
# has not said "ready" in 300 s is stuck.
START_S = 300.0
# The zygote answers a job seconds after killing its child at the job's timeout (unless something
# else holds the child's pipe open: then this deadline is what ends the wait).
ANSWER_GRACE_S = 60.0


# A job a child runs: (its reporter, the loaded models by name -> (backend, chat format), params).
Job = Callable[["Reporter", dict[str, tuple[Any, Any]], dict[str, Any]], None]
# The modules whose `job_*` functions a zygote runs (it never imports them itself: callers name them).
JOB_MODULES = "harness.faults."


def job_name(job: Job) -> str:
    """How a job is named on the zygote's input: "module:function"."""
    return f"{job.__module__}:{job.__qualname__}"


def resolve_job(name: str) -> Job:
    """The job a name gives (ValueError for anything but a campaign module's `job_*` function)."""
    module, _, function = name.partition(":")
    if not module.startswith(JOB_MODULES) or not function.startswith("job_"):
        raise ValueError(f"not a campaign job: {name!r}")
    job: Job = getattr(importlib.import_module(module), function)
    return job


class Reporter:
    """A child's events, one JSON line each, into the pipe its zygote reads (survives a SIGKILL:
    every line is written before the next step)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def event(self, **fields: Any) -> None:
        data = (json.dumps(fields, default=str) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]


@dataclass
class ChildResult:
    status: int                  # exit code, or -signal
    events: list[dict[str, Any]]
    seconds: float

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if kind in e]

    @property
    def error(self) -> str:
        return next((e["error_trace"] for e in self.events if "error_trace" in e), "")


class Zygote:
    """A process that loaded the models once and forks one child per job (see `zygote_main`)."""

    def __init__(self, models: Sequence[str], log: Path, answer_grace_s: float = ANSWER_GRACE_S) -> None:
        self.log = log
        self.answer_grace_s = answer_grace_s
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "harness.faults.zygote", *models], cwd=REPO,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                         env=campaign_env())
        self._unread = b""
        if not self._line(START_S).startswith(b"ready"):
            self.close()
            raise RuntimeError(f"the zygote did not start:\n{self._log_tail()}")
        self.lock = threading.Lock()

    def run(self, job: Job, params: dict[str, Any], timeout: float = 300.0) -> ChildResult:
        """Run one job (a campaign module's `job_*` function) in a child of the zygote. The zygote
        kills a child at `timeout`; a zygote that has not answered `answer_grace_s` later is
        stopped, and this raises RuntimeError."""
        assert self.proc.stdin is not None
        with self.lock:
            try:
                self.proc.stdin.write((json.dumps({"job": job_name(job), "params": params,
                                                   "timeout": timeout}) + "\n").encode())
                self.proc.stdin.flush()
            except OSError as e:
                raise RuntimeError(f"the zygote died ({e}):\n{self._log_tail()}") from None
            line = self._line(timeout + self.answer_grace_s)
        if not line:
            raise RuntimeError(f"the zygote died:\n{self._log_tail()}")
        reply = json.loads(line)
        return ChildResult(reply["status"], reply["events"], reply["seconds"])

    def _line(self, seconds: float) -> bytes:
        """The zygote's next line (b"" once its output ended); after `seconds` without one the
        zygote is stopped and RuntimeError raised."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + seconds
        while b"\n" not in self._unread:
            left = deadline - time.monotonic()
            ready = select.select([fd], [], [], left)[0] if left > 0 else []
            if not ready:
                stop_process(self.proc, timeout=5.0)
                raise RuntimeError(f"the zygote gave no answer in {seconds:.0f} s; stopped it:\n{self._log_tail()}")
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return b""
            self._unread += chunk
        line, _, self._unread = self._unread.partition(b"\n")
        return line + b"\n"

    def _log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def close(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)  # it ends at the end of its input
            except subprocess.TimeoutExpired:
                stop_process(self.proc)
        self.proc.stdout.close()


def zygote_main(models: Sequence[str]) -> int:
    """Load the models, then for each job line on stdin fork a child that runs it and answer one
    line: its exit status and every event it reported. The zygote itself never opens a gRPC
    channel (children do), so forking stays safe."""
    import torch

    torch.set_num_threads(1)
    from backends import load_backend
    from serving.chat_format import ChatFormat

    loaded: dict[str, tuple[Any, Any]] = {}
    for model in models:
        backend = load_backend("torch", model, capacity=2048)
        loaded[model] = (backend, ChatFormat(backend.tokenizer))
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        started = time.monotonic()
        try:
            job = resolve_job(request["job"])   # imported here, before the fork, once per module
        except (ValueError, ImportError, AttributeError):
            out.write((json.dumps({"status": 1, "events": [{"error_trace": traceback.format_exc()[-4000:]}],
                                   "seconds": 0.0}) + "\n").encode())
            out.flush()
            continue
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(read_fd)
            os.dup2(2, 1)  # stdout is the zygote's protocol
            reporter = Reporter(write_fd)
            code = 0
            try:
                job(reporter, loaded, request["params"])
            except BaseException:  # noqa: BLE001 - reported, then the child exits
                reporter.event(error_trace=traceback.format_exc()[-4000:])
                code = 1
            os._exit(code)
        os.close(write_fd)
        events, buffer = [], b""
        deadline = started + float(request.get("timeout", 300.0))
        killed = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0 and not killed:
                os.kill(pid, signal.SIGKILL)  # our own child, by pid
                killed = True
                events.append({"timeout": True})
            ready, _, _ = select.select([read_fd], [], [], max(left, 0.5) if not killed else 5.0)
            if not ready:
                continue
            chunk = os.read(read_fd, 1 << 16)
            if not chunk:
                break
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            events += [json.loads(x) for x in lines if x]
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        out.write((json.dumps({"status": code, "events": events, "seconds": time.monotonic() - started}) + "\n")
                  .encode())
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(zygote_main(sys.argv[1:]))
