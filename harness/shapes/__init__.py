"""Agent sessions of several shapes, with planted ground truth, for studying retrieval (issue 17).

Each generator builds a coding agent's session (harness.shapes.session.Workload): an opening,
one turn per file the agent reads, and finally questions about facts planted in files read long
before, each with the exact substrings of the session that hold its answer (two for `split`).
Everything comes from `(shape, seed)` through `random.Random`: no data set is read. One concept
per module:

    session.py     the workload: its files, its questions, how it reads as chat; approx_tokens
    building.py    what every generator builds with: the builder, the cold schedule, unique values
    notes.py       facts in notes of filler prose: prose, paraphrase, split, near_duplicate
    repository.py  facts in a code base's files: boilerplate, code, config, logs
    __main__.py    `python -m harness.shapes`: one session printed as chat messages and questions

This module is the registry: the shapes by name (GENERATORS, SHAPES), the seeds, and `make`,
which checks every workload's ground truth before handing it out.

Seeds: TUNING_SEEDS (1, 2, 3) are the ones signals and parameters may be tuned on; HELD_OUT_SEEDS
(101, 102, 103) are for reporting only and nobody tunes on them.

Sizes: `tokens` is the approximate session length (SmolLM2 tokenizer, +-15%). Facts sit only in the
files that end before the newest `max(6000, tokens // 4)` tokens, so every fact is cold at a budget
of 4,096 (and 2,048), whatever the size.

Dependency rules: the standard library and this package's modules, which never import this
registry (it imports them), __main__.py aside.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from harness.shapes.notes import near_duplicate, paraphrase, prose, split
from harness.shapes.repository import boilerplate, code, config, logs
from harness.shapes.session import DEFAULT_TOKENS, Workload

TUNING_SEEDS = (1, 2, 3)
HELD_OUT_SEEDS = (101, 102, 103)

GENERATORS: dict[str, Callable[..., Workload]] = {
    "prose": prose, "boilerplate": boilerplate, "code": code, "paraphrase": paraphrase, "split": split,
    "near_duplicate": near_duplicate, "config": config, "logs": logs,
}
SHAPES = tuple(GENERATORS)  # the order the study reports them in


def make(shape: str, seed: int, tokens: int = DEFAULT_TOKENS) -> Workload:
    """The workload of `shape` for `seed`, about `tokens` tokens long."""
    if shape not in GENERATORS:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    workload = GENERATORS[shape](seed, tokens)
    _check(workload)
    return workload


def _check(workload: Workload) -> None:
    """Ground truth must be exact: every evidence string once in the session, answers inside it."""
    text = workload.text()
    for q in workload.questions:
        for evidence, part in zip(q.evidence, q.answer_parts, strict=True):
            count = text.count(evidence)
            if count != 1:
                raise AssertionError(f"{workload.shape}/{workload.seed}: evidence {evidence[:60]!r} occurs {count}x")
            if part not in evidence:
                raise AssertionError(f"{workload.shape}/{workload.seed}: answer {part!r} not in its evidence")
            if len(re.findall(r"(?<!\w)" + re.escape(part) + r"(?!\w)", text)) != 1:
                raise AssertionError(f"{workload.shape}/{workload.seed}: answer {part!r} is not unique")
