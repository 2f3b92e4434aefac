"""Eviction order on agent tasks: does the page a user's task is about stay while the agent reads on?

    python -m benchmarks.eviction [--shapes prose,code,config,paraphrase,near_duplicate]
        [--seeds held-out|tuning|101,102] [--budgets 2048] [--tokens 30000] [--gap 1.0]
        [--orders recency,model,attention] [--model smollm2-135m] [--controller-model NAME]

For each shape (harness.shapes), seed, budget and eviction order (`EngineConfig.evict_order`:
recency, the pager's own; model, controller.eviction's likelihood advice; attention, its
attention order), one session is driven through the real
engine (real contextd process, real weights, the default `hybrid` selector) the way an agent
drives a server: one request per turn, the whole transcript in each. A turn reads one file (the
assistant's `read` call and its result) and the user asks for a note on it; but right after the
file that holds a question's fact is read, the user's message is that question (the task), and
the agent then reads on with no user message, as a tool loop does, for `--gap` budgets' worth of
tokens; the next turn answers. Only questions whose fact is in one file are asked, one at a time;
a question whose file came while another task was open is not asked.

At the answer turn (the selector has already run on the last tool result, as it would), over the
exact cache the answer is read from (serving.watch.AnswerWatch, serving.likelihood):
  kept            every page that holds the fact is in attention;
  question_kept   the page(s) holding the question are (the question is asked once, so an answer
                  read without it is read blind: recall with the fact kept but not the question,
                  or the other way round, says which of the two mattered);
  meanwhile_kept  of the facts in the files read while the task was open (not asked: what the
                  advice may have pushed out in the task's place), how many are in attention;
  recall_at_1     the right value ranked first by likelihood among every value the session
                  plants (a tie counts against it); `answer_logprob` its log-probability;
  restored        pages the selector brought back for that answer.
Each session runs on a contextd of its own (sessions share their opening: on one contextd a later
one would start as a branch of an earlier one).
Per session: controller forward tokens (the advice's scoring), the advice's time per turn
(p50 / p95 of the `advise` phase over turns that evicted), with `--controller-model` the time a
turn's new pages took the controller to read after its answer (over turns that read any),
`historical_forward` and whether
model_forward_tokens == new_prefill_tokens + decoded_tokens held. Tuning seeds are
harness.shapes.TUNING_SEEDS; the advice's defaults were set before any run and tuned on none.

With the attention order, `attention_watch_cost`: what reading its weights adds to the forward
it rides on (a 512-token chunk over a budget less 512 held tokens, p50 with and without, on
forks of one session: `watch_cost`); its `advise` time is the host's share (scores and order).

Last line: one JSON object: `rows` (per order, shape, seed and budget), `summary` (per order and
budget, over every question: kept, question_kept, meanwhile_kept of meanwhile, recall_at_1, the
answers' mean log-probability, the advice's p95 and controller tokens), `attention_watch_cost`
(null without the attention order), `sessions`,
`other_processes_cpu_share` and `reliable`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from backends import Backend, load_backend
from benchmarks.selectors import controller_backend, locate, names_of, pages_over, seeds_of, token_spans
from benchmarks.stats import percentile, reliable, unreliable_warning
from controller.eviction import EVICTION_ORDERS, AttentionOrderConfig
from harness.procfs import machine_cpu_seconds, other_cpu_share, process_cpu_seconds
from harness.shapes import SHAPES, TUNING_SEEDS, make
from harness.shapes.session import Question, Workload, approx_tokens
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.heap import freeze_loaded_heap
from serving.launcher import ContextdProcess
from serving.scoring import ControllerScorer
from serving.turn import ChatRequest
from serving.watch import AnswerWatch

MODEL = "smollm2-135m"
DEFAULT_SHAPES = ("prose", "code", "config", "paraphrase", "near_duplicate")


@dataclass(frozen=True)
class Turn:
    """One request's new messages; for an answer turn, the question it answers and the questions
    whose facts were read while that task was open (what the advice might have pushed out)."""

    messages: list[dict[str, Any]]
    answers: Question | None = None
    read_meanwhile: tuple[Question, ...] = ()


def script(workload: Workload, budget: int, gap: float) -> list[Turn]:
    """The session's turns: reads with notes; a question as the user's task right after the file
    holding its fact, reads with no user message for `gap` x `budget` tokens, then its answer."""
    turns = [Turn(workload.opening())]
    asked: set[str] = set()
    task: Question | None = None
    meanwhile: list[Question] = []
    read_since = 0
    for n, file in enumerate(workload.files):
        call = {"id": f"call_{n:03d}", "type": "function",
                "function": {"name": "read", "arguments": json.dumps({"path": file.path})}}
        messages: list[dict[str, Any]] = [{"role": "assistant", "content": "", "tool_calls": [call]},
                                          {"role": "tool", "tool_call_id": call["id"], "content": file.text}]
        here = [q for q in workload.questions if len(q.evidence) == 1 and q.evidence[0] in file.text]
        if task is not None:
            read_since += approx_tokens(file.text)
            meanwhile += here
            if read_since >= gap * budget:
                turns.append(Turn(messages, answers=task, read_meanwhile=tuple(meanwhile)))
                task = None
            else:
                turns.append(Turn(messages))
            continue
        fresh = [q for q in here if q.text not in asked]
        if fresh:
            task, read_since, meanwhile = fresh[0], 0, []
            asked.add(task.text)
            messages.append(workload.question_message(task))
        else:
            messages.append({"role": "user", "content": f"Note what matters in {file.path} in one sentence."})
        turns.append(Turn(messages))
    return turns


def measure_session(backend: Backend, workload: Workload, budget: int, gap: float, order: str,
                    controller: Backend | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Drive one session on a contextd of its own (sessions of one run share their opening, and
    on one contextd a later session would start as a branch of an earlier one); one entry per
    answered question, and the session's own figures."""
    base = Path(tempfile.mkdtemp(prefix="kvb-evict-", dir="/tmp"))
    daemon = ContextdProcess(base / "root", base / "run" / "c.sock", extra=["--reserve-bytes", "0"])
    client = daemon.start()
    try:
        answers, context = drive(backend, client, workload, budget, gap, order, controller)
    finally:
        context_s = process_cpu_seconds(daemon.proc.pid) if daemon.proc is not None else 0.0
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
    return answers, {**context, "contextd_cpu_s": context_s}


def drive(backend: Backend, client: Any, workload: Workload, budget: int, gap: float, order: str,
          controller: Backend | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    fresh = backend.fork()   # the engine empties it when the session comes in
    engine = Engine(fresh, ChatFormat(fresh.tokenizer), client,
                    EngineConfig(budget_tokens=budget, tail_tokens=512, max_new_tokens=1, evict_order=order),
                    controller=ControllerScorer(controller, fresh.tokenizer)
                    if controller is not None and order == "model" else None)
    watch = AnswerWatch(engine)
    session_id = f"{workload.shape}-{workload.seed}-{budget}-{order}"
    values = list(dict.fromkeys(q.answer for q in workload.questions))
    messages: list[dict[str, Any]] = []
    answers: list[dict[str, Any]] = []
    advise_ms: list[float] = []
    read_ms: list[float] = []
    started = time.perf_counter()
    for turn in script(workload, budget, gap):
        messages.extend(turn.messages)
        if turn.answers is not None:
            watch.watch(session_id, values)
        for _ in engine.chat(ChatRequest(session_id, list(messages), tools=workload.tools, max_tokens=1)):
            pass
        session = engine.sessions[session_id]
        assert session.last_turn is not None
        if session.last_turn.phases.get("advise", 0.0) > 0:
            advise_ms.append(session.last_turn.phases["advise"])
        if session.read_ahead_ms > 1.0:   # a controller model read pages
            read_ms.append(session.read_ahead_ms)
        if turn.answers is None:
            continue
        reading = watch.take_reading(session_id)
        held = set(reading.resident_pages)
        text, spans = token_spans(engine, session_id)
        task, *others = locate(text, spans, dataclasses.replace(workload, questions=(turn.answers,
                                                                                     *turn.read_meanwhile)))
        asked_at = text.rfind(turn.answers.text)
        assert asked_at >= 0, f"{workload.shape}/{workload.seed}: the question is not in the transcript"
        right = reading.logprobs[values.index(turn.answers.answer)]
        answers.append({"kept": all(pages <= held for pages in task.needed),
                        "question_kept": pages_over(spans, asked_at, asked_at + len(turn.answers.text)) <= held,
                        "meanwhile": len(others),
                        "meanwhile_kept": sum(all(pages <= held for pages in q.needed) for q in others),
                        "first": sum(1 for lp in reading.logprobs if lp >= right) == 1,
                        "logprob": right, "restored": len(reading.restored_pages)})
    counters = fresh.counters   # the serving session's own forwards; scoring ran on scratch sessions
    session = engine.sessions[session_id]
    context = {"session_tokens": session.transcript.tokens, "build_s": round(time.perf_counter() - started, 1),
               "controller_forward_tokens": session.counters.controller_forward_tokens,
               "branches": session.counters.branches,
               "advise_ms": advise_ms, "read_ahead_ms": read_ms,
               "historical_forward": counters.historical_forward_during_restore,
               "forward_invariant":
                   counters.model_forward_tokens
                   == counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens}
    return answers, context


def totals(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """What a set of answers adds up to: the counts, and the right values' mean log-probability."""
    return {"questions": len(answers), "kept": sum(a["kept"] for a in answers),
            "question_kept": sum(a["question_kept"] for a in answers),
            "meanwhile": sum(a["meanwhile"] for a in answers),
            "meanwhile_kept": sum(a["meanwhile_kept"] for a in answers),
            "answer_logprob": round(fmean(a["logprob"] for a in answers), 3) if answers else None}


def row(order: str, shape: str, seed: int, budget: int, answers: list[dict[str, Any]], context: dict[str, Any]
        ) -> dict[str, Any]:
    ms = context["advise_ms"] or [0.0]
    read = context["read_ahead_ms"] or [0.0]
    return {"order": order, "shape": shape, "seed": seed, "budget": budget, **totals(answers),
            "recall_at_1": sum(a["first"] for a in answers),
            "restored_per_answer": round(fmean(a["restored"] for a in answers), 2) if answers else None,
            "advise_p50_ms": round(percentile(ms, 50), 1), "advise_p95_ms": round(percentile(ms, 95), 1),
            "read_ahead_p50_ms": round(percentile(read, 50), 1), "read_ahead_p95_ms": round(percentile(read, 95), 1),
            "controller_forward_tokens": context["controller_forward_tokens"],
            "historical_forward": context["historical_forward"], "forward_invariant": context["forward_invariant"]}


def summarise(rows: list[dict[str, Any]], answers: dict[tuple[str, int], list[dict[str, Any]]],
              advise: dict[tuple[str, int], list[float]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for (order, budget), given in sorted(answers.items()):
        ms = advise[(order, budget)] or [0.0]
        mine = [r for r in rows if r["order"] == order and r["budget"] == budget]
        out.setdefault(order, {})[str(budget)] = {
            **totals(given), "recall_at_1": round(sum(a["first"] for a in given) / max(1, len(given)), 3),
            "advise_p95_ms": round(percentile(ms, 95), 1),
            "controller_forward_tokens": sum(r["controller_forward_tokens"] for r in mine)}
    return out


def watch_cost(backend: Backend, held: int, chunk: int = 512, repeats: int = 7) -> dict[str, float]:
    """What reading the attention order's weights adds to the forward it rides on: a `chunk`-token
    prefill over `held` held tokens, timed with the engine's watch (controller.eviction's defaults)
    and without, alternating, on forks of one prefilled session; p50 of each, in ms."""
    order = AttentionOrderConfig()
    layers = order.watched_layers(len(backend.layer_view.attention_layers))
    base = backend.fork()
    base.observe_attention(0, [])
    ids = base.tokenizer.encode(" ".join(f"line {i} of the file holds value {i * 7919 % 1000}." for i in range(held)))
    base.prefill(ids[:held])
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for watched in (False, True):
            twin = base.fork()
            twin.observe_attention(order.queries if watched else 0, layers if watched else [])
            started = time.perf_counter()
            twin.extend(ids[held:held + chunk])
            times[watched].append((time.perf_counter() - started) * 1e3)
    plain, watched_ms = percentile(times[False], 50), percentile(times[True], 50)
    return {"held_tokens": held, "chunk_tokens": chunk, "forward_p50_ms": round(plain, 1),
            "watched_forward_p50_ms": round(watched_ms, 1), "watch_ms": round(watched_ms - plain, 1)}


def run(shapes: Sequence[str], seeds: Sequence[int], budgets: Sequence[int], tokens: int, gap: float,
        orders: Sequence[str], model: str = MODEL, log: Any = print, controller_model: str | None = None
        ) -> dict[str, Any]:
    machine0, own0 = machine_cpu_seconds(), process_cpu_seconds(os.getpid())
    rows: list[dict[str, Any]] = []
    sessions: list[dict[str, Any]] = []
    answers: dict[tuple[str, int], list[dict[str, Any]]] = {}
    advise: dict[tuple[str, int], list[float]] = {}
    backend = load_backend("torch", model, capacity=max(budgets) + 256)
    controller = controller_backend(controller_model)
    freeze_loaded_heap()   # as `kv-elision serve` does once its models are loaded
    contextd_s = 0.0
    for budget, shape, seed in itertools.product(budgets, shapes, seeds):
        workload = make(shape, seed, tokens)
        for order in orders:   # the same session, each order in turn
            given, context = measure_session(backend, workload, budget, gap, order, controller)
            rows.append(row(order, shape, seed, budget, given, context))
            answers.setdefault((order, budget), []).extend(given)
            advise.setdefault((order, budget), []).extend(context.pop("advise_ms"))
            context.pop("read_ahead_ms")
            contextd_s += context.pop("contextd_cpu_s")
            sessions.append({"order": order, "shape": shape, "seed": seed, "budget": budget, **context})
            r = rows[-1]
            log(f"{shape:<15} seed {seed:<4} budget {budget:<5} {order:<8}"
                f"  kept {r['kept']}/{r['questions']} (question {r['question_kept']}, read meanwhile"
                f" {r['meanwhile_kept']}/{r['meanwhile']})  recall@1 {r['recall_at_1']}/{r['questions']}"
                f"  log p {r['answer_logprob']}"
                f"  advise p95 {r['advise_p95_ms']} ms  read ahead p95 {r['read_ahead_p95_ms']} ms"
                f"  scored {r['controller_forward_tokens']} tokens")
    cost = watch_cost(backend, max(budgets) - 512) if "attention" in orders else None
    other = other_cpu_share(machine0, machine_cpu_seconds(), process_cpu_seconds(os.getpid()) - own0 + contextd_s)
    return {"model": model, "controller_model": controller_model, "tokens": tokens, "gap": gap, "rows": rows,
            "summary": summarise(rows, answers, advise), "attention_watch_cost": cost,
            "sessions": sessions, "tuning_seeds": sorted(set(seeds) & set(TUNING_SEEDS)),
            "other_processes_cpu_share": other, "reliable": reliable(other)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                        help=f"comma-separated, or all: {', '.join(SHAPES)} (split has no one-file facts)")
    parser.add_argument("--seeds", default="held-out", help="held-out, tuning, or comma-separated seeds")
    parser.add_argument("--budgets", default="2048")
    parser.add_argument("--tokens", type=int, default=30000,
                        help="approximate session length (facts sit in its first three quarters: a session of "
                             "12,000 tokens asks one or two questions)")
    parser.add_argument("--gap", type=float, default=1.0, help="budgets' worth of tokens read between task and answer")
    parser.add_argument("--orders", default=",".join(EVICTION_ORDERS), help=f"from {', '.join(EVICTION_ORDERS)}")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--controller-model", default=None, metavar="NAME",
                        help="the model order is scored by this separate model from the pages' text "
                             "(serving.scoring) instead of by the serving model over their K/V")
    args = parser.parse_args(argv)
    shapes = names_of(parser, args.shapes, SHAPES, "shapes")
    orders = names_of(parser, args.orders, EVICTION_ORDERS, "orders")
    if args.gap <= 0:
        parser.error("--gap must be positive")
    result = run(shapes, seeds_of(args.seeds), [int(b) for b in args.budgets.split(",")], args.tokens, args.gap,
                 orders, args.model, controller_model=args.controller_model)
    if not result["reliable"]:
        print(unreliable_warning(result["other_processes_cpu_share"]))
    for order, budgets in result["summary"].items():
        for budget, entry in budgets.items():
            print(f"{order:<8} budget {budget:<5} kept {entry['kept']}/{entry['questions']} (question "
                  f"{entry['question_kept']}, read meanwhile {entry['meanwhile_kept']}/{entry['meanwhile']})  recall@1 "
                  f"{entry['recall_at_1']}  log p {entry['answer_logprob']}  advise p95 {entry['advise_p95_ms']} ms  "
                  f"scored {entry['controller_forward_tokens']} tokens")
    if result["attention_watch_cost"] is not None:
        cost = result["attention_watch_cost"]
        print(f"attention watch: a {cost['chunk_tokens']}-token chunk over {cost['held_tokens']} held tokens, "
              f"p50 {cost['forward_p50_ms']} ms plain, {cost['watched_forward_p50_ms']} ms watched "
              f"(+{cost['watch_ms']} ms)")
    print(json.dumps(result, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
