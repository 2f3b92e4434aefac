"""Retrieval on the demo workload (slow): facts planted once in early units, asked about many
units later, after their pages went cold. Real SmolLM2 weights, real contextd, the real engine.

The model-native attention selector must bring the fact's page back for most of them, in every
language of the workload; the default retention (recency) brings back none. The embedded
controllers are measured by `python -m benchmarks.selectors` (minutes per model here), not here.
"""

from __future__ import annotations

import pytest

from benchmarks.selectors import measure

pytestmark = pytest.mark.slow


def test_attention_brings_cold_facts_back_in_every_language_and_recency_does_not() -> None:
    summary = measure("smollm2-135m", files=16, facts_per_file=2, budget=4096, controller_models=[], deadline_s=1.0)
    attention, recency = summary["attention"], summary["recency"]
    assert attention["facts"] >= 20 and len(summary["_workload"]["languages"]) == 6, summary
    assert recency["hits"] == 0, recency
    assert attention["hit_rate"] >= 0.6, attention
    assert all(not tally.startswith("0/") for tally in attention["by_language"].values()), attention
    assert attention["p95_ms"] <= 1000, attention
