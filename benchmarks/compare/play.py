"""One session of the comparison: the real Pi plays the script against one arm, turn by turn, and
what each turn's events and the servers' counters say is kept (`Turn`, `ArmResult`).

Depends on harness.pi, harness.procfs, harness.fact_script, benchmarks.answers, benchmarks.stats
and the arms.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import answers
from benchmarks.compare.arms import SUMMARY_MARKER, Arm, KvArm, LlamaArm
from benchmarks.stats import percentile
from harness.fact_script import Script, answer_candidates, answers_with
from harness.pi import Pi, assistant_text, pi_env
from harness.procfs import machine_cpu_seconds, process_cpu_seconds

TUNING_SEED = 7
HELD_OUT_SEEDS = (11, 13)

# Sessions per seed: the same script under Pi working directories of different lengths. Pi's
# system prompt states the directory, so every later token and page edge moves with it: a
# four-token shift once moved one arm by five answers of eight (docs/proof.md), so a seed's
# figure is a mean over such sessions, not one run.
SESSION_DIRS = ("/tmp/kv-elision-compare-cwd", "/tmp/kv/work", "/tmp/kv-elision/agent-sessions/repository-checkout")


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
    branch_ranks: dict[str, int] = field(default_factory=dict)   # the same, answered in a branch per selector


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
    machine0 = machine_cpu_seconds()
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
                    turn.branch_ranks = {name: answers.rank_of(branch["logprobs"], right)
                                         for name, branch in reading["branches"].items()}
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
        machine1 = machine_cpu_seconds()
        ours = sum(process_cpu_seconds(pid) for pid in [*arm.pids(), pi.proc.pid])
        self1 = os.times()
        ours += (self1.user + self1.system) - (self0.user + self0.system)
        wall = time.perf_counter() - wall0
        if machine0 is not None and machine1 is not None and wall > 0:
            busy = machine1[0] - machine0[0]
            result.cpu_other_share = round(max(0.0, busy - ours) / wall / (os.cpu_count() or 1), 3)
    finally:
        if pi is not None:
            pi.close()
        arm.stop()
    return result


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")


def turn_line(t: Turn) -> str:
    extra = ""
    if t.kind == "question":
        extra = f" | {'CORRECT' if t.correct else 'wrong'} ({t.fact}) view={'yes' if t.in_view else 'no'} [{t.view}]"
        if t.answer_rank is not None:
            extra += f" rank {t.answer_rank} logp {t.answer_logprob}"
        if t.branch_ranks:
            extra += " branches: " + ", ".join(f"{name} rank {rank}" for name, rank in t.branch_ranks.items())
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
