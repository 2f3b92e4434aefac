"""Retrieval on every workload shape, on a seed nobody tuned on (slow): real contextd, the real
engine (`python -m benchmarks.selectors` at a smaller session size than its default, run as a user
runs it; its last line is the JSON the test reads).

The selectors asserted here (recency, bm25, hybrid) read token ids and page states, never the
model's weights, so the sessions are built on tiny-llama (random weights, SmolLM2's tokenizer and
chat template): the same pages, questions and restores as on SmolLM2 in a seventh of the time
(seed 102, budget 2048, 5,000 tokens, prose, boilerplate and code: every row equal but the
timings, 17 s against 116 s). The model-reading attention selector is the benchmark's to measure.

The default (hybrid) selector must bring back what most questions need on every shape, never do
worse than lexical rarity alone, and decide in well under the foreground budget. Recency brings
back nothing (every fact is cold by construction). Measured with this very configuration
(`python -m benchmarks.selectors --seeds 102 --budgets 2048 --tokens 5000`): the hybrid selector
found all 56 questions' pages, bm25 alone 50, attention 34 (docs/controller.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.shapes import HELD_OUT_SEEDS, SHAPES

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_default_selector_finds_what_each_shape_of_session_needs_on_an_untuned_seed() -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks.selectors", "--seeds", str(HELD_OUT_SEEDS[1]),
                          "--budgets", "2048", "--tokens", "5000", "--model", "tiny-llama",
                          "--selectors", "recency,bm25,hybrid"], cwd=REPO, capture_output=True, text=True,
                         timeout=3600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["model"] == "tiny-llama"
    rows = {(r["selector"], r["shape"]): r for r in result["rows"]}
    for shape in SHAPES:
        hybrid, recency, bm25 = rows["hybrid", shape], rows["recency", shape], rows["bm25", shape]
        assert hybrid["questions"] >= 5, hybrid
        assert recency["hits"] == 0, recency
        assert hybrid["hit_rate"] >= 0.8, hybrid
        assert hybrid["hits"] >= bm25["hits"], (hybrid, bm25)
        assert hybrid["p95_ms"] <= 100, hybrid


def test_answers_are_read_per_selector_from_a_branch_of_the_same_state() -> None:
    """`--answers`: each counted question answered once per selector in a branch of the built
    session. The branch prefills only the question and the open last page (never the history),
    the hybrid's view holds the fact exactly where its probe found it, and recency's never does:
    asked right after the hybrid's branch of the same question, it would hold the fact if that
    branch, left stored, had become the next one's parent."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.selectors", "--seeds", "1", "--shapes", "prose,code",
                          "--budgets", "2048", "--tokens", "3000", "--model", "tiny-llama",
                          "--selectors", "hybrid,recency", "--answers"], cwd=REPO, capture_output=True, text=True,
                         timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    for row in result["rows"]:
        assert row["questions"] >= 3 and row["answered"] == row["questions"], row
        assert row["ranked_first"] <= row["answered"] and row["answer_logprob"] < 0, row
        assert row["answer_in_view"] == (row["hits"] if row["selector"] == "hybrid" else 0), row
    for session in result["sessions"]:
        assert 0 < session["branch_prefill_max"] < 2 * 128, session
        assert session["historical_forward"] == 0 and session["forward_invariant"], session
    for name, budgets in result["summary"].items():   # recall@1: the questions whose right answer ranked first
        rows = [r for r in result["rows"] if r["selector"] == name]
        assert budgets["2048"]["recall_at_1"] == pytest.approx(
            sum(r["ranked_first"] for r in rows) / sum(r["answered"] for r in rows), abs=1e-3), budgets
