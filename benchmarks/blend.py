"""Where the gap between the served cache and a fresh read lives: each part of a turn's view
recomputed in the current view, one at a time, and what the answer then reads.

    python -m benchmarks.blend [--model smollm2-135m] [--seeds 7,11,13] [--sessions 3] [--budget 1024]
                               [--variants exact,all,new,...] [--greedy-tokens 16] [--out bench-out/blend]

The session is the one `make demo` and benchmarks.compare play (harness.fact_script: an objective,
12 evidence files of ~300 tokens with one planted value each, then 8 questions about the first 8),
driven through the real engine in-process (real contextd process, real weights, the server's own
configuration from `kv-elision serve`'s flags with the blend off). Three sessions per seed differ
in one line of the system prompt (a working directory, as Pi states it), so page edges move.

At each question, once the turn's restores are placed and before its answer's opening is
prefilled (`Engine.observers`), the view is forked once per variant; the variant's tokens are
recomputed in that view (`Backend.recompute`), the opening is prefilled, and the fork is read as
the answer would read it: the right value's likelihood rank among every value planted in the
session (`recall_at_1`), its log-probability, and the greedy answer (does it hold the value).
Variants (controller.blend's parts):
  exact            nothing recomputed: the served cache as kv-elision serves it today
  all              every held token: a fresh read of the view (the reference)
  new, restored, tail, pins      one part of the view
  headsK           the first K tokens of every run of consecutive pages (EPIC)
  devP             the P % of held tokens whose keys at the second and third paged layers moved most
                   when everything was recomputed (CacheBlend's choice, read off the reference)
  A+B              the union of two variants
  A+B@S            a policy as the server runs it (controller.blend.BlendPolicy): A's tokens, then B's,
                   cut at S % of the view
Per variant also the tokens recomputed, as a share of the view, and the recompute's time against
a fresh prefill of the view's tokens measured in the same place.

Seed 7 is the tuning seed; the others are reported apart as held out. The last line is one JSON
object: `variants` (per variant: tuning and held_out figures), `questions`, `sessions`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from statistics import fmean
from typing import Any

import numpy as np

from backends import Backend, load_backend
from benchmarks.answers import bootstrap_ci, rank_of
from benchmarks.compare.play import HELD_OUT_SEEDS, SESSION_DIRS, TUNING_SEED
from controller.blend import BlendPolicy, ViewParts, view_parts
from controller.selectors import make_selector
from harness.fact_script import (
    SYSTEM_PROMPT,
    Fact,
    answer_candidates,
    answers_with,
    fact_needle,
    make_script,
)
from harness.procfs import machine_cpu_seconds, other_cpu_share, process_cpu_seconds
from serving.chat_format import ChatFormat
from serving.cli import build_parser, engine_config
from serving.engine import Engine
from serving.launcher import ContextdProcess
from serving.likelihood import continuation_logprobs
from serving.observe import TurnObserver
from serving.paging import recompute_scratch, rewind
from serving.session import Session
from serving.turn import ChatRequest

DEFAULT_VARIANTS = "exact,all,new,restored,tail,pins,heads4,heads16,dev10,new+restored,new+heads4,new+restored@20"
# The layers (among the paged ones) whose key deviation ranks tokens for the devP variants: the
# first layer's keys do not depend on context at all, so the next two.
DEVIATION_LAYERS = slice(1, 3)


def system_prompt(session: int) -> str:
    return f"{SYSTEM_PROMPT}\nCurrent working directory: {SESSION_DIRS[session % len(SESSION_DIRS)]}"


def deviation(base: Backend) -> np.ndarray:
    """Per held token: how far its keys at DEVIATION_LAYERS move when every held token is recomputed
    (relative L2 over heads and dims)."""
    before = base.rotated_keys()[DEVIATION_LAYERS]
    fresh = base.fork()
    recompute_scratch(fresh, np.arange(base.attention_tokens))
    after = fresh.rotated_keys()[DEVIATION_LAYERS]
    moved = np.sqrt(((after - before) ** 2).sum(axis=(0, 1, 3)))
    size = np.sqrt((before ** 2).sum(axis=(0, 1, 3))) + 1e-9
    score: np.ndarray = moved / size
    return score


def variant_indices(name: str, parts: ViewParts, dev: np.ndarray) -> np.ndarray:
    if "@" in name:   # a policy as the server runs it: its parts in order, cut at a share of the view
        named, share = name.split("@")
        heads = [int(n[5:]) for n in named.split("+") if n.startswith("heads")]
        policy = BlendPolicy(parts=tuple(n for n in named.split("+") if not n.startswith("heads")),
                             heads=heads[0] if heads else 0, budget=int(share) / 100)
        return policy.choose(parts)
    if "+" in name:
        return np.unique(np.concatenate([variant_indices(n, parts, dev) for n in name.split("+")]))
    if name == "exact":
        return np.zeros(0, dtype=np.int64)
    if name == "all":
        return np.arange(parts.held, dtype=np.int64)
    if name.startswith("heads"):
        return np.unique(parts.heads(int(name[5:])))
    if name.startswith("dev"):
        k = max(1, int(round(parts.held * int(name[3:]) / 100)))
        return np.sort(np.argsort(-dev, kind="stable")[:k]).astype(np.int64)
    return parts.part(name)


class Reader(TurnObserver):
    """The engine's observer: at a question's turn, reads every variant of the planned view."""

    def __init__(self, fmt: ChatFormat, variants: list[str], greedy_tokens: int) -> None:
        self.format = fmt
        self.variants = variants
        self.greedy_tokens = greedy_tokens
        self.asking: tuple[Fact, list[Fact]] | None = None
        self.rows: list[dict[str, Any]] = []

    def view_planned(self, session: Session, backend: Backend, restored: list[int], new_tokens: int,
                     opener: list[int]) -> None:
        if self.asking is None:
            return
        fact, facts = self.asking
        self.asking = None
        base = backend.fork()
        parts = view_parts(session.pager, restored, new_tokens, base.positions())
        held_text = self.format.decode(base.held_token_ids().tolist())
        candidates = [self.format.encode(c) for c in answer_candidates(facts, fact.code)]
        right = [f.code for f in facts].index(fact.code)
        started = time.perf_counter()
        scratch = load_like(base)
        scratch.prefill(base.held_token_ids()[np.argsort(base.positions(), kind="stable")].tolist())
        fresh_ms = (time.perf_counter() - started) * 1e3
        dev = deviation(base)
        for name in self.variants:
            view = base.fork()
            chosen = variant_indices(name, parts, dev)
            started = time.perf_counter()
            recompute_scratch(view, chosen)
            blend_ms = (time.perf_counter() - started) * 1e3
            view.prefill(opener)
            logprobs, _ = continuation_logprobs(view, candidates)
            picked: list[int] = []
            for _ in range(self.greedy_tokens):
                token = view.decode()
                if token in self.format.stop_ids:
                    break
                picked.append(token)
            answer = self.format.decode(picked)
            self.rows.append({"variant": name, "rank": rank_of(logprobs, right), "logprob": logprobs[right],
                              "correct": answers_with(answer, fact.code), "answer": answer.strip(),
                              "tokens": int(chosen.shape[0]), "share": chosen.shape[0] / parts.held,
                              "held": parts.held, "blend_ms": blend_ms, "fresh_ms": fresh_ms,
                              "in_view": fact_needle(fact.code) in held_text, "restored": len(restored)})


def load_like(base: Backend) -> Backend:
    """An empty session of `base`'s model sharing its weights (a fork, emptied)."""
    scratch = base.fork()
    rewind(scratch, 0)
    return scratch


def play(backend: Backend, seed: int, session: int, variants: list[str], greedy_tokens: int,
         serve_flags: list[str]) -> list[dict[str, Any]]:
    args = build_parser().parse_args(["serve", *serve_flags, "--blend", "none"])
    config = engine_config(args)
    script = make_script(seed, 12, 300, 8)
    base = Path(tempfile.mkdtemp(prefix="kvb-blend-", dir="/tmp"))
    daemon = ContextdProcess(base / "root", base / "run" / "c.sock", extra=["--reserve-bytes", "0"])
    client = daemon.start()
    try:
        fork = backend.fork()
        fmt = ChatFormat(fork.tokenizer)
        engine = Engine(fork, fmt, client, config, make_selector(args.selector, args.restore_pages))
        reader = Reader(fmt, variants, greedy_tokens)
        engine.observers.append(reader)
        session_id = f"blend-{seed}-{session}"
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt(session)}]
        for step in script.steps:
            messages.append({"role": "user", "content": step.message})
            if step.kind == "question":
                assert step.fact is not None
                reader.asking = (step.fact, list(script.facts))
            content: list[str] = []
            for event in engine.chat(ChatRequest(session_id, list(messages), max_tokens=args.max_new_tokens)):
                if event.delta:
                    content.append(event.delta)
            messages.append({"role": "assistant", "content": "".join(content)})
        c = engine.sessions[session_id].counters
        assert c.model_forward_tokens == c.new_prefill_tokens + c.decoded_tokens + c.blend_forward_tokens
        for row in reader.rows:
            row.update(seed=seed, session=f"s{session}")
        return reader.rows
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


class ViewRecorder(TurnObserver):
    """The engine's observer in a timed play: only notes the planned view (its token ids in position
    order) and the answer's opening, so a fresh prefill of the same tokens can be timed after."""

    def __init__(self) -> None:
        self.view: tuple[list[int], list[int]] | None = None

    def view_planned(self, session: Session, backend: Backend, restored: list[int], new_tokens: int,
                     opener: list[int]) -> None:
        ids = backend.held_token_ids()[np.argsort(backend.positions(), kind="stable")]
        self.view = (ids.tolist(), opener)


def time_turns(backend: Backend, seed: int, session: int, serve_flags: list[str]) -> list[dict[str, Any]]:
    """Play one session with the engine `serve_flags` configure and, per question, its time to first
    token against a fresh prefill of the same view (and its opening) and the first token, timed right
    after in the same process on a session sharing the weights."""
    args = build_parser().parse_args(["serve", *serve_flags])
    script = make_script(seed, 12, 300, 8)
    base = Path(tempfile.mkdtemp(prefix="kvb-blend-", dir="/tmp"))
    daemon = ContextdProcess(base / "root", base / "run" / "c.sock", extra=["--reserve-bytes", "0"])
    client = daemon.start()
    rows: list[dict[str, Any]] = []
    try:
        fork = backend.fork()
        engine = Engine(fork, ChatFormat(fork.tokenizer), client, engine_config(args),
                        make_selector(args.selector, args.restore_pages))
        recorder = ViewRecorder()
        engine.observers.append(recorder)
        scratch = load_like(fork)
        session_id = f"ttft-{seed}-{session}"
        messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt(session)}]
        for step in script.steps:
            messages.append({"role": "user", "content": step.message})
            content: list[str] = []
            started = time.perf_counter()
            first: float | None = None
            blended = engine.sessions[session_id].counters.blend_forward_tokens if session_id in engine.sessions else 0
            for event in engine.chat(ChatRequest(session_id, list(messages), max_tokens=args.max_new_tokens)):
                if event.delta:
                    first = first or time.perf_counter()
                    content.append(event.delta)
            messages.append({"role": "assistant", "content": "".join(content)})
            if step.kind != "question" or first is None or recorder.view is None:
                continue
            view, opener = recorder.view
            rewind(scratch, 0)
            fresh_started = time.perf_counter()
            scratch.extend(view)
            scratch.prefill(opener)
            scratch.decode()
            fresh_ms = (time.perf_counter() - fresh_started) * 1e3
            rows.append({"seed": seed, "session": f"s{session}", "ttft_ms": (first - started) * 1e3,
                         "fresh_ms": fresh_ms, "view_tokens": len(view) + len(opener),
                         "blend_tokens": engine.sessions[session_id].counters.blend_forward_tokens - blended})
        return rows
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by_session: dict[str, list[float]] = {}
    for r in rows:
        by_session.setdefault(f"{r['seed']}/{r['session']}", []).append(float(r["rank"] == 1))
    return {"questions": len(rows), "recall_at_1": round(fmean(float(r["rank"] == 1) for r in rows), 3),
            "recall_at_1_ci": bootstrap_ci(by_session),
            "logprob_mean": round(fmean(r["logprob"] for r in rows), 3),
            "correct": sum(bool(r["correct"]) for r in rows),
            "share_mean": round(fmean(r["share"] for r in rows), 3),
            "tokens_mean": round(fmean(r["tokens"] for r in rows), 1),
            "blend_ms_p50": round(float(np.percentile([r["blend_ms"] for r in rows], 50)), 1),
            "fresh_ms_p50": round(float(np.percentile([r["fresh_ms"] for r in rows], 50)), 1),
            "in_view": sum(bool(r["in_view"]) for r in rows)}


def timed(backend: Backend, seeds: list[int], sessions: int, flags: list[str], model: str) -> int:
    """`--ttft`: the shipped default and the exact cache, session by session in turn, each question's
    time to first token next to a fresh prefill of its view."""
    arms = {"default": flags, "exact": [*flags, "--blend", "none"]}
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    cpu = machine_cpu_seconds()
    own = process_cpu_seconds(os.getpid())
    for seed in seeds:
        for session in range(sessions):
            for arm, arm_flags in arms.items():
                rows[arm].extend(time_turns(backend, seed, session, arm_flags))
    other = other_cpu_share(cpu, machine_cpu_seconds(), process_cpu_seconds(os.getpid()) - own)
    result: dict[str, Any] = {"model": model, "seeds": seeds, "sessions": sessions,
                              "other_processes_cpu_share": None if other is None else round(other, 3), "arms": {}}
    for arm, got in rows.items():
        ttft = float(np.percentile([r["ttft_ms"] for r in got], 50))
        fresh = float(np.percentile([r["fresh_ms"] for r in got], 50))
        ratios = [r["ttft_ms"] / r["fresh_ms"] for r in got]
        result["arms"][arm] = {"questions": len(got), "ttft_ms_p50": round(ttft, 1), "fresh_ms_p50": round(fresh, 1),
                               "ratio_p50": round(float(np.percentile(ratios, 50)), 3),
                               "ratio_p95": round(float(np.percentile(ratios, 95)), 3),
                               "blend_share_mean": round(fmean(r["blend_tokens"] / r["view_tokens"] for r in got), 3)}
        print(f"{arm:8} TTFT p50 {ttft:7.1f} ms, fresh prefill of the view p50 {fresh:7.1f} ms, "
              f"ratio p50 {result['arms'][arm]['ratio_p50']} p95 {result['arms'][arm]['ratio_p95']}")
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--seeds", default=",".join(str(s) for s in (TUNING_SEED, *HELD_OUT_SEEDS)))
    parser.add_argument("--sessions", type=int, default=len(SESSION_DIRS))
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--tail-tokens", type=int, default=256)
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--greedy-tokens", type=int, default=16)
    parser.add_argument("--out", default="bench-out/blend")
    parser.add_argument("--ttft", action="store_true",
                        help="instead of reading variants: time each question's first token as shipped and "
                        "with --blend none, against a fresh prefill of the same view, in the same run")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    backend = load_backend("torch", args.model, capacity=args.budget + 256)
    flags = ["--model", args.model, "--budget", str(args.budget), "--tail-tokens", str(args.tail_tokens),
             "--max-new-tokens", "32"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.ttft:
        return timed(backend, seeds, args.sessions, flags, args.model)
    rows: list[dict[str, Any]] = []
    for seed in seeds:
        for session in range(args.sessions):
            started = time.perf_counter()
            got = play(backend, seed, session, variants, args.greedy_tokens, flags)
            rows.extend(got)
            first = {v: sum(r["rank"] == 1 for r in got if r["variant"] == v) for v in variants}
            print(f"seed {seed} s{session} ({time.perf_counter() - started:.0f} s): "
                  + " ".join(f"{v}={n}" for v, n in first.items()), flush=True)
            (out / "rows.json").write_text(json.dumps(rows))
    result: dict[str, Any] = {"model": args.model, "budget": args.budget, "seeds": seeds,
                              "sessions": args.sessions, "variants": {}}
    print(f"\n{'variant':<16} {'tune r@1':>8} {'held r@1':>8} {'held logp':>9} {'held greedy':>11} "
          f"{'share':>6} {'blend ms':>8} {'fresh ms':>8}")
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        tuning = summarize([r for r in mine if r["seed"] == TUNING_SEED]) if any(
            r["seed"] == TUNING_SEED for r in mine) else None
        held = summarize([r for r in mine if r["seed"] != TUNING_SEED]) if any(
            r["seed"] != TUNING_SEED for r in mine) else None
        result["variants"][v] = {"tuning": tuning, "held_out": held}
        h = held or tuning
        assert h is not None
        print(f"{v:<16} {tuning['recall_at_1'] if tuning else '-':>8} {held['recall_at_1'] if held else '-':>8} "
              f"{h['logprob_mean']:>9} {str(h['correct']) + '/' + str(h['questions']):>11} {h['share_mean']:>6} "
              f"{h['blend_ms_p50']:>8} {h['fresh_ms_p50']:>8}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
