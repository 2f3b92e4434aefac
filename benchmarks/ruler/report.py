"""RULER's scores, the cells of the result, the tables, the plot and docs/results/ruler.md.

Scores per answer:
  recall        RULER's string-match recall of the greedy answer, as the paper scores each task:
                "all", the share of the expected values found in the answer (every task here);
                "part", 1 when any is (the paper's QA tasks, not generated here)
  recall_at_1   likelihood recall over the answer's own cache: each expected value counts when its
                candidate answer (RULER's answer prefix, then the value) is more likely than every
                candidate that is not expected (a tie counts against it); the share of expected
                values that do. With one expected value this is recall@1 among the 12 candidates.
  needle_in_view  the share of the asked-for needles whose tokens were all in attention when the
                answer started (kv-elision's servers); each listed needle is reported in `needles`
  all_in_view   the share of samples with every asked-for needle in attention (a chain's every
                link, a multi-value question's every value)

A cell (model, task, arm and form, length) holds the means over its samples, the median time to
first token, the sample count and its status: "ok", "past window" (a full-context arm past the
model's trained window: not run), "not built" (llama.cpp), or the error that stopped it.

Depends on benchmarks.stats.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path
from statistics import fmean
from typing import Any

from benchmarks.stats import percentile

PAST_WINDOW = "past window"
NOT_BUILT = "not built"
NOT_PLANNED = "not in the plan"


def string_match(answer: str, expected: Sequence[str], metric: str) -> float:
    """RULER's recall: case-insensitive substring matches of the expected values in the answer."""
    text = answer.lower()
    hits = [value.lower() in text for value in expected]
    return float(any(hits)) if metric == "part" else sum(hits) / len(hits)


def likelihood_recall(logprobs: Sequence[float], expected: int) -> float:
    """The share of the first `expected` candidates more likely than every other candidate."""
    wrong = max(logprobs[expected:], default=float("-inf"))
    return sum(lp > wrong for lp in logprobs[:expected]) / expected


def length_label(tokens: int) -> str:
    return f"{tokens // 1024}k"


def cell(records: list[dict[str, Any]], status: str = "ok") -> dict[str, Any]:
    """The figures of one cell from its samples' records."""
    if not records:
        return {"recall": None, "recall_at_1": None, "needle_in_view": None, "all_in_view": None,
                "ttft_ms_p50": None, "samples": 0,
                "status": status, "needles": []}
    at1 = [r["recall_at_1"] for r in records if r["recall_at_1"] is not None]
    targets = [n["in_view"] for r in records for n in r["needles"] if n["target"] and n["in_view"] is not None]
    every = [all(n["in_view"] for n in r["needles"] if n["target"]) for r in records
             if any(n["target"] and n["in_view"] is not None for n in r["needles"])]
    return {"recall": round(fmean(r["recall"] for r in records), 3),
            "recall_at_1": round(fmean(at1), 3) if at1 else None,
            "needle_in_view": round(fmean(targets), 3) if targets else None,
            "all_in_view": round(fmean(every), 3) if every else None,
            "ttft_ms_p50": round(percentile([r["ttft_ms"] for r in records], 50)),
            "samples": len(records), "status": status,
            "needles": [[{"target": n["target"], "in_view": n["in_view"]} for n in r["needles"]] for r in records]}


def task_mean(cells: list[dict[str, Any]], key: str) -> float | None:
    """The mean over tasks of one figure, None when a task has none (not run, or not measured)."""
    values = [c[key] for c in cells]
    return None if not values or any(v is None for v in values) else fmean(values)


def table(result: dict[str, Any], key: str, lengths: list[int], tasks: list[str]) -> str:
    """RULER's table layout: a row per model and arm, a column per length, the mean over `tasks`
    (x100), then the mean over the lengths run."""
    heads = [length_label(n) for n in lengths]
    rows = [f"| model | arm / form | {' | '.join(heads)} | avg |", "|---|---|" + "---|" * (len(heads) + 1)]
    for model, per_model in result["models"].items():
        chosen = [per_model["tasks"][t] for t in tasks]
        for arm in chosen[0]["arms"] if chosen else []:
            values: list[str] = []
            run: list[float] = []
            for label in heads:
                cells = [t["arms"][arm]["lengths"][label] for t in chosen]
                mean = task_mean(cells, key)
                if mean is None:
                    status = next((c["status"] for c in cells if c["status"] != "ok"), "-")
                    values.append(status if status in (PAST_WINDOW, NOT_BUILT) else "-")
                else:
                    run.append(mean)
                    values.append(f"{100 * mean:.1f}")
            avg = f"{100 * fmean(run):.1f}" if run else "-"
            rows.append(f"| {model} | {arm} | {' | '.join(values)} | {avg} |")
    return "\n".join(rows)


def tiers(plan: dict[int, tuple[tuple[str, ...], int]]) -> list[tuple[list[str], list[int]]]:
    """Each set of tasks the plan runs at some length, largest first, with every length that runs
    all of them: the summary tables average over one set, so a column never mixes other tasks."""
    sets = sorted({tasks for tasks, _ in plan.values()}, key=len, reverse=True)
    return [(list(tasks), [n for n, (run, _) in plan.items() if set(tasks) <= set(run)]) for tasks in sets]


def task_table(result: dict[str, Any], key: str, lengths: list[int]) -> str:
    """Per task: a row per model, task and arm, a column per length (x100)."""
    heads = [length_label(n) for n in lengths]
    rows = [f"| model | task | arm / form | {' | '.join(heads)} |", "|---|---|---|" + "---|" * len(heads)]
    for model, per_model in result["models"].items():
        for task, per_task in per_model["tasks"].items():
            for arm, per_arm in per_task["arms"].items():
                values = []
                for label in heads:
                    c = per_arm["lengths"][label]
                    values.append(c["status"] if c[key] is None and c["status"] in (PAST_WINDOW, NOT_BUILT)
                                  else "·" if c["status"] == NOT_PLANNED else "-" if c[key] is None
                                  else f"{100 * c[key]:.0f}")
                rows.append(f"| {model} | {task} | {arm} | {' | '.join(values)} |")
    return "\n".join(rows)


def plot(result: dict[str, Any], lengths: list[int], tasks: list[str], path: Path) -> None:
    """Recall (greedy, and likelihood) against length, the mean over `tasks`, a line per arm and
    form, a row per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(result["models"])
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4.2 * len(models)), dpi=110, squeeze=False)
    heads = [length_label(n) for n in lengths]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, model in enumerate(models):
        chosen = [result["models"][model]["tasks"][t] for t in tasks]
        arms = list(chosen[0]["arms"]) if chosen else []
        kinds = list(dict.fromkeys(arm.rsplit(" / ", 1)[0] for arm in arms))
        for col, (key, title) in enumerate((("recall", "greedy answer: RULER's string-match recall"),
                                            ("recall_at_1", "likelihood recall@1 over the answer's cache"))):
            ax = axes[row][col]
            for arm in arms:
                xs, ys = [], []
                for n, label in zip(lengths, heads, strict=True):
                    mean = task_mean([t["arms"][arm]["lengths"][label] for t in chosen], key)
                    if mean is not None:
                        xs.append(n)
                        ys.append(100 * mean)
                if xs:
                    kind, form = arm.rsplit(" / ", 1)
                    ax.plot(xs, ys, marker="o", color=colors[kinds.index(kind) % len(colors)],
                            linestyle="-" if form == "ruler" else "--", label=arm)
            ax.set_xscale("log", base=2)
            ax.set_xticks(lengths, heads)
            ax.set_ylim(-3, 103)
            ax.set_xlabel("sample length (tokens)")
            ax.set_ylabel("mean over tasks (%)")
            ax.set_title(f"{model}: {title}\n(mean over {', '.join(tasks)})", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def machine() -> str:
    """The CPU, its cores and memory, the OS and Python: what the figures were measured on."""
    cpu = platform.processor() or platform.machine()
    memory = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        total = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemTotal"))
        memory = f", {int(total.split()[1]) / 2**20:.0f} GiB of memory"
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores{memory}, {platform.system()} {platform.release()}, Python " \
           f"{platform.python_version()}"


DIFFERENCES = """\
* **No essays.** The paper's essay haystack (Paul Graham's essays) is not shipped; the tasks
  that use it (niah_single_2, niah_single_3, niah_multikey_1, niah_multivalue, niah_multiquery)
  use a repetitive service log of our own (`2024-05-14T08:00:01Z INFO http worker-3 GET
  /api/v1/items/4821 status=200 took=12ms`, six shapes, numbers of at most 4 digits, so a needle's
  7-digit value is the only one of its kind). The noise haystack ("The grass is green. The sky is
  blue. ...") and the haystack made of needles are the paper's.
* **No QA.** The paper's two QA tasks need SQuAD and HotpotQA, which this project does not ship;
  they are left out, so "part" string matching (theirs) is implemented but unused.
* **Word keys** are two words of Debian's word list (`wamerican`) joined by a hyphen; the paper
  draws its word keys from another list. Values: 7-digit numbers and version-4 UUIDs, as in the
  paper; variables are 5 capital letters with 5-digit values; coded words are 5 random letters.
* **Lengths** are counted in the served model's own tokens on the agent's form (the longer one)
  plus the answer's cap; RULER's form of the same sample is shorter by the agent's system prompt,
  tool schema and per-file tool-call wrapping (about 350 tokens at 4k, 5 % at 128k).
* **Answers are capped** shorter than the paper's (32-80 tokens by task against 30-128) and the
  answer prefix is not put into the model's turn (the chat API has no way to); it is the lead-in
  of every candidate the likelihood measure scores.
* **The likelihood measure is ours.** Beside RULER's string match, each question is scored by the
  likelihood of each candidate value over the exact cache the answer is read from; candidates are
  the expected values, then values planted in the text (the other needles', the rarer words), then
  made-up values of the same form, 12 in all (20 for common words).
* **The agent's form is ours.** The same text, cut at unit boundaries into files of about 1,024
  tokens, each delivered as the result of a `read` tool call in a turn of its own (the model's
  one-token reply to each is left out of the next request, as an agent that called its next tool
  would), then the question as a user message. RULER's form is one user message.
* **Samples per cell** are far fewer than the paper's 500, and not every task runs at every
  length: the full run has to fit 3 hours on 2 CPU cores (the plan above; a 128k-token sample
  alone is minutes of prefill per arm and form). A cell of 1 or 2 samples is a reading, not an
  estimate; the summary tables average only over tasks run at each of their lengths.
"""


def summaries(result: dict[str, Any], key: str, plan: dict[int, tuple[tuple[str, ...], int]]) -> str:
    out = []
    for tasks, lengths in tiers(plan):
        what = tasks[0] if len(tasks) == 1 else f"the {len(tasks)} tasks {', '.join(tasks)}"
        out.append(f"Mean over {what}:\n\n{table(result, key, lengths, tasks)}")
    return "\n\n".join(out)


def markdown(result: dict[str, Any], plan: dict[int, tuple[tuple[str, ...], int]], command: str, started: str,
             seconds: float, png: str) -> str:
    """docs/results/ruler.md: what was run, where, and the tables."""
    quick = " (`--quick`: a smoke run, not the benchmark's figures)" if result.get("quick") else ""
    share = result.get("other_processes_cpu_share")
    load = "not measured" if share is None else f"{100 * share:.0f} % of the CPU went to other processes"
    lengths = list(plan)
    planned = "; ".join(f"{length_label(n)}: {', '.join(tasks)} ({k} sample{'s' if k > 1 else ''} per cell)"
                        for n, (tasks, k) in plan.items())
    return f"""# RULER on kv-elision{quick}

`python -m benchmarks.ruler` plays RULER's synthetic long-context tasks (Hsieh et al., 2024,
arXiv 2404.06654; the generator is written from the paper's task definitions, see
`benchmarks/ruler/tasks.py`) against kv-elision as shipped at attention budgets of 2,048 and 4,096
tokens, against the full context in the same runtime (budget above the sample, up to the model's
trained window) and against llama.cpp's full context (when `llama-server` is built). Every sample
is delivered twice: RULER's form (one user message, the question at its end) and an agent's form
(the text read as files through tool calls, then the question as a user message).

* command: `{command}`
* machine: {machine()}
* date: {started} (UTC), {seconds / 60:.0f} minutes; {load}
* llama.cpp: {result.get("llama_cpp")}
* plan: {planned}
* plot: `{png}`

Figures are x100; "past window": a full-context sample longer than the model's trained window
(SmolLM2-135M 8k, Gemma 3 270M 32k), not run; "not built": llama.cpp's server was not built; "·"
(per task): not in the plan; "-": not measured for that arm (llama.cpp reads no cache of ours).

## Greedy answer: RULER's string-match recall

{summaries(result, "recall", plan)}

## Likelihood recall@1 over the answer's own cache

{summaries(result, "recall_at_1", plan)}

## The asked-for needles in attention when the answer started

{summaries(result, "needle_in_view", plan)}

## Samples with every asked-for needle in attention

{summaries(result, "all_in_view", plan)}

## Per task, greedy recall

{task_table(result, "recall", lengths)}

## Per task, likelihood recall@1

{task_table(result, "recall_at_1", lengths)}

## Per task, the asked-for needles in attention

{task_table(result, "needle_in_view", lengths)}

## Per task, samples with every asked-for needle in attention

{task_table(result, "all_in_view", lengths)}

## Where this differs from RULER

{DIFFERENCES}"""
