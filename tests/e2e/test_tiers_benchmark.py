"""`python -m benchmarks.tiers` as a user runs it, on tiny-llama at a small size, against the real
Ceph RGW it starts: every figure it promises is in its last line, restores from either tier run
no forward pass, pages really came back from the object store, and a session handed over to a
second server prefilled only its new question."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.rgw import missing

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_the_tiers_benchmark_restores_from_both_tiers() -> None:
    reason = missing()
    if reason:
        pytest.skip(reason)
    run = subprocess.run([sys.executable, "-m", "benchmarks.tiers", "--model", "tiny-llama", "--tokens", "3000",
                          "--budget", "1024", "--repeats", "3",
                          "--handover-tokens", "3000"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(run.stdout.splitlines()[-1])
    for key in ("restore_over_recompute_local", "restore_over_recompute_remote", "restore_local_ms_p95",
                "restore_remote_ms_p95", "mbps_local", "mbps_remote", "other_processes_cpu_share"):
        assert isinstance(result[key], float | int) and result[key] > 0, (key, result[key])
    assert result["historical_forward_during_restore"] == 0
    assert result["objects_fetched"] >= 3 and result["bytes_moved"] > 0
    assert result["handover_s"] > 0 and result["handover_adoptions"] == 1 and result["handover_bytes"] > 0
    assert result["handover_historical_forward"] == 0 and 0 < result["handover_prefilled_tokens"] < 40
