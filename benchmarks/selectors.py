"""Selectors on agent sessions of several shapes: does the page a question needs come back?

For each workload shape and seed (harness.shapes) and each budget, one session is built through
the real engine (real contextd process, real SmolLM2 weights): the whole session is sent as one
request, so it is prefilled in chunks with evictions between them exactly as serving does. Then
every question whose answer sits in a cold page is prefilled and each selector says what it would
restore (`serving.probe.probe`: the question is taken back out after, so every selector sees the same
state). A question is a hit when every page holding a part of its answer (both parts for `split`)
is in attention after the selector's validated plan; precision is the share of restored pages
that hold evidence text. Tuning seeds are harness.shapes.TUNING_SEEDS; nothing was tuned on
HELD_OUT_SEEDS.

    python -m benchmarks.selectors [--shapes all] [--seeds held-out|tuning|101,102]
        [--budgets 2048,4096] [--tokens 16000] [--selectors recency,attention,bm25,hybrid]
        [--model smollm2-135m] [--ablation] [--controller-model NAME] [--controller-cache-mb 512] [--answers]

Selectors: recency (no advice), attention (the model's keys, controller.keyindex), bm25 (lexical
rarity alone: the 8 best pages by BM25 that fit), hybrid (the default, controller.hybrid), rerank
(the hybrid's choice re-ranked by query likelihood over the stored K/V, controller.rerank; it
reads the model's weights, so it needs the real model, not tiny-llama), likelihood (query
likelihood alone over every stored cold page: the re-ranker without the lexical choice, an
ablation that takes seconds a question). With
`--ablation`, the hybrid without each of its parts and with the key evidence added. Last line: one
JSON object: `rows` (per selector, shape, seed and budget: hit_rate, hits, questions, pages,
precision, p50_ms, p95_ms, controller_forward_tokens), `sessions` (per session: its size, cold
pages, and the serving session's `historical_forward` and whether model_forward_tokens ==
new_prefill_tokens + decoded_tokens held), `summary` (per selector and budget, by shape) and
`other_processes_cpu_share` with `reliable`: the decision times (p95 against the 250 ms budget) are
the machine's as much as the selector's when other processes took more than a tenth of it.

With `--answers`, each counted question is also answered once per selector, from the same state:
a branch of the built session (`AnswerWatch.answer_in_branches`: the session's stored pages and resident set,
no prefill of its history) takes the question in a real turn with that selector, and the answer's
view is scored (serving.watch: the teacher-forced log p of every answer the workload
plants, the right one's rank among them). Through Pi (benchmarks.compare) each arm writes its
own answers, so two arms' sessions part at the first answer that differs and every later
question compares different histories; here the two selectors' answers differ only by what they
restored. Rows gain `answered`, `ranked_first`, `answer_logprob` (the sum over the questions, for
pairing by session) and `answer_in_view`; the branch's own prefill (the built session's open last
page and the question) is `branch_prefill_max` in `sessions`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backends import Backend, load_backend
from benchmarks.answers import rank_of
from benchmarks.stats import percentile, print_result
from contextd.wire import PageState
from controller.hybrid import HybridConfig
from controller.links import FOLLOW_HOPS, LinkConfig
from controller.pager import PAGE_TOKENS
from controller.selectors import (
    AttentionSelector,
    HybridSelector,
    LikelihoodSelector,
    RecencySelector,
    RerankSelector,
    Selector,
)
from harness.procfs import machine_cpu_seconds, other_cpu_share, own_cpu_seconds
from harness.shapes import HELD_OUT_SEEDS, SHAPES, TUNING_SEEDS, make
from harness.shapes.session import DEFAULT_TOKENS, Question, Workload
from serving.chat_format import ChatFormat
from serving.engine import Engine, EngineConfig
from serving.heap import freeze_loaded_heap
from serving.launcher import ContextdProcess
from serving.probe import probe
from serving.scoring import ControllerConfig, ControllerScorer
from serving.turn import ChatRequest, TurnResult
from serving.watch import AnswerWatch

MODEL = "smollm2-135m"
BASE_SELECTORS = ("recency", "attention", "bm25", "hybrid", "rerank")   # the default run
# The last two: the hybrid with links (--follow-hops), without its floor (ablations).
NAMED_SELECTORS = (*BASE_SELECTORS, "likelihood", "hybrid+links", "hybrid-floor")


def selectors(names: Sequence[str], ablation: bool) -> list[Selector]:
    made: dict[str, Selector] = {
        "recency": RecencySelector(), "attention": AttentionSelector(),
        "bm25": HybridSelector(HybridConfig(coverage_decay=1.0, cutoff=0.0, neighbour_tokens=0), "bm25"),
        "hybrid": HybridSelector(), "rerank": RerankSelector(), "likelihood": LikelihoodSelector(),
        "hybrid+links": HybridSelector(HybridConfig(follow=LinkConfig(hops=FOLLOW_HOPS)), "hybrid + links"),
        "hybrid-floor": HybridSelector(HybridConfig(min_gain=0.0), "hybrid - floor")}
    out = [made[name] for name in names]
    if ablation:
        out += [HybridSelector(HybridConfig(coverage_decay=1.0), "hybrid - coverage"),
                HybridSelector(HybridConfig(neighbour_tokens=0), "hybrid - neighbours"),
                HybridSelector(HybridConfig(cutoff=0.0), "hybrid - cutoff"),
                HybridSelector(HybridConfig(key_weight=0.5), "hybrid + keys"), made["hybrid+links"],
                made["hybrid-floor"]]
    return out


@dataclass(frozen=True)
class Located:
    """Where a question's evidence is in the session: pages holding answer parts, and every page
    touched by an evidence string (harness code: it reads text to find ground truth)."""

    needed: list[set[int]]
    touched: set[int]


def token_spans(engine: Engine, session_id: str) -> tuple[str, list[tuple[int, int]]]:
    """The cached transcript's text and each token's character span in it."""
    session = engine.sessions[session_id]
    tokenizer = engine.format.tokenizer
    text = ""
    spans: list[tuple[int, int]] = []
    for segment in session.transcript.segments:
        encoded = tokenizer(segment.text, return_offsets_mapping=True, add_special_tokens=False)
        if list(encoded["input_ids"]) != list(segment.ids):  # generated text: spans by decoding
            for k in range(len(segment.ids)):
                spans.append((len(text) + len(engine.format.decode(segment.ids[:k])),
                              len(text) + len(engine.format.decode(segment.ids[:k + 1]))))
        else:
            spans.extend((len(text) + a, len(text) + b) for a, b in encoded["offset_mapping"])
        text += segment.text
    return text, spans


def pages_over(spans: list[tuple[int, int]], a: int, b: int) -> set[int]:
    """The pages whose tokens cover any of the transcript's characters [a, b) (`token_spans`)."""
    return {t // PAGE_TOKENS for t, (s, e) in enumerate(spans) if e > a and s < b}


def locate(text: str, spans: list[tuple[int, int]], workload: Workload) -> list[Located]:
    out = []
    for q in workload.questions:
        needed, touched = [], set()
        for evidence, part in zip(q.evidence, q.answer_parts, strict=True):
            at = text.find(evidence)
            if at < 0:
                raise AssertionError(f"{workload.shape}/{workload.seed}: evidence not in the transcript: {evidence!r}")
            touched |= pages_over(spans, at, at + len(evidence))
            part_at = at + evidence.index(part)
            needed.append(pages_over(spans, part_at, part_at + len(part)))
        out.append(Located(needed, touched))
    return out


def turn(engine: Engine, request: ChatRequest) -> TurnResult:
    """Run one turn to its end and return what it reports."""
    final = None
    for event in engine.chat(request):
        final = event.final or final
    assert final is not None
    return final


def build(engine: Engine, session_id: str, workload: Workload) -> list[dict[str, Any]]:
    """The whole session in one request (one token generated), as a client resuming it would send it."""
    messages = workload.messages()
    final = turn(engine, ChatRequest(session_id, list(messages), tools=workload.tools, max_tokens=1))
    return [*messages, {"role": "assistant", "content": final.content}]


def read_answers(engine: Engine, parent: str, messages: list[dict[str, Any]], workload: Workload,
                 counted: list[tuple[Question, Located]], chosen: Sequence[Selector],
                 results: dict[str, dict[str, Any]]) -> int:
    """Each counted question answered in a branch of `parent` per selector
    (`AnswerWatch.answer_in_branches`), its answer's view scored against every answer the workload
    plants (see the module docstring); returns the most tokens a branch prefilled."""
    candidates = list(dict.fromkeys(q.answer for q in workload.questions))
    watch = AnswerWatch(engine)
    prefilled = 0
    for question, where in counted:
        request = ChatRequest(parent, [*messages, workload.question_message(question)], tools=workload.tools)
        for name, (reading, tokens) in watch.answer_in_branches(request, candidates, chosen).items():
            prefilled = max(prefilled, tokens)
            held = set(reading.resident_pages)
            right = candidates.index(question.answer)
            r = results[name]
            r["answered"] += 1
            r["ranked_first"] += int(rank_of(reading.logprobs, right) == 1)   # ties against it, as compare's
            r["answer_logprob"] += reading.logprobs[right]
            r["answer_in_view"] += int(all(pages <= held for pages in where.needed))
    return prefilled


def measure_session(backend: Backend, client: Any, workload: Workload, budget: int, chosen: Sequence[Selector],
                    controller: Backend | None = None, controller_config: ControllerConfig | None = None,
                    answers: bool = False) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    fresh = backend.fork()   # the engine empties it when the session comes in
    # The session is built with no selector: pages restored (and leased) while it is built would
    # take the room every question's restores need. Each selector is asked in `serving.probe.probe`.
    engine = Engine(fresh, ChatFormat(fresh.tokenizer), client,
                    EngineConfig(budget_tokens=budget, tail_tokens=512, max_new_tokens=1), RecencySelector(),
                    None if controller is None else ControllerScorer(controller, fresh.tokenizer, controller_config))
    session_id = f"{workload.shape}-{workload.seed}-{budget}"
    started = time.perf_counter()
    messages = build(engine, session_id, workload)
    build_s = time.perf_counter() - started
    text, spans = token_spans(engine, session_id)
    located = locate(text, spans, workload)
    session = engine.sessions[session_id]
    results = {s.name: {"hits": 0, "questions": 0, "pages": [], "useful": 0, "ms": [], "controller_tokens": 0,
                        "answered": 0, "ranked_first": 0, "answer_logprob": 0.0, "answer_in_view": 0}
               for s in chosen}
    counted: list[tuple[Question, Located]] = []
    for question, where in zip(workload.questions, located, strict=True):
        cold = {p.index for p in session.pager.pages if p.state is PageState.COLD}
        if not any(pages & cold for pages in where.needed):
            continue  # nothing it needs has left attention: it does not test retrieval
        counted.append((question, where))
        request = ChatRequest(session_id, [*messages, workload.question_message(question)], tools=workload.tools)
        for name, found in probe(engine, request, list(chosen)).items():
            held = set(found.resident) | set(found.restore)
            r = results[name]
            r["questions"] += 1
            r["hits"] += int(all(pages <= held for pages in where.needed))
            r["pages"].append(len(found.restore))
            r["useful"] += len(set(found.restore) & where.touched)
            r["ms"].append(found.decided_ms)
            r["controller_tokens"] += found.controller_forward_tokens
    context: dict[str, Any] = {"session_tokens": session.transcript.tokens, "cold_pages": sum(
        1 for p in session.pager.pages if p.state is PageState.COLD), "build_s": round(build_s, 1)}
    if answers:
        context["branch_prefill_max"] = read_answers(engine, session_id, messages, workload, counted,
                                                     chosen, results)
    counters = fresh.counters  # the serving sessions' own forwards; scoring ran on scratch sessions
    context |= {
        "historical_forward": counters.historical_forward_during_restore,
        "forward_invariant": counters.model_forward_tokens
        == counters.new_prefill_tokens + counters.decoded_tokens + counters.blend_forward_tokens}
    return results, context


def row(name: str, r: dict[str, Any], shape: str, seed: int, budget: int) -> dict[str, Any]:
    ms = sorted(r["ms"]) or [0.0]
    restored = sum(r["pages"])
    return {"selector": name, "shape": shape, "seed": seed, "budget": budget,
            "hit_rate": round(r["hits"] / max(1, r["questions"]), 3), "hits": r["hits"],
            "questions": r["questions"], "pages": round(restored / max(1, len(r["pages"])), 2),
            "precision": round(r["useful"] / restored, 3) if restored else 0.0,
            "p50_ms": round(percentile(ms, 50), 2), "p95_ms": round(percentile(ms, 95), 2),
            "controller_forward_tokens": r["controller_tokens"],
            **({"answered": r["answered"], "ranked_first": r["ranked_first"],
                "answer_logprob": round(r["answer_logprob"], 4), "answer_in_view": r["answer_in_view"]}
               if r["answered"] else {})}


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per selector and budget: hits / questions by shape over the seeds run, the worst p95, and
    with answers read, the right answer ranked first and its mean log p over every shape."""
    out: dict[str, Any] = {}
    for r in rows:
        entry = out.setdefault(r["selector"], {}).setdefault(str(r["budget"]), {"by_shape": {}, "p95_ms": 0.0})
        hits, questions = entry["by_shape"].get(r["shape"], (0, 0))
        entry["by_shape"][r["shape"]] = (hits + r["hits"], questions + r["questions"])
        entry["p95_ms"] = max(entry["p95_ms"], r["p95_ms"])
        if "answered" in r:
            entry["answered"] = entry.get("answered", 0) + r["answered"]
            entry["ranked_first"] = entry.get("ranked_first", 0) + r["ranked_first"]
            entry["answer_logprob"] = entry.get("answer_logprob", 0.0) + r["answer_logprob"]
    for budgets in out.values():
        for entry in budgets.values():
            entry["by_shape"] = {shape: round(h / max(1, q), 3) for shape, (h, q) in entry["by_shape"].items()}
            entry["min_hit_rate"] = min(entry["by_shape"].values())
            if entry.get("answered"):
                entry["recall_at_1"] = round(entry["ranked_first"] / entry["answered"], 3)
                entry["answer_logprob_mean"] = round(entry.pop("answer_logprob") / entry["answered"], 4)
    return out


def controller_backend(name: str | None) -> Backend | None:
    """The separate controller model `name`, or None for none; each session gets a scorer of its
    own over it (`ControllerScorer`), so no session finds pages another one read."""
    return None if name is None else load_backend("torch", name, capacity=ControllerConfig.max_page_tokens)


def names_of(parser: argparse.ArgumentParser, text: str, known: Sequence[str], what: str) -> list[str]:
    """Comma-separated names from `known` ("all": every one); an unknown name is a usage error."""
    names = list(known) if text == "all" else text.split(",")
    unknown = sorted(set(names) - set(known))
    if unknown:
        parser.error(f"unknown {what} {unknown}: use {', '.join(known)}")
    return names


def seeds_of(text: str) -> list[int]:
    if text == "held-out":
        return list(HELD_OUT_SEEDS)
    if text == "tuning":
        return list(TUNING_SEEDS)
    return [int(s) for s in text.split(",")]


def run(shapes: list[str], seeds: list[int], budgets: list[int], tokens: int, chosen: list[Selector],
        model: str = MODEL, log: Any = print, controller_model: str | None = None,
        controller_config: ControllerConfig | None = None, answers: bool = False) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="kvb-sel-", dir="/tmp"))
    daemon = ContextdProcess(base / "root", base / "run" / "c.sock", extra=["--reserve-bytes", "0"])
    client = daemon.start()
    rows: list[dict[str, Any]] = []
    sessions: list[dict[str, Any]] = []
    try:
        backend = load_backend("torch", model, capacity=max(budgets) + 256)
        controller = controller_backend(controller_model)
        freeze_loaded_heap()   # as `kv-elision serve` does once its models are loaded
        for budget in budgets:
            for shape in shapes:
                for seed in seeds:
                    workload = make(shape, seed, tokens)
                    results, context = measure_session(backend, client, workload, budget, chosen, controller,
                                                       controller_config, answers)
                    sessions.append({"shape": shape, "seed": seed, "budget": budget, **context})
                    for name, r in results.items():
                        rows.append(row(name, r, shape, seed, budget))
                        log(f"{shape:<15} seed {seed:<4} budget {budget:<5} {name:<20} "
                            f"{r['hits']:>2}/{r['questions']:<2} pages {rows[-1]['pages']:<5} "
                            f"precision {rows[-1]['precision']:<5} p95 {rows[-1]['p95_ms']} ms"
                            + (f" answers {r['ranked_first']}/{r['answered']} first, log p "
                               f"{r['answer_logprob'] / r['answered']:.2f}" if r["answered"] else ""))
    finally:
        daemon.stop()
        shutil.rmtree(base, ignore_errors=True)
    tuned = sorted(set(seeds) & set(TUNING_SEEDS))
    return {"model": model, "controller_model": controller_model,
            "controller_cache_bytes": controller_config.cache_bytes if controller_config else None, "rows": rows,
            "summary": summarise(rows),
            "sessions": sessions, "tokens": tokens,
            "tuning_seeds": tuned, "held_out_seeds": sorted(set(seeds) - set(TUNING_SEEDS))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="all", help=f"comma-separated, or all: {', '.join(SHAPES)}")
    parser.add_argument("--seeds", default="held-out", help="held-out, tuning, or comma-separated seeds")
    parser.add_argument("--budgets", default="2048,4096")
    parser.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="approximate session length")
    parser.add_argument("--selectors", default=",".join(BASE_SELECTORS),
                        help=f"comma-separated, from {', '.join(NAMED_SELECTORS)}")
    parser.add_argument("--model", default=MODEL,
                        help="the serving model; recency, bm25 and hybrid read token ids only, so any model with "
                             "SmolLM2's tokenizer (tiny-llama) gives them the same figures in a fraction of the time")
    parser.add_argument("--ablation", action="store_true", help="also the hybrid without each part, and with keys")
    parser.add_argument("--controller-model", default=None, metavar="NAME",
                        help="rerank scores with this separate model from the pages' text (serving.scoring) instead "
                             "of the serving model over their stored K/V")
    parser.add_argument("--controller-cache-mb", type=int, default=ControllerConfig.cache_bytes >> 20, metavar="MB",
                        help="the controller's memory for pages it read (as kv-elision serve's flag)")
    parser.add_argument("--answers", action="store_true",
                        help="also answer each counted question once per selector from the same state and score "
                             "the answer's view (the right answer's rank and log p among the workload's answers)")
    args = parser.parse_args(argv)
    shapes = names_of(parser, args.shapes, SHAPES, "shapes")
    chosen = selectors(names_of(parser, args.selectors, NAMED_SELECTORS, "selectors"), args.ablation)
    machine0, own0 = machine_cpu_seconds(), own_cpu_seconds()
    result = run(shapes, seeds_of(args.seeds), [int(b) for b in args.budgets.split(",")], args.tokens, chosen,
                 args.model, controller_model=args.controller_model,
                 controller_config=ControllerConfig(cache_bytes=args.controller_cache_mb << 20), answers=args.answers)
    for name, budgets in result["summary"].items():
        for budget, entry in budgets.items():
            shapes_text = "  ".join(f"{shape} {rate:.2f}" for shape, rate in entry["by_shape"].items())
            answered = (f"  answers recall@1 {entry['recall_at_1']} log p {entry['answer_logprob_mean']}"
                        if entry.get("answered") else "")
            print(f"{name:<20} budget {budget:<5} {shapes_text}  p95 {entry['p95_ms']} ms{answered}")
    print_result(result, other_cpu_share(machine0, machine_cpu_seconds(), own_cpu_seconds() - own0))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
