"""`python -m benchmarks.ruler`: the command line of the RULER benchmark (the package's docstring
says what it measures).

Depends on the benchmark's modules, backends.models, serving.chat_format, benchmarks.llamacpp,
benchmarks.stats and harness.procfs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import benchmarks.ruler
from backends.models import load_tokenizer, resolve
from benchmarks import llamacpp
from benchmarks.ruler.arms import LLAMA, WINDOWS, Arm, KvArm, LlamaArm, Reading, listed_needles
from benchmarks.ruler.forms import FILE_TOKENS, FORMS, Fitter, agent_messages, ruler_messages
from benchmarks.ruler.report import (
    NOT_BUILT,
    NOT_PLANNED,
    PAST_WINDOW,
    cell,
    length_label,
    likelihood_recall,
    markdown,
    plot,
    string_match,
)
from benchmarks.ruler.tasks import TASKS, MissingWordList, Sample, word_list
from benchmarks.stats import print_result
from harness.procfs import machine_cpu_seconds, other_cpu_share, own_cpu_seconds
from serving.chat_format import ChatFormat

LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
MODELS = ("smollm2-135m", "gemma3-270m")
# kv-4096-links: kv-elision at 4,096 with --follow-hops (controller.links), not the shipped default.
ARM_KEYS = ("kv-2048", "kv-4096", "kv-4096-links", "full", "llama")
# A plan: per length, the tasks run and the samples per cell.
Plan = dict[int, tuple[tuple[str, ...], int]]
# The full run, what fits 3 hours on 2 cores (`estimate`), one sample per cell: every task at 4k; one
# task of each kind at 8k (a passkey in noise, a needle in the log, a needle among distractors, four
# values of one key, a 4-hop chain, common words); past 8k, where SmolLM2 runs only on kv-elision
# (Gemma's full context goes to 32k), the needle among distractors in the log haystack.
EIGHT_K_TASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "vt", "cwe")
LONG_TASKS = ("niah_multikey_1",)
PLAN: Plan = {n: (tuple(TASKS) if n == 4096 else EIGHT_K_TASKS if n == 8192 else LONG_TASKS, 1) for n in LENGTHS}
QUICK_PLAN: Plan = {4096: (("niah_single_1", "vt"), 1)}
QUICK_ARMS = ("kv-2048", "full", "llama")
# What `estimate` assumes per 2 CPU cores (how they were come by: docs/results/ruler.md): the prefill
# rate of kv-elision's servers (both models), llama.cpp's (assumed, not measured), the seconds of a
# sample's decode, scoring and reading, and of an agent's file turn beyond its prefill.
TOKENS_PER_S = 500
LLAMA_TOKENS_PER_S = 1500
SAMPLE_S = 8
FILE_TURN_S = 0.7


def parse_length(text: str) -> int:
    text = text.strip().lower()
    return int(text[:-1]) * 1024 if text.endswith("k") else int(text)


def describe(plan: Plan) -> str:
    return "; ".join(f"{length_label(n)}: {len(tasks)} task{'s' if len(tasks) > 1 else ''} x {k} sample"
                     f"{'s' if k > 1 else ''}" for n, (tasks, k) in plan.items())


def estimate(plan: Plan, models: list[str], arms: list[str], forms: list[str]) -> tuple[int, float]:
    """(tokens the servers prefill, hours) for a plan at TOKENS_PER_S (LLAMA_TOKENS_PER_S for llama.cpp)."""
    tokens = samples = turns = 0
    seconds = 0.0
    for model in models:
        for length, (tasks, k) in plan.items():
            for arm in arms:
                if arm in ("full", "llama") and length > WINDOWS[model]:
                    continue
                n = len(tasks) * k * len(forms)
                tokens += n * length
                samples += n
                turns += len(tasks) * k * length // FILE_TOKENS if "agent" in forms else 0
                seconds += n * length / (LLAMA_TOKENS_PER_S if arm == "llama" else TOKENS_PER_S)
    return tokens, (seconds + samples * SAMPLE_S + turns * FILE_TURN_S) / 3600


def arm_name(key: str, form: str) -> str:
    return f"{key} / {form}"


def score(sample: Sample, reading: Reading, seconds: float) -> dict[str, Any]:
    """One sample's record: its scores, its needles and what the server said."""
    needles = listed_needles(sample)
    views: list[bool | None] = list(reading.in_view) if reading.in_view is not None else [None] * len(needles)
    return {"task": sample.task, "length": sample.length, "index": sample.index, "answer": reading.answer,
            "expected": list(sample.expected), "recall": round(string_match(reading.answer, sample.expected,
                                                                            sample.metric), 3),
            "recall_at_1": None if reading.logprobs is None else round(
                likelihood_recall(reading.logprobs, len(sample.expected)), 3),
            "needles": [{"value": n.value, "target": n.target, "in_view": v} for n, v in zip(needles, views,
                                                                                          strict=True)],
            "ttft_ms": round(reading.ttft_ms), "prompt_tokens": reading.prompt_tokens, "counters": reading.counters,
            "seconds": round(seconds, 1)}


class Run:
    """The arms of every model over every task, length, sample and form, recorded as they finish."""

    def __init__(self, args: argparse.Namespace, words: tuple[str, ...], work: Path, out: Path) -> None:
        self.args = args
        self.words = words
        self.work = work
        self.records = out / "samples.jsonl"
        self.records.write_text("")
        self.plan: Plan = args.plan
        self.lengths = list(args.plan)
        self.tasks = list(dict.fromkeys(t for tasks, _ in args.plan.values() for t in tasks))

    def arms(self, model: str, fmt: ChatFormat, fitter: Fitter) -> list[Arm | str]:
        """The arms asked for, in order; llama.cpp's is its key when it is not built."""
        out: list[Arm | str] = []
        for key in self.args.arms:
            if key.startswith("kv-"):
                budget, _, links = key[3:].partition("-")
                out.append(KvArm(model, int(budget), self.work, fmt, fitter.splitter, links=links == "links"))
            elif key == "full":
                out.append(KvArm(model, WINDOWS[model], self.work, fmt, fitter.splitter, full=True))
            else:
                binary = llamacpp.locate()
                out.append(LlamaArm(model, binary, self.work, fmt, fitter.splitter) if binary else LLAMA)
        return out

    def model(self, model: str) -> dict[str, Any]:
        fmt = ChatFormat(load_tokenizer(resolve(model)))
        fitter = Fitter(fmt, self.words, self.args.seed)
        fitted: dict[tuple[str, int, int], Sample] = {}
        tasks: dict[str, Any] = {task: {"arms": {}} for task in self.tasks}
        for arm in self.arms(model, fmt, fitter):
            key = arm if isinstance(arm, str) else arm.key
            cells: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
            status: dict[tuple[str, str, int], str] = {}
            if isinstance(arm, str):
                print(f"\n== {model} / {key}: {NOT_BUILT} (python -m benchmarks.llamacpp builds it)", flush=True)
                status = {(t, f, n): NOT_BUILT for t in self.tasks for f in self.args.forms for n in self.lengths}
            else:
                print(f"\n== {model} / {key}", flush=True)
                started = time.perf_counter()
                arm.start()
                print(f"   started in {time.perf_counter() - started:.0f} s", flush=True)
                try:
                    self.play(model, arm, fitter, fitted, cells, status)
                finally:
                    arm.stop()
            for task in self.tasks:
                for form in self.args.forms:
                    tasks[task]["arms"][arm_name(key, form)] = {"lengths": {
                        length_label(n): cell(cells.get((task, form, n), []), status.get(
                            (task, form, n), "ok" if task in self.plan[n][0] else NOT_PLANNED)) for n in self.lengths}}
        return {"tasks": tasks}

    def play(self, model: str, arm: Arm, fitter: Fitter, fitted: dict[tuple[str, int, int], Sample],
             cells: dict[tuple[str, str, int], list[dict[str, Any]]], status: dict[tuple[str, str, int], str]
             ) -> None:
        for task in self.tasks:
            for length, (planned, samples) in self.plan.items():
                if task not in planned:
                    continue
                if not arm.runs(length):
                    for form in self.args.forms:
                        status[task, form, length] = PAST_WINDOW
                    continue
                for index in range(samples):
                    if (task, length, index) not in fitted:
                        fitted[task, length, index] = fitter.fit(task, length, index)
                    sample = fitted[task, length, index]
                    for form in self.args.forms:
                        session = f"ruler-{task}-{length}-{index}-{form}"
                        started = time.perf_counter()
                        try:
                            reading = arm.play(sample, form, session)
                        except Exception as exc:  # noqa: BLE001 - one failed sample is recorded, the run goes on
                            status[task, form, length] = f"error: {str(exc)[:300]}"
                            print(f"   {task} {length_label(length)} #{index} {form}: FAILED {exc}", flush=True)
                            continue
                        record = score(sample, reading, time.perf_counter() - started)
                        cells.setdefault((task, form, length), []).append(record)
                        with self.records.open("a") as out:
                            out.write(json.dumps({"model": model, "arm": arm_name(arm.key, form), **record}) + "\n")
                        inside = [n["in_view"] for n in record["needles"] if n["target"]]
                        print(f"   {task:<16} {length_label(length):>4} #{index} {form:<5} recall "
                              f"{record['recall']:.2f}  recall@1 {record['recall_at_1']}  needles in view "
                              f"{'-' if not inside or inside[0] is None else f'{sum(inside)}/{len(inside)}'}  "
                              f"ttft {record['ttft_ms']} ms  {record['prompt_tokens']} tokens  "
                              f"{record['seconds']} s  {record['answer'][:60]!r}", flush=True)


def print_sample(spec: str, model: str, seed: int, words: tuple[str, ...]) -> None:
    """One sample in both forms, as JSON (its determinism is tested on this)."""
    task, length, index = spec.split(":")
    fmt = ChatFormat(load_tokenizer(resolve(model)))
    fitter = Fitter(fmt, words, seed)
    sample = fitter.fit(task, parse_length(length), int(index))
    print(json.dumps({"task": sample.task, "length": sample.length, "index": sample.index,
                      "expected": list(sample.expected), "candidates": [sample.scored(v) for v in sample.candidates],
                      "needles": [{"text": n.text, "target": n.target} for n in sample.needles if n.target],
                      "tokens": {"ruler": fitter.ruler_tokens(sample), "agent": fitter.agent_tokens(sample)},
                      "ruler": ruler_messages(sample),
                      "agent": agent_messages(sample, fitter.splitter.files(sample))}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ruler",
                                     description=(benchmarks.ruler.__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"{describe(QUICK_PLAN)} ({', '.join(QUICK_PLAN[4096][0])}); arms "
                        f"{', '.join(QUICK_ARMS)} unless --arms names others; {MODELS[0]} only")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--tasks", help=f"of {', '.join(TASKS)} (with --lengths and --samples: in place of the "
                        f"plan, {describe(PLAN)})")
    parser.add_argument("--lengths", help=f"of {', '.join(length_label(n) for n in LENGTHS)}")
    parser.add_argument("--samples", type=int, help="samples per cell")
    parser.add_argument("--arms", help=f"of {', '.join(ARM_KEYS)} (default: all)")
    parser.add_argument("--forms", default=",".join(FORMS), help=f"of {', '.join(FORMS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench-out/ruler")
    parser.add_argument("--report", default=None,
                        help="where the markdown report goes (default: docs/results/ruler.md, but for --quick "
                        "only OUT/ruler.md)")
    parser.add_argument("--print-sample", metavar="TASK:LENGTH:INDEX",
                        help="print one sample of the first model in both forms, as JSON, and exit")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.arms, plan = MODELS[0], args.arms or ",".join(QUICK_ARMS), QUICK_PLAN
    elif args.tasks or args.lengths or args.samples:
        tasks = tuple(args.tasks.split(",")) if args.tasks else tuple(TASKS)
        lengths = sorted(parse_length(n) for n in args.lengths.split(",")) if args.lengths else LENGTHS
        plan = {n: (tasks, args.samples or 1) for n in lengths}
    else:
        plan = PLAN
    args.plan = plan
    args.models = args.models.split(",")
    args.arms = (args.arms or ",".join(ARM_KEYS)).split(",")
    args.forms = args.forms.split(",")
    for name, given, known in (
            ("model", args.models, list(WINDOWS)), ("form", args.forms, FORMS),
            ("task", [t for tasks, _ in plan.values() for t in tasks], list(TASKS)),
            ("arm", args.arms, list(ARM_KEYS))):
        unknown = sorted({g for g in given if g not in known})
        if unknown:
            parser.error(f"unknown {name}: {', '.join(unknown)} (known: {', '.join(known)})")
    try:
        words = word_list()
    except MissingWordList as exc:
        print(f"ruler: {exc}", file=sys.stderr)
        return 2
    if args.print_sample:
        print_sample(args.print_sample, args.models[0], args.seed, words)
        return 0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started_at = datetime.now(UTC).strftime("%Y-%m-%d %H:%M")
    started = time.perf_counter()
    machine0, ours0 = machine_cpu_seconds(), own_cpu_seconds()
    work = Path(tempfile.mkdtemp(prefix="kvd-ruler-", dir="/tmp"))
    run = Run(args, words, work, out)
    tokens, hours = estimate(plan, args.models, args.arms, args.forms)
    print(f"RULER: {', '.join(args.models)}; arms {', '.join(args.arms)}; forms {', '.join(args.forms)}; "
          f"{describe(plan)}; {tokens:,} tokens to prefill, about {hours:.1f} h on 2 cores", flush=True)
    try:
        result: dict[str, Any] = {"models": {model: run.model(model) for model in args.models}}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - started
    share = other_cpu_share(machine0, machine_cpu_seconds(), own_cpu_seconds() - ours0)
    binary = llamacpp.locate()
    result.update({"quick": args.quick, "lengths": [length_label(n) for n in plan], "seed": args.seed,
                   "plan": {length_label(n): {"tasks": list(tasks), "samples": k} for n, (tasks, k) in plan.items()},
                   "seconds": round(seconds), "llama_cpp": str(binary) if binary else NOT_BUILT,
                   "other_processes_cpu_share": None if share is None else round(share, 3)})
    png = out / "ruler.png"
    every = [t for t in run.tasks if all(t in tasks for tasks, _ in plan.values())]
    plot(result, list(plan), every or run.tasks, png)
    command = "python -m benchmarks.ruler " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                  else sys.argv[1:]))
    text = markdown(result, plan, command.strip(), started_at, seconds, str(png))
    (out / "ruler.md").write_text(text)
    report = args.report or (None if args.quick else "docs/results/ruler.md")
    if report:
        Path(report).parent.mkdir(parents=True, exist_ok=True)
        Path(report).write_text(text)
    print(f"\nwrote {png}, {out / 'ruler.md'}{f', {report}' if report else ''} and {run.records} "
          f"in {seconds / 60:.1f} minutes")
    print_result(result, share)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
