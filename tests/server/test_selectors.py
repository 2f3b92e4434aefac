"""Selectors in serving: a real `kv-elision serve` process on the real SmolLM2 weights, the
default hybrid selector with the page listing a user reads, the re-ranker's scoring over stored
pages and the attention selector's index (slow: minutes on two cores).

Hit rates over many planted facts are asserted in tests/e2e/test_retrieval.py; here each
selector runs where a user meets it, and the pager's accounting stays exact.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.shapes import TUNING_SEEDS, make
from harness.workload import TOOLS, agent_turns, evidence_files, opening_messages
from serving.launcher import ServerProcess
from tests.server.test_server import assistant

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def grow(server: ServerProcess, session: str, files: int) -> list[dict[str, Any]]:
    """The agent workload, one file per turn, far past the budget."""
    messages = opening_messages()
    for added in [[], *agent_turns(evidence_files(files, tokens_per_file=600, facts_per_file=1))]:
        messages = [*messages, *added]
        reply = server.chat(messages, session=session, tools=TOOLS, max_tokens=4)
        assert reply.status == 200, reply.body
        messages.append(assistant(reply))
    return messages


def exact(stats: dict[str, Any]) -> None:
    counters = stats["counters"]
    assert counters["model_forward_tokens"] == \
        counters["new_prefill_tokens"] + counters["decoded_tokens"] + counters["blend_forward_tokens"]
    assert counters["historical_forward_during_restore"] == 0
    assert stats["attention_tokens"] <= stats["budget_tokens"]


def test_the_default_selector_brings_the_fact_back_and_the_page_listing_shows_it(server_factory: Any) -> None:
    server: ServerProcess = server_factory("smollm2-135m", 1536)
    messages = grow(server, "h", files=4)
    before = server.get("/v1/kv/pages?session=h&text=1").body
    where = {f.answer: [p["index"] for p in before["pages"] if f.answer in p["text"]]
             for file in evidence_files(4, tokens_per_file=600, facts_per_file=1) for f in file.facts}
    fact = next(f for file in evidence_files(4, tokens_per_file=600, facts_per_file=1) for f in file.facts
                if where[f.answer] and all(before["pages"][i]["state"] == "cold" for i in where[f.answer]))
    holding = where[fact.answer]
    reply = server.chat([*messages, {"role": "user", "content": fact.question}], session="h", tools=TOOLS,
                        max_tokens=4)
    assert reply.status == 200, reply.body
    listing = server.get("/v1/kv/pages?session=h").body
    assert listing["last_selection"].startswith("hybrid: restore "), listing["last_selection"]
    back = [p for p in listing["pages"] if p["moved_turn"] == listing["turn"] and p["lease_until_turn"] is not None]
    assert len(back) == listing["restored_this_turn"] > 0
    assert any(p["index"] in holding for p in back), (holding, back)
    assert all("text" not in p for p in listing["pages"])
    assert [p["token_start"] for p in listing["pages"]] == [128 * i for i in range(len(listing["pages"]))]
    assert server.get("/v1/kv/pages?session=nobody").status == 404
    assert server.get("/v1/kv/pages?session=h&text=yes").status == 400
    stats = server.stats("h")
    assert stats["lexical_index_pages"] > 0 and stats["key_index_pages"] == 0  # no key index unless asked for
    exact(stats)


def test_rerank_selector_scores_the_hybrids_choice_over_stored_pages(server_factory: Any) -> None:
    """Near-identical boilerplate files make the hybrid choose several candidates for a question:
    the serving model scores them over their stored K/V in a scratch session (counted as
    controller forward tokens, never as the session's forwards), and keeps fewer pages."""
    server: ServerProcess = server_factory("smollm2-135m", 1536, "--selector", "rerank")
    workload = make("boilerplate", TUNING_SEEDS[0], 5000)
    messages = workload.messages()
    reply = server.chat(messages, session="r", tools=workload.tools, max_tokens=1)
    assert reply.status == 200, reply.body
    messages.append(assistant(reply))
    scored = hits = asked = 0
    for question in workload.questions:
        pages = server.get("/v1/kv/pages?session=r&text=1").body["pages"]
        holding = [p["index"] for p in pages if question.answer in p["text"]]
        if not holding or any(pages[i]["state"] != "cold" for i in holding):
            continue
        before = server.stats("r")["counters"]
        reply = server.chat([*messages, workload.question_message(question)], session="r", tools=workload.tools,
                            max_tokens=1)
        assert reply.status == 200, reply.body
        messages += [workload.question_message(question), assistant(reply)]
        after = server.stats("r")
        note = after["last_selection"]
        assert note.startswith("rerank: restore "), note
        listing = server.get("/v1/kv/pages?session=r").body
        back = {p["index"] for p in listing["pages"] if p["moved_turn"] == listing["turn"]}
        asked += 1
        hits += set(holding) <= back
        tokens = after["counters"]["controller_forward_tokens"] - before["controller_forward_tokens"]
        if "candidates kept" in note:
            scored += 1
            assert tokens > 0, (tokens, note)
        else:
            assert tokens == 0, note
        exact(after)
    assert scored and hits >= asked - 1, (scored, hits, asked)


@pytest.mark.parametrize(("flag", "advice"), [(["--selector", "rerank"], "--selector hybrid"),
                                              (["--evict-order", "model"], "--evict-order recency")])
def test_scoring_pages_apart_is_refused_at_start_for_a_model_that_cannot(tmp_path: Path, flag: list[str],
                                                                          advice: str) -> None:
    run = subprocess.run([sys.executable, "-m", "serving.cli", "serve", "--model", "tiny-qwen3-next", *flag,
                          "--root", str(tmp_path / "root"), "--port", "0", "--budget", "2048"],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "full attention" in run.stderr and advice in run.stderr


@pytest.mark.parametrize(("flags", "says"), [
    (["--model", "tiny-llama", "--controller-model", "tiny-llama"], "nothing to do"),
    (["--model", "tiny-qwen3-next", "--evict-order", "model", "--controller-model", "tiny-qwen3-next"],
     "full attention"),
    (["--model", "tiny-llama", "--selector", "rerank", "--controller-model", "no-such-model"], "no-such-model"),
    (["--model", "tiny-llama", "--selector", "rerank", "--controller-model", "tiny-llama",
      "--controller-cache-mb", "-1"], "--controller-cache-mb must be >= 0")])
def test_a_controller_model_that_cannot_serve_is_refused_at_start(tmp_path: Path, flags: list[str], says: str) -> None:
    run = subprocess.run([sys.executable, "-m", "serving.cli", "serve", *flags, "--root", str(tmp_path / "root"),
                          "--port", "0", "--budget", "2048"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 2, run.stderr[-2000:]
    assert says in run.stderr and "Traceback" not in run.stderr, run.stderr[-2000:]


def test_a_controller_model_advises_evictions_for_a_hybrid_model_over_http(server_factory: Any) -> None:
    """Recurrent layers keep the serving model from scoring pages apart; a full-attention controller
    reads the pages' text instead, and the session stays exact."""
    server: ServerProcess = server_factory("tiny-qwen3-next", 2048, "--evict-order", "model",
                                           "--controller-model", "tiny-llama")
    grow(server, "c", files=8)
    stats = server.stats("c")
    assert stats["counters"]["evicted_pages"] > 0
    assert stats["counters"]["controller_forward_tokens"] > 0
    assert stats["last_turn"]["advise_ms"] > 0, stats["last_turn"]   # the advice ordered this turn's evictions
    assert stats["read_ahead_ms"] > 0   # the controller read the pages the turn stored
    exact(stats)


def test_evict_order_model_scores_pages_in_attention_over_http(server_factory: Any) -> None:
    """The flag reaches the engine: sessions past their budget evict with the model's advice (its
    scoring forwards counted apart) and stay exact."""
    server: ServerProcess = server_factory("tiny-llama", 2048, "--evict-order", "model")
    grow(server, "m", files=8)
    stats = server.stats("m")
    assert stats["counters"]["evicted_pages"] > 0
    assert stats["counters"]["controller_forward_tokens"] > 0
    exact(stats)


def test_attention_selector_restores_pages_for_a_question_about_a_cold_fact(server_factory: Any) -> None:
    server: ServerProcess = server_factory("smollm2-135m", 1536, "--selector", "attention")
    messages = grow(server, "a", files=3)
    fact = evidence_files(3, tokens_per_file=600, facts_per_file=1)[0].facts[0]
    before = server.stats("a")
    assert before["pages"]["cold"] > 0 and before["key_index_pages"] > 0
    reply = server.chat([*messages, {"role": "user", "content": fact.question}], session="a", tools=TOOLS,
                        max_tokens=4)
    assert reply.status == 200, reply.body
    after = server.stats("a")
    assert after["last_selection"].startswith("attention: restore "), after["last_selection"]
    assert after["counters"]["restored_pages_turn"] > 0
    assert after["key_index_bytes"] == after["key_index_pages"] * 128 * 3 * 64 * 2  # SmolLM2: 3 KV heads x 64
    exact(after)
