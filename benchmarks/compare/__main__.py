"""`python -m benchmarks.compare`: the command line of the comparison (the package's docstring says
what it measures).

Depends on the comparison's modules, harness.fact_script, harness.pi and backends.models.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import benchmarks.compare
from benchmarks import answers, llamacpp
from benchmarks.compare.arms import (
    ARM_KEYS,
    ARM_ROLES,
    DEFAULT_ARMS,
    KV_ARMS,
    MODEL,
    PI_DEFAULT_KEEP,
    PI_DEFAULT_RESERVE,
    PI_OUTPUT_MARGIN,
    PI_REFERENCE_WINDOW,
    RERANK,
    TRAINED_CONTEXTS,
    TRUNCATION,
    Arm,
    KvArm,
    LlamaArm,
    Settings,
    calibrate,
    probe_truncation,
    scaled_compaction,
)
from benchmarks.compare.play import HELD_OUT_SEEDS, SESSION_DIRS, TUNING_SEED, ArmResult, run_arm, slug
from benchmarks.compare.report import budget_reason, combine, likelihood_table, plot, question_table, table
from benchmarks.compare.scoring import branch_arm, replay_views, score_and_tell
from controller.selectors import SELECTORS
from harness.fact_script import Script, make_script
from harness.pi import PI_BIN


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compare",
                                     description=(benchmarks.compare.__doc__ or "").splitlines()[0])
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
    parser.add_argument("--controller-model", default=None, choices=sorted(TRAINED_CONTEXTS),
                        help="the rerank arm scores with this separate controller model (the server's "
                             "--controller-model) instead of the serving model")
    parser.add_argument("--controller-cache-mb", type=int, default=512,
                        help="the controller model's page memory in MB (the server's --controller-cache-mb)")
    parser.add_argument("--branches", default="",
                        help="comma-separated selectors that also answer every question of a kv-elision arm, each "
                             "in a branch of the session from the state before the question (paired: the session's "
                             "history is the same for all of them), e.g. hybrid,rerank")
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
    if args.controller_model and RERANK not in wanted:
        parser.error("--controller-model applies to the rerank arm only: add rerank to --arms")
    branches = tuple(b.strip() for b in args.branches.split(",") if b.strip())
    if set(branches) - set(SELECTORS) or len(set(branches)) < len(branches):
        parser.error(f"--branches names each selector once, from: {','.join(SELECTORS)}")
    if branches and not any(name in KV_ARMS for name in wanted):
        parser.error("--branches answers the questions of a kv-elision arm: add one to --arms")
    if args.controller_cache_mb < 0:
        parser.error("--controller-cache-mb cannot be negative")
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
                        args.turn_timeout, args.llama_threads, args.controller_model, args.controller_cache_mb,
                        branches)
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
    pairs: dict[str, dict[str, Any]] = {}
    for name in [n for n in wanted if n in KV_ARMS]:
        for selector in branches[1:]:
            base_arm, other_arm = branch_arm(name, branches[0]), branch_arm(name, selector)
            pairs[f"{other_arm} - {base_arm}"] = answers.paired(scored, base_arm, other_arm, {TUNING_SEED})
    for pair, figures in pairs.items():
        print(f"paired, held out, {pair}: {json.dumps(figures)}")
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
        "controller_model": args.controller_model,
        "branches": list(branches), "paired_branches": pairs,
        "scoring_prefill_tokens": sum(s.prefilled_tokens for s in scorers.values()),
        "other_processes_cpu_share": max(other) if other else None,
    }
    print(json.dumps(summary, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
