"""The model's eviction advice and the attention order on an agent task, end to end (slow):
`python -m benchmarks.eviction` run as a user runs it, on the real SmolLM2 weights (both orders
read them: tiny-llama's random weights would rank pages at random), a real contextd and the real
engine, at a smaller session than the benchmark's default; its last line is the JSON the test
reads.

The user asks about a file the agent has just read; the agent reads on, tool results only, for a
budget's worth of tokens, then answers. With the pager's own order the file's page is gone by
then (by construction: benchmarks.eviction kept 0 of 51 on seeds 101 and 103, so that arm is not
run here); with the advice it must still be there. The session keeps the forward accounting and
never runs a forward over history.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_page_a_task_is_about_stays_while_the_agent_reads_on() -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks.eviction", "--shapes", "prose", "--seeds", "1",
                          "--tokens", "7000", "--budgets", "2048", "--orders", "model,attention"], cwd=REPO,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    model, attention = result["rows"]
    assert model["order"] == "model" and model["questions"] >= 1, model
    assert model["kept"] == model["questions"], model
    assert model["controller_forward_tokens"] > 0, model
    # The attention order reads the forwards the turns make anyway: no scoring forward, an order
    # computed on the turns that evicted, and the same accounting.
    assert attention["order"] == "attention" and attention["questions"] == model["questions"], attention
    assert attention["controller_forward_tokens"] == 0 and attention["advise_p95_ms"] > 0, attention
    for row in (model, attention):
        assert row["historical_forward"] == 0 and row["forward_invariant"], row
    cost = result["attention_watch_cost"]
    assert cost["chunk_tokens"] == 512 and cost["forward_p50_ms"] > 0 and cost["watched_forward_p50_ms"] > 0
