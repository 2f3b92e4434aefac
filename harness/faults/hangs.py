"""Hangs (H1): a read of the store wedged in the kernel, on a read queue's thread or on the
worker's own, and the MLX runtime's greedy-step finalizer run by the garbage collector on a
restore's reader thread. No case may leave anyone waiting: a wedged restore's turn is answered
503 within the read deadline (a read on a reader thread) or the worker's --stuck-after (a read on
the worker itself), /health answers 503 while anything is stuck, a new turn is refused 503, and
once the read returns the server answers again, the same answer as a server that never hung. The
finalizer never waits for the runtime's lock, so that restore just goes through.

A read is wedged by the read hook of backends.read_stalls (KV_ELISION_READ_HANG=FIFO:N:WHERE): it
blocks in open(2) of a FIFO until `Fifo.release` opens the other end, as a read of a hung disk
blocks until the disk answers. Each wedged case runs a real `kv-elision serve` with its own contextd;
the finalizer case runs a real Engine and Worker on the MLX runtime in a child process
(`python -m harness.faults.hangs finalizer WORK`), since the collector has to find a session
that process dropped.

Depends on backends (read_stalls, the MLX runtime), serving (launcher, engine, HTTP worker) and
contextd's client side.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import json
import os
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from backends.read_stalls import READ_DEADLINE_ENV, READ_HANG_ENV
from harness.faults.processes import environ_set
from harness.faults.scenarios import CRASH_ENV, IO_FAULT_ENV

__all__ = ["CASES", "HangOutcome", "finalizer_case", "twin_answers", "wedged_read_case"]

READ_DEADLINE_S = 2.0   # the wedged servers' read deadline (read_stalls)
STUCK_AFTER_S = 4.0     # the wedged servers' --stuck-after
SLACK_S = 15.0          # on top of a deadline: a busy 2-core machine, the server's own work
POLL_S = 0.1
CASES = ("wedged reader", "wedged worker", "finalizer on the reader thread")
BUDGET = 1024


class Fifo:
    """The FIFO a wedged read blocks on (the read hook of backends.read_stalls), and its release."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "hang.fifo"
        os.mkfifo(self.path, 0o600)

    def hang(self, where: str) -> str:
        """The KV_ELISION_READ_HANG value: the first read on `where` ("reader" or "caller") blocks."""
        return f"{self.path}:1:{where}"

    def release(self) -> bool:
        """Let the blocked read go on; False when no read is blocked on it (yet)."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                return False
            raise
        os.close(fd)
        return True


@dataclass
class HangOutcome:
    """One case: how its wedged turn was answered and when, what /health and a new turn said while
    it was stuck, and whether the server answered as an unhung one once the read returned."""

    case: str
    deadline_s: float
    turn_status: int = 0
    turn_s: float = 0.0
    health_status: int = 0       # while stuck (the first 503, or what /health said at the deadline)
    health_s: float = 0.0        # from the turn's request to that answer
    refused_status: int = 0      # a new turn while stuck
    recovered: bool = False      # /health 200 again, and the turn sent again answered as the twin's
    problems: list[str] = field(default_factory=list)

    @property
    def answered_503_in_deadline(self) -> bool:
        return (self.turn_status == 503 and self.health_status == 503 and self.refused_status == 503
                and max(self.turn_s, self.health_s) <= self.deadline_s)

    @property
    def answered_in_deadline(self) -> bool:
        return self.turn_status in (200, 503) and self.turn_s <= self.deadline_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "answered_503_in_deadline": self.answered_503_in_deadline,
                "answered_in_deadline": self.answered_in_deadline}


def notes(name: str) -> list[dict[str, Any]]:
    """A session's first request: a few pages of notes, far under the budget."""
    body = " ".join(f"{name}_{i}" for i in range(150))
    return [{"role": "system", "content": "You are a coding agent. Be brief."},
            {"role": "user", "content": f"Notes of {name}:\n{body}\nRemember them."}]


QUESTION = {"role": "user", "content": "What came first in the notes?"}


def _answer(reply: Any) -> str:
    return str(reply.body["choices"][0]["message"]["content"] or "")


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(environ_set(name, value))
        yield


def _server(root: Path, hang: str | None) -> Any:
    """A real server on the tiny model with one resident session: a second session takes the
    cache, so the first one's next turn streams its pages back from the store (a restore of
    several files at once: the first read on the worker itself, the rest on a read queue)."""
    from serving.launcher import ServerProcess

    server = ServerProcess(root=root, model="tiny-llama", budget=BUDGET,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "4",
                                  "--stuck-after", str(STUCK_AFTER_S)])
    with _environment({CRASH_ENV: None, IO_FAULT_ENV: None, "KV_ELISION_API_KEY": None, READ_HANG_ENV: hang,
                       READ_DEADLINE_ENV: str(READ_DEADLINE_S)}):
        server.start()
    return server


def _opening(server: Any) -> list[dict[str, Any]]:
    """Session a's first turn, then b's (which takes the one cache); a's next request."""
    first = server.chat(notes("a"), session="a", max_tokens=4)
    if first.status != 200:
        raise RuntimeError(f"session a's first turn answered {first.status}: {first.body}")
    other = server.chat(notes("b"), session="b", max_tokens=4)
    if other.status != 200:
        raise RuntimeError(f"session b's first turn answered {other.status}: {other.body}")
    return [*notes("a"), {"role": "assistant", "content": _answer(first)}, QUESTION]


def twin_answers(work: Path) -> str:
    """What session a's second turn answers on a server that never hangs."""
    server = _server(work / "twin", None)
    try:
        reply = server.chat(_opening(server), session="a", max_tokens=4)
        if reply.status != 200:
            raise RuntimeError(f"the twin answered {reply.status}: {reply.body}")
        return _answer(reply)
    finally:
        server.stop()


def _poll(check: Any, seconds: float) -> bool:
    """Whether `check()` held within `seconds` (asked every POLL_S)."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def wedged_read_case(work: Path, where: str, expected: str) -> HangOutcome:
    """Session a's second turn with the first read on `where` ("reader": a read queue's thread;
    "caller": the worker's own thread) wedged until released."""
    case = "wedged reader" if where == "reader" else "wedged worker"
    deadline = (READ_DEADLINE_S if where == "reader" else STUCK_AFTER_S) + SLACK_S
    outcome = HangOutcome(case, deadline)
    work.mkdir(parents=True, exist_ok=True)
    fifo = Fifo(work)
    server = _server(work / where, fifo.hang(where))
    try:
        messages = _opening(server)
        replies: list[Any] = []
        started = time.monotonic()
        sender = threading.Thread(target=lambda: replies.append(server.chat(messages, session="a", max_tokens=4)),
                                  daemon=True)
        sender.start()

        def health_503() -> bool:
            return int(server.get("/health").status) == 503

        stuck = _poll(health_503, deadline)
        outcome.health_s = time.monotonic() - started
        outcome.health_status = 503 if stuck else int(server.get("/health").status)
        sender.join(max(0.0, started + deadline - time.monotonic()))
        outcome.turn_s = time.monotonic() - started
        if replies:
            outcome.turn_status = int(replies[0].status)
            if outcome.turn_status != 503:
                outcome.problems.append(f"the wedged turn answered {outcome.turn_status}: {replies[0].body}")
        else:
            outcome.problems.append(f"the wedged turn was not answered within {deadline:g} s")
        refused = server.chat([*notes("c"), QUESTION], session="c", max_tokens=4)
        outcome.refused_status = int(refused.status)
        if not fifo.release():
            outcome.problems.append("no read was blocked on the FIFO")
        back = _poll(lambda: int(server.get("/health").status) == 200, deadline)
        sender.join(deadline)
        again = server.chat(messages, session="a", max_tokens=4) if back else None
        outcome.recovered = again is not None and again.status == 200 and _answer(again) == expected
        if not outcome.recovered:
            outcome.problems.append("after the read returned: " + (
                "/health never answered 200" if again is None else
                f"the turn answered {again.status}: {again.body if again.status != 200 else _answer(again)!r} "
                f"(the twin: {expected!r})"))
        if stuck and outcome.health_s > deadline:
            outcome.problems.append(f"/health answered 503 only after {outcome.health_s:.1f} s")
    finally:
        fifo.release()
        server.stop()
    return outcome


def finalizer_case(work: Path) -> HangOutcome:
    """The finalizer case in a child process of its own (`_finalizer_child`), ended at its deadline."""
    deadline = READ_DEADLINE_S + SLACK_S
    outcome = HangOutcome(CASES[2], deadline)
    work.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "harness.faults.hangs", "finalizer", str(work)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop(READ_HANG_ENV, None)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=deadline + 120.0, env=env,
                              cwd=Path(__file__).resolve().parents[2])
    except subprocess.TimeoutExpired:
        outcome.problems.append("the child did not end: the restore waited for ever")
        return outcome
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        outcome.problems.append(f"the child failed ({done.returncode}): {done.stderr[-2000:]}")
        return outcome
    found = json.loads(lines[-1])
    outcome.turn_status, outcome.turn_s = int(found["status"]), float(found["seconds"])
    outcome.recovered = found["status"] == 200 and found["collected_on_reader"]
    if not found["collected_on_reader"]:
        outcome.problems.append("the collector did not finalize the dropped session on the reader thread")
    if outcome.turn_status != 200:
        outcome.problems.append(f"the restore's turn answered {outcome.turn_status}: {found['error']}")
    if outcome.turn_s > deadline:
        outcome.problems.append(f"the restore's turn took {outcome.turn_s:.1f} s")
    return outcome


def _finalizer_child(work: Path) -> dict[str, Any]:
    """A real Engine and Worker on the MLX runtime with its own contextd: session a, then b takes
    the one cache; a session dropped with a greedy step ahead (garbage in a cycle, the collector
    off); then a's next turn, whose restore's reader thread runs the collector as its first read
    begins, while the restore holds the runtime's lock and waits for that reader."""
    from backends import load_backend, read_stalls
    from controller.selectors import make_selector
    from serving.chat_format import ChatFormat
    from serving.engine import Engine, EngineConfig
    from serving.http_request import RequestError
    from serving.launcher import ContextdProcess
    from serving.turn import ChatRequest
    from serving.worker import Worker

    read_stalls.READ_DEADLINE_S = READ_DEADLINE_S
    daemon = ContextdProcess(work / "contextd", work / "c.sock", log=work / "contextd.log")
    client = daemon.start()
    try:
        backend = load_backend("mlx", "tiny-llama", capacity=BUDGET + 256)
        engine = Engine(backend, ChatFormat(backend.tokenizer), client,
                        EngineConfig(budget_tokens=BUDGET, tail_tokens=256, max_new_tokens=4),
                        make_selector("hybrid", 8))
        worker = Worker(engine)
        worker.start()

        def turn(session: str, messages: list[dict[str, Any]]) -> tuple[int, str, float]:
            started = time.monotonic()
            job = worker.submit(ChatRequest(session, messages))
            while time.monotonic() - started < READ_DEADLINE_S + SLACK_S:
                event = worker.next_event(job, POLL_S)
                if isinstance(event, RequestError):
                    return int(event.status), str(event), time.monotonic() - started
                if event is not None and event.final is not None:
                    return 200, event.final.content, time.monotonic() - started
            return 0, "no answer", time.monotonic() - started

        status, first, _ = turn("a", notes("a"))
        if status != 200 or turn("b", notes("b"))[0] != 200:
            raise RuntimeError(f"the opening turns failed: {status} {first}")
        dropped = backend.fork()
        dropped.prefill(list(range(5, 60)))
        token = dropped.decode(greedy=True)
        dropped.decode(token, greedy=True)       # a step dispatched ahead
        gone = weakref.ref(dropped)
        collected: list[bool] = []

        def on_read(on_opener: bool) -> None:
            if not on_opener and not collected:
                gc.collect()
                collected.append(gone() is None)

        gc.disable()
        try:
            del dropped
            read_stalls.set_read_hook(on_read)
            status, text, seconds = turn("a", [*notes("a"), {"role": "assistant", "content": first}, QUESTION])
        finally:
            read_stalls.set_read_hook(None)
            gc.enable()
        return {"status": status, "seconds": round(seconds, 3), "error": "" if status == 200 else text,
                "collected_on_reader": bool(collected and collected[0])}
    finally:
        daemon.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.faults.hangs")
    parser.add_argument("case", choices=["finalizer"])
    parser.add_argument("work", type=Path)
    args = parser.parse_args(argv)
    print(json.dumps(_finalizer_child(args.work)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
