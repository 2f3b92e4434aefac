"""The real Pi (0.73.1, from extension/node_modules) with the kv-elision extension, in RPC mode,
against the real `kv-elision serve` on SmolLM2-135M (real weights, CPU) with its own contextd.

One server serves the module; every test runs its own Pi process, so its own Pi session id and
its own server session. Pi's config is isolated in a temporary PI_CODING_AGENT_DIR and it runs
with --offline --no-session in a temporary working directory, loading nothing but the extension
(`extension/index.ts`) and a test probe (`extension/test/e2e-probe.ts`), which logs each provider
response's X-KV-* headers and gives RPC the /tree rewind it lacks. The probe sends nothing.

The attention budget (1,024 tokens, 256 of them the tail) is smaller than Pi's first request
(~1,420 tokens: its system prompt and four tool schemas), so pages go cold from the first turn.
Runs in 75-110 s on two CPU cores: one server start, three Pi sessions, eleven model turns.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.agent import ServerProcess
from contextd.client import Client

REPO = Path(__file__).resolve().parents[2]
PI_BIN = REPO / "extension" / "node_modules" / ".bin" / "pi"
EXTENSION = REPO / "extension" / "index.ts"
PROBE = REPO / "extension" / "test" / "e2e-probe.ts"

MODEL = "smollm2-135m"
BUDGET = 1024
TAIL = 256
MAX_NEW_TOKENS = 24
# Pi compacts when its context tokens exceed contextWindow - compaction.reserveTokens. The window
# stays the server's (1,000,000; a smaller one than the usage would make Pi drop answers as
# overflows); a large reserve puts the threshold inside this short session. Pi's first request is
# ~1,420 tokens, so after the first answer (at most 24 tokens) the context is at most ~1,445
# tokens; each later prompt adds ~33 tokens plus its answer, so after five prompts it is over
# ~1,550 whatever the model says. The threshold sits between the two.
THRESHOLD = 1500

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PI_BIN.exists(), reason=f"Pi is not installed at {PI_BIN} (cd extension && npm ci)"),
]


# ---------------------------------------------------------------------------------------------- Pi


class PiRpc:
    """Pi in --mode rpc: one JSON command per stdin line, one JSON record per stdout line.

    The same protocol handling as extension/test/pi-harness.mjs (which the extension's own tests
    use): `events` holds every record but command responses; `prompt` waits until Pi is idle again.
    """

    def __init__(self, workdir: Path, server: ServerProcess, settings: dict[str, Any]) -> None:
        self.agent_dir = workdir / "agent"
        self.cwd = workdir / "cwd"
        self.probe_log = workdir / "probe.jsonl"
        self.agent_dir.mkdir()
        self.cwd.mkdir()
        (self.agent_dir / "settings.json").write_text(json.dumps(settings, indent=2) + "\n")
        env = dict(os.environ, PI_CODING_AGENT_DIR=str(self.agent_dir), PI_OFFLINE="1",
                   KV_ELISION_URL=f"http://127.0.0.1:{server.port}/v1", KV_ELISION_SOCKET=str(server.socket),
                   KV_E2E_PROBE_LOG=str(self.probe_log))
        command = [str(PI_BIN), "--mode", "rpc", "--offline", "--no-session",
                   "--no-extensions", "--no-skills", "--no-prompt-templates", "--no-context-files",
                   "-e", str(EXTENSION), "-e", str(PROBE), "--provider", "kv-elision", "--model", MODEL]
        self.proc = subprocess.Popen(command, cwd=self.cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.events: list[dict[str, Any]] = []
        self.responses: dict[str, dict[str, Any]] = {}
        self.stderr = b""
        self.changed = threading.Condition()
        self.next_id = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.send({"type": "get_state"}, timeout=90)  # answers once startup, extensions included, is done

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:  # LF framing only, as Pi writes it
            line = raw.decode().rstrip("\r\n")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = {"type": "non_json_stdout", "line": line}
            with self.changed:
                if record.get("type") == "response" and str(record.get("id", "")).startswith("py"):
                    self.responses[record["id"]] = record
                else:
                    self.events.append(record)
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
                    raise AssertionError(f"pi exited ({self.proc.returncode}) waiting for {what}\n"
                                         f"{self.stderr.decode()[-3000:]}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                         f"stderr: {self.stderr.decode()[-3000:]}")
                self.changed.wait(min(left, 1.0))

    def until(self, condition: Callable[[], bool], timeout: float = 60.0, what: str = "a condition") -> None:
        self._wait(lambda: True if condition() else None, timeout, what)

    def send(self, command: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        ident = f"py{self.next_id}"
        self.next_id += 1
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({**command, "id": ident}) + "\n").encode())
        self.proc.stdin.flush()
        response: dict[str, Any] = self._wait(lambda: self.responses.get(ident), timeout,
                                              f"the response to {command['type']}")
        return response

    def wait_for(self, predicate: Callable[[dict[str, Any]], bool], start: int = 0, timeout: float = 60.0,
                 what: str = "an event") -> int:
        def find() -> int | None:
            return next((i for i in range(start, len(self.events)) if predicate(self.events[i])), None)
        index: int = self._wait(find, timeout, what)
        return index

    def prompt(self, message: str, timeout: float = 300.0) -> list[dict[str, Any]]:
        """Send a prompt; return its events once Pi is idle again (the run ended, and any retry or
        compaction Pi started after it ended too)."""
        start = len(self.events)
        response = self.send({"type": "prompt", "message": message})
        assert response["success"], response
        cursor = start
        while True:
            end = self.wait_for(lambda e: e["type"] == "agent_end", cursor, timeout, "agent_end")
            cursor = end + 1
            # Pi emits auto_retry_start / compaction_start right after agent_end, so they are in by
            # the time get_state answers.
            state = self.send({"type": "get_state"})["data"]
            after = self.events[cursor:]
            if any(e["type"] == "auto_retry_start" for e in after):
                continue
            if state.get("isCompacting") or any(e["type"] == "compaction_start" for e in after):
                done = self.wait_for(lambda e: e["type"] == "compaction_end", cursor, timeout, "compaction_end")
                if self.events[done].get("willRetry"):
                    cursor = done + 1
                    continue
            if not state.get("isStreaming"):
                return self.events[start:]

    def command(self, text: str) -> None:
        """Run an extension command; Pi answers once its handler has finished (no agent run follows)."""
        response = self.send({"type": "prompt", "message": text})
        assert response["success"], response

    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = self.send({"type": "get_state"})["data"]
        return data

    def messages(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = self.send({"type": "get_messages"})["data"]["messages"]
        return data

    def probe(self, kind: str = "response") -> list[dict[str, Any]]:
        if not self.probe_log.exists():
            return []
        records = [json.loads(line) for line in self.probe_log.read_text().splitlines() if line.strip()]
        return [r for r in records if r["kind"] == kind]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # Pi shuts down (session_shutdown) at the end of its input
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=15)
        self.reader.join(timeout=5)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    base = Path(tempfile.mkdtemp(prefix="kvpi-", dir="/tmp"))
    process = ServerProcess(root=base / "root", model=MODEL, budget=BUDGET,
                            extra=["--tail-tokens", str(TAIL), "--max-new-tokens", str(MAX_NEW_TOKENS)])
    try:
        process.start(timeout=300)
        models = process.get("/v1/models").body["data"]
        assert [m["id"] for m in models] == [MODEL] and models[0]["budget_tokens"] == BUDGET
        yield process
    finally:
        children = _children(process.proc.pid) if process.proc is not None else []
        process.stop()
        for pid in children:  # the contextd it started; it ends with a stopped server, this is in case
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        shutil.rmtree(base, ignore_errors=True)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.fixture
def start_pi(server: ServerProcess) -> Iterator[Callable[..., PiRpc]]:
    started: list[PiRpc] = []
    folders: list[Path] = []

    def start(**settings: Any) -> PiRpc:
        workdir = Path(tempfile.mkdtemp(prefix="kvpi-pi-", dir="/tmp"))
        folders.append(workdir)
        # One failed request should fail the test, not be retried behind its back.
        pi = PiRpc(workdir, server, {"retry": {"enabled": False}, **settings})
        started.append(pi)
        return pi

    yield start
    for pi in started:
        pi.close()
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from backends.models import load_tokenizer, resolve

    return load_tokenizer(resolve(MODEL))


# ----------------------------------------------------------------------------------------- helpers


def n_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def turn_text(user: str) -> str:
    """What SmolLM2's chat template adds to a rendered transcript ending in an assistant answer
    when a user message follows. The answer's closing `<|im_end|>` is new too: the server never
    feeds a stop token, and an answer cut at the token limit has none."""
    return f"<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def assistant_messages(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["message"] for e in events if e["type"] == "message_end" and e["message"].get("role") == "assistant"]


def text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if part.get("type") == "text")


def context_tokens(message: dict[str, Any]) -> int:
    """What Pi compares with its compaction threshold (calculateContextTokens)."""
    usage = message["usage"]
    return int(usage["totalTokens"] or usage["input"] + usage["output"] + usage["cacheRead"] + usage["cacheWrite"])


def assert_answered(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The prompt's run ended in a real answer; return that last assistant message."""
    replies = assistant_messages(events)
    assert replies, "no assistant message"
    for reply in replies:
        assert reply["provider"] == "kv-elision" and reply["model"] == MODEL
        assert not reply.get("errorMessage"), f"{reply['stopReason']}: {reply['errorMessage']}"
        assert reply["stopReason"] in ("stop", "length", "toolUse"), reply
        assert reply["usage"]["output"] >= 1
    last = replies[-1]
    assert last["stopReason"] in ("stop", "length"), last
    assert text_of(last).strip(), f"empty answer: {last}"
    return last


def compaction_pairs(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    marks = [e for e in events if e["type"] in ("compaction_start", "compaction_end")]
    assert len(marks) % 2 == 0, marks
    pairs = list(zip(marks[::2], marks[1::2], strict=True))
    for start, end in pairs:
        assert (start["type"], end["type"]) == ("compaction_start", "compaction_end"), marks
    return pairs


def assert_cancelled(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    for start, end in pairs:
        assert start["reason"] == end["reason"] == "threshold", (start, end)
        assert end["aborted"] is True and end["willRetry"] is False, end
        assert end.get("result") is None, end


def status_texts(events: list[dict[str, Any]]) -> list[str | None]:
    return [e.get("statusText") for e in events if e["type"] == "extension_ui_request"
            and e.get("method") == "setStatus" and e.get("statusKey") == "kv-elision"]


def notices(events: list[dict[str, Any]]) -> list[str]:
    return [str(e["message"]) for e in events if e["type"] == "extension_ui_request" and e.get("method") == "notify"]


def expected_status(socket: Path, session_id: str) -> tuple[str, Any]:
    """The status line docs/pi.md specifies, computed from contextd's own record of the session."""
    with Client(socket) as client:
        reply = client.status(session_id=session_id)
    [session] = [s for s in reply.sessions if s.session_id == session_id]
    pages = session.pages
    text = (f"kv hot {pages.hot} · cold {pages.cold} · pinned {pages.pinned} | "
            f"attn {session.attention_tokens}/{session.budget_tokens} | "
            f"restored {session.counters['restored_pages_turn']}")
    if pages.dropped:
        text += f" | dropped {pages.dropped}"
    if pages.corrupt:
        text += f" | corrupt {pages.corrupt}"
    return text, session


def assert_server_counters_consistent(counters: dict[str, int]) -> None:
    assert counters["model_forward_tokens"] == counters["new_prefill_tokens"] + counters["decoded_tokens"], counters
    assert counters["historical_forward_during_restore"] == 0, counters
    assert counters["compactions"] == 0, counters
    assert 0 < counters["peak_attention_tokens"] <= BUDGET, counters


# ------------------------------------------------------------------------------------------- tests

SESSION = [
    "I am starting a small Python project. Reply with one short sentence to say you are ready.",
    "The project has a file called main.py that prints a greeting. In one sentence, what does print do?",
    "Next we will add a function named add that returns the sum of two numbers. Describe it in one line.",
    "Then we will write a test for add with two positive and two negative numbers. What should it check?",
    "Finally we will run the tests from the command line with pytest. Summarise the plan in one sentence.",
]


def test_pi_session_crosses_the_threshold_never_compacts_and_prefills_only_new_tokens(
        server: ServerProcess, start_pi: Callable[..., PiRpc], tokenizer: Any) -> None:
    window = server.get("/v1/models").body["data"][0]["context_window"]
    pi = start_pi(compaction={"enabled": True, "reserveTokens": window - THRESHOLD})
    state = pi.state()
    session_id = state["sessionId"]
    assert state["model"]["provider"] == "kv-elision" and state["model"]["contextWindow"] == window

    replies: list[dict[str, Any]] = []  # every assistant message, i.e. every request to the server
    previous_tokens = 0  # Pi's context tokens after the previous prompt
    for n, message in enumerate(SESSION):
        events = pi.prompt(message)
        last = assert_answered(events)
        if n:
            # The prompt's first request prefilled the new user message and nothing else: the
            # previous answer is in the cache token for token as it was generated.
            assert assistant_messages(events)[0]["usage"]["input"] == n_tokens(tokenizer, turn_text(message))
        replies += assistant_messages(events)
        tokens = context_tokens(last)
        # Pi checks its threshold before sending a prompt (on the previous answer) and after the
        # run (on this one). Whenever it is over, compaction starts and the extension cancels it.
        begin = next(i for i, e in enumerate(events) if e["type"] == "agent_start")
        end = max(i for i, e in enumerate(events) if e["type"] == "agent_end")
        before, after = compaction_pairs(events[:begin]), compaction_pairs(events[end:])
        assert compaction_pairs(events[begin:end]) == []
        assert len(before) == (1 if n and previous_tokens > THRESHOLD else 0), (n, previous_tokens, before)
        assert len(after) == (1 if tokens > THRESHOLD else 0), (n, tokens, after)
        assert_cancelled(before + after)
        previous_tokens = tokens

    totals = [context_tokens(r) for r in replies]
    assert totals[0] < THRESHOLD < totals[-1], f"the session must cross the threshold mid-way: {totals}"
    assert totals[-1] > BUDGET

    # Pi's transcript is whole: every prompt and answer, no compaction summary in front.
    transcript = pi.messages()
    assert [text_of(m) for m in transcript if m["role"] == "user"] == SESSION
    assert sum(m["role"] == "assistant" for m in transcript) == len(replies)
    assert any("compaction is off for this provider" in note for note in notices(pi.events))

    # Every request continued the server's cache: what it prefilled is exactly what Pi's
    # request added after everything the previous request left cached (its prompt and answer).
    responses = pi.probe()
    assert len(responses) == len(replies)
    for n, (reply, response) in enumerate(zip(replies, responses, strict=True)):
        assert response["status"] == 200 and response["session"] == session_id
        headers = response["headers"]
        assert headers["x-kv-session"] == session_id and "x-kv-rebuilt" not in headers, headers
        usage = reply["usage"]
        assert usage["input"] == int(headers["x-kv-prefilled-tokens"]), (n, usage, headers)
        assert usage["cacheRead"] == (context_tokens(replies[n - 1]) if n else 0), (n, usage)

    stats = server.stats(session_id)
    counters = stats["counters"]
    prefilled = [int(r["headers"]["x-kv-prefilled-tokens"]) for r in responses]
    assert counters["new_prefill_tokens"] == sum(prefilled)
    assert counters["decoded_tokens"] == sum(r["usage"]["output"] for r in replies)
    assert counters["reprefilled_tokens"] == 0 and counters["rebuilds"] == 0
    assert counters["turns"] == len(replies)
    assert_server_counters_consistent(counters)
    assert stats["session_tokens"] == totals[-1]
    # The session outgrew its budget: pages went cold on disk while Pi kept its whole transcript.
    assert stats["pages"]["cold"] > 0 and counters["evicted_pages"] > 0
    assert stats["attention_tokens"] <= BUDGET < stats["session_tokens"]


def test_pi_rewind_is_caught_by_the_fingerprint_and_answered(
        server: ServerProcess, start_pi: Callable[..., PiRpc], tokenizer: Any) -> None:
    pi = start_pi()
    session_id = pi.state()["sessionId"]
    first = assert_answered(pi.prompt("Name one programming language in a few words."))
    assert_answered(pi.prompt("Why do people like that language? One sentence."))
    assert all("x-kv-rebuilt" not in p["headers"] for p in pi.probe()), pi.probe()

    # /tree back to the second prompt: Pi's leaf moves to the first answer; same Pi session.
    pi.command("/kv-e2e-rewind 2")
    [rewind] = pi.probe("rewind")
    assert rewind["cancelled"] is False and rewind["session"] == session_id
    assert pi.state()["sessionId"] == session_id
    assert [text_of(m) for m in pi.messages() if m["role"] == "user"] == [
        "Name one programming language in a few words."]

    edited = "Instead, name one database in a few words."
    sent = len(pi.probe())
    events = pi.prompt(edited)
    answer = assert_answered(events)
    rebuilt = assistant_messages(events)[0]  # the prompt's first request is the one after the rewind
    response = pi.probe()[sent]
    assert response["status"] == 200 and response["headers"]["x-kv-session"] == session_id
    reason = response["headers"].get("x-kv-rebuilt", "")
    assert reason.startswith("client history changed at message 2"), response
    assert f"kv-elision rebuilt the KV cache: {reason}" in notices(events)
    # It was answered from exactly Pi's new branch: the prompt is the kept messages (the first
    # prompt and answer) plus the edited message, and nothing of the abandoned branch was
    # reused: at most the part both renderings share.
    usage = rebuilt["usage"]
    assert usage["input"] == int(response["headers"]["x-kv-prefilled-tokens"])
    assert usage["input"] + usage["cacheRead"] == context_tokens(first) + n_tokens(tokenizer, turn_text(edited))
    assert usage["cacheRead"] <= context_tokens(first) + n_tokens(tokenizer, "<|im_end|>\n<|im_start|>user\n")
    assert [text_of(m) for m in pi.messages() if m["role"] == "user"] == [
        "Name one programming language in a few words.", edited]
    assert all("x-kv-rebuilt" not in p["headers"] for p in pi.probe()[sent + 1:])

    # The server now holds exactly Pi's new branch: the next prompt continues it.
    goodbye = "Thanks. Say goodbye in three words."
    sent = len(pi.probe())
    events = pi.prompt(goodbye)
    last = assert_answered(events)
    follow = assistant_messages(events)[0]
    headers = pi.probe()[sent]["headers"]
    assert "x-kv-rebuilt" not in headers
    assert follow["usage"]["cacheRead"] == context_tokens(answer)
    assert follow["usage"]["input"] == int(headers["x-kv-prefilled-tokens"]) == n_tokens(tokenizer, turn_text(goodbye))

    responses = pi.probe()
    stats = server.stats(session_id)
    counters = stats["counters"]
    assert counters["rebuilds"] == 1 and counters["turns"] == len(responses)
    assert counters["new_prefill_tokens"] == sum(int(p["headers"]["x-kv-prefilled-tokens"]) for p in responses)
    assert_server_counters_consistent(counters)
    assert stats["session_tokens"] == context_tokens(last)


STATUS = re.compile(r"^kv hot (\d+) · cold (\d+) · pinned (\d+) \| attn (\d+)/(\d+) \| restored (\d+)$")


def test_pi_status_line_shows_contextd_pages_for_its_session(
        server: ServerProcess, start_pi: Callable[..., PiRpc]) -> None:
    pi = start_pi()
    session_id = pi.state()["sessionId"]
    # contextd answers before the server has opened this Pi session
    pi.wait_for(lambda e: e.get("statusText") == "kv ready · no pages yet", timeout=30, what="the ready status")

    for message in ("Say hello in one short sentence.", "What is two plus two? Answer in a few words."):
        assert_answered(pi.prompt(message))
        want, session = expected_status(server.socket, session_id)
        # The watcher follows contextd's commits; the turn's last commit is in before the reply,
        # so the line settles on it.
        try:
            pi.until(lambda want=want: status_texts(pi.events)[-1:] == [want], timeout=30, what=f"status {want!r}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nshown: {status_texts(pi.events)}") from None
        stats = server.stats(session_id)
        assert stats["pages"] == {"hot": session.pages.hot, "cold": session.pages.cold, "pinned": session.pages.pinned}
        assert stats["attention_tokens"] == session.attention_tokens and stats["budget_tokens"] == BUDGET

    shown = [STATUS.match(t) for t in status_texts(pi.events) if t and t.startswith("kv hot")]
    assert shown and all(shown), status_texts(pi.events)
    numbers = [tuple(int(g) for g in m.groups()) for m in shown if m]
    assert all(budget == BUDGET and attn <= BUDGET for _, _, _, attn, budget, _ in numbers)
    hot, cold, pinned, attn, _, _ = numbers[-1]
    assert cold > 0 and pinned > 0 and hot > 0 and attn > 0, "the session should have hot, cold and pinned pages"

    pi.close()
    assert status_texts(pi.events)[-1] is None, "the line is cleared when Pi shuts down"
