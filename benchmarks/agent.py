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
from collections.abc import Callable
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
class ServerProcess:
    """`kv-elision serve` as a child process with its data under `root`."""

    root: Path
    model: str = "smollm2-135m"
    budget: int = 4096
    extra: tuple[str, ...] = ()
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> Path:
        return self.root / "run" / "c.sock"

    def start(self, timeout: float = 300.0) -> ServerProcess:
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        log = open(self.root / "server.log", "ab")
        command = [sys.executable, "-m", "backends.cli", "serve", "--model", self.model, "--budget", str(self.budget),
                   "--root", str(self.root), "--socket", str(self.socket), "--port", str(self.port), *self.extra]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kv-elision serve exited; see {self.root / 'server.log'}")
            try:
                if self.call("GET", "/health")[0] == 200:
                    return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"kv-elision serve did not answer within {timeout:.0f}s")

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
             ) -> tuple[int, dict[str, str], Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=3600)
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        data = response.read()
        conn.close()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, json.loads(data or b"null")

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
        status, headers, body = self.server.call(
            "POST", "/v1/chat/completions",
            {"model": self.server.model, "messages": self.messages, "tools": TOOLS,
             "max_tokens": max_tokens or self.max_tokens},
            headers={"X-KV-Session": self.session_id})
        elapsed = time.perf_counter() - started
        if status != 200:
            raise RuntimeError(f"turn {len(self.turns)} failed with {status}: {body}")
        message = body["choices"][0]["message"]
        reply: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
        if message.get("tool_calls"):
            reply["tool_calls"] = message["tool_calls"]
        self.messages.append(reply)
        stats = self.server.call("GET", f"/v1/kv/stats?session={self.session_id}")[2]
        counters = stats["counters"]
        record = TurnRecord(turn=len(self.turns) + 1, session_tokens=stats["session_tokens"],
                            attention_tokens=stats["attention_tokens"], hot=stats["pages"]["hot"],
                            cold=stats["pages"]["cold"], pinned=stats["pages"]["pinned"],
                            prefilled=int(headers["x-kv-prefilled-tokens"]),
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
