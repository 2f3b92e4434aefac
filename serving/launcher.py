"""The one process launcher: contextd and `kv-elision serve` as child processes, ended by pid.

The CLI (a server that starts its own contextd), the demo, the benchmarks and the tests all start
processes through here. A launcher ends only what it started, by pid; nothing is ever killed by
name or pattern, so two test runs (or a user's own server) on one machine never touch each other.
A contextd started for a server is asked to die with its parent (PR_SET_PDEATHSIG on Linux), so a
server killed with SIGKILL does not leave a daemon behind. `stop_process` and `wait_healthy` are
the one process stop and the one health wait; the harness uses them for Pi, llama-server and the
fault campaign's processes too. A server's API key file (ROOT/api-key, made by the server at its
first start) is made and read here: `ServerProcess` sends its key with every request, so every
test, benchmark and harness keeps working with the key a server wants by default.

Depends on contextd.client (to wait until the daemon answers) and the standard library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import http.client
import json
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contextd.client import Client
from contextd.errors import DaemonUnavailable

REPO = Path(__file__).resolve().parent.parent
_PR_SET_PDEATHSIG = 1
API_KEY_FILE = "api-key"   # under a server's --root: the key its clients send
_KEY_FILES: dict[int, Path] = {}   # port -> the key file of a server this process started there


def read_api_key(path: Path) -> str | None:
    """The key in `path` when it is this user's own regular file that nobody else may read; None
    when it is missing, a link, another user's, or readable by group or others (such a key may
    be known to others: the server replaces it)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with open(fd, encoding="ascii", errors="replace") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
            return None
        return file.read().strip() or None


def server_api_key(root: Path) -> str:
    """The key a server on `root` wants when it is given none: the one in ROOT/api-key, made at
    its first start (and made again when the file was not this user's private file). Loopback is
    every local user: without a key any of them could read the sessions (the user's code). 32
    random bytes, written whole to a file of mode 0600 before it gets its name, so a client never
    reads half a key; two servers starting on one root at once end with the same key."""
    path = root / API_KEY_FILE
    key = read_api_key(path)
    if key is not None:
        return key
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_urlsafe(32)
    fd, made = tempfile.mkstemp(dir=root, prefix=f".{API_KEY_FILE}.")   # mode 0600
    try:
        with open(fd, "w", encoding="ascii") as file:
            file.write(key + "\n")
            file.flush()
            os.fsync(file.fileno())
        if os.path.lexists(path):
            os.replace(made, path)   # there, but not a private file of this user's
        else:
            try:
                os.link(made, path)
            except FileExistsError:   # another server on this root made one meanwhile
                return server_api_key(root)
    finally:
        if os.path.lexists(made):
            os.unlink(made)
    return key


def key_file_at(port: int) -> Path | None:
    """The API key file of the server this process started (ServerProcess) on `port`: where the
    Pi extension of a Pi this process starts against that server finds its key (harness.pi)."""
    return _KEY_FILES.get(port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere a no-op)."""
    libc_name = ctypes.util.find_library("c")
    if sys.platform.startswith("linux") and libc_name:
        ctypes.CDLL(libc_name, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


KILLED_WAIT_S = 30.0  # a killed process is gone at once, unless it is stuck in the kernel


def stop_process(proc: subprocess.Popen[Any], timeout: float = 60.0, *, read_output: bool = False) -> str:
    """End this one process, by its pid: SIGTERM, wait up to `timeout` s, SIGKILL if it does not
    go. With `read_output`, its stdout pipe is read while it goes (a full pipe cannot hold it up)
    and returned; without, the caller reads its output or it goes elsewhere, and "" is returned."""
    def finish(wait_s: float) -> str:
        if read_output:
            return str(proc.communicate(timeout=wait_s)[0] or "")
        proc.wait(timeout=wait_s)
        return ""

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return finish(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
    try:
        return finish(KILLED_WAIT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"process {proc.pid} (or a child holding its output) did not end "
                           f"{KILLED_WAIT_S:.0f} s after SIGKILL") from None


def wait_healthy(proc: subprocess.Popen[Any], healthy: Callable[[], bool], timeout: float, name: str,
                 log_tail: Callable[[], str], poll_s: float = 0.5) -> None:
    """Wait until `healthy()` says yes (an OSError counts as not yet). A RuntimeError with the
    process's log tail when it exits first or `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}):\n{log_tail()}")
        try:
            if healthy():
                return
        except OSError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{name} did not answer within {timeout:.0f} s:\n{log_tail()}")


@dataclass
class ContextdProcess:
    """`contextd serve` on `root` and `socket`; `start()` again reuses both (a restart)."""

    root: Path
    socket: Path
    extra: Sequence[str] = ()
    log: Path | None = None          # where its output goes (None: a pipe, read by `stop()`)
    tied_to_parent: bool = False     # die with this process (a server's own daemon)
    proc: subprocess.Popen[str] | None = None
    client: Client | None = None

    def command(self) -> list[str]:
        return [sys.executable, "-m", "contextd.cli", "serve", "--root", str(self.root), "--socket",
                str(self.socket), *self.extra]

    def start(self, timeout: float = 30.0) -> Client:
        self.spawn()
        return self.wait_started(timeout)

    def spawn(self) -> None:
        """Start the process without waiting for it to answer (`wait_started` does): a server loads
        its model meanwhile, since contextd's start needs none of it (docs/journal/2026-12-01-models.md)."""
        if self.client is not None:
            self.client.close()
        output: Any = subprocess.PIPE if self.log is None else open(self.log, "ab")  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(self.command(), cwd=REPO, stdout=output, stderr=subprocess.STDOUT,
                                         text=True, preexec_fn=_die_with_parent if self.tied_to_parent else None)
        finally:
            if self.log is not None:
                output.close()
        self.client = Client(self.socket, timeout=60.0)

    def wait_started(self, timeout: float = 30.0) -> Client:
        """The client once the spawned process answers; RuntimeError with its output if it exits
        or stays silent for `timeout` seconds (it is killed then)."""
        assert self.proc is not None and self.client is not None, "spawn() first"
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.client.wait_ready(timeout=min(0.5, max(0.05, deadline - time.monotonic())))
                return self.client
            except DaemonUnavailable:
                if self.proc.poll() is None and time.monotonic() < deadline:
                    continue   # still starting
                self.proc.kill()
                out = self.proc.communicate()[0] if self.log is None else self.log.read_text(errors="replace")
                raise RuntimeError(f"contextd did not start: {out}") from None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exited(self, timeout: float) -> bool:
        """Whether the process ends within `timeout` seconds. A daemon that dies on purpose (a crash
        point) closes its socket before the kernel has finished tearing it down, so its clients can
        see it gone a moment before `running` does."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> str:
        """SIGTERM, wait; return what the process printed (when it printed to a pipe)."""
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.proc is None:
            return ""
        return stop_process(self.proc, read_output=self.log is None)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: Any                # parsed JSON, or the text when the body is not JSON


@dataclass
class Streamed:
    """A streamed turn as it arrives: its status and headers first, then `chunks()`."""

    status: int
    headers: dict[str, str]  # lower-case names
    error: str               # the body of an answer that is not 200 ("" otherwise)
    response: http.client.HTTPResponse
    conn: http.client.HTTPConnection

    def chunks(self) -> Iterator[tuple[float, dict[str, Any]]]:
        """(time.perf_counter() at its arrival, the parsed chunk) of each SSE data event; the
        connection is closed once they end."""
        try:
            for raw in self.response:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    yield time.perf_counter(), json.loads(line[6:])
        finally:
            self.conn.close()


@dataclass
class ServerProcess:
    """`kv-elision serve` as a child process with its data under `root`, and its own contextd
    (started first, on `root/run/c.sock` unless `socket_path` is given), both ended by pid."""

    root: Path
    model: str = "smollm2-135m"
    budget: int = 4096
    extra: Sequence[str] = ()
    socket_path: Path | None = None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    contextd: ContextdProcess | None = field(default=None)

    @property
    def socket(self) -> Path:
        return self.socket_path or self.root / "run" / "c.sock"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    @property
    def key_file(self) -> Path:
        return self.root / API_KEY_FILE

    def auth_headers(self) -> dict[str, str]:
        """The Authorization header with the key the server made (ROOT/api-key), read at each
        request (a server may make a new one when it starts again); none when there is no such
        file: a server given --api-key makes none, and its callers send that key themselves."""
        key = read_api_key(self.key_file)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def start(self, timeout: float = 300.0) -> ServerProcess:
        self.root.mkdir(parents=True, exist_ok=True)
        if self.contextd is None:
            self.contextd = ContextdProcess(self.root / "contextd", self.socket, log=self.root / "contextd.log")
        if not self.contextd.running:
            self.contextd.start()
        self.port = free_port()
        command = [sys.executable, "-m", "serving.cli", "serve", "--model", self.model, "--budget", str(self.budget),
                   "--root", str(self.root), "--socket", str(self.socket), "--port", str(self.port), *self.extra]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_healthy(self.proc, lambda: self.get("/health").status == 200, timeout, "kv-elision serve",
                         self.log_tail)
        except BaseException:
            self.stop()  # a server that never came up leaves no contextd behind
            raise
        _KEY_FILES[self.port] = self.key_file
        return self

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None, timeout: float = 3600.0) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **self.auth_headers(),
                                                       **(headers or {})})
        response = conn.getresponse()
        text = response.read().decode()
        conn.close()
        try:
            parsed: Any = json.loads(text)
        except json.JSONDecodeError:
            parsed = text
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, parsed)

    def get(self, path: str) -> Reply:
        return self.request("GET", path, timeout=5.0)

    def chat(self, messages: list[dict[str, Any]], session: str | None = None, **body: Any) -> Reply:
        headers = {"X-KV-Session": session} if session else {}
        return self.request("POST", "/v1/chat/completions", {"model": self.model, "messages": messages, **body},
                            headers=headers)

    def stream(self, messages: list[dict[str, Any]], session: str | None = None, **body: Any) -> Streamed:
        """A chat turn with `stream: true`, read as it arrives (Streamed.chunks)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600.0)
        conn.request("POST", "/v1/chat/completions", json.dumps(
            {"model": self.model, "messages": messages, **body, "stream": True}),
            headers={"Content-Type": "application/json", **self.auth_headers(),
                     **({"X-KV-Session": session} if session else {})})
        response = conn.getresponse()
        error = response.read().decode() if response.status != 200 else ""
        return Streamed(response.status, {k.lower(): v for k, v in response.getheaders()}, error, response, conn)

    def stats(self, session: str | None = None) -> dict[str, Any]:
        reply = self.request("GET", "/v1/kv/stats" + (f"?session={session}" if session else ""), timeout=30.0)
        if reply.status != 200:
            raise RuntimeError(f"/v1/kv/stats answered {reply.status}: {reply.body}")
        return reply.body  # type: ignore[no-any-return]

    def kill9(self) -> None:
        """SIGKILL the server alone (its contextd keeps running, as after a crash of the server)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        """End the server, then its contextd (also when the server would not end)."""
        _KEY_FILES.pop(self.port, None)
        try:
            if self.proc is not None:
                stop_process(self.proc)
        finally:
            if self.contextd is not None:
                self.contextd.stop()


def spawn_tied_contextd(root: Path, socket_path: Path) -> ContextdProcess:
    """A contextd for a server that found none answering, spawned (`wait_started` before use): it
    logs beside its data and dies with the server."""
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    daemon = ContextdProcess(root, socket_path, log=root / "contextd.log", tied_to_parent=True)
    daemon.spawn()
    return daemon
