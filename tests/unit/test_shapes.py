"""The workload shapes of the retrieval study: deterministic, with exact ground truth."""

from __future__ import annotations

import json
import re

import pytest

from harness.shapes import HELD_OUT_SEEDS, SHAPES, TUNING_SEEDS, make
from harness.shapes.session import DEFAULT_TOKENS, LANGUAGES, Workload, approx_tokens

ALL = [(shape, seed) for shape in SHAPES for seed in (*TUNING_SEEDS, *HELD_OUT_SEEDS)]


@pytest.fixture(scope="module")
def workloads() -> dict[tuple[str, int], Workload]:
    return {(shape, seed): make(shape, seed) for shape, seed in ALL}


def _blob(w: Workload) -> str:
    return json.dumps([w.messages(), [q.__dict__ for q in w.questions]], ensure_ascii=False)


def test_seeds_are_disjoint_and_documented() -> None:
    assert not set(TUNING_SEEDS) & set(HELD_OUT_SEEDS)
    assert set(SHAPES) >= {"prose", "boilerplate", "code", "paraphrase", "split", "near_duplicate"}


@pytest.mark.parametrize("shape", SHAPES)
def test_same_seed_same_session_other_seed_other_session(shape: str,
                                                         workloads: dict[tuple[str, int], Workload]) -> None:
    again = make(shape, TUNING_SEEDS[0])
    assert _blob(again) == _blob(workloads[(shape, TUNING_SEEDS[0])])
    assert _blob(workloads[(shape, TUNING_SEEDS[1])]) != _blob(workloads[(shape, TUNING_SEEDS[0])])


@pytest.mark.parametrize(("shape", "seed"), ALL)
def test_evidence_once_answer_inside_and_unique(shape: str, seed: int,
                                                workloads: dict[tuple[str, int], Workload]) -> None:
    w = workloads[(shape, seed)]
    text = w.text()
    assert len(w.questions) >= 5
    for q in w.questions:
        assert q.text and q.answer
        assert len(q.evidence) == len(q.answer_parts) == (2 if shape == "split" else 1)
        for evidence, part in zip(q.evidence, q.answer_parts, strict=True):
            assert text.count(evidence) == 1, evidence
            assert part in evidence and part in q.answer
            assert len(re.findall(r"(?<!\w)" + re.escape(part) + r"(?!\w)", text)) == 1, part
            assert part not in q.text  # the question names the thing, never the value
        assert all(part in q.answer for part in q.answer_parts)


@pytest.mark.parametrize(("shape", "seed"), ALL)
def test_shape_of_a_coding_agent_session(shape: str, seed: int, workloads: dict[tuple[str, int], Workload]) -> None:
    w = workloads[(shape, seed)]
    opening = w.opening()
    assert [m["role"] for m in opening] == ["system", "user"]
    for turn in w.turns():
        assert [m["role"] for m in turn] == ["assistant", "tool", "user"]
        call = turn[0]["tool_calls"][0]
        assert call["function"]["name"] == "read"
        assert turn[1]["tool_call_id"] == call["id"]
        assert json.loads(call["function"]["arguments"])["path"] in turn[2]["content"]
    assert 0.8 * DEFAULT_TOKENS <= approx_tokens(w.text()) <= 1.25 * DEFAULT_TOKENS


@pytest.mark.parametrize(("shape", "seed"), ALL)
def test_facts_sit_in_files_that_go_cold_at_4096(shape: str, seed: int,
                                                 workloads: dict[tuple[str, int], Workload]) -> None:
    """Every evidence string lies in a file followed by at least 5,000 tokens of session."""
    w = workloads[(shape, seed)]
    after = [sum(approx_tokens(f.text) for f in w.files[i + 1:]) for i in range(len(w.files))]
    for q in w.questions:
        for evidence in q.evidence:
            at = next(i for i, f in enumerate(w.files) if evidence in f.text)
            assert after[at] >= 5000, (q.text, after[at])


def test_size_is_a_parameter() -> None:
    small, large = make("prose", 1, tokens=12000), make("prose", 1, tokens=30000)
    assert approx_tokens(small.text()) < 14000 < 26000 < approx_tokens(large.text())
    assert len(large.questions) >= len(small.questions)


@pytest.mark.parametrize("shape", ["prose", "boilerplate", "paraphrase", "split", "near_duplicate"])
def test_several_languages(shape: str, workloads: dict[tuple[str, int], Workload]) -> None:
    seen = {q.language for seed in (*TUNING_SEEDS, *HELD_OUT_SEEDS) for q in workloads[(shape, seed)].questions}
    assert seen == set(LANGUAGES)


def test_code_asks_by_name_and_by_behaviour(workloads: dict[tuple[str, int], Workload]) -> None:
    kinds = {q.kind for seed in TUNING_SEEDS for q in workloads[("code", seed)].questions}
    assert kinds == {"constant", "default", "behaviour", "error"}
    errors = {q.language for seed in (*TUNING_SEEDS, *HELD_OUT_SEEDS) for q in workloads[("code", seed)].questions
              if q.kind == "error"}
    assert len(errors) >= 3


def test_boilerplate_files_are_near_identical(workloads: dict[tuple[str, int], Workload]) -> None:
    w = workloads[("boilerplate", 1)]
    handlers = [f.text for f in w.files if f.path.endswith("handler.py")]
    assert len(handlers) >= 8
    facts = {e for q in w.questions for e in q.evidence}

    def skeleton(text: str) -> str:
        lines = [line for line in text.splitlines() if not any(fact in line for fact in facts)]
        services = "orders|billing|search|export|auth|media|reports|inventory|shipping|profiles"
        return re.sub(rf"(?<![a-z])({services})(?![a-z])", "S", "\n".join(lines))

    assert len({skeleton(t) for t in handlers}) == 1  # the same code but for the service name and the fact
    paragraph = w.files[1].text.split("\n\n")[1]
    assert len(paragraph) > 300 and sum(paragraph in f.text for f in w.files) >= len(w.files) // 2
    # The setting a question names also appears in boilerplate, so the name alone is not enough.
    assert any(sum(q.text.split()[-1].rstrip("?") in f.text for f in w.files) > 1 for q in w.questions)


def test_near_duplicates_differ_only_in_name_and_value(workloads: dict[tuple[str, int], Workload]) -> None:
    w = workloads[("near_duplicate", 1)]
    text = w.text()
    by_template: dict[str, int] = {}
    for line in text.splitlines():
        m = re.search(r"([a-z]+-[a-z]+)\b.*?\b(\d{4})\b", line)
        if m and (" ms" in line):
            template = line.replace(m.group(1), "NAME").replace(m.group(2), "VALUE")
            by_template[template] = by_template.get(template, 0) + 1
    assert sum(by_template.values()) >= 30
    assert len(by_template) <= len(LANGUAGES)  # one sentence per language, many facts each
    names = [q.text.rsplit(" ", 1)[-1].rstrip("?") for q in w.questions]
    halves = [n.split("-") for n in names]
    # Names share their parts with other facts' names.
    assert all(sum(h[0] in line for line in text.splitlines() if " ms" in line) > 1 for h in halves)


def test_split_needs_two_files(workloads: dict[tuple[str, int], Workload]) -> None:
    for seed in TUNING_SEEDS:
        w = workloads[("split", seed)]
        for q in w.questions:
            files = [next(i for i, f in enumerate(w.files) if e in f.text) for e in q.evidence]
            assert files[0] != files[1]


def test_paraphrase_shares_little_but_the_name(workloads: dict[tuple[str, int], Workload]) -> None:
    w = workloads[("paraphrase", 1)]
    for q in (q for q in w.questions if q.language == "en"):
        words = {x.lower().strip("?.,") for x in q.text.split()}
        fact = {x.lower().strip("?.,") for x in q.evidence[0].split()}
        shared = words & fact - {"the", "a", "of", "to", "is", "are", "does", "do"}
        assert len(shared) <= 2, shared


def test_config_questions_share_key_and_service_with_other_files(workloads: dict[tuple[str, int], Workload]) -> None:
    """The worker that reads a config names its file and every key: the config file is the only one
    with the value, not the only one with the words of the question."""
    w = workloads[("config", 1)]
    for q in w.questions:
        path = re.search(r"config/[a-z-]+\.yaml", q.text)
        assert path is not None
        key = q.kind
        holders = [f for f in w.files if path.group(0) in f.text and key in f.text]
        assert len(holders) >= 2 and sum(q.evidence[0] in f.text for f in holders) == 1
        assert sum(key in f.text for f in w.files) >= len(w.files) // 2


def test_logs_name_the_failing_test_in_every_run(workloads: dict[tuple[str, int], Workload]) -> None:
    w = workloads[("logs", 1)]
    runs = [f for f in w.files if f.path.startswith("ci/")]
    assert len(runs) >= 10
    for q in w.questions:
        test = q.text.split()[1]
        assert all(test in f.text for f in runs)
        assert sum(f"{test} FAILED" in f.text for f in runs) == 1
