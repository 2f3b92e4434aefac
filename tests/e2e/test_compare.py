"""A small `python -m benchmarks.compare` end to end: the real Pi 1.6 plays a three-file session
against `kv-elision serve` (the hybrid selector, the server's default) and against llama-server
(Pi's compaction, and the full context), and the run prints the table and the JSON line.

llama-server is never built here: the test runs only where `python -m benchmarks.llamacpp` (or
`make compare`) has built it into the cache folder, or KV_ELISION_LLAMA_SERVER names one.
The figures are the servers' own counters; what the model answers is not asserted (SmolLM2-135M),
only that every arm played the whole script and that each arm's accounting holds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.fact_script import answers_with, make_script
from harness.pi import PI_BIN

REPO = Path(__file__).resolve().parents[2]
# The arms' names in the JSON line (benchmarks/compare/arms.py).
HYBRID = "kv-elision / hybrid"
COMPACTION = "llama.cpp + Pi compaction"
FULL = "llama.cpp, full context"
TRUNCATION = "llama.cpp + truncation"


def test_script_is_deterministic_and_codes_are_unique() -> None:
    a, b = make_script(7, 6, 300, 3), make_script(7, 6, 300, 3)
    assert a == b
    assert [s.kind for s in a.steps] == ["objective"] + ["file"] * 6 + ["question"] * 3
    assert len({f.code for f in a.facts}) == 6
    for step in a.steps[1:7]:
        assert step.fact is not None and step.fact.statement in step.message
    assert answers_with("The key is 3471.", "3471") and not answers_with("13471", "3471")


@pytest.mark.slow
@pytest.mark.skipif(not PI_BIN.exists(), reason=f"Pi is not installed at {PI_BIN} (cd extension && npm ci)")
@pytest.mark.usefixtures("llama_server_built")
def test_compare_quick_run_prints_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--quick", "--files", "3", "--questions", "2",
         "--max-tokens", "16", "--arms", "hybrid,compaction,full,truncation", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    summary = json.loads(lines[-1])
    assert "| arm | correct | evidence in view | prompt tokens processed |" in run.stdout
    arms = summary["arms"]
    assert {HYBRID, COMPACTION, FULL, TRUNCATION} <= set(arms)
    assert {arms[name]["role"] for name in arms} >= {"default", "compaction", "full", "fresh", "recency", "removed"}
    for name in (HYBRID, COMPACTION, FULL):
        fields = arms[name]
        assert {"correct", "facts", "in_view", "prompt_tokens", "wall_s", "ttft_p50_ms", "ttft_p95_ms",
                "compactions"} <= set(fields)
        assert fields["facts"] == 2 and 0 <= fields["correct"] <= 2 and 0 <= fields["in_view"] <= 2
        assert fields["prompt_tokens"] > 0 and fields["wall_s"] > 0
    # The whole three-file session fits llama-server's trained context: every fact was in the prompt.
    assert arms[FULL]["in_view"] == 2 and arms[FULL]["compactions"] == 0
    # kv-elision's prompt tokens are its own prefill counter, and the accounting invariant holds.
    final = summary["kv_final"]["7"][f"{HYBRID} [s0]"]
    assert final["prompt"] == arms[HYBRID]["prompt_tokens"]
    assert final["forward"] == final["prompt"] + final["decoded"] + final["blend"] and final["historical"] == 0
    assert final["blend"] > 0   # the shipped default recomputes part of each turn's view
    assert final["rebuilds"] == 0 and final["reprefilled"] == 0
    # This llama-server refuses a prompt over -c even with --context-shift: reported, not run.
    assert "status" in arms[TRUNCATION]
    assert (out / "compare.png").stat().st_size > 0
    turns = json.loads((out / "turns.json").read_text())
    assert {t["arm"] for t in turns} == {HYBRID, COMPACTION, FULL}
