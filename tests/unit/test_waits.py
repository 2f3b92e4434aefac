"""Tests wait on what they wait for, never on the clock: no module under tests/ calls a sleep of
its own (harness.waits polls a condition with a deadline, and holds a real process's outage
where its timers are its own), and the wait fails naming what it waited for.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from harness.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
TESTS = sorted((REPO / "tests").rglob("*.py"))


def sleeps(path: Path) -> list[int]:
    """Lines that call `time.sleep`, `asyncio.sleep` or a `sleep` imported from either."""
    tree = ast.parse(path.read_text())
    imported = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and node.module in ("time", "asyncio") for alias in node.names if alias.name == "sleep"}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "sleep" and isinstance(func.value, ast.Name) \
                and func.value.id in ("time", "asyncio"):
            found.append(node.lineno)
        elif isinstance(func, ast.Name) and func.id in imported:
            found.append(node.lineno)
    return found


@pytest.mark.parametrize("path", TESTS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_test_sleeps(path: Path) -> None:
    assert not sleeps(path), f"{path.relative_to(REPO)} sleeps at lines {sleeps(path)}: wait with harness.waits"


def test_the_walk_sees_both_ways_of_sleeping(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom time import sleep as nap\n\ndef f():\n    time.sleep(1)\n    nap(2)\n")
    assert sleeps(bad) == [5, 6]


def test_a_wait_that_does_not_come_fails_naming_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match="waited 0 s for the moon"):
        wait_until(lambda: False, 0, "the moon")
    wait_until(lambda: True, 0, "what is already there")
