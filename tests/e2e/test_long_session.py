"""A session of more than 30,000 tokens through a real server with a 2,048-token budget: fifteen
budgets' worth, so most of the session lives cold in the store and every rule is exercised hundreds
of times.

The model is tiny-llama (random weights, SmolLM2's tokenizer and chat template): the rules checked
here (the budget, the forward accounting, durable cold pages) do not read the weights, and SmolLM2
took 266 s of a parallel suite run for this session alone; SmolLM2 serves Pi and the server tests,
and the million-token run is benchmarks.scale's."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from contextd.client import Client
from contextd.wire import PageState
from controller.pager import PAGE_TOKENS
from harness.agent import AgentRun
from harness.workload import evidence_files
from serving.launcher import ServerProcess

BUDGET = 2048
SESSION_TOKENS = 30_000


@pytest.mark.slow
def test_thirty_thousand_tokens_through_a_2048_token_budget() -> None:
    root = Path(tempfile.mkdtemp(prefix="kvl-", dir="/tmp"))
    server = ServerProcess(root=root, model="tiny-llama", budget=BUDGET, extra=("--max-new-tokens", "8")).start()
    try:
        run = AgentRun(server, "long", max_tokens=8)
        run.run(evidence_files(80, tokens_per_file=1100), until_tokens=SESSION_TOKENS)
        last = run.turns[-1]
        counters = last.counters
        assert last.session_tokens >= SESSION_TOKENS
        assert max(t.attention_tokens for t in run.turns) <= BUDGET
        assert 0 < counters["peak_attention_tokens"] <= BUDGET
        assert counters["historical_forward_during_restore"] == 0
        assert counters["model_forward_tokens"] == \
            counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
        assert counters["reprefilled_tokens"] == 0 and counters["rebuilds"] == 0
        # every turn prefilled only what it added
        assert counters["new_prefill_tokens"] == sum(t.prefilled for t in run.turns)
        assert last.cold >= (SESSION_TOKENS - BUDGET) // PAGE_TOKENS and counters["evicted_pages"] >= last.cold
        with Client(server.socket) as client:
            cold = client.query_pages("long", [PageState.COLD])
            assert len(cold) == last.cold
            assert all(p.locator and len(p.checksum) == 32 and p.byte_size > 0 for p in cold)
            verified = client.verify("long")
            assert not verified.corrupt and verified.pages_ok >= len(cold)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
