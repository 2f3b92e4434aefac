"""Drive a scripted agent session through a running `kv-elision serve`, turn by turn.

`ServerProcess` starts the real server (and, through it, contextd) as a child process;
`AgentRun` replays the workload of benchmarks.workload over HTTP the way a coding agent would
(the server's replies go back into the transcript as the assistant's messages) and records the
server's per-turn figures from /v1/kv/stats. Used by `make demo`, the session benchmark and the
long-session test.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.workload import TOOLS, EvidenceFile, agent_turns, opening_messages

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: Any                # parsed JSON, or the text when the body is not JSON


@dataclass
class ServerProcess:
    """`kv-elision serve` as a child process (it starts its own contextd) with its data under
    `root`. The one launcher: the demo, the benchmarks and the tests all use it."""

    root: Path
    model: str = "smollm2-135m"
    budget: int = 4096
    extra: Sequence[str] = ()
    socket_path: Path | None = None  # contextd's socket; root/run/c.sock unless given (keep it short)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.socket_path or self.root / "run" / "c.sock"

    @property
    def log(self) -> Path:
        return self.root / "server.log"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def start(self, timeout: float = 300.0) -> ServerProcess:
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        command = [sys.executable, "-m", "backends.cli", "serve", "--model", self.model, "--budget", str(self.budget),
                   "--root", str(self.root), "--socket", str(self.socket), "--port", str(self.port), *self.extra]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kv-elision serve exited:\n{self.log_tail()}")
            try:
                if self.get("/health").status == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"kv-elision serve did not answer within {timeout:.0f}s:\n{self.log_tail()}")

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None, timeout: float = 3600.0) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
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

    def stats(self, session: str | None = None) -> dict[str, Any]:
        reply = self.request("GET", "/v1/kv/stats" + (f"?session={session}" if session else ""), timeout=30.0)
        if reply.status != 200:
            raise RuntimeError(f"/v1/kv/stats answered {reply.status}: {reply.body}")
        return reply.body  # type: ignore[no-any-return]

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class TurnRecord:
    turn: int
    session_tokens: int
    attention_tokens: int
    hot: int
    cold: int
    pinned: int
    prefilled: int
    restored_pages: int
    evicted_pages: int
    seconds: float
    answer: str
    counters: dict[str, int]


@dataclass
class AgentRun:
    server: ServerProcess
    session_id: str
    max_tokens: int = 16
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=opening_messages)

    def ask(self, new_messages: list[dict[str, Any]], max_tokens: int | None = None) -> TurnRecord:
        self.messages.extend(new_messages)
        started = time.perf_counter()
        answer = self.server.chat(self.messages, session=self.session_id, tools=TOOLS,
                                  max_tokens=max_tokens or self.max_tokens)
        elapsed = time.perf_counter() - started
        if answer.status != 200:
            raise RuntimeError(f"turn {len(self.turns)} failed with {answer.status}: {answer.body}")
        message = answer.body["choices"][0]["message"]
        reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        self.messages.append(reply)
        stats = self.server.stats(self.session_id)
        counters = stats["counters"]
        record = TurnRecord(turn=len(self.turns) + 1, session_tokens=stats["session_tokens"],
                            attention_tokens=stats["attention_tokens"], hot=stats["pages"]["hot"],
                            cold=stats["pages"]["cold"], pinned=stats["pages"]["pinned"],
                            prefilled=int(answer.headers["x-kv-prefilled-tokens"]),
                            restored_pages=counters["restored_pages_turn"],
                            evicted_pages=counters["evicted_pages_turn"], seconds=elapsed,
                            answer=str(reply["content"]), counters=counters)
        self.turns.append(record)
        return record

    def run(self, files: list[EvidenceFile], on_turn: Callable[[TurnRecord], None] | None = None,
            until_tokens: int | None = None) -> None:
        """The opening turn, then one turn per evidence file (until the session has `until_tokens`)."""
        first = self.ask([])
        if on_turn:
            on_turn(first)
        for added in agent_turns(files):
            record = self.ask(added)
            if on_turn:
                on_turn(record)
            if until_tokens and record.session_tokens >= until_tokens:
                return
