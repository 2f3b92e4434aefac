"""`python -m benchmarks.sessions` as a user runs it, on tiny-llama at a small size (slow: ~20 s): a
branch of a stored session prefills only what follows the fork, keeps the forward accounting, and
the benchmark reports every figure it promises in its last line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_sessions_benchmark_reports_a_branch_that_prefills_under_a_tenth() -> None:
    run = subprocess.run([sys.executable, "-m", "benchmarks.sessions", "--model", "tiny-llama", "--tokens", "3000",
                          "--budget", "1024", "--decode-tokens", "32"], cwd=REPO, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    branch = result["branches"]["3000"]
    assert branch["branches"] == 1 and branch["historical_forward"] == 0 and branch["forward_invariant"]
    assert branch["parent_tokens"] >= 3000 and result["branch_prefill_fraction"] <= 0.1
    assert branch["prefilled_tokens"] < 0.1 * branch["prompt_tokens"]
    assert result["switch_ms_p95"] < result["switch_from_store_ms_p50"]   # a resident switch moves no page
    for key in ("branch_ttft_ms", "switch_ms_p50", "switch_ms_p95", "switch_from_store_ms_p95", "decode_speedup_2",
                "decode_speedup_4", "decode_speedup_4_unbatched",
                "ttft_ratio_busy", "other_processes_cpu_share"):
        assert isinstance(result[key], float | int), (key, result[key])
    assert result["switch_samples"] == 12 and set(result["decode_tok_s"]) == {"1", "2", "4"}
    assert set(result["decode_tok_s_unbatched"]) == {"1", "2", "4"}
