"""`python -m benchmarks.compare` measuring answers by likelihood, end to end, without llama.cpp.

The real Pi 1.6 plays a short session against `kv-elision serve` as shipped; before each question
the benchmark asks the server to score every planted value over the cache the answer is read
from, then scores the reference views (full, fresh, recency, removed) afresh with the same
weights, and (`--branches`) the question answered in a branch of the session per selector. The
run is a subprocess: the figures are what the benchmark prints, and SmolLM2-135M's answers are
not asserted, only that every arm has them, per role, on held-out seeds, and that the branch with
the arm's own selector reads what the arm read.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PI_BIN = REPO / "extension" / "node_modules" / ".bin" / "pi"


@pytest.mark.slow
@pytest.mark.skipif(not PI_BIN.exists(), reason=f"Pi is not installed at {PI_BIN} (cd extension && npm ci)")
def test_compare_reports_answers_by_likelihood_per_role(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--quick", "--seeds", "11", "--files", "3", "--questions", "1",
         "--max-tokens", "8", "--greedy-tokens", "4", "--arms", "hybrid", "--branches", "hybrid,recency",
         "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = json.loads([line for line in run.stdout.splitlines() if line.strip()][-1])
    arms = summary["arms"]
    roles = {name: figures["role"] for name, figures in arms.items()}
    assert sorted(roles.values()) == ["branch", "branch", "default", "fresh", "full", "recency", "removed"]
    for figures in arms.values():
        held_out = figures["held_out"]
        assert held_out["questions"] == 1 and held_out["sessions"] == 1 and held_out["seeds"] == [11]
        assert held_out["recall_at_1"] in (0.0, 1.0) and held_out["answer_logprob_mean"] < 0   # one question
        assert held_out["recall_ci95"][0] <= held_out["recall_at_1"] <= held_out["recall_ci95"][1]
        assert held_out["correct"] in (0, 1) and figures["tuning"]["questions"] == 0
    default = next(f for f in arms.values() if f["role"] == "default")
    removed = next(f for f in arms.values() if f["role"] == "removed")
    # The fact in view is what makes its value likely: the same view with the fact's page taken out
    # reads the right value as less likely.
    assert default["held_out"]["answer_logprob_mean"] > removed["held_out"]["answer_logprob_mean"]
    full = next(f for f in arms.values() if f["role"] == "full")
    assert full["held_out"]["view_tokens_mean"] > default["held_out"]["view_tokens_mean"]
    final = next(iter(summary["kv_final"]["11"].values()))
    assert final["forward"] == final["prompt"] + final["decoded"] + final["blend"] and final["historical"] == 0
    assert "### Answers by likelihood" in run.stdout
    same = arms["kv-elision / hybrid / branch: hybrid"]["held_out"]
    assert same["recall_at_1"] == default["held_out"]["recall_at_1"]
    assert same["answer_logprob_mean"] == pytest.approx(default["held_out"]["answer_logprob_mean"], abs=1e-3)
    recency = arms["kv-elision / hybrid / branch: recency"]["held_out"]
    pair = summary["paired_branches"]["kv-elision / hybrid / branch: recency - kv-elision / hybrid / branch: hybrid"]
    assert pair["questions"] == 1
    assert pair["recall_at_1_diff"] == pytest.approx(recency["recall_at_1"] - same["recall_at_1"])
    assert pair["logprob_diff"] == pytest.approx(recency["answer_logprob_mean"] - same["answer_logprob_mean"], abs=1e-3)
