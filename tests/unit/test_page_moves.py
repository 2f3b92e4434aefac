"""Pages move only through serving/paging.py: an AST walk over every module that drives a
backend (serving, controller, contextd, benchmarks and the harness) finds no call of a backend
method that puts K/V into the cache, takes it out, copies a page out, empties the cache or moves
positions anywhere else. The backends implement these methods and their own tests call them;
nothing else does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
THE_MOVER = REPO / "serving" / "paging.py"
DRIVERS = ("serving", "controller", "contextd", "benchmarks", "harness")
# The backend protocol's page-moving methods (backends/protocol.py).
PAGE_MOVES = frozenset({"insert_block", "insert_block_file", "insert_block_files", "remove_attention_range",
                        "save_block", "reset", "compact_positions", "reposition", "restore_recurrent",
                        "recompute", "drop_recomputed"})


def page_moves(path: Path) -> list[tuple[int, str]]:
    """(line, method) of every call `<anything>.<page move>(...)` in the file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in PAGE_MOVES:
            found.append((node.lineno, node.func.attr))
    return found


MODULES = [p for package in DRIVERS if (REPO / package).is_dir()
           for p in sorted((REPO / package).rglob("*.py")) if "_gen" not in p.parts and p != THE_MOVER]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_moves_outside_the_mover(path: Path) -> None:
    moves = page_moves(path)
    assert not moves, f"{path.relative_to(REPO)} moves pages itself: " + ", ".join(
        f"line {line}: {method}()" for line, method in moves) + " (go through serving.paging)"


def test_the_mover_is_where_pages_move() -> None:
    assert {method for _, method in page_moves(THE_MOVER)} >= {"insert_block_files", "remove_attention_range",
                                                               "save_block", "reset", "compact_positions",
                                                               "recompute", "drop_recomputed"}


def test_the_walk_sees_a_page_move_inside_a_function(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f(engine):\n    return [engine.backend.save_block(0, 128)]\n")
    assert page_moves(bad) == [(2, "save_block")]
