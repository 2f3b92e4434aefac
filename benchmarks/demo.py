"""`make demo`: the main job on the embedded model, end to end.

Starts `kv-elision serve` (which starts contextd), plays a scripted agent session that reads
evidence files in five languages and code far past the attention budget through `read` tool
calls, then asks about facts planted in the first files, long cold by then (one fact per file,
an English sentence about a distinct setting, as in benchmarks.compare). Prints one line per
turn (pages hot / cold / pinned, session and attention tokens, tokens prefilled, restores, the
accounting check), and for every question the answer, whether it holds the planted code, and
where the fact's page was when the model answered: brought back for that question, already in
attention, or still cold (contextd's manifest). It ends by saying which facts the model got and
which it did not. Writes a plot of attention tokens against session tokens.

    python -m benchmarks.demo [--files 24] [--budget 4096] [--questions 6] [--out demo-out]

The plot and a JSON record of every turn land in --out. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from backends.models import load_tokenizer, resolve
from benchmarks.agent import AgentRun, TurnRecord
from benchmarks.compare import answers_with, fact_needle, fact_residency, plant_fact
from benchmarks.workload import evidence_files
from serving.launcher import ServerProcess


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--files", type=int, default=24)
    parser.add_argument("--tokens-per-file", type=int, default=1000)
    parser.add_argument("--budget", type=int, default=4096)
    parser.add_argument("--questions", type=int, default=6, help="facts asked about, from the first files")
    parser.add_argument("--out", default="demo-out")
    args = parser.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvd-demo-", dir="/tmp"))
    planted = [plant_fact(f, i, seed=7) for i, f in enumerate(evidence_files(args.files,
                                                                             tokens_per_file=args.tokens_per_file))]
    files = [f for f, _ in planted]
    server = ServerProcess(root=root, model=args.model, budget=args.budget,
                           extra=("--max-new-tokens", "48")).start()
    print(f"kv-elision demo: {args.model}, budget {args.budget} tokens, {args.files} evidence files "
          f"({', '.join(sorted({f.language for f in files}))}); server on port {server.port}")
    header = (f"{'turn':>4} {'session':>8} {'attn':>6} {'hot':>4} {'cold':>5} {'pin':>4} {'prefill':>7} "
              f"{'restored':>8} {'evicted':>7} {'fwd==new+dec':>12} {'secs':>6}")
    print(header)

    def show(t: TurnRecord) -> None:
        c = t.counters
        exact = c["model_forward_tokens"] == c["new_prefill_tokens"] + c["decoded_tokens"] and \
            c["historical_forward_during_restore"] == 0
        print(f"{t.turn:>4} {t.session_tokens:>8} {t.attention_tokens:>6} {t.hot:>4} {t.cold:>5} {t.pinned:>4} "
              f"{t.prefilled:>7} {t.restored_pages:>8} {t.evicted_pages:>7} {'yes' if exact else 'NO':>12} "
              f"{t.seconds:>6.1f}", flush=True)

    try:
        run = AgentRun(server, "demo", max_tokens=16)
        run.run(files, on_turn=show)
        tokenizer = load_tokenizer(resolve(args.model))
        asked = [fact for _, fact in planted[:args.questions]]
        print(f"\nquestions about facts planted in the first {len(asked)} files (cold long before):")
        answers = []
        final = run.turns[-1]
        for fact in asked:
            final = run.ask([{"role": "user", "content": fact.question}], max_tokens=24)
            show(final)
            turn = server.stats("demo")["turn"]
            where = fact_residency(server.socket, "demo", fact_needle(fact.code), tokenizer, turn=turn)
            page = ("its page came back for this question" if where["came_back"] else
                    "its page was already in attention" if where["in_view"] else "its page stayed cold")
            got = answers_with(final.answer, fact.code)
            answers.append({"file": fact.path, "language": fact.language, "question": fact.question,
                            "expected": fact.code, "answer": final.answer.strip(), "correct": got,
                            "in_view": where["in_view"], "came_back": where["came_back"], "pages": where["detail"]})
            print(f"     {fact.path} ({fact.language}) {fact.question}\n       expected {fact.code}; answer "
                  f"{final.answer.strip()[:70]!r}: {'CORRECT' if got else 'wrong'}; {page} ({where['detail']})")
        counters = final.counters
        right = [a for a in answers if a["correct"]]
        wrong = [a for a in answers if not a["correct"]]
        because = [a for a in right if a["came_back"]]
        print(f"\nthe model got {len(right)} of {len(answers)} facts"
              + (f" ({', '.join(a['expected'] + ' from ' + a['file'] for a in right)})" if right else "")
              + (f"; {len(because)} of them because the page came back for the question" if right else "")
              + (f"; it did not get {', '.join(a['expected'] + ' from ' + a['file'] for a in wrong)}" if wrong else "")
              + f". The fact's page was in attention for {sum(a['in_view'] for a in answers)} of {len(answers)}"
              " questions: a page in view is no promise that SmolLM2-135M copies the value out of a "
              f"{args.budget}-token view.")
        print(f"peak attention {counters['peak_attention_tokens']} of {args.budget} tokens over a "
              f"{final.session_tokens}-token session; {counters['evicted_pages']} pages evicted, "
              f"{counters['restored_pages']} restored; model_forward_tokens {counters['model_forward_tokens']} == "
              f"new_prefill {counters['new_prefill_tokens']} + decoded {counters['decoded_tokens']}; "
              f"historical_forward_during_restore {counters['historical_forward_during_restore']}")
        plot(run.turns, args.budget, out / "attention.png")
        (out / "turns.json").write_text(json.dumps([asdict(t) for t in run.turns], indent=1, ensure_ascii=False))
        print(f"plot: {out / 'attention.png'}; per-turn record: {out / 'turns.json'}")
        summary = {"session_tokens": final.session_tokens, "peak_attention_tokens": counters["peak_attention_tokens"],
                   "budget_tokens": args.budget, "turns": len(run.turns), "evicted_pages": counters["evicted_pages"],
                   "restored_pages": counters["restored_pages"],
                   "model_forward_tokens": counters["model_forward_tokens"],
                   "new_prefill_tokens": counters["new_prefill_tokens"], "decoded_tokens": counters["decoded_tokens"],
                   "historical_forward_during_restore": counters["historical_forward_during_restore"],
                   "facts_asked": len(answers), "facts_correct": len(right), "facts_in_view":
                   sum(a["in_view"] for a in answers), "facts_correct_after_restore": len(because),
                   "facts": answers}
        print(json.dumps(summary, ensure_ascii=False))
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
