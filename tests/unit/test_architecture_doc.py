"""Every `file.py:Name` or `file.py:Class.method` docs/architecture.md names exists, so the map of
the tree cannot drift from the tree when code moves (it did once: a split module left the doc
naming functions that had moved)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NAMED = re.compile(r"`([a-z_/]+\.py):([A-Za-z_][\w.]*)`")


def defines(path: Path, dotted: str) -> bool:
    """Whether the module defines `dotted` (a function, class or assigned name; methods by Class.name)."""
    scope: list[ast.stmt] = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        found = next((node for node in scope
                      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == part
                      or isinstance(node, ast.Assign)
                      and any(isinstance(t, ast.Name) and t.id == part for t in node.targets)), None)
        if found is None:
            return False
        scope = getattr(found, "body", [])
    return True


def test_every_name_the_architecture_doc_gives_exists() -> None:
    named = sorted(set(NAMED.findall((REPO / "docs" / "architecture.md").read_text())))
    assert len(named) > 10
    missing = [f"{path}:{name}" for path, name in named
               if not (REPO / path).is_file() or not defines(REPO / path, name)]
    assert not missing, missing


def test_a_moved_name_is_noticed(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("class Mover:\n    def cut(self):\n        pass\n\nLIMIT = 3\n")
    assert defines(module, "Mover.cut") and defines(module, "LIMIT")
    assert not defines(module, "Mover.truncate") and not defines(module, "recover")
