"""The reliability campaign (issue 15): crashes, storage faults, fuzzing, concurrency, access.

    python -m benchmarks.faults                    # the whole campaign (slow: ~20-40 min on 2 cores)
    python -m benchmarks.faults --parts crash --crash-points 40    # a part, smaller
    python -m benchmarks.faults --json-out bench-out/faults.json

It prints a summary table, then one JSON line (the figures docs/reliability.md quotes). Every
check compares against an oracle, never against "it did not crash":

  crash    kill -9 at named crash points (contextd.crashpoints) in the serving code (chunked
           prefill, payload written but not recorded, eviction, decode, write-through, recovery)
           and in contextd (before and after a commit is durable). After each restart the oracle
           is an uncrashed twin fed the same turns: the requests whose record was committed, in
           order (a turn that died is re-sent by the client; one that died after its record is a
           retry). Checked: every acknowledged turn and page present and verifying, no manifest row
           pointing at a missing or partial file, the manifest after recovery equal to the twin's
           (ids, states, checksums), the accounting invariant, the held tokens equal to the
           session's own resident pages, and every later answer equal to the twin's.
  storage  torn, flipped, truncated, missing, emptied payloads and snapshots; ENOSPC, EDQUOT, EIO
           and EROFS from open / write / fsync / rename / directory fsync (fault injection at the
           file-I/O seam, contextd/blobs.py) and, where mounting is allowed, a real full and a real
           read-only tmpfs. Checked: the client gets an error (507 / 503) or a correct answer, a
           corrupt byte never reaches attention, the manifest never points at a missing file, and
           once the fault is gone the session goes on exactly as its twin.
  fuzz     Hypothesis-generated malformed HTTP requests (bodies, headers, X-KV-Context pieces,
           chunked encodings, slow clients, invalid UTF-8, deep and huge JSON) to a real server,
           malformed gRPC requests and raw bytes to a real contextd. Checked: a clear 4xx (gRPC: a
           status other than INTERNAL / UNKNOWN), both processes keep serving, memory bounded.
  sessions 4 clients, 4 sessions, one server, interleaved: each session's answers equal its solo
           twin's, no forward pass on a switch, no page of one session in another's attention;
           contextd killed and restarted under a live server.
  access   socket and store modes, loopback binding, the API key.

Turns run on the tiny random-weight models. The serving engine runs in-process in children forked
from a "zygote" that loaded the models once (a fork costs milliseconds; loading a model ~10 s),
so hundreds of kill -9 restarts fit in minutes; every process a run starts (zygote, contextd,
servers) is ended by pid. Depends on serving, contextd, backends and (fuzz) hypothesis.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.procfs import status_field

REPO = Path(__file__).resolve().parent.parent
SYSTEM = "You are a coding agent. Be brief."
CRASH_ENV = "KV_ELISION_CRASH_AT"
IO_FAULT_ENV = "KV_ELISION_IO_FAULT"

# ============================================================================ scenarios


def _user_turns(n: int, repeat: int) -> tuple[str, ...]:
    first = "Read the repository and take notes on every handler."
    files = tuple(f"File {i}: " + f"the handler {i} retries {i * 7} times and logs to queue {i % 3}. " * repeat
                  for i in range(n - 1))
    return (first, *files, "Which handler retries 7 times, and where does it log?")


@dataclass(frozen=True)
class Scenario:
    """One session: the user's turns (the last is the probe), the engine's knobs, the model."""

    name: str
    model: str
    users: tuple[str, ...]
    budget: int = 768
    tail: int = 128
    max_new: int = 6
    chunk: int = 128

    def config(self) -> dict[str, int]:
        return {"budget_tokens": self.budget, "tail_tokens": self.tail, "max_new_tokens": self.max_new,
                "prefill_chunk": self.chunk}


SCENARIOS = {
    # 7 requests; evictions from the third, restores chosen by the attention selector
    "llama": Scenario("llama", "tiny-llama", _user_turns(6, 14)),
    # the hybrid: recurrent snapshots written through and restored
    "hybrid": Scenario("hybrid", "tiny-qwen3-next", _user_turns(5, 14)),
}


def messages_for(users: Sequence[str], answers: dict[int, str], i: int) -> list[dict[str, Any]]:
    """The client's request number `i`: the system prompt, every user turn up to i, and the answer
    it kept for each earlier one."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for j in range(i):
        messages += [{"role": "user", "content": users[j]}, {"role": "assistant", "content": answers[j]}]
    return [*messages, {"role": "user", "content": users[i]}]


# ============================================================================ the zygote


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

    def __init__(self, models: Sequence[str], log: Path) -> None:
        self.log = log
        with open(log, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.faults", "--zygote", *models], cwd=REPO,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                         env=_clean_env())
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith(b"ready"):
            self.close()
            raise RuntimeError(f"the zygote did not start:\n{log.read_text(errors='replace')[-3000:]}")
        self.lock = threading.Lock()

    def run(self, job: str, params: dict[str, Any], timeout: float = 300.0) -> ChildResult:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self.lock:
            self.proc.stdin.write((json.dumps({"job": job, "params": params, "timeout": timeout}) + "\n").encode())
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died:\n{self.log.read_text(errors='replace')[-3000:]}")
        reply = json.loads(line)
        return ChildResult(reply["status"], reply["events"], reply["seconds"])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _clean_env(**extra: str) -> dict[str, str]:
    """The environment for processes the campaign starts: no crash point, fault or key inherited."""
    env = {k: v for k, v in os.environ.items() if k not in (CRASH_ENV, IO_FAULT_ENV, "KV_ELISION_API_KEY")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **extra)
    return env


def zygote_main(models: Sequence[str]) -> int:
    """Load the models, then for each job line on stdin fork a child that runs it and answer one
    line: its exit status and every event it reported. The zygote itself never opens a gRPC
    channel (children do), so forking stays safe."""
    import torch

    torch.set_num_threads(1)
    from backends import load_backend
    from serving.transcript import ChatFormat

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
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child
            os.close(read_fd)
            os.dup2(2, 1)  # stdout is the zygote's protocol
            reporter = Reporter(write_fd)
            code = 0
            try:
                JOBS[request["job"]](reporter, loaded, request["params"])
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


# ============================================================================ in the child


def _manifest(client: Any, sid: str) -> list[list[Any]]:
    return sorted([p.page_id, int(p.state), p.checksum, int(p.byte_size)] for p in client.query_pages(sid))


def _inspect(client: Any, payloads: Any, sid: str) -> dict[str, Any]:
    """What a crash left in contextd, before anything recovers: the record's turn, the manifest,
    rows whose payload is missing, partial or failing its checksum, leftover temporary files."""
    from contextd.blobs import TEMP_PREFIX
    from contextd.errors import NotFound

    try:
        turn = int(client.read_record(sid).record.turn)
    except NotFound:
        turn = 0
    try:
        pages = list(client.query_pages(sid))
    except NotFound:
        pages = []
    half = [p.page_id for p in pages if p.locator and not payloads.blobs.exists(p.locator, p.byte_size)]
    half += [p.page_id for p in pages if not p.locator and int(p.state) == 2]  # COLD with nothing behind it
    corrupt = [c.page_id for c in client.verify(sid).corrupt] if pages else []
    folder = payloads.blobs.root / sid
    temps = [f.name for f in folder.iterdir() if f.name.startswith(TEMP_PREFIX)] if folder.exists() else []
    return {"record_turn": turn, "manifest": sorted([p.page_id, int(p.state), p.checksum, int(p.byte_size)]
                                                    for p in pages),
            "half_present": half, "corrupt": corrupt, "temp_files": temps}


class Driver:
    """The client and the server, in one child: a real serving.http.Worker around a real Engine
    (so every failure maps to the HTTP status a client would see), and a client that re-sends a
    turn that failed, as Pi does."""

    def __init__(self, loaded: dict[str, tuple[Any, Any]], p: dict[str, Any]) -> None:
        from contextd.client import Client
        from controller.selectors import AttentionSelector
        from serving.engine import Engine, EngineConfig
        from serving.http import Worker

        self.scenario = SCENARIOS[p["scenario"]]
        backend, chat_format = loaded[self.scenario.model]
        backend.reset()
        self.client = Client(p["socket"], timeout=60.0)
        self.engine = Engine(backend, chat_format, self.client, EngineConfig(**self.scenario.config()),
                             AttentionSelector())
        self.payloads = self.engine.mover.payloads
        self.worker = Worker(self.engine)
        self.worker.start()
        self.sid = p["session"]
        self.inserted: list[str] = []        # page ids streamed into attention (restores, recoveries)
        self.served_corrupt: list[str] = []  # ... whose file did not hold the bytes first written
        self._watch_inserts()

    def _watch_inserts(self) -> None:
        """After every insert into attention, hash the file again: a payload that differs from its
        manifest checksum would be a corrupt page served (the insert checks it; this checks the check)."""
        import xxhash

        backend = self.engine.backend
        original = backend.insert_block_file

        def insert(path: Any, at: int, *, checksum: str, size: int, **kw: Any) -> Any:
            block = original(path, at, checksum=checksum, size=size, **kw)
            page_id = Path(path).name.split(".")[0]
            self.inserted.append(page_id)
            data = Path(path).read_bytes() if Path(path).exists() else b""
            if len(data) != size or xxhash.xxh3_128_hexdigest(data) != checksum:
                self.served_corrupt.append(page_id)
            return block

        backend.insert_block_file = insert  # type: ignore[method-assign]

    def turn(self, messages: list[dict[str, Any]]) -> tuple[int, Any]:
        """One request through the worker: (200, TurnResult) or (status, message)."""
        from serving.engine import ChatRequest
        from serving.http import RequestError

        job = self.worker.submit(ChatRequest(self.sid, messages))
        while True:
            event = job.events.get()
            if isinstance(event, RequestError):
                return int(event.status), f"{event.kind}: {event}"
            if event.final is not None:
                return 200, event.final

    def checks(self) -> dict[str, Any]:
        """The invariants after a turn: accounting, budget, and attention holding exactly this
        session's resident pages (nothing of another session, nothing stale)."""
        import numpy as np

        with self.worker.lock:
            engine = self.engine
            session = engine.sessions.get(self.sid)
            if session is None or engine.active != self.sid:
                return {"ok": False, "why": "the session is not active after its turn"}
            c, t = session.counters, engine.totals
            pager = session.pager
            want = [tok for p in pager.pages if p.resident for tok in session.transcript.ids[p.token_start:p.token_end]]
            held = engine.backend.held_token_ids()
            why = []
            if c.model_forward_tokens != c.new_prefill_tokens + c.decoded_tokens:
                why.append("model_forward_tokens != new_prefill_tokens + decoded_tokens (session)")
            if t.model_forward_tokens != t.new_prefill_tokens + t.decoded_tokens:
                why.append("model_forward_tokens != new_prefill_tokens + decoded_tokens (server)")
            if c.historical_forward_during_restore or t.historical_forward_during_restore:
                why.append("historical_forward_during_restore != 0")
            if not np.array_equal(np.asarray(held), np.asarray(want, dtype=np.asarray(held).dtype)):
                why.append("attention holds other tokens than the session's resident pages")
            if engine.backend.attention_tokens > self.scenario.budget:
                why.append("attention over the budget")
            if pager.total_tokens != session.transcript.tokens:
                why.append("pager and transcript disagree on the session's length")
            return {"ok": not why, "why": "; ".join(why), "leak": "other tokens" in " ".join(why),
                    "counters": c.as_dict(), "pager": _pager(session)}

    def activate(self) -> dict[str, Any]:
        """Bring the session in (what the next request would do first) and describe it."""
        with self.worker.lock:
            engine = self.engine
            session = engine._activate(self.sid, engine.format.fingerprint(None, "default"))
            return {"turn": session.pager.turn, "tokens": session.transcript.tokens, "pager": _pager(session),
                    "notes": list(session.recovery_notes), "manifest": _manifest(self.client, self.sid)}


def _pager(session: Any) -> list[list[Any]]:
    """What the pager decides from, page by page: state, pin, lease, last use."""
    return [[p.index, p.state.name, p.pin.value if p.pin else "", p.lease_until_turn, p.last_used_turn]
            for p in session.pager.pages]


def job_drive(rep: Reporter, loaded: dict[str, tuple[Any, Any]], p: dict[str, Any]) -> None:
    """Send requests `sequence` of the scenario in order; report each one sent, acknowledged or
    failed. Options: `crash` [NAME, N] (this child SIGKILLs itself there), `inspect` (first look
    at what a crash left, then recover), `stays_up` (a failed request is re-sent, as the server
    keeps serving), `count` (count every crash point and file operation per request: the twin),
    `before` / `after` {request: [action, ...]}: actions run before the request is first sent and
    after it was answered (ok or not): ["inject", op, errno name, nth, times] (a fault at the
    file-I/O seam, cleared after the request), ["corrupt", page id | "@cold" | "@resident" |
    "@snapshot", how], ["forget"] (the server drops the session from memory: a restart without
    the crash), ["fill", folder, bytes left free], ["unfill", folder], ["remount", folder, "ro" | "rw"]."""
    from contextd import blobs, crashpoints

    d = Driver(loaded, p)
    users = d.scenario.users
    answers = {int(k): v for k, v in p.get("answers", {}).items()}
    hits: dict[str, int] = {}
    if p.get("count"):
        reached = crashpoints.reached

        def counting(name: str) -> None:
            hits[name] = hits.get(name, 0) + 1
            reached(name)

        crashpoints.reached = counting  # type: ignore[assignment]
        io = blobs._io

        def counting_io(op: str, path: object) -> None:
            hits["io." + op] = hits.get("io." + op, 0) + 1
            io(op, path)

        blobs._io = counting_io  # type: ignore[assignment]
    if p.get("crash"):
        name, n = p["crash"]
        crashpoints._TARGET = (name, int(n))
        crashpoints._hits = 0
    before: dict[str, list[list[Any]]] = dict(p.get("before", {}))
    after: dict[str, list[list[Any]]] = dict(p.get("after", {}))
    pending_inspect = bool(p.get("inspect"))
    todo = list(p["sequence"])
    failures = 0
    while todo or pending_inspect:
        if pending_inspect:
            try:
                rep.event(inspect=_inspect(d.client, d.payloads, d.sid))
                rep.event(recovered=d.activate())
                pending_inspect = False
            except Exception as exc:
                if not p.get("stays_up") or failures > 5:
                    raise
                failures += 1  # what the worker answers when bringing the session in fails like this
                rep.event(failed=todo[0] if todo else -1, status=_status_for(exc),
                          error=f"{type(exc).__name__}: {exc}"[:400])
                d.engine.forget_active()
                d.client.wait_ready(timeout=120)
            continue
        i = todo[0]
        armed = [_act(d, action) for action in before.pop(str(i), [])]
        fault = next((a for a in armed if isinstance(a, blobs.IOFault)), None)
        for info in armed:
            if isinstance(info, dict):
                rep.event(action=info)
        counted = dict(hits)
        commits = d.client.status().commit_seq if p.get("count") else 0
        rep.event(sent=i)
        status, result = d.turn(messages_for(users, answers, i))
        blobs.clear_fault()
        for action in after.pop(str(i), []):
            _act(d, action)
        fired = fault.fired if fault is not None else 0
        if status != 200:
            failures += 1
            rep.event(failed=i, status=status, error=str(result)[:400], fired=fired)
            if not p.get("stays_up") or failures > 5:
                raise RuntimeError(f"request {i} failed: {status} {result}")
            d.client.wait_ready(timeout=120)
            pending_inspect = True
            continue
        todo.pop(0)
        answers[i] = result.content
        event: dict[str, Any] = {"ack": i, "content": result.content, "checks": d.checks(), "fired": fired,
                                 "manifest": _manifest(d.client, d.sid), "rebuilt": result.rebuilt,
                                 "prefilled": result.prefilled_tokens,
                                 "inserted": list(d.inserted), "served_corrupt": list(d.served_corrupt)}
        d.inserted.clear()
        if p.get("count"):
            event["hits"] = {k: v - counted.get(k, 0) for k, v in hits.items() if v != counted.get(k, 0)}
            event["commits"] = d.client.status().commit_seq - commits
        rep.event(**event)
    rep.event(done=True, served_corrupt=d.served_corrupt)


def _status_for(exc: BaseException) -> int:
    """The status serving.http.Worker answers for an exception out of the engine."""
    from contextd.errors import DaemonUnavailable, StoreFull
    from serving.transcript import TranscriptError

    if isinstance(exc, TranscriptError):
        return 400
    if isinstance(exc, StoreFull):
        return 507
    if isinstance(exc, DaemonUnavailable):
        return 503
    return 500


def _act(d: Driver, action: list[Any]) -> Any:
    from contextd import blobs

    kind, *args = action
    if kind == "inject":
        op, name, nth, times = args
        return blobs.inject(op, getattr(errno, name), int(nth), int(times))
    if kind == "corrupt":
        return _corrupt(d, *args)
    if kind == "forget":
        with d.worker.lock:
            d.engine.forget_active()
        return {"forgot": True}
    if kind == "fill":
        folder, leave = Path(args[0]), int(args[1])
        st = os.statvfs(folder)
        size = max(0, st.f_bavail * st.f_frsize - leave)
        with open(folder / "filler", "wb") as f:
            f.truncate(0)
            chunk = bytes(1 << 20)
            while size > 0:
                try:
                    size -= f.write(chunk[:min(size, len(chunk))])
                except OSError:
                    break
        return {"filled": str(folder), "free": os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize}
    if kind == "unfill":
        (Path(args[0]) / "filler").unlink(missing_ok=True)
        return {"unfilled": args[0]}
    if kind == "remount":
        subprocess.run(["mount", "-o", f"remount,{args[1]}", args[0]], check=True, capture_output=True)
        return {"remounted": args[1]}
    raise ValueError(f"unknown action {kind!r}")


def _corrupt(d: Driver, target: str, how: str) -> dict[str, Any]:
    """Damage one stored payload on disk the way a disk or a crash can: `flip` a byte, `torn`
    (the second half zeroed, as a write that never reached the platter), `truncate` to half,
    `empty`, `append` garbage, `missing`. The target: a page id, the session's first stored cold
    page ("@cold"), its first stored resident page ("@resident") or its recurrent snapshot."""
    client, sid = d.client, d.sid
    if target == "@snapshot":
        snaps = [s for s in client.query_snapshots(sid) if s.slot == "recurrent"]
        if not snaps:
            return {"skipped": "no snapshot"}
        locator, page_id = snaps[0].locator, "snapshot"
    else:
        pages = [p for p in client.query_pages(sid) if p.locator]
        if target.startswith("@"):
            want = 2 if target == "@cold" else 1  # COLD, HOT
            pages = [p for p in pages if int(p.state) == want and p.token_end - p.token_start == 128]
            if target == "@resident":
                pages = pages[1:] or pages  # not the pinned system page: a plain resident one
        else:
            pages = [p for p in pages if p.page_id == target]
        if not pages:
            return {"skipped": f"no page for {target}"}
        locator, page_id = pages[0].locator, pages[0].page_id
    path = d.payloads.path(locator)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
    elif how == "torn":
        data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
    elif how == "truncate":
        del data[len(data) // 2:]
    elif how == "empty":
        data = bytearray()
    elif how == "append":
        data += b"\0garbage"
    if how == "missing":
        path.unlink()
    else:
        os.chmod(path, 0o600)
        path.write_bytes(bytes(data))
    return {"page": page_id, "how": how}


JOBS: dict[str, Callable[[Reporter, dict[str, tuple[Any, Any]], dict[str, Any]], None]] = {"drive": job_drive}


# ============================================================================ processes


class Daemon:
    """The campaign's contextd: a ContextdProcess (serving.launcher) on a root, restartable with a
    crash point, watched so that one that dies at its crash point comes back at once."""

    def __init__(self, root: Path, socket_path: Path, extra: Sequence[str] = ("--reserve-bytes", "0")) -> None:
        from serving.launcher import ContextdProcess

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
        with _env(CRASH_ENV, crash):
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


@contextlib.contextmanager
def _env(name: str, value: str | None) -> Iterator[None]:
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


# ============================================================================ twins


class Twins:
    """Uncrashed runs of a scenario, one per sequence of completed requests, computed once."""

    def __init__(self, zygote: Zygote, daemon: Daemon) -> None:
        self.zygote = zygote
        self.daemon = daemon
        self._done: dict[tuple[str, tuple[int, ...]], list[dict[str, Any]]] = {}
        self._n = 0

    def run(self, scenario: Scenario, sequence: Sequence[int]) -> list[dict[str, Any]]:
        """The ack event of each request of `sequence`, in order (answers, manifests, hits)."""
        key = (scenario.name, tuple(sequence))
        if key not in self._done:
            self._n += 1
            result = self.zygote.run("drive", {"scenario": scenario.name, "socket": str(self.daemon.socket),
                                               "session": f"twin-{scenario.name}-{self._n}",
                                               "sequence": list(sequence), "count": True})
            acks = result.of("ack")
            if result.status != 0 or len(acks) != len(sequence):
                raise RuntimeError(f"the twin of {key} failed ({result.status}): {result.error or result.events[-3:]}")
            self._done[key] = acks
        return self._done[key]

    def plain(self, scenario: Scenario) -> list[dict[str, Any]]:
        return self.run(scenario, range(len(scenario.users)))


# ============================================================================ part 1: crashes


@dataclass(frozen=True)
class CrashSpec:
    where: str   # "server" (the serving child) or "contextd" (the daemon)
    name: str
    n: int

    def label(self) -> str:
        return f"{self.name}:{self.n}"


@dataclass
class CaseOutcome:
    """One crash (or fault) case against its twin."""

    label: str
    scope: str
    reached: bool = True
    exact: bool = True
    problems: list[str] = field(default_factory=list)
    pages_lost: int = 0
    half_present: int = 0
    leaks: int = 0
    served_corrupt: int = 0
    unclear_errors: int = 0
    statuses: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def fail(self, why: str) -> None:
        self.exact = False
        if len(self.problems) < 6:
            self.problems.append(why)


class History:
    """What the client and the store went through in one case: the requests whose record was
    committed, in order (the twin's sequence), and the checks to run against that twin."""

    def __init__(self, n_requests: int) -> None:
        self.n = n_requests
        self.answers: dict[int, str] = {}
        self.completed: list[int] = []
        self.in_flight: int | None = None
        self.acks: list[tuple[int, dict[str, Any]]] = []        # (position in `completed`, ack event)
        self.inspections: list[tuple[int, dict[str, Any]]] = []  # (completed requests then, inspect event)
        self.recoveries: list[tuple[int, dict[str, Any]]] = []

    @property
    def next_request(self) -> int:
        return max(self.answers) + 1 if self.answers else 0

    def feed(self, events: list[dict[str, Any]], outcome: CaseOutcome) -> None:
        for e in events:
            if "sent" in e:
                self.in_flight = e["sent"]
            elif "ack" in e:
                self.answers[e["ack"]] = e["content"]
                self.completed.append(e["ack"])
                self.acks.append((len(self.completed), e))
                self.in_flight = None
            elif "failed" in e:
                outcome.statuses.append(int(e["status"]))
            elif "inspect" in e:
                turn = int(e["inspect"]["record_turn"])
                if self.in_flight is not None and turn == len(self.completed) + 1:
                    self.completed.append(self.in_flight)  # it died after its record: the re-send is a retry
                elif turn != len(self.completed):
                    outcome.fail(f"the record says {turn} turns, the client saw {len(self.completed)} "
                                 f"(+{'1 in flight' if self.in_flight is not None else '0'})")
                self.in_flight = None
                self.inspections.append((len(self.completed), e["inspect"]))
            elif "recovered" in e:
                self.recoveries.append((len(self.completed), e["recovered"]))

    def check(self, twin: list[dict[str, Any]], outcome: CaseOutcome) -> None:
        """Everything against the twin fed `completed` (answers, manifests after each request)."""
        def manifest_at(k: int) -> list[list[Any]]:
            return twin[k - 1]["manifest"] if k > 0 else []

        for k, found in self.inspections:
            present = {tuple(row[:1] + row[2:]) for row in found["manifest"]} if found else set()
            lost = [row[0] for row in manifest_at(k) if (row[0], row[2], row[3]) not in present
                    or row[0] in found["corrupt"]]
            outcome.pages_lost += len(lost)
            outcome.half_present += len(found["half_present"])
            if lost:
                outcome.fail(f"after {k} completed turns, pages lost: {lost[:4]}")
            if found["half_present"] or found["corrupt"]:
                outcome.fail(f"half-present {found['half_present'][:3]}, corrupt {found['corrupt'][:3]}")
        for k, recovered in self.recoveries:
            if k and [r[:2] for r in recovered["manifest"]] != [r[:2] for r in manifest_at(k)]:
                outcome.fail(f"after recovery at {k} turns the manifest differs from the twin's "
                             f"({_manifest_diff(recovered['manifest'], manifest_at(k))})")
        for position, ack in self.acks:
            want = twin[position - 1]
            if ack["content"] != want["content"]:
                outcome.fail(f"request {ack['ack']} (turn {position}): answer {ack['content']!r} != twin's "
                             f"{want['content']!r}")
            elif [r[:2] + r[3:] for r in ack["manifest"]] != [r[:2] + r[3:] for r in want["manifest"]]:
                # ids, states and sizes: K/V computed after a recovery may differ from the twin's in
                # the last bits (attention sums over another slot layout); what was stored before
                # the crash is compared byte for byte above
                outcome.fail(f"request {ack['ack']}: manifest differs from the twin's "
                             f"({_manifest_diff(ack['manifest'], want['manifest'])})")
            checks = ack["checks"]
            if not checks["ok"]:
                outcome.fail(f"request {ack['ack']}: {checks['why']}")
            outcome.leaks += int(bool(checks.get("leak")))
            outcome.served_corrupt += len(ack["served_corrupt"])


def _manifest_diff(got: list[list[Any]], want: list[list[Any]]) -> str:
    a, b = {r[0]: r[1:] for r in got}, {r[0]: r[1:] for r in want}
    extra, missing = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    moved = sorted(k for k in set(a) & set(b) if a[k][0] != b[k][0])
    other = sorted(k for k in set(a) & set(b) if a[k][1:] != b[k][1:])
    return f"extra {extra[:3]}, missing {missing[:3]}, other state {moved[:3]}, other bytes {other[:3]}"


class CrashCampaign:
    def __init__(self, zygote: Zygote, daemon: Daemon, twins: Twins) -> None:
        self.zygote = zygote
        self.daemon = daemon
        self.twins = twins
        self.count = 0

    def case(self, scenario: Scenario, specs: Sequence[CrashSpec]) -> CaseOutcome:
        """Run the scenario under `specs` (one per process life: the first child dies at the first,
        the next at the second, ...), recover after each, finish the session, check it all."""
        self.count += 1
        sid = f"c{self.count:04d}-{scenario.name}"
        label = " then ".join(f"{s.where}:{s.label()}" for s in specs) or "none"
        outcome = CaseOutcome(label, "+".join(sorted({s.where for s in specs})))
        history = History(len(scenario.users))
        started = time.monotonic()
        lives = [*specs, None]
        for life, spec in enumerate(lives):
            if history.next_request >= history.n and life > 0 and spec is None:
                # every request was acknowledged before the last crash point was reached
                outcome.reached = False
                break
            params: dict[str, Any] = {"scenario": scenario.name, "socket": str(self.daemon.socket), "session": sid,
                                      "sequence": list(range(history.next_request, history.n)),
                                      "answers": history.answers, "inspect": life > 0}
            if spec is not None and spec.where == "server":
                params["crash"] = [spec.name, spec.n]
            if spec is not None and spec.where == "contextd":
                params["stays_up"] = True
                self.daemon.restart(crash=spec.label())
                self.daemon.watch()
                crashed_before = self.daemon.crashed
            result = self.zygote.run("drive", params)
            if spec is not None and spec.where == "contextd":
                self.daemon.unwatch()
                if self.daemon.crashed == crashed_before:
                    outcome.reached = False
                self.daemon.restart()  # no crash point left armed
            history.feed(result.events, outcome)
            for failed in result.of("failed"):
                if failed["status"] != 503:
                    outcome.unclear_errors += 1
                    outcome.fail(f"a request in flight when contextd died got {failed['status']}, not 503: "
                                 f"{failed['error'][:160]}")
            if spec is not None and spec.where == "server":
                if result.status != -signal.SIGKILL:
                    if result.status == 0:
                        outcome.reached = False
                        break
                    outcome.fail(f"the child ended with {result.status}, not at its crash point: {result.error[-600:]}")
                    break
            elif result.status != 0:
                outcome.fail(f"the run ended with {result.status}: {result.error[-600:]}")
                break
            if spec is None or spec.where == "contextd":
                break  # this life served the session to its end
        if outcome.reached and outcome.exact:
            # the manifest and the answers must be what an uncrashed server fed the completed requests gives
            twin = self.twins.run(scenario, history.completed)
            history.check(twin, outcome)
            if history.next_request < history.n:
                outcome.fail(f"the session stopped at request {history.next_request} of {history.n}")
        outcome.seconds = time.monotonic() - started
        return outcome


SERVER_POINTS = ("serving.prefill.chunk", "serving.decode.token", "serving.evict.removed",
                 "serving.restore.inserted", "serving.store.payload_written", "serving.store.recorded",
                 "serving.blob.temp_written", "serving.blob.renamed", "serving.persist.pages_stored",
                 "serving.persist.recorded")
CONTEXTD_POINTS = ("contextd.commit.begin", "contextd.commit.durable")


def _spread(total: int, k: int) -> list[int]:
    """k hit numbers spread evenly over 1..total (all of them when total <= k)."""
    if total <= k:
        return list(range(1, total + 1))
    return sorted({1 + round(i * (total - 1) / (k - 1)) for i in range(k)}) if k > 1 else [1]


def hit_in(plain: list[dict[str, Any]], name: str, request: int, k: int = 1) -> int:
    """The hit number of the `k`-th time `name` is reached while request `request` runs (the twin's counts)."""
    if plain[request]["hits"].get(name, 0) < k:
        raise ValueError(f"{name} is reached {plain[request]['hits'].get(name, 0)} times in request {request}")
    return sum(ack["hits"].get(name, 0) for ack in plain[:request]) + k


def plan_crashes(twins: Twins, scenario: Scenario, budget: int) -> list[list[CrashSpec]]:
    """About `budget` cases for one scenario, spread over every crash point by how often the
    uncrashed run reaches it: single crashes in the server and in contextd, and double ones (a
    crash, then another during the recovery: restoring resident pages, or contextd mid-commit)."""
    plain = twins.plain(scenario)
    totals: dict[str, int] = {}
    for ack in plain:
        for name, n in ack["hits"].items():
            totals[name] = totals.get(name, 0) + n
    capacity = {("server", name): totals.get(name, 0) for name in SERVER_POINTS if totals.get(name, 0)}
    capacity.update({("contextd", name): sum(ack["commits"] for ack in plain) for name in CONTEXTD_POINTS})

    def after_second(name: str) -> int:  # hits from the third request on: resident pages exist by then
        return totals.get(name, 0) - sum(ack["hits"].get(name, 0) for ack in plain[:2])

    capacity[("double", "serving.store.recorded")] = after_second("serving.store.recorded")
    capacity[("double", "serving.decode.token")] = after_second("serving.decode.token")
    share = {kind: 0 for kind in capacity}
    left = budget
    while left > 0 and any(share[k] < capacity[k] for k in share):
        for kind in share:
            if left > 0 and share[kind] < capacity[kind]:
                share[kind] += 1
                left -= 1
    cases: list[list[CrashSpec]] = []
    resident = max(1, scenario.budget // 128 - 2)
    for (where, name), count in share.items():
        if where != "double":
            cases += [[CrashSpec(where, name, n)] for n in _spread(capacity[(where, name)], count)]
            continue
        early = totals.get(name, 0) - capacity[(where, name)]
        for k, n in enumerate(_spread(capacity[(where, name)], count)):
            second = (CrashSpec("server", "serving.recover.resident_page", 1 + k % resident)
                      if name == "serving.store.recorded"
                      else CrashSpec("contextd", "contextd.commit.begin", 1 + k % 3))
            cases.append([CrashSpec("server", name, early + n), second])
    return cases


# ============================================================================ part 2: storage faults

EXPECTED_STATUS = {"ENOSPC": 507, "EDQUOT": 507, "EIO": 503, "EROFS": 503}
WRITE_OPS = ("open", "write", "fsync", "rename", "dirsync")
DAMAGE = ("flip", "torn", "truncate", "empty", "append", "missing")


@dataclass
class StorageCase:
    label: str
    scenario: str
    kind: str                                   # "write" (a refused write) or "damage" (bytes on disk)
    before: dict[str, list[list[Any]]]
    after: dict[str, list[list[Any]]] = field(default_factory=dict)
    expect: int = 0                             # the status a client should get (write faults)
    daemon: Any = None                          # a daemon of its own (a tmpfs root), else the shared one


def plan_storage(twins: Twins, scenario: Scenario) -> list[StorageCase]:
    """Write faults at the first payload write of the first turn that evicts (mid-prefill) and at
    the last write of the probe turn (write-through: the open page, or the recurrent snapshot of a
    hybrid); damaged payloads where a restore, a recovery or the key index will read them."""
    plain = twins.plain(scenario)
    evicting = next(i for i, a in enumerate(plain) if a["hits"].get("serving.evict.removed"))
    last = len(plain) - 1
    cases: list[StorageCase] = []
    places = [("write-through", last)] if scenario.name == "hybrid" else [("eviction", evicting),
                                                                           ("write-through", last)]
    for name, status in EXPECTED_STATUS.items():
        for op in WRITE_OPS:
            for place, i in places:
                nth = 1 if place == "eviction" else plain[i]["hits"].get(f"io.{op}", 1)
                cases.append(StorageCase(f"{name} on {op} during {place}", scenario.name, "write",
                                         {str(i): [["inject", op, name, nth, 1]]}, expect=status))
    restored = next(((i, page) for i, a in enumerate(plain) if i > 0 for page in a["inserted"]
                     if [r for r in plain[i - 1]["manifest"] if r[0] == page and r[1] == 2]), None)
    for how in DAMAGE:
        if scenario.name == "hybrid":
            cases.append(StorageCase(f"{how} recurrent snapshot, read on recovery", scenario.name, "damage",
                                     {str(last): [["corrupt", "@snapshot", how], ["forget"]]}))
            continue
        if restored is not None:
            i, page = restored
            cases.append(StorageCase(f"{how} cold page, read by a restore", scenario.name, "damage",
                                     {str(i): [["corrupt", page, how]]}))
        cases.append(StorageCase(f"{how} resident page, read on recovery", scenario.name, "damage",
                                 {str(last): [["corrupt", "@resident", how], ["forget"]]}))
        cases.append(StorageCase(f"{how} cold page, read by the key index on recovery", scenario.name, "damage",
                                 {str(last): [["corrupt", "@cold", how], ["forget"]]}))
    return cases


def tmpfs_allowed(work: Path) -> bool:
    probe = work / "tmpfs-probe"
    probe.mkdir(exist_ok=True)
    mount = ["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(probe)]
    ok = subprocess.run(mount, capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(probe)], capture_output=True)
    return ok


@contextlib.contextmanager
def tmpfs(folder: Path, size_mib: int) -> Iterator[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}M,mode=0700", "tmpfs", str(folder)], check=True,
                   capture_output=True)
    try:
        yield folder
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(folder)], capture_output=True).returncode == 0:
                break
            time.sleep(0.25)


class StorageCampaign:
    def __init__(self, zygote: Zygote, daemon: Daemon, twins: Twins) -> None:
        self.zygote = zygote
        self.daemon = daemon
        self.twins = twins
        self.count = 0

    def case(self, case: StorageCase) -> CaseOutcome:
        self.count += 1
        scenario = SCENARIOS[case.scenario]
        daemon = case.daemon or self.daemon
        sid = f"s{self.count:04d}-{scenario.name}"
        outcome = CaseOutcome(case.label, f"{case.scenario}/{case.kind}")
        started = time.monotonic()
        result = self.zygote.run("drive", {"scenario": case.scenario, "socket": str(daemon.socket), "session": sid,
                                           "sequence": list(range(len(scenario.users))), "stays_up": True,
                                           "before": case.before, "after": case.after})
        history = History(len(scenario.users))
        history.feed(result.events, outcome)
        outcome.exact = True  # History.feed may have failed it on the record count: re-judged below
        outcome.problems.clear()
        failed = result.of("failed")
        actions = [e["action"] for e in result.of("action")]
        outcome.served_corrupt = len(next((e["served_corrupt"] for e in result.of("done")), []))
        outcome.served_corrupt += sum(len(a["served_corrupt"]) for a in result.of("ack"))
        if result.status != 0:
            outcome.fail(f"the server gave up: {result.error[-500:]}")
        acks = result.of("ack")
        statuses = [int(e["status"]) for e in failed]
        bad = [a for a in acks if not a["checks"]["ok"]]
        outcome.leaks = sum(bool(a["checks"].get("leak")) for a in acks)
        complete = history.next_request >= history.n
        dropped = sorted({row[0] for a in acks for row in a["manifest"] if row[1] == 4})
        if case.kind == "write":
            fired = sum(int(e.get("fired", 0)) for e in [*failed, *acks])
            outcome.reached = fired > 0 or bool(failed) or bool(dropped)
            first = next((e for e in failed if e["failed"] != -1), None)
            if first is not None and int(first["status"]) != case.expect:
                outcome.unclear_errors += 1
                outcome.fail(f"answered {first['status']}, not {case.expect}: {first['error'][:200]}")
            if dropped:
                # the documented pressure policy: cold, unpinned, unleased pages are dropped to make
                # room; the session goes on without them (answers may differ from the twin's)
                outcome.dropped = len(dropped)  # type: ignore[attr-defined]
                outcome.caught = outcome.served_corrupt == 0 and not bad  # type: ignore[attr-defined]
                outcome.intact = complete and not bad  # type: ignore[attr-defined]
                if bad:
                    outcome.fail(f"request {bad[0]['ack']}: {bad[0]['checks']['why']}")
            else:
                refused = first is not None and not any(a.get("fired") for a in acks)
                if not refused:
                    outcome.fail("the refused write was not reported to the client")
                outcome.caught = refused and outcome.served_corrupt == 0  # type: ignore[attr-defined]
                intact = CaseOutcome(case.label, outcome.scope)
                replay = History(len(scenario.users))
                replay.feed(result.events, intact)
                if intact.exact:
                    replay.check(self.twins.run(scenario, replay.completed), intact)
                outcome.half_present = intact.half_present
                outcome.pages_lost = intact.pages_lost
                for problem in intact.problems:
                    outcome.fail(f"session not intact after the fault: {problem}")
                outcome.intact = intact.exact and complete  # type: ignore[attr-defined]
        else:
            damaged = [a for a in actions if "page" in a]
            outcome.reached = bool(damaged)
            for status in statuses:
                outcome.unclear_errors += 1
                outcome.fail(f"a damaged payload failed a request with {status}: "
                             f"{failed[0]['error'][:200]} (the server should say CORRUPT and go on)")
            if bad:
                outcome.fail(f"request {bad[0]['ack']}: {bad[0]['checks']['why']}")
            outcome.caught = outcome.served_corrupt == 0 and not bad  # type: ignore[attr-defined]
            outcome.intact = complete and not bad  # type: ignore[attr-defined]
        if not complete:
            outcome.fail(f"the session stopped at request {history.next_request} of {history.n}: "
                         f"{(result.error or str(failed[-1:]))[-300:]}")
        if outcome.served_corrupt:
            outcome.fail(f"{outcome.served_corrupt} corrupt payloads were streamed into attention")
        outcome.statuses = statuses
        outcome.seconds = time.monotonic() - started
        return outcome


def run_storage_part(args: argparse.Namespace, work: Path, zygote: Zygote, log: Callable[[str], None]
                     ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    daemon = Daemon(work / "storage" / "root", work / "storage.sock")
    daemon.start()
    outcomes: list[CaseOutcome] = []
    tmpfs_cases = 0
    try:
        twins = Twins(zygote, daemon)
        campaign = StorageCampaign(zygote, daemon, twins)
        plan = [c for name in args.scenarios if name in SCENARIOS for c in plan_storage(twins, SCENARIOS[name])]
        log(f"storage: {len(plan)} injected and on-disk faults")
        for n, case in enumerate(plan):
            outcome = campaign.case(case)
            outcomes.append(outcome)
            if not outcome.exact:
                log(f"  [{n + 1}/{len(plan)}] {case.scenario}: {case.label}: {outcome.problems[0][:300]}")
        if tmpfs_allowed(work):
            found = run_tmpfs_cases(campaign, twins, work, log)
            tmpfs_cases = len(found)
            outcomes += found
        else:
            log("storage: mounting a tmpfs is not allowed here; the injected faults stand for it")
    finally:
        daemon.stop()
    reached = [o for o in outcomes if o.reached]
    figures = {"faults_injected": len(reached),
               "faults_caught": sum(bool(getattr(o, "caught", False)) for o in reached),
               "served_corrupt": sum(o.served_corrupt for o in reached),
               "unclear_storage_errors": sum(o.unclear_errors for o in reached),
               "sessions_intact": sum(bool(getattr(o, "intact", False)) for o in reached),
               "storage_half_present": sum(o.half_present for o in reached),
               "tmpfs_faults": tmpfs_cases, "faults_not_reached": len(outcomes) - len(reached),
               "pages_dropped_under_pressure": sum(getattr(o, "dropped", 0) for o in reached)}
    return figures, reached


def run_tmpfs_cases(campaign: StorageCampaign, twins: Twins, work: Path, log: Callable[[str], None]
                    ) -> list[CaseOutcome]:
    """The same faults from a real kernel: the store on a small tmpfs that fills up or turns
    read-only in the middle of a turn, then gets its space (or write access) back."""
    scenario = SCENARIOS["llama"]
    plain = twins.plain(scenario)
    evicting = next(i for i, a in enumerate(plain) if a["hits"].get("serving.evict.removed"))
    outcomes: list[CaseOutcome] = []
    variants: list[tuple[str, str, int, list[list[Any]], list[list[Any]], int]] = []
    for leave in (0, 48 << 10, 160 << 10):
        variants.append((f"store tmpfs full ({leave >> 10} KiB left) mid-turn", "store", 64,
                         [["fill", "{dir}", leave]], [["unfill", "{dir}"]], 507))
        variants.append((f"whole root on a full tmpfs ({leave >> 10} KiB left) mid-turn", "root", 96,
                         [["fill", "{dir}", leave]], [["unfill", "{dir}"]], 507))
    variants.append(("store tmpfs remounted read-only mid-turn", "store", 64, [["remount", "{dir}", "ro"]],
                     [["remount", "{dir}", "rw"]], 503))
    for n, (label, scope, size, before, after, expect) in enumerate(variants):
        base = work / f"tmpfs{n}"
        root = base / "root"
        mount_at = root / "store" if scope == "store" else root
        with tmpfs(mount_at, size):
            daemon = Daemon(root, base / "c.sock")
            daemon.start()
            try:
                fill = [[str(mount_at) if x == "{dir}" else x for x in a] for a in before]
                undo = [[str(mount_at) if x == "{dir}" else x for x in a] for a in after]
                case = StorageCase(f"tmpfs: {label}", "llama", "write", {str(evicting): fill}, {str(evicting): undo},
                                   expect=expect, daemon=daemon)
                outcome = campaign.case(case)
            finally:
                daemon.stop()
        outcome.scope = "llama/tmpfs"
        if not outcome.exact:
            log(f"  tmpfs: {label}: {outcome.problems[0][:300]}")
        outcomes.append(outcome)
    return outcomes


# ============================================================================ part 3: fuzzing

CHAT = "/v1/chat/completions"
ACCEPTABLE_HTTP = set(range(200, 300)) | set(range(400, 500)) | {501, 505}  # 501/505: unknown method, bad version


def http_strategies() -> dict[str, Any]:
    """Kinds of malformed (now and then well-formed) HTTP requests, each a strategy for raw bytes."""
    from hypothesis import strategies as st

    json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                          st.text(max_size=40))
    json_any = st.recursive(json_leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                               st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                            max_leaves=12)
    role = st.sampled_from(["user", "assistant", "system", "tool", "developer", "function", "", "USER", "x" * 300])
    content = st.one_of(st.text(max_size=60), json_any,
                        st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x", ""])},
                                                       optional={"text": json_any, "image_url": json_any}), max_size=3))
    message = st.fixed_dictionaries({}, optional={
        "role": role, "content": content, "name": json_any, "tool_call_id": json_any,
        "tool_calls": st.one_of(json_any, st.lists(st.fixed_dictionaries(
            {}, optional={"id": json_any, "type": json_any, "function": st.one_of(json_any, st.fixed_dictionaries(
                {}, optional={"name": json_any, "arguments": json_any}))}), max_size=2))})
    body = st.fixed_dictionaries({}, optional={
        "model": st.one_of(st.just("tiny-llama"), json_any),
        "messages": st.one_of(st.lists(message, max_size=4), json_any),
        "tools": st.one_of(json_any, st.lists(st.dictionaries(st.sampled_from(["type", "function"]), json_any,
                                                              max_size=2), max_size=2)),
        "max_tokens": st.one_of(st.integers(-5, 2), json_any), "temperature": json_any, "seed": json_any,
        "stream": json_any, "stream_options": json_any, "reasoning_effort": json_any, "thinking": json_any,
        "max_completion_tokens": st.one_of(st.just(1), json_any)})

    def encode(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")

    def request(path: bytes, headers: list[tuple[bytes, bytes]], payload: bytes | None, method: bytes = b"POST",
                length: bytes | None = None, version: bytes = b"HTTP/1.1") -> bytes:
        lines = [method + b" " + path + b" " + version, b"Host: 127.0.0.1", b"Connection: close"]
        if payload is not None:
            lines.append(b"Content-Length: " + (length if length is not None else str(len(payload)).encode()))
        lines += [name + b": " + value for name, value in headers]
        return b"\r\n".join(lines) + b"\r\n\r\n" + (payload or b"")

    header_value = st.one_of(st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
                             st.text(max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass")
                                                      .replace(b"\r", b"").replace(b"\n", b"")))
    context_piece = st.one_of(st.text(max_size=80), json_any.map(lambda x: json.dumps(x)),
                              st.builds(lambda m, t: json.dumps({"v": 1, "messages": m, "thinking": t}),
                                        st.lists(json_any, max_size=5), json_any))
    context_headers = st.lists(context_piece, min_size=1, max_size=6).flatmap(
        lambda pieces: st.permutations(list(range(len(pieces)))).map(lambda order: [
            ((b"X-KV-Context" if n == 0 else b"X-KV-Context-%d" % (n + 1)),
             pieces[k].encode("utf-8", "surrogatepass").replace(b"\r", b"").replace(b"\n", b""))
            for n, k in enumerate(order)]))
    valid_ish = st.builds(lambda b: encode(b), body)

    kinds = {
        "json body": st.builds(lambda b: request(CHAT.encode(), [], b), valid_ish),
        "binary body": st.builds(lambda b: request(CHAT.encode(), [], b), st.binary(max_size=300)),
        "invalid utf-8": st.builds(lambda b, cut: request(CHAT.encode(), [], b[:cut] + b"\xff\xfe\xc3" + b[cut:]),
                                   valid_ish, st.integers(0, 40)),
        "truncated json": st.builds(lambda b, cut: request(CHAT.encode(), [], b[:max(1, len(b) * cut // 100)]),
                                    valid_ish, st.integers(1, 99)),
        "deep json": st.builds(lambda d, c: request(CHAT.encode(), [], (c[0] * d + c[1] * d).encode()),
                               st.integers(200, 120_000), st.sampled_from([("[", "]"), ('{"a":', "}")])),
        "huge json": st.builds(lambda n: request(CHAT.encode(), [], encode({"model": "tiny-llama", "messages": [
            {"role": "user", "content": "x" * n}], "max_tokens": 0})), st.integers(1 << 16, 3 << 20)),
        "declared too large": st.builds(lambda n: request(CHAT.encode(), [], b"{}", length=str(n).encode()),
                                        st.integers((32 << 20) + 1, 1 << 62)),
        "bad content-length": st.builds(lambda v, b: request(CHAT.encode(), [], b, length=v),
                                        st.sampled_from([b"-1", b"abc", b"1e3", b"0x10", b"", b" 5", b"5, 5"]),
                                        st.binary(max_size=20)),
        "headers": st.builds(lambda hs, b: request(CHAT.encode(), hs, b),
                             st.lists(st.tuples(st.sampled_from([b"X-KV-Session", b"X-Session-Affinity", b"Accept",
                                                                 b"Content-Type", b"X-KV-Context", b"Authorization",
                                                                 b"X-KV-Context-2", b"Expect"]), header_value),
                                      max_size=5), valid_ish),
        "x-kv-context": st.builds(lambda hs, b: request(CHAT.encode(), hs, b), context_headers, valid_ish),
        "long header": st.builds(lambda n: request(CHAT.encode(), [(b"X-KV-Context", b"a" * n)], b"{}"),
                                 st.integers(60_000, 200_000)),
        "chunked": st.builds(lambda chunks, b: request(CHAT.encode(), [(b"Transfer-Encoding", b"chunked")], None)
                             + b"".join(b"%x\r\n" % len(c) + c + b"\r\n" for c in chunks) + b"0\r\n\r\n",
                             st.lists(st.binary(min_size=1, max_size=30), max_size=4), valid_ish),
        "bad chunked": st.builds(lambda junk: request(CHAT.encode(), [(b"Transfer-Encoding", b"chunked")], None) + junk,
                                 st.binary(max_size=60)),
        "request line": st.builds(lambda m, path, v: request(path, [], b"{}", method=m, version=v),
                                  st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"HEAD", b"FOO",
                                                   b"P\xffST"]),
                                  st.one_of(st.sampled_from([b"/v1/chat/completions", b"/v1/models", b"/health",
                                                             b"/v1/kv/stats?session=%00", b"/v1/kv/stats?session=",
                                                             b"http://x/health", b"*", b"/" + b"a" * 70_000]),
                                            st.binary(max_size=40).map(lambda b: b"/" + b.replace(b" ", b"")
                                                                       .replace(b"\r", b"").replace(b"\n", b""))),
                                  st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/x", b""])),
        "garbage": st.binary(min_size=1, max_size=200).map(lambda b: b + b"\r\n\r\n"),
    }
    return kinds


HTTP_WEIGHTS = {"json body": 6, "binary body": 2, "invalid utf-8": 2, "truncated json": 2, "deep json": 1,
                "huge json": 0.5, "declared too large": 0.5, "bad content-length": 1, "headers": 2, "x-kv-context": 3,
                "long header": 0.5, "chunked": 1, "bad chunked": 1, "request line": 2, "garbage": 2}


# Kinds whose framing is broken on purpose (the server cannot know where the request ends): the
# client closes its sending side after the request, so a server that waits for more reads EOF.
# Every other request is framed right and the client keeps its side open, as a real client does:
# the server takes a half-closed connection for a client that left (a queued turn is dropped, a
# running one ends), which would hide what the turn itself answers.
HALF_CLOSE_KINDS = {"bad content-length", "chunked", "bad chunked", "request line", "garbage", "long header",
                    "declared too large"}


def http_exchange(port: int, raw: bytes, timeout: float = 20.0, half_close: bool = False
                  ) -> tuple[int | None, bytes]:
    """Send one raw request (then, with `half_close`, shut the sending side); (status, body) of
    the answer, (None, b"") when the server closed the connection without one, (-1, b"") when it
    did not answer in time."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        try:
            conn.sendall(raw)
            if half_close:
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may answer (413, 400) and close before reading everything
        data = b""
        try:
            while True:
                chunk = conn.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
        except TimeoutError:
            return -1, data
        except OSError:
            pass
    if not data.startswith(b"HTTP/"):
        return None, data
    try:
        return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[-1]
    except (IndexError, ValueError):
        return None, data


@dataclass
class FuzzTally:
    sent: int = 0
    answered: dict[str, int] = field(default_factory=dict)
    unclear: dict[str, list[str]] = field(default_factory=dict)

    def note(self, kind: str, outcome: str, ok: bool, example: str = "") -> None:
        self.sent += 1
        self.answered[outcome] = self.answered.get(outcome, 0) + 1
        if not ok:
            found = self.unclear.setdefault(f"{kind}: {outcome}", [])
            if len(found) < 3:
                found.append(example[:160])

    @property
    def unclear_count(self) -> int:
        return sum(v for k, v in self.answered.items() if k.startswith("UNCLEAR"))


def _bound(fn: Callable[[str, Any], None], kind: str) -> Callable[[Any], None]:
    """A one-argument test for Hypothesis's @given (which refuses defaults and partials)."""
    def run(value: Any) -> None:
        fn(kind, value)
    return run


def fuzz_http(port: int, n: int, seed: int = 0, alive: Callable[[], bool] | None = None) -> FuzzTally:
    """About `n` Hypothesis-generated requests against the server on `port`, every kind in proportion."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    tally = FuzzTally()
    kinds = http_strategies()
    total = sum(HTTP_WEIGHTS.values())
    for k, (kind, strategy) in enumerate(kinds.items()):
        count = max(1, round(n * HTTP_WEIGHTS[kind] / total))

        def one(kind: str, raw: bytes) -> None:
            status, body = http_exchange(port, raw, half_close=kind in HALF_CLOSE_KINDS)
            if status is None:
                # nothing came back: fine for a request that never ended its headers, for an HTTP/0.9
                # answer (one word on the request line: no status line, by that protocol) and for an
                # empty first line (http.server reads no request from it: LF alone ends a line)
                ok = b"\r\n\r\n" not in raw[:70_000] or bool(body) or not raw.split(b"\n", 1)[0].strip()
                tally.note(kind, "closed (no request / HTTP/0.9)" if ok else "UNCLEAR: closed without an answer", ok,
                           repr(raw[:120]))
            elif status == -1:
                tally.note(kind, "UNCLEAR: no answer in time", False, repr(raw[:120]))
            else:
                clear = status in ACCEPTABLE_HTTP and (status < 400 or status >= 500 or body[:1] in (b"{", b"<", b""))
                tally.note(kind, f"{status}" if clear else f"UNCLEAR: {status}", clear,
                           body[:160].decode(errors="replace"))
            if alive is not None and tally.sent % 500 == 0 and not alive():
                raise RuntimeError(f"the server stopped answering after {tally.sent} fuzz requests")

        hseed(seed + k)(settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
                                 suppress_health_check=list(HealthCheck))(
            given(strategy)(_bound(one, kind))))()
    return tally


SLOW_CLIENT_TIMEOUT_S = 2.0   # the fuzzed server's --client-timeout: short, so the check waits past it


def slow_clients(port: int, clients: int = 40, hold_s: float = SLOW_CLIENT_TIMEOUT_S + 2.0) -> dict[str, Any]:
    """Clients that open a connection, send half a request and wait: does the server still answer
    others, and does it let go of each once its --client-timeout has passed?"""
    conns = []
    for n in range(clients):
        conn = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"mess" if n % 2
                     else b"POST /v1/chat/completions HTTP/1.1\r\nX-KV-Sess")
        conns.append(conn)
    started = time.monotonic()
    status, _ = http_exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", timeout=10)
    health_ms = (time.monotonic() - started) * 1e3
    time.sleep(hold_s)
    dropped = 0
    for conn in conns:
        conn.settimeout(0.05)
        try:
            dropped += conn.recv(1) == b""
        except TimeoutError:
            pass
        except OSError:
            dropped += 1
        conn.close()
    return {"slow_clients": clients, "health_while_slow": status, "health_ms": round(health_ms, 1),
            "slow_clients_let_go": dropped}


def grpc_strategies() -> Any:
    """(method, request message) for every unary contextd verb, fields filled adversarially."""
    from google.protobuf import message_factory
    from google.protobuf.descriptor import FieldDescriptor as F
    from hypothesis import strategies as st

    from contextd.client import pb

    service = pb.DESCRIPTOR.services_by_name["Contextd"]
    ids = st.one_of(st.sampled_from(["s1", "s2", "p0000001", "p0000002.5", "s1/p", "../../etc", ".hidden", "",
                                     "a" * 129,
                                     "a:b", "x\x00y", "é", "s1\n"]), st.text(max_size=20))
    scalar = {F.TYPE_STRING: st.one_of(ids, st.text(max_size=200), st.just("x" * 70_000)),
              F.TYPE_BYTES: st.binary(max_size=50),
              F.TYPE_BOOL: st.booleans(),
              F.TYPE_DOUBLE: st.floats(), F.TYPE_FLOAT: st.floats(width=32),
              F.TYPE_INT32: st.integers(-2**31, 2**31 - 1), F.TYPE_INT64: st.integers(-2**63, 2**63 - 1),
              F.TYPE_UINT32: st.integers(0, 2**32 - 1), F.TYPE_UINT64: st.one_of(st.integers(0, 300),
                                                                                st.integers(0, 2**64 - 1)),
              F.TYPE_ENUM: st.integers(0, 7)}

    def message(descriptor: Any, depth: int) -> Any:
        fields = {}
        for f in descriptor.fields:
            if f.type == F.TYPE_MESSAGE:
                if f.message_type.GetOptions().map_entry:
                    value = st.dictionaries(st.text(max_size=10), st.one_of(st.text(max_size=10), st.integers(0, 9)),
                                            max_size=3)
                elif depth > 2:
                    continue
                else:
                    value = message(f.message_type, depth + 1)
                    if _repeated(f):
                        value = st.lists(value, max_size=4)
            else:
                value = scalar.get(f.type, st.none())
                if _repeated(f):
                    value = st.lists(value, max_size=5)
            fields[f.name] = value

        def build(values: dict[str, Any]) -> Any:
            msg = message_factory.GetMessageClass(descriptor)()
            for name, value in values.items():
                field_ = descriptor.fields_by_name[name]
                try:
                    if field_.type == F.TYPE_MESSAGE and field_.message_type.GetOptions().map_entry:
                        target = getattr(msg, name)
                        for k, v in value.items():
                            try:
                                target[k] = v
                            except (TypeError, ValueError):
                                pass
                    elif field_.type == F.TYPE_MESSAGE and _repeated(field_):
                        getattr(msg, name).extend(value)
                    elif field_.type == F.TYPE_MESSAGE:
                        getattr(msg, name).CopyFrom(value)
                    elif _repeated(field_):
                        getattr(msg, name).extend(value)
                    else:
                        setattr(msg, name, value)
                except (TypeError, ValueError):
                    pass
            return msg

        return st.fixed_dictionaries({}, optional=fields).map(build)

    methods = [m for m in service.methods if not m.server_streaming]
    return st.sampled_from(methods).flatmap(lambda m: message(m.input_type, 0).map(lambda msg: (m.name, msg)))


def _repeated(field_: Any) -> bool:
    flag = getattr(field_, "is_repeated", None)
    return bool(flag) if flag is not None else bool(field_.label == field_.LABEL_REPEATED)


CLEAR_GRPC = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "ALREADY_EXISTS",
              "DATA_LOSS", "OUT_OF_RANGE", "UNIMPLEMENTED"}


def fuzz_grpc(socket_path: Path, n: int, seed: int = 0) -> FuzzTally:
    """`n` gRPC calls and raw writes to contextd: adversarial messages through the typed stub,
    undecodable bodies through a raw method, and bytes that are not HTTP/2 at all."""
    import grpc
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from contextd.paths import target
    from contextd.wire import grpc_options

    channel = grpc.insecure_channel(target(socket_path), options=grpc_options())
    tally = FuzzTally()
    prefix = "/kv_elision.contextd.v1.Contextd/"
    structured = grpc_strategies()
    undecodable = st.tuples(st.sampled_from(["UpsertPages", "WriteRecord", "SetPageStates", "Status", "GetPages",
                                             "Nope"]),
                            st.binary(max_size=300))
    raw_bytes = st.one_of(st.binary(min_size=1, max_size=400),
                          st.binary(max_size=200).map(lambda b: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b),
                          st.binary(max_size=200).map(lambda b: b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                                                      + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b))
    def one(kind: str, what: Any) -> None:
        if kind == "raw":
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(2.0)
                    conn.connect(str(socket_path))
                    conn.sendall(what)
                    with contextlib.suppress(OSError):
                        conn.recv(1 << 12)
                tally.note("raw", "connection handled", True)
            except OSError as exc:
                tally.note("raw", f"UNCLEAR: {type(exc).__name__}", False, str(exc))
            return
        if kind == "call":
            method, request = what
            call = channel.unary_unary(prefix + method, request_serializer=lambda m: m.SerializeToString(),
                                       response_deserializer=lambda b: b)
        else:
            method, request = what
            call = channel.unary_unary(prefix + method, request_serializer=None, response_deserializer=None)
        try:
            call(request, timeout=20.0)
            tally.note(kind, "OK", True)
        except grpc.RpcError as exc:
            code = exc.code().name
            detail = exc.details() or ""
            ok = code in CLEAR_GRPC
            label = code if ok else f"UNCLEAR: {code}" + (" (undecodable body)" if "deserializ" in detail else "")
            tally.note(f"{kind} {method}", label, ok, detail)

    try:
        for k, (kind, strategy, share) in enumerate([("call", structured, 0.7), ("bytes", undecodable, 0.15),
                                                      ("raw", raw_bytes, 0.15)]):
            run = hseed(seed + k)(settings(max_examples=max(1, round(n * share)), database=None, deadline=None,
                                           phases=[Phase.generate], suppress_health_check=list(HealthCheck))(
                given(strategy)(_bound(one, kind))))
            run()
    finally:
        channel.close()
    return tally


def run_fuzz_part(args: argparse.Namespace, work: Path, zygote: Any, log: Callable[[str], None]
                  ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    from serving.launcher import ServerProcess

    outcomes: list[CaseOutcome] = []
    server = ServerProcess(root=work / "fuzz-server", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "2",
                                  "--client-timeout", str(SLOW_CLIENT_TIMEOUT_S)])
    with _env(CRASH_ENV, None), _env(IO_FAULT_ENV, None), _env("KV_ELISION_API_KEY", None):
        server.start()
    assert server.proc is not None and server.contextd is not None and server.contextd.proc is not None
    pids = {"server": server.proc.pid, "contextd": server.contextd.proc.pid}
    try:
        warm = server.chat([{"role": "user", "content": "hello"}], session="warm", max_tokens=2)
        rss0 = {k: status_field(v, "VmRSS", gone=0) for k, v in pids.items()}
        threads0 = status_field(pids["server"], "Threads", gone=0)

        def alive() -> bool:
            return server.get("/health").status == 200

        log(f"fuzz: {args.fuzz_http} HTTP requests (server pid {pids['server']}, warm-up {warm.status})")
        http = fuzz_http(server.port, args.fuzz_http, alive=alive)
        slow = slow_clients(server.port)
        log(f"fuzz: {args.fuzz_grpc} gRPC calls and raw writes (contextd pid {pids['contextd']})")
        grpc_tally = fuzz_grpc(server.socket, args.fuzz_grpc)
        after = server.chat([{"role": "user", "content": "hello"}], session="warm-2", max_tokens=2)
        rss1 = {k: status_field(v, "VmRSS", gone=0) for k, v in pids.items()}
        crashes = sum(server.proc.poll() is not None or server.contextd.proc.poll() is not None for _ in [0])
        figures = {"fuzz_http": http.sent, "fuzz_grpc": grpc_tally.sent,
                   "fuzz_unclear": http.unclear_count + grpc_tally.unclear_count,
                   "fuzz_http_unclear": http.unclear_count, "fuzz_grpc_unclear": grpc_tally.unclear_count,
                   "crashes": crashes + int(after.status != 200),
                   "fuzz_rss_growth_mib": round(max(rss1[k] - rss0[k] for k in pids) / 1024, 1),
                   "fuzz_server_rss_mib": [round(rss0["server"] / 1024), round(rss1["server"] / 1024)],
                   "fuzz_contextd_rss_mib": [round(rss0["contextd"] / 1024), round(rss1["contextd"] / 1024)],
                   "fuzz_server_threads": [threads0, status_field(pids["server"], "Threads", gone=0)], **slow,
                   "fuzz_http_answers": dict(sorted(http.answered.items())),
                   "fuzz_grpc_answers": dict(sorted(grpc_tally.answered.items()))}
        for tally in (http, grpc_tally):
            for what, examples in tally.unclear.items():
                log(f"fuzz: {what}, e.g. {examples[0]!r}")
                outcome = CaseOutcome(what, "fuzz")
                outcome.fail(f"e.g. {examples[0]!r}")
                outcomes.append(outcome)
        if slow["slow_clients_let_go"] < slow["slow_clients"]:
            outcome = CaseOutcome("slow clients", "fuzz")
            outcome.fail(f"{slow['slow_clients'] - slow['slow_clients_let_go']} of {slow['slow_clients']} clients that "
                         "sent half a request still hold a server thread (no read timeout)")
            outcomes.append(outcome)
    finally:
        server.stop()
    return figures, outcomes


# ============================================================================ part 4: sessions

def _session_scenarios(k: int) -> list[Scenario]:
    """`k` sessions of the llama scenario with their own text (a main agent and its subagents)."""
    return [SCENARIOS[f"llama-s{n}"] for n in range(k)]


for _n in range(4):  # module level: the zygote's children look scenarios up by name
    SCENARIOS[f"llama-s{_n}"] = Scenario(f"llama-s{_n}", "tiny-llama", tuple(
        f"Project {_n} ({'abcd'[_n] * (_n + 1)}): {u}" for u in SCENARIOS["llama"].users[:5]))


def job_sessions(rep: Reporter, loaded: dict[str, tuple[Any, Any]], p: dict[str, Any]) -> None:
    """Several sessions through one engine in the order `schedule` gives (session index per turn):
    after every turn, attention must hold exactly that session's resident pages."""
    drivers: list[Driver] = []
    first = Driver(loaded, {"scenario": p["scenarios"][0], "socket": p["socket"], "session": p["sessions"][0]})
    for n, (scenario, sid) in enumerate(zip(p["scenarios"], p["sessions"], strict=True)):
        if n == 0:
            drivers.append(first)
            continue
        other = object.__new__(Driver)  # same engine and worker, another session and scenario
        other.__dict__.update(first.__dict__, scenario=SCENARIOS[scenario], sid=sid)
        drivers.append(other)
    answers: list[dict[int, str]] = [{} for _ in drivers]
    engine = first.engine
    active: str | None = None
    switches = 0
    for k in p["schedule"]:
        d = drivers[k]
        i = len(answers[k])
        before = dict(engine.backend.counters)
        status, result = d.turn(messages_for(d.scenario.users, answers[k], i))
        if status != 200:
            raise RuntimeError(f"session {d.sid} request {i}: {status} {result}")
        after = engine.backend.counters
        switches += int(active is not None and active != d.sid)
        active = d.sid
        answers[k][i] = result.content
        forward = after["model_forward_tokens"] - before["model_forward_tokens"]
        fed = sum(after[k] - before[k] for k in ("new_prefill_tokens", "decoded_tokens"))
        rep.event(ack=i, session=k, content=result.content, checks=d.checks(), prefilled=result.prefilled_tokens,
                  forward_not_fed=forward - fed, counters=engine.totals.as_dict())
    rep.event(done=True, switches=switches, totals=engine.totals.as_dict())


JOBS["sessions"] = job_sessions


def run_sessions_part(args: argparse.Namespace, work: Path, zygote: Zygote, log: Callable[[str], None]
                      ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    import random

    outcomes: list[CaseOutcome] = []
    figures: dict[str, Any] = {}
    daemon = Daemon(work / "sessions" / "root", work / "sessions.sock")
    daemon.start()
    try:
        twins = Twins(zygote, daemon)
        scenarios = _session_scenarios(4)
        solo = [twins.run(sc, range(len(sc.users))) for sc in scenarios]
        rng = random.Random(15)
        mismatches = leaks = turns = switches = wasted = 0
        for trial in range(args.session_trials):
            schedule = [k for k, sc in enumerate(scenarios) for _ in sc.users]
            rng.shuffle(schedule)
            result = zygote.run("sessions", {"socket": str(daemon.socket), "scenarios": [sc.name for sc in scenarios],
                                             "sessions": [f"t{trial}-{sc.name}" for sc in scenarios],
                                             "schedule": schedule})
            outcome = CaseOutcome(f"4 sessions interleaved, trial {trial}", "sessions/in-process")
            if result.status != 0:
                outcome.fail(f"the run failed: {result.error[-500:]}")
            for ack in result.of("ack"):
                turns += 1
                want = solo[ack["session"]][ack["ack"]]
                if ack["content"] != want["content"]:
                    mismatches += 1
                    outcome.fail(f"session {ack['session']} request {ack['ack']}: {ack['content']!r} != solo "
                                 f"{want['content']!r}")
                if not ack["checks"]["ok"]:
                    leaks += int(bool(ack["checks"].get("leak")))
                    outcome.fail(f"session {ack['session']} request {ack['ack']}: {ack['checks']['why']}")
                wasted += ack["forward_not_fed"]
            done = result.of("done")
            if done:
                switches += done[0]["switches"]
                solo_prefill = sum(a["checks"]["counters"]["new_prefill_tokens"] for t in solo for a in t[-1:])
                figures.setdefault("switch_prefill_tokens", 0)
                figures["switch_prefill_tokens"] += done[0]["totals"]["new_prefill_tokens"] - solo_prefill
                figures.setdefault("switch_recovered_pages", 0)
                figures["switch_recovered_pages"] += done[0]["totals"]["recovered_pages"]
            outcomes.append(outcome)
        log(f"sessions: in-process: {turns} turns, {switches} switches, {mismatches} answers off, {leaks} leaks")
        figures.update(interleaved_turns=turns, session_switches=switches, session_mismatches=mismatches,
                       cross_session_leaks=leaks, switch_forward_tokens=wasted)
    finally:
        daemon.stop()
    found, more = server_sessions(work, log)
    for key, value in found.items():
        figures[key] = figures.get(key, 0) + value if isinstance(value, int) and key in figures else value
    outcomes += more
    return figures, outcomes


def server_sessions(work: Path, log: Callable[[str], None], restarts: bool = True
                    ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    """The same through a real `kv-elision serve`: 4 client threads at once, each session's answers
    against the same session run alone; then (`restarts`) contextd killed and restarted under the
    live server."""
    from serving.launcher import ServerProcess

    outcomes: list[CaseOutcome] = []
    scenarios = _session_scenarios(4)
    server = ServerProcess(root=work / "sessions-server", model="tiny-llama", budget=768,
                           extra=["--tail-tokens", "128", "--max-new-tokens", "6"])
    with _env(CRASH_ENV, None), _env(IO_FAULT_ENV, None), _env("KV_ELISION_API_KEY", None):
        server.start()
    figures: dict[str, Any] = {}
    try:
        def run(sc: Scenario, sid: str, into: dict[int, Any]) -> None:
            answers: dict[int, str] = {}
            for i in range(len(sc.users)):
                reply = server.chat(messages_for(sc.users, answers, i), session=sid)
                into[i] = reply
                if reply.status != 200:
                    return
                answers[i] = reply.body["choices"][0]["message"]["content"] or ""

        solo: list[dict[int, Any]] = [{} for _ in scenarios]
        for k, sc in enumerate(scenarios):
            run(sc, f"solo-{k}", solo[k])
        together: list[dict[int, Any]] = [{} for _ in scenarios]
        threads = [threading.Thread(target=run, args=(sc, f"mixed-{k}", together[k])) for k, sc in enumerate(scenarios)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcome = CaseOutcome("4 clients, 4 sessions, one server", "sessions/server")
        mismatches = leaks = 0
        client = server.contextd.client if server.contextd is not None else None
        for k, sc in enumerate(scenarios):
            for i in range(len(sc.users)):
                a, b = solo[k].get(i), together[k].get(i)
                if a is None or b is None or a.status != 200 or b.status != 200:
                    outcome.fail(f"session {k} request {i}: {getattr(b, 'status', None)}")
                    continue
                if a.body["choices"][0]["message"] != b.body["choices"][0]["message"]:
                    mismatches += 1
                    outcome.fail(f"session {k} request {i}: answer differs from the session alone")
            stats = server.stats(f"mixed-{k}")
            c = stats["counters"]
            if c["model_forward_tokens"] != c["new_prefill_tokens"] + c["decoded_tokens"] or \
                    c["historical_forward_during_restore"]:
                outcome.fail(f"session {k}: accounting invariant broken: {c}")
            if client is not None:
                manifest = client.query_pages(f"mixed-{k}")
                hot = sum(p.token_end - p.token_start for p in manifest if int(p.state) in (1, 3))
                if hot != stats["hot_tokens"] or stats["attention_tokens"] > stats["budget_tokens"]:
                    leaks += 1
                    outcome.fail(f"session {k}: the manifest holds {hot} resident tokens, "
                                 f"the server {stats['hot_tokens']}")
        totals = server.stats()["counters"]
        solo_prefill = sum(server.stats(f"solo-{k}")["counters"]["new_prefill_tokens"] for k in range(len(scenarios)))
        mixed_prefill = sum(server.stats(f"mixed-{k}")["counters"]["new_prefill_tokens"] for k in range(len(scenarios)))
        if totals["model_forward_tokens"] != totals["new_prefill_tokens"] + totals["decoded_tokens"]:
            outcome.fail("server totals: model_forward_tokens != new_prefill_tokens + decoded_tokens")
        figures.update(server_interleaved_turns=sum(len(t) for t in together), server_session_mismatches=mismatches,
                       server_cross_session_leaks=leaks, server_switch_prefill_tokens=mixed_prefill - solo_prefill,
                       server_recovered_pages=totals["recovered_pages"],
                       session_switch_counter="session_switches" in totals)
        outcomes.append(outcome)
        log(f"sessions: server: {figures['server_interleaved_turns']} concurrent turns, {mismatches} answers off")
        if restarts:
            found, more = contextd_restarts(server, log)
            figures.update(found)
            outcomes += more
    finally:
        server.stop()
    return figures, outcomes


def _send(server: Any, messages: list[dict[str, Any]], sid: str, box: dict[str, Any]) -> None:
    box["r"] = server.chat(messages, session=sid)


def contextd_restarts(server: Any, log: Callable[[str], None]) -> tuple[dict[str, Any], list[CaseOutcome]]:
    """contextd dies under a serving server (at a commit, at a random moment of a turn, and for a
    long outage): the turn in flight fails with 503, and once contextd is back the next request
    succeeds (a client re-sends as Pi does, every 0.25 s); nothing acknowledged is lost."""
    from contextd.errors import NotFound

    sc = SCENARIOS["llama"]
    outcomes: list[CaseOutcome] = []
    in_flight_503 = lost = 0
    reconnect: list[float] = []
    daemon = server.contextd
    for n, how in enumerate(["contextd.commit.begin:4", "contextd.commit.durable:9", "kill:0.05", "kill:0.2",
                             "outage:20"]):
        sid = f"restart-{n}"
        outcome = CaseOutcome(f"contextd killed ({how}) under a live server", "sessions/contextd")
        answers: dict[int, str] = {}
        statuses: list[int] = []
        daemon.stop()
        with _env(CRASH_ENV, how if how.startswith("contextd.") else None):
            daemon.start()
        i = 0
        killed = False
        back_at: float | None = None
        while i < len(sc.users) and len(statuses) < 200:
            box: dict[str, Any] = {}
            request = messages_for(sc.users, answers, i)
            thread = threading.Thread(target=_send, args=(server, request, sid, box))
            thread.start()
            if how.split(":")[0] in ("kill", "outage") and i == 2 and not killed:
                time.sleep(float(how.split(":")[1]) if how.startswith("kill") else 0.05)
                daemon.kill9()
                killed = True
            thread.join()
            reply = box["r"]
            statuses.append(reply.status)
            if reply.status == 200:
                if back_at is not None:
                    reconnect.append(time.monotonic() - back_at)
                    back_at = None
                answers[i] = reply.body["choices"][0]["message"]["content"] or ""
                i += 1
                continue
            if reply.status == 503 and back_at is None:
                in_flight_503 += 1
            elif reply.status != 503:
                outcome.fail(f"request {i} failed with {reply.status}, not 503: {str(reply.body)[:200]}")
            if not daemon.running:
                if how.startswith("outage"):
                    time.sleep(float(how.split(":")[1]))  # contextd stays down a while, then comes back
                daemon.start()
                back_at = time.monotonic()
            time.sleep(0.25)
        if i < len(sc.users):
            outcome.fail(f"the session did not get past request {i}: statuses {statuses[:12]}...")
        if reconnect and reconnect[-1] > 2.0:
            outcome.fail(f"contextd was back, but the server answered 503 for {reconnect[-1]:.1f} s more "
                         "(gRPC reconnect backoff)")
        if daemon.running and daemon.client is not None:
            try:
                turn = int(daemon.client.read_record(sid).record.turn)
                corrupt = list(daemon.client.verify(sid).corrupt)
            except NotFound:
                turn, corrupt = 0, []
            if turn < len(answers) or corrupt:
                lost += 1
                outcome.fail(f"after the restart the record has {turn} turns for {len(answers)} answered, "
                             f"{len(corrupt)} corrupt pages")
        if 503 not in statuses:
            outcome.fail(f"no request failed with 503 although contextd died ({statuses})")
        outcome.statuses = statuses
        outcomes.append(outcome)
    daemon.stop()
    with _env(CRASH_ENV, None):
        daemon.start()
    log(f"sessions: contextd restarts: {in_flight_503} turns in flight answered 503, {lost} sessions lost something, "
        f"back to serving {max(reconnect, default=0):.1f} s at most after contextd was")
    return {"contextd_restarts": 5, "contextd_restart_503": in_flight_503, "contextd_restart_lost": lost,
            "contextd_reconnect_s_max": round(max(reconnect, default=0.0), 2)}, outcomes


# ============================================================================ part 5: access


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _listening(port: int) -> list[str]:
    """Local addresses listening on TCP `port` (from /proc/net/tcp and tcp6)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hexport = local.rsplit(":", 1)
            if state == "0A" and int(hexport, 16) == port:
                found.append(address)
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}


def access_checks(server: Any, key: str) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for the server on `server` (started with --api-key `key`)."""
    checks: list[tuple[str, bool, str]] = []

    def req(method: str, path: str, auth: str | None, body: Any = None) -> Any:
        headers = {"Authorization": auth} if auth is not None else {}
        return server.request(method, path, body, headers=headers, timeout=60)

    def is_openai_error(reply: Any) -> bool:
        error = reply.body.get("error") if isinstance(reply.body, dict) else None
        return isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error

    chat = {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    health = req("GET", "/health", None)
    checks.append(("/health answers without a key", health.status == 200, str(health.status)))
    for path, method, body in [("/v1/models", "GET", None), ("/v1/kv/stats", "GET", None),
                               ("/v1/chat/completions", "POST", chat)]:
        for label, auth in [("no key", None), ("a wrong key", f"Bearer {key}x"), ("a bare key", key),
                            ("another scheme", f"Basic {key}")]:
            reply = req(method, path, auth, body)
            checks.append((f"{method} {path} with {label}: 401, OpenAI error body",
                           reply.status == 401 and is_openai_error(reply), f"{reply.status} {str(reply.body)[:120]}"))
        reply = req(method, path, f"Bearer {key}", body)
        checks.append((f"{method} {path} with the key: 200", reply.status == 200, f"{reply.status}"))
    turns = req("GET", "/v1/kv/stats", f"Bearer {key}").body["counters"]["turns"]
    checks.append(("a refused chat ran no turn", turns == 1, f"{turns} turns after one authorised chat"))
    addresses = _listening(server.port)
    checks.append(("HTTP listens on loopback only", bool(addresses) and set(addresses) <= LOOPBACK, str(addresses)))
    sock = server.socket
    checks.append(("contextd socket is 0600", _mode(sock) == 0o600, oct(_mode(sock))))
    checks.append(("contextd socket folder is 0700", _mode(sock.parent) == 0o700, oct(_mode(sock.parent))))
    root = server.contextd.root
    checks.append(("contextd root is 0700", _mode(root) == 0o700, oct(_mode(root))))
    store = root / "store"
    payloads = [f for f in store.rglob("*") if f.is_file()]
    folders = [store, *[f for f in store.rglob("*") if f.is_dir()]]
    bad_files = [str(f.relative_to(root)) for f in payloads if _mode(f) & 0o077]
    bad_folders = [str(f.relative_to(root)) for f in folders if _mode(f) & 0o077]
    checks.append(("payload files are 0600", bool(payloads) and not bad_files,
                   f"{len(payloads)} files, {bad_files[:3]}"))
    checks.append(("store folders are 0700", not bad_folders, str(bad_folders[:3])))
    exposed = [f"{f.relative_to(root)} {oct(_mode(f))}" for f in root.rglob("*") if _mode(f) & 0o004]
    checks.append(("nothing under the contextd root is world-readable", not exposed, str(exposed[:4])))
    return checks


def precreated_root_checks(work: Path) -> list[tuple[str, bool, str]]:
    """A root that already existed with the usual 0755 (`mkdir -p ~/.local/state/kv-elision`):
    does contextd still keep the transcript (LMDB) and the payloads from other users?"""
    root = work / "precreated" / "root"
    root.mkdir(parents=True, mode=0o755)
    os.chmod(root, 0o755)
    daemon = Daemon(root, work / "precreated.sock")
    daemon.start()
    try:
        daemon.client.open_session("s")
    finally:
        daemon.stop()
    readable = [f"{f.relative_to(root)} {oct(_mode(f))}" for f in [root, *root.rglob("*")]
                if _mode(f) & 0o004 and (f.is_file() or f == root)]
    reachable = _mode(root) & 0o005 == 0o005 and _mode(root / "db") & 0o005 == 0o005
    return [("a pre-existing 0755 root does not expose the transcript (db/data.mdb)",
             not (reachable and any("data.mdb" in r for r in readable)), str(readable[:4]))]


def run_access_part(args: argparse.Namespace, work: Path, zygote: Any, log: Callable[[str], None]
                    ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    from serving.launcher import ServerProcess

    key = "kv-" + os.urandom(8).hex()
    server = ServerProcess(root=work / "access", model="tiny-llama", budget=1024,
                           extra=["--tail-tokens", "256", "--max-new-tokens", "2", "--api-key", key])
    with _env(CRASH_ENV, None), _env(IO_FAULT_ENV, None), _env("KV_ELISION_API_KEY", None):
        try:
            server.start(timeout=300)
            checks = access_checks(server, key)
        except RuntimeError as exc:
            checks = [("kv-elision serve --api-key starts", False, str(exc)[-300:])]
        finally:
            server.stop()
    checks += precreated_root_checks(work)
    outcomes = []
    for name, ok, detail in checks:
        outcome = CaseOutcome(name, "access")
        if not ok:
            outcome.fail(detail)
        outcomes.append(outcome)
    failed = [o for o in outcomes if not o.exact]
    log(f"access: {len(checks)} checks, {len(failed)} failed")
    return {"access_checks": len(checks), "access_failures": len(failed)}, outcomes


# ============================================================================ reporting


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


HTTP_CRASHES = (("serving.prefill.chunk", 9), ("serving.decode.token", 27), ("serving.evict.removed", 2),
                ("serving.store.payload_written", 8), ("serving.persist.recorded", 5), ("serving.restore.inserted", 1))


def http_crashes(work: Path, log: Callable[[str], None]) -> list[CaseOutcome]:
    """A few crash points through the real thing: `kv-elision serve` started with the crash point,
    a client on HTTP that re-sends what was not answered, the server restarted (its contextd stays
    up), the answers against the same requests to an uncrashed server."""
    from contextd.errors import NotFound
    from serving.launcher import ServerProcess

    scenario = SCENARIOS["llama"]
    extra = ["--tail-tokens", str(scenario.tail), "--max-new-tokens", str(scenario.max_new)]

    def make(name: str) -> Any:
        return ServerProcess(root=work / name, model=scenario.model, budget=scenario.budget, extra=extra)

    def answer(reply: Any) -> str:
        return str(reply.body["choices"][0]["message"]["content"] or "")

    twin_server = make("http-twin")
    with _env(CRASH_ENV, None), _env("KV_ELISION_API_KEY", None):
        twin_server.start()
    twins: dict[tuple[int, ...], list[str]] = {}

    def twin(sequence: list[int]) -> list[str]:
        if tuple(sequence) not in twins:
            got: dict[int, str] = {}
            out = []
            for i in sequence:
                reply = twin_server.chat(messages_for(scenario.users, got, i), session=f"t{len(twins)}")
                got[i] = answer(reply)
                out.append(got[i])
            twins[tuple(sequence)] = out
        return twins[tuple(sequence)]

    outcomes = []
    try:
        twin(list(range(len(scenario.users))))
        for name, n in HTTP_CRASHES:
            outcome = CaseOutcome(f"http:{name}:{n}", "llama/http")
            started = time.monotonic()
            server = make(f"http-{name}")
            answers: dict[int, str] = {}
            completed: list[int] = []
            try:
                with _env(CRASH_ENV, f"{name}:{n}"), _env("KV_ELISION_API_KEY", None):
                    server.start()
                i, died_at = 0, None
                while i < len(scenario.users):
                    try:
                        reply = server.chat(messages_for(scenario.users, answers, i), session="h")
                    except (OSError, http_client_errors()):
                        died_at = i
                        break
                    if reply.status != 200:
                        outcome.fail(f"request {i}: {reply.status} {str(reply.body)[:200]}")
                        break
                    answers[i] = answer(reply)
                    completed.append(i)
                    i += 1
                if died_at is None:
                    outcome.reached = False
                    continue
                assert server.proc is not None and server.contextd is not None
                server.proc.wait(timeout=60)
                if server.proc.returncode != -signal.SIGKILL:
                    outcome.fail(f"the server ended with {server.proc.returncode}, not at its crash point")
                client = server.contextd.client
                try:
                    turn = int(client.read_record("h").record.turn)
                except NotFound:
                    turn = 0
                if turn == len(completed) + 1:
                    completed.append(died_at)  # it died after its record: the re-send is a retry
                elif turn != len(completed):
                    outcome.fail(f"the record says {turn} turns, the client saw {len(completed)}")
                if client.verify("h").corrupt:
                    outcome.fail("corrupt pages after the crash")
                with _env(CRASH_ENV, None), _env("KV_ELISION_API_KEY", None):
                    server.start()
                after: list[str] = []
                for j in range(died_at, len(scenario.users)):
                    reply = server.chat(messages_for(scenario.users, answers, j), session="h")
                    if reply.status != 200:
                        outcome.fail(f"after the restart, request {j}: {reply.status} {str(reply.body)[:200]}")
                        break
                    answers[j] = answer(reply)
                    after.append(answers[j])
                    c = reply.body["kv"]
                    if c["model_forward_tokens"] != c["new_prefill_tokens"] + c["decoded_tokens"] or \
                            c["historical_forward_during_restore"]:
                        outcome.fail(f"request {j}: accounting invariant broken")
                want = twin(completed + list(range(died_at, len(scenario.users))))[len(completed):]
                if after != want:
                    outcome.fail(f"answers after the restart {after} != the uncrashed server's {want}")
            finally:
                server.stop()
                outcome.seconds = time.monotonic() - started
                outcomes.append(outcome)
                if not outcome.exact:
                    log(f"  http {name}:{n}: {outcome.problems[0][:300]}")
    finally:
        twin_server.stop()
    return outcomes


def http_client_errors() -> type[Exception]:
    import http.client

    return http.client.HTTPException


def run_crash_part(args: argparse.Namespace, work: Path, zygote: Zygote, log: Callable[[str], None]
                   ) -> tuple[dict[str, Any], list[CaseOutcome]]:
    daemon = Daemon(work / "crash" / "root", work / "crash.sock")
    daemon.start()
    outcomes: list[CaseOutcome] = []
    try:
        twins = Twins(zygote, daemon)
        campaign = CrashCampaign(zygote, daemon, twins)
        names = [n for n in args.scenarios if n in SCENARIOS]
        weights = {"llama": 0.75, "hybrid": 0.25} if len(names) > 1 else {names[0]: 1.0}
        for name in names:
            scenario = SCENARIOS[name]
            plan = plan_crashes(twins, scenario, int(args.crash_points * weights[name] * 1.1))
            log(f"crash: {name}: {len(plan)} cases")
            for n, specs in enumerate(plan):
                outcome = campaign.case(scenario, specs)
                outcome.scope = f"{name}/{outcome.scope}"
                outcomes.append(outcome)
                if not outcome.reached:
                    log(f"  [{n + 1}/{len(plan)}] {outcome.label}: not reached")
                elif not outcome.exact:
                    log(f"  [{n + 1}/{len(plan)}] {outcome.label}: {outcome.problems[0]}")
                elif (n + 1) % 25 == 0:
                    log(f"  [{n + 1}/{len(plan)}] ok so far")
    finally:
        daemon.stop()
    if args.http_crashes:
        log(f"crash: {len(HTTP_CRASHES)} through the real server and HTTP")
        outcomes += http_crashes(work, log)
    reached = [o for o in outcomes if o.reached]
    figures = {"crash_points": len(reached), "crash_recovered_exact": sum(o.exact for o in reached),
               "pages_lost": sum(o.pages_lost for o in reached),
               "half_present_pages": sum(o.half_present for o in reached),
               "crash_unclear_errors": sum(o.unclear_errors for o in reached),
               "crash_points_not_reached": len(outcomes) - len(reached),
               "crash_case_s_p50": round(percentile([o.seconds for o in reached], 0.5), 2)}
    return figures, reached


# ============================================================================ main

PARTS = ("crash", "storage", "fuzz", "sessions", "access")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    parser.add_argument("--zygote", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--scenarios", default="llama,hybrid", help="crash and storage scenarios: llama,hybrid")
    parser.add_argument("--crash-points", type=int, default=220, help="crash cases to aim for (>= 200 for the issue)")
    parser.add_argument("--fuzz-http", type=int, default=10_000, help="malformed HTTP requests")
    parser.add_argument("--fuzz-grpc", type=int, default=10_000, help="malformed gRPC requests and raw socket writes")
    parser.add_argument("--http-crashes", type=int, default=1, help="also crash the real server over HTTP (0: no)")
    parser.add_argument("--session-trials", type=int, default=3, help="interleavings of 4 sessions (in-process)")
    parser.add_argument("--json-out", default=None, help="also write the JSON line to this file")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, stores)")
    args = parser.parse_args(argv)
    if args.zygote is not None:
        return zygote_main(args.zygote)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    work = short_tempdir("kvf-")
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[{time.monotonic() - started:7.1f}s] {message}", file=sys.stderr, flush=True)

    figures: dict[str, Any] = {}
    failures: dict[str, list[str]] = {}
    zygote: Zygote | None = None
    try:
        if {"crash", "storage", "sessions"} & set(parts):
            models = sorted({SCENARIOS[s].model for s in args.scenarios} | {"tiny-llama"})
            log(f"zygote: loading {', '.join(models)}")
            zygote = Zygote(models, work / "zygote.log")
        for part in parts:
            log(f"part {part}")
            t0 = time.monotonic()
            found, outcomes = PART_RUNNERS[part](args, work, zygote, log)
            figures.update(found)
            figures[f"{part}_s"] = round(time.monotonic() - t0, 1)
            failures[part] = [f"{o.scope} {o.label}: {'; '.join(o.problems)}" for o in outcomes if not o.exact]
    finally:
        if zygote is not None:
            zygote.close()
        if args.keep:
            log(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    figures["campaign_s"] = round(time.monotonic() - started, 1)
    print_table(figures, failures)
    line = json.dumps(figures, sort_keys=True)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(line + "\n")
    print(line, flush=True)
    return 0


def print_table(figures: dict[str, Any], failures: dict[str, list[str]]) -> None:
    rows = [("crash", "crash points tried (kill -9)", "crash_points", ">= 200"),
            ("", "recovered exactly", "crash_recovered_exact", "= points"),
            ("", "pages lost", "pages_lost", "0"),
            ("", "pages half-present after a crash", "half_present_pages", "0"),
            ("", "turns in flight not answered 503", "crash_unclear_errors", "0"),
            ("storage", "faults injected", "faults_injected", ""),
            ("", "caught", "faults_caught", "= injected"),
            ("", "served corrupt", "served_corrupt", "0"),
            ("", "errors other than 507 / 503", "unclear_storage_errors", "0"),
            ("", "sessions intact once the fault is gone", "sessions_intact", "= injected"),
            ("fuzz", "malformed HTTP requests", "fuzz_http", ">= 10000"),
            ("", "malformed gRPC requests + raw writes", "fuzz_grpc", ">= 10000"),
            ("", "answers that were not a clear 4xx / status", "fuzz_unclear", "0"),
            ("", "process crashes", "crashes", "0"),
            ("", "server / contextd RSS growth (MiB)", "fuzz_rss_growth_mib", "bounded"),
            ("sessions", "interleaved turns (4 sessions)", "interleaved_turns", ""),
            ("", "answers different from the solo twin", "session_mismatches", "0"),
            ("", "cross-session leaks", "cross_session_leaks", "0"),
            ("", "forward tokens spent on switches", "switch_forward_tokens", "0"),
            ("", "contextd restarts under load: turns lost", "contextd_restart_lost", "0"),
            ("access", "access checks failed", "access_failures", "0")]
    print(f"{'part':<9} {'measure':<44} {'value':>10}  goal", flush=True)
    for part, what, key, goal in rows:
        if key in figures:
            print(f"{part:<9} {what:<44} {figures[key]!s:>10}  {goal}")
    for part, lines in failures.items():
        if lines:
            print(f"\n{part}: {len(lines)} cases did not hold" + (", the first 12:" if len(lines) > 12 else ":"))
        for line in lines[:12]:
            print(f"  - {line[:400]}")


PART_RUNNERS: dict[str, Callable[[argparse.Namespace, Path, Any, Callable[[str], None]],
                                 tuple[dict[str, Any], list[CaseOutcome]]]] = {
    "crash": run_crash_part,
    "storage": run_storage_part,
    "fuzz": run_fuzz_part,
    "sessions": run_sessions_part,
    "access": run_access_part,
}

if __name__ == "__main__":
    raise SystemExit(main())
