"""The RULER benchmark end to end (slow): `python -m benchmarks.ruler --quick` as a user runs it,
against real `kv-elision serve` processes, real contextd and SmolLM2-135M's real weights; its last
line is the JSON the test reads.

The quick run plays niah_single_1 (a passkey in the noise haystack) and vt (a 4-hop chain of
variable assignments) at 4k tokens, in RULER's form (one user message) and the agent's form
(files read through tool calls, then the question), against kv-elision at a 2,048-token budget
(so pages leave and come back) and against the full context in the same runtime; here without
llama.cpp's arm, which a test of its own plays on the passkey when llama-server is built. The
other lengths run the same code with more text; the full benchmark plays them.

What must hold beyond the JSON's shape: with the whole 4k text in attention SmolLM2 picks the
passkey out of 12 candidates by likelihood far above chance (1 in 12) and every needle is in
view; each needle of a sample is reported, one for the passkey and five for the chain; and the
agent's question, asked after the files were read in earlier turns, is answered sooner than
RULER's one message, whose whole text is prefilled before the first token. A sample is a function
of its seed: printed twice it is the same, and it fits its length in the model's tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path("/usr/share/dict/words").exists(),
                                 reason="the RULER keys need Debian's word list (apt-get install wamerican)")]

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m"
FULL, KV = "full context", "kv-elision 2048"
LLAMA = "llama.cpp full context"
FORMS = ("ruler", "agent")
CELL = {"recall", "recall_at_1", "needle_in_view", "all_in_view", "ttft_ms_p50", "samples", "status", "needles"}


def ruler(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "benchmarks.ruler", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_a_sample_is_the_same_from_the_same_seed_and_fits_its_length() -> None:
    first, again, other = (ruler("--print-sample", spec, "--models", MODEL, timeout=300)
                           for spec in ("niah_multikey_2:4k:1", "niah_multikey_2:4k:1", "niah_multikey_2:4k:2"))
    for run in (first, again, other):
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert first.stdout == again.stdout and first.stdout != other.stdout
    sample = json.loads(first.stdout)
    (message,) = sample["ruler"]
    (needle,) = sample["needles"]
    (value,) = sample["expected"]
    # The haystack is made of needles: the asked one is among many, and is the one holding the value.
    assert message["content"].count("One of the special magic numbers for") > 50
    assert needle["text"] in message["content"] and needle["text"].endswith(f"{value}.")
    assert message["content"].endswith("mentioned in the provided text?")
    files = [m for m in sample["agent"] if m["role"] == "tool"]
    assert len(files) >= 3 and needle["text"] in "".join(f["content"] for f in files)
    assert sample["agent"][-1] == {"role": "user", "content": message["content"].rsplit("\n\n", 1)[1]}
    # Both forms fit 4k with the answer's cap; RULER's form is the shorter.
    assert 3500 < sample["tokens"]["ruler"] < sample["tokens"]["agent"] <= 4096
    assert len(sample["candidates"]) == 12 and sample["candidates"][0].endswith(value)


def string_match(c: dict[str, object]) -> int:
    """RULER's string match over one sample: the share of its expected values the answer spells.
    Returns how many values the sample expects."""
    needles = c["needles"]
    assert isinstance(needles, list) and isinstance(c["recall"], float)
    expected = sum(1 for n in needles[0] if n["target"])
    assert (c["recall"] * expected) == pytest.approx(round(c["recall"] * expected), abs=0.01)
    return expected


@pytest.mark.timeout(3000)
def test_quick_run_reads_the_needles_it_was_given(tmp_path: Path) -> None:
    run = ruler("--quick", "--arms", "kv-2048,full", "--out", str(tmp_path), timeout=2900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(run.stdout.splitlines()[-1])
    tasks = result["models"][MODEL]["tasks"]
    assert set(result["models"]) == {MODEL} and set(tasks) == {"niah_single_1", "vt"}
    for task, per_task in tasks.items():
        assert {f"{arm} / {form}" for arm in (KV, FULL) for form in FORMS} == set(per_task["arms"])
        for arm, per_arm in per_task["arms"].items():
            assert set(per_arm["lengths"]) == {"4k"}
            for length, c in per_arm["lengths"].items():
                assert set(c) == CELL, (task, arm, length)
                assert c["status"] == "ok" and c["samples"] == 1, (task, arm, length, c)
                expected = string_match(c)
                assert c["ttft_ms_p50"] > 0
                # The share of the sample's values ranked first, and of its target needles in attention.
                assert (c["recall_at_1"] * expected) == pytest.approx(round(c["recall_at_1"] * expected), abs=0.01)
                inside = [n["in_view"] for n in c["needles"][0] if n["target"]]
                assert c["needle_in_view"] == pytest.approx(sum(inside) / len(inside), abs=1e-3)
                assert c["all_in_view"] == float(all(inside))
                # Every needle of every sample, with whether it was in attention.
                needles = 1 if task == "niah_single_1" else 5
                assert [len(s) for s in c["needles"]] == [needles] * c["samples"]
                assert all(n["target"] and isinstance(n["in_view"], bool) for s in c["needles"] for n in s)
                if arm.startswith(FULL):   # nothing is ever evicted below the window
                    assert c["needle_in_view"] == 1.0
    passkey = tasks["niah_single_1"]["arms"]
    # The whole 4k text in attention: the passkey is the likeliest of 12 values (chance: 1/12).
    assert passkey[f"{FULL} / ruler"]["lengths"]["4k"]["recall_at_1"] >= 0.5
    assert passkey[f"{FULL} / agent"]["lengths"]["4k"]["recall_at_1"] >= 0.5
    # RULER's form prefills its whole text before the first token; the agent's question comes
    # after the files were read in turns of their own.
    for arm in (FULL, KV):
        assert passkey[f"{arm} / agent"]["lengths"]["4k"]["ttft_ms_p50"] < \
            passkey[f"{arm} / ruler"]["lengths"]["4k"]["ttft_ms_p50"] / 2
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    ran = sum(c["samples"] for t in tasks.values() for a in t["arms"].values() for c in a["lengths"].values())
    assert len(records) == ran and all(r["prompt_tokens"] <= 8192 for r in records)
    assert (tmp_path / "ruler.png").stat().st_size > 0
    assert "## Greedy answer: RULER's string-match recall" in (tmp_path / "ruler.md").read_text()


@pytest.mark.timeout(1200)
@pytest.mark.usefixtures("llama_server_built")
def test_llama_cpp_arm_reads_the_same_text_and_answers_the_agents_question_from_its_prompt_cache(
        tmp_path: Path) -> None:
    run = ruler("--models", MODEL, "--tasks", "niah_single_1", "--lengths", "4k", "--samples", "1", "--arms", "llama",
                "--out", str(tmp_path), "--report", str(tmp_path / "ruler.md"), timeout=1100)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["llama_cpp"] != "not built"
    arms = result["models"][MODEL]["tasks"]["niah_single_1"]["arms"]
    assert set(arms) == {f"{LLAMA} / {form}" for form in FORMS}
    for arm, per_arm in arms.items():
        c = per_arm["lengths"]["4k"]
        assert set(c) == CELL and c["status"] == "ok" and c["samples"] == 1, (arm, c)
        string_match(c)
        # llama.cpp reads no cache of ours: nothing to rank over, nothing to find in a view.
        assert c["recall_at_1"] is None and c["needle_in_view"] is None and c["all_in_view"] is None
    # Its prompt cache holds the files the agent read in earlier requests: the question is prefilled alone.
    assert arms[f"{LLAMA} / agent"]["lengths"]["4k"]["ttft_ms_p50"] < \
        arms[f"{LLAMA} / ruler"]["lengths"]["4k"]["ttft_ms_p50"] / 2
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["prompt_tokens"] <= 8192 for r in records)
