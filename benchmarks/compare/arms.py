"""The comparison's arms: kv-elision served with each selector or placement, and llama-server with
Pi's compaction, a full context or truncation. Each arm starts its servers, gives Pi its
arguments and files, reads the servers' counters and says whether a fact was in the model's view.

Depends on serving.launcher, contextd's client, harness.fact_script, harness.pi, benchmarks.answers
and benchmarks.llamacpp.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import answers, llamacpp
from harness.fact_script import OBJECTIVE, SYSTEM_PROMPT, Fact, Script, answers_with, fact_needle, make_script
from harness.pi import EXTENSION
from serving.launcher import ServerProcess

MODEL = "smollm2-135m"

# Trained context per model (GGUF `*.context_length`): the full-context views must fit it.
TRAINED_CONTEXTS = {"smollm2-135m": 8192, "gemma3-270m": 32768}

PI_OUTPUT_MARGIN = 4096         # pi-ai's CONTEXT_SAFETY_TOKENS (dist/api/simple-options.js)
PI_REFERENCE_WINDOW = 128_000   # the window pi-ai assumes for a model that states none
PI_DEFAULT_RESERVE = 16_384     # Pi's compaction.reserveTokens default
PI_DEFAULT_KEEP = 20_000        # Pi's compaction.keepRecentTokens default

HYBRID = "kv-elision / hybrid"
# The blend arm: a policy other than the shipped one, for comparison (controller.blend).
BLEND_FLAGS = ("--blend", "new,restored")
ATTENTION = "kv-elision / attention"
RERANK = "kv-elision / rerank"
RECENCY = "kv-elision / recency"
TIMELINE = "kv-elision / hybrid, placement timeline"
QUESTION = "kv-elision / hybrid, placement question"
EXACT = "kv-elision / hybrid, exact (no blend)"
BLEND = "kv-elision / hybrid, blend"
# Each kv-elision arm: the server's flags on top of the shared ones. HYBRID is the server as shipped.
KV_ARMS: dict[str, tuple[str, ...]] = {
    HYBRID: (), ATTENTION: ("--selector", "attention"), RERANK: ("--selector", "rerank"),
    RECENCY: ("--selector", "recency"),
    TIMELINE: ("--placement", "timeline"), QUESTION: ("--placement", "question"),
    EXACT: ("--blend", "none"), BLEND: BLEND_FLAGS}
COMPACTION = "llama.cpp + Pi compaction"
COMPACTION_ROOM = "llama.cpp + Pi compaction, room to summarise"
COMPACTION_ARMS = (COMPACTION, COMPACTION_ROOM)
FULL = "llama.cpp, full context"
TRUNCATION = "llama.cpp + truncation"
ARMS = (HYBRID, ATTENTION, RERANK, RECENCY, TIMELINE, QUESTION, EXACT, BLEND, COMPACTION, COMPACTION_ROOM, FULL,
        TRUNCATION)
ARM_KEYS = {"hybrid": HYBRID, "attention": ATTENTION, "rerank": RERANK, "recency": RECENCY, "timeline": TIMELINE,
            "question": QUESTION, "exact": EXACT, "blend": BLEND, "compaction": COMPACTION,
            "compaction-room": COMPACTION_ROOM, "full": FULL, "truncation": TRUNCATION}
DEFAULT_ARMS = "hybrid,compaction,full,truncation"
# The role each arm plays in the answer figures (benchmarks.answers): the shipped server is the
# default; the reference views (full, fresh, recency, removed) are derived from its sessions.
ARM_ROLES = {HYBRID: "default", EXACT: "exact", BLEND: "blend", COMPACTION: "compaction",
             COMPACTION_ROOM: "compaction"}

PI_COMMON = ["--mode", "rpc", "--offline", "--no-session", "-ne", "--no-skills", "--no-prompt-templates",
             "--no-context-files", "--no-tools", "--system-prompt", SYSTEM_PROMPT]


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
    # The rerank arm's separate controller model (`--controller-model`) and its page memory in
    # MB; none: the serving model scores.
    controller: str | None = None
    controller_cache_mb: int = 512
    # Selectors that also answer every question of a kv-elision arm, each in a branch of the
    # session from the state before the question (`AnswerWatch.answer_in_branches`, serving.watch).
    branches: tuple[str, ...] = ()


def scaled_compaction(budget: int) -> tuple[int, int]:
    """Pi's defaults (reserve 16,384, keep 20,000 of a 128,000-token window) scaled to `budget`."""
    scale = budget / PI_REFERENCE_WINDOW
    return round(PI_DEFAULT_RESERVE * scale), round(PI_DEFAULT_KEEP * scale)


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
        controller = ("--controller-model", self.s.controller, "--controller-cache-mb",
                      str(self.s.controller_cache_mb)) if self.s.controller and self.name == RERANK else ()
        # A second cache for the branches, so the session's own stays as its turns left it.
        branching = ("--resident-sessions", "2") if self.s.branches else ()
        self.server = ServerProcess(root=self.work / "kv", model=self.s.model, budget=self.s.budget, extra=(
            "--max-new-tokens", str(self.s.max_tokens), "--tail-tokens", str(self.s.tail_tokens),
            *self.flags, *controller, *branching)).start(timeout=600)

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
                "blend": c["blend_forward_tokens"]}

    def residency(self, session_id: str) -> str:
        """The pages in attention after the turn, in timeline order: index, H (hot) or P (hot and
        pinned), the lease's last turn ("L5") for restored pages, tokens, and "@" the RoPE position
        of the page's first token as the server recorded it at the turn's end."""
        from contextd.client import Client
        from contextd.wire import PageState

        assert self.server is not None
        with Client(self.server.socket) as client:
            pages = client.query_pages(session_id, [PageState.HOT])
            pins = {pin.page_id for pin in client.query_pins(session_id)}
            leases = {lease.page_id: lease.until_turn for lease in client.query_leases(session_id)}
            record = client.read_record(session_id)
        positions = dict(zip(record.record.resident_pages, record.record.resident_positions, strict=True))
        out = []
        for p in sorted(pages, key=lambda p: p.index):
            lease = f"L{leases[p.page_id]}" if p.page_id in leases else ""
            at = f"@{positions[p.index]}" if p.index in positions else ""
            out.append(f"{p.index}{'P' if p.page_id in pins else 'H'}{lease}({p.token_end - p.token_start}){at}")
        return " ".join(out)

    def capture_view(self, session_id: str) -> list[int]:
        """The token ids the model attended to when it answered the last question: the resident
        pages after the turn, in timeline order, cut where the answer begins."""
        from contextd.client import Client
        from contextd.wire import PageState

        assert self.server is not None
        with Client(self.server.socket) as client:
            record = client.read_record(session_id)
            pages = client.query_pages(session_id, [PageState.HOT])
        ids = [t for segment in record.segments for t in segment.token_ids]
        last = record.segments[-1] if record.segments else None
        cut = len(ids) - (len(last.token_ids) if last is not None and last.generated else 0)
        spans = sorted((p.token_start, p.token_end) for p in pages)
        return [t for a, b in spans if a < cut for t in ids[a:min(b, cut)]]

    def session_stats(self, session_id: str) -> dict[str, Any]:
        assert self.server is not None
        return self.server.stats(session_id)

    def watch(self, session_id: str, candidates: list[str]) -> None:
        """Have the server score `candidates` over the cache its next answer is read from, and over
        each branch's that the settings name."""
        assert self.server is not None
        reply = self.server.request("POST", "/v1/kv/score", {"session": session_id, "candidates": candidates,
                                                             "branches": list(self.s.branches)}, timeout=60.0)
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


def fact_residency(socket: Path, session_id: str, needle: str, tokenizer: Any, turn: int | None = None
                   ) -> dict[str, Any]:
    """Where the pages holding `needle` (its first occurrence in text the client wrote) are in
    contextd's manifest: `in_view` when all are hot (pinned pages are hot). Read after a question's
    turn, that is the state the answer was decoded in (restored pages hold a lease past the turn).
    With `turn`, `came_back` says whether one of them was restored in that turn (last_used_turn)."""
    from contextd.client import Client
    from contextd.wire import PageState

    with Client(socket) as client:
        record = client.read_record(session_id)
        pages = client.query_pages(session_id)
        pins = {pin.page_id for pin in client.query_pins(session_id)}
    span = token_span(record.segments, needle, tokenizer)
    if span is None:
        return {"found": False, "in_view": False, "came_back": False, "detail": "not in the session's transcript"}
    start, end = span
    holding = sorted((p for p in pages if p.token_start < end and p.token_end > start), key=lambda p: p.index)
    resident = bool(holding) and all(PageState(p.state) is PageState.HOT for p in holding)
    came_back = resident and turn is not None and any(p.score > 0 and p.last_used_turn == turn for p in holding)
    states = " ".join(f"p{p.index}:{PageState(p.state).name.lower()}{'+pin' if p.page_id in pins else ''}"
                      for p in holding)
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
