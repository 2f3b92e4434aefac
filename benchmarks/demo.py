"""`make demo`: the main job on the embedded model, end to end, with restores on and off.

Plays one scripted session twice through `kv-elision serve` (which starts contextd): the server
as shipped (restores on), then the same server with `--selector recency` (restores off: pages
leave attention and never come back by relevance). It is the session benchmarks.compare has Pi
play (its seed 7), sent over HTTP as Pi would: an objective, evidence files in five languages
and code, one per message, far past the attention budget, then a question about the value
planted in each of the first files, long cold by then (an English sentence about a distinct
setting). No tools: with a tool schema pinned and every tool-call page in the ledger, a
1,024-token budget left room for one restored page a question (a first run of this demo: the
page came back for 3 of 8 questions).

The budget is 1,024 tokens: the view SmolLM2-135M still copies a value out of (docs/proof.md).
Per turn it prints pages hot / cold / pinned, session and attention tokens, tokens prefilled,
restores and the accounting check. Per question, side by side for both runs: whether the fact's
page was back in attention, the likelihood rank of the right value among every value planted in
the session (the server scores them over the exact cache the answer is read from, `POST
/v1/kv/score`), and whether the greedy answer held it. The last line is one JSON object, and
the line before it says how many questions each run answered.

    python -m benchmarks.demo [--files 12] [--budget 1024] [--questions 8] [--model smollm2-135m] [--seed 7]
                              [--out demo-out]

Writes a plot of attention tokens against session tokens (restores on) and a JSON record of
every turn into --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from backends.models import load_tokenizer, resolve
from benchmarks.answers import rank_of
from benchmarks.compare.arms import fact_residency
from harness.agent import AgentRun, TurnRecord
from harness.fact_script import SYSTEM_PROMPT, Script, answer_candidates, answers_with, fact_needle, make_script
from serving.launcher import ServerProcess

RUNS = {"restores on": (), "restores off": ("--selector", "recency")}


def plot(turns: list[TurnRecord], budget: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    session = [t.session_tokens for t in turns]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot(session, session, color="#bbbbbb", linestyle="--", label="unbounded cache (attention = session)")
    ax.plot(session, [t.attention_tokens for t in turns], color="#1f77b4", marker=".", label="kv-elision attention")
    ax.axhline(budget, color="#d62728", linewidth=1, label=f"budget ({budget} tokens)")
    ax.set_xlabel("session tokens")
    ax.set_ylabel("tokens held in attention")
    ax.set_title("kv-elision: attention stays bounded while the session grows")
    ax.set_ylim(0, max(budget * 1.6, 1))
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def accounted(c: dict[str, int]) -> bool:
    """Every token through the model is new text, an answer or the blend, and none is history
    re-read by a restore."""
    return c["model_forward_tokens"] == c["new_prefill_tokens"] + c["decoded_tokens"] + c["blend_forward_tokens"] \
        and c["historical_forward_during_restore"] == 0


def show(t: TurnRecord, blended: int) -> None:
    print(f"{t.turn:>4} {t.session_tokens:>8} {t.attention_tokens:>6} {t.hot:>4} {t.cold:>5} {t.pinned:>4} "
          f"{t.prefilled:>7} {t.restored_pages:>8} {t.evicted_pages:>7} {blended:>5} "
          f"{'yes' if accounted(t.counters) else 'NO':>18} {t.seconds:>6.1f}", flush=True)


def play(name: str, flags: tuple[str, ...], args: argparse.Namespace, script: Script, tokenizer: Any
         ) -> tuple[AgentRun, list[dict[str, Any]]]:
    """One run of the session against a fresh server and store; per question what the answer read."""
    root = Path(tempfile.mkdtemp(prefix="kvd-demo-", dir="/tmp"))
    server = ServerProcess(root=root, model=args.model, budget=args.budget,
                           extra=("--max-new-tokens", "32", "--tail-tokens", "256", *flags)).start()
    facts = list(script.facts)
    values = [f.code for f in facts]
    asked: list[dict[str, Any]] = []
    try:
        print(f"\n== {name} ({' '.join(flags) or 'the server as shipped'}), server on port {server.port}")
        print(f"{'turn':>4} {'session':>8} {'attn':>6} {'hot':>4} {'cold':>5} {'pin':>4} {'prefill':>7} "
              f"{'restored':>8} {'evicted':>7} {'blend':>5} {'fwd==new+dec+blend':>18} {'secs':>6}")
        run = AgentRun(server, "demo", max_tokens=32, messages=[{"role": "system", "content": SYSTEM_PROMPT}],
                       tools=None)
        def ask(message: str) -> TurnRecord:
            blended = run.turns[-1].counters["blend_forward_tokens"] if run.turns else 0
            record = run.ask([{"role": "user", "content": message}])
            show(record, record.counters["blend_forward_tokens"] - blended)
            return record

        for step in script.steps:
            if step.kind != "question":
                ask(step.message)
                continue
            fact = step.fact
            assert fact is not None
            reply = server.request("POST", "/v1/kv/score", {"session": "demo",
                                                             "candidates": answer_candidates(facts, fact.code)},
                                   timeout=60.0)
            if reply.status != 202:
                raise RuntimeError(f"the server would not score the answer: {reply.status} {reply.body}")
            record = ask(step.message)
            reading = server.request("GET", "/v1/kv/score?session=demo", timeout=60.0).body
            turn = server.stats("demo")["turn"]
            where = fact_residency(server.socket, "demo", fact_needle(fact.code), tokenizer, turn=turn)
            right = values.index(fact.code)
            asked.append({"file": fact.path, "language": fact.language, "question": fact.question,
                          "expected": fact.code, "answer": record.answer.strip(),
                          "correct": answers_with(record.answer, fact.code), "in_view": where["in_view"],
                          "came_back": where["came_back"], "pages": where["detail"],
                          "rank": rank_of(reading["logprobs"], right), "candidates": len(values),
                          "logprob": round(reading["logprobs"][right], 3)})
        return run, asked
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--tokens-per-file", type=int, default=300)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--questions", type=int, default=8, help="facts asked about, from the first files")
    parser.add_argument("--seed", type=int, default=7, help="the script's seed (benchmarks.compare's)")
    parser.add_argument("--out", default="demo-out")
    args = parser.parse_args(argv)
    if not 1 <= args.questions <= args.files:
        parser.error("--questions must be 1 to --files")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    script = make_script(args.seed, args.files, args.tokens_per_file, args.questions)
    tokenizer = load_tokenizer(resolve(args.model))
    print(f"kv-elision demo: {args.model}, budget {args.budget} tokens, {args.files} evidence files "
          f"({', '.join(sorted({f.language for f in script.facts}))}), then {args.questions} questions about the "
          "first files; played twice, with restores on and off")
    results: dict[str, list[dict[str, Any]]] = {}
    runs: dict[str, AgentRun] = {}
    for name, flags in RUNS.items():
        runs[name], results[name] = play(name, flags, args, script, tokenizer)

    on, off = results["restores on"], results["restores off"]
    print(f"\n{'question':<52} | {'restores on: page / rank / answer':<34} | restores off: page / rank / answer")
    for a, b in zip(on, off, strict=True):
        def cell(x: dict[str, Any]) -> str:
            page = "back" if x["came_back"] else "in view" if x["in_view"] else "cold"
            return f"{page:<7} {x['rank']:>2}/{x['candidates']:<2} {'CORRECT' if x['correct'] else 'wrong':<7}"
        print(f"{a['expected']} {a['question'][:47]:<47} | {cell(a):<34} | {cell(b)}")
    for name, asked in results.items():
        print(f"  {name}: answers {[x['answer'][:40] for x in asked]}")

    final = runs["restores on"].turns[-1]
    counters = final.counters
    plot(runs["restores on"].turns, args.budget, out / "attention.png")
    (out / "turns.json").write_text(json.dumps({name: [asdict(t) for t in run.turns] for name, run in runs.items()},
                                               indent=1, ensure_ascii=False))
    print(f"\npeak attention {counters['peak_attention_tokens']} of {args.budget} tokens over a "
          f"{final.session_tokens}-token session; {counters['evicted_pages']} pages evicted, "
          f"{counters['restored_pages']} restored; model_forward_tokens {counters['model_forward_tokens']} == "
          f"new_prefill {counters['new_prefill_tokens']} + decoded {counters['decoded_tokens']} + blend "
          f"{counters['blend_forward_tokens']} (held tokens recomputed before answers); "
          f"historical_forward_during_restore {counters['historical_forward_during_restore']}")
    print(f"plot: {out / 'attention.png'}; per-turn record: {out / 'turns.json'}")

    def tally(asked: list[dict[str, Any]]) -> dict[str, Any]:
        return {"answered": sum(x["correct"] for x in asked), "ranked_first": sum(x["rank"] == 1 for x in asked),
                "page_in_view": sum(x["in_view"] for x in asked), "questions": len(asked), "facts": asked}

    summary = {name: tally(asked) for name, asked in results.items()}
    print(f"restores on answered {summary['restores on']['answered']} of {len(on)} questions (right value ranked "
          f"first {summary['restores on']['ranked_first']}, page in view {summary['restores on']['page_in_view']}); "
          f"restores off answered {summary['restores off']['answered']} of {len(off)} (ranked first "
          f"{summary['restores off']['ranked_first']}, page in view {summary['restores off']['page_in_view']})")
    print(json.dumps({"session_tokens": final.session_tokens, "budget_tokens": args.budget,
                      "peak_attention_tokens": counters["peak_attention_tokens"],
                      "evicted_pages": counters["evicted_pages"], "restored_pages": counters["restored_pages"],
                      "model_forward_tokens": counters["model_forward_tokens"],
                      "new_prefill_tokens": counters["new_prefill_tokens"],
                      "decoded_tokens": counters["decoded_tokens"],
                      "blend_forward_tokens": counters["blend_forward_tokens"],
                      "accounted": all(accounted(run.turns[-1].counters) for run in runs.values()),
                      "historical_forward_during_restore": counters["historical_forward_during_restore"],
                      **{name.replace(" ", "_"): figures for name, figures in summary.items()}},
                     ensure_ascii=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
