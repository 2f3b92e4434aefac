"""Fixtures that run the real `kv-elision serve` process (with its own contextd) on a free port."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from benchmarks.agent import free_port

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: Any


@dataclass
class ServerProcess:
    root: Path
    socket: Path
    model: str
    budget: int
    extra: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen[str] | None = None
    log: Path | None = None

    def start(self, timeout: float = 240.0) -> None:
        self.port = free_port()
        self.log = self.root / f"server-{time.time():.0f}.log"
        self.root.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "backends.cli", "serve", "--model", self.model, "--budget", str(self.budget),
                   "--root", str(self.root), "--socket", str(self.socket), "--port", str(self.port), *self.extra]
        handle = open(self.log, "w")
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=handle, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()[-3000:]}")
            try:
                if self.get("/health").status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"server did not come up: {self.log.read_text()[-3000:]}")

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                raw: bytes | None = None, timeout: float = 600.0) -> Reply:
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
        return self.request("POST", "/v1/chat/completions",
                            {"model": self.model, "messages": messages, **body}, headers=headers)

    def stats(self, session: str | None = None) -> dict[str, Any]:
        reply = self.get("/v1/kv/stats" + (f"?session={session}" if session else ""))
        assert reply.status == 200, reply.body
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


@pytest.fixture
def server_factory() -> Iterator[Any]:
    made: list[ServerProcess] = []
    folders: list[Path] = []

    def make(model: str = "tiny-llama", budget: int = 1024, *extra: str, start: bool = True) -> ServerProcess:
        base = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
        folders.append(base)
        server = ServerProcess(root=base / "root", socket=base / "run" / "c.sock", model=model, budget=budget,
                               extra=["--tail-tokens", "256", "--max-new-tokens", "16", *extra])
        made.append(server)
        if start:
            server.start()
        return server

    yield make
    for server in made:
        server.stop()
    # the contextd each server started is its child; a killed server leaves it running
    subprocess.run(["pkill", "-f", "contextd.cli serve --root /tmp/kvs-"], check=False)
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)
