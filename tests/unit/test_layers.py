"""Imports point one way: serving -> (controller, backends, contextd.client); nothing points back.

An AST walk over every module of the four packages (imports inside functions included), so a
late, local import cannot hide a dependency the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from contextd.wire import PageState as WireState
from controller.pager import PageState

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("backends", "controller", "contextd", "serving")

# package -> the packages of ours it may import (itself always)
ALLOWED: dict[str, set[str]] = {
    "backends": set(),
    "controller": set(),
    "contextd": set(),
    "serving": {"backends", "controller", "contextd"},
}
# Inside contextd: the client side must not reach the daemon side.
CLIENT_SIDE = ("client.py", "wire.py", "errors.py", "paths.py", "ids.py", "blobs.py")
DAEMON_SIDE = {"contextd.daemon", "contextd.service", "contextd.server", "contextd.store"}


def ours(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in PACKAGES or top in ("benchmarks", "tests") else None


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


MODULES = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py")) if "_gen" not in p.parts]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_one_way(path: Path) -> None:
    package = path.relative_to(REPO).parts[0]
    for line, module in imports(path):
        target = ours(module)
        if target is None or target == package:
            continue
        assert target in ALLOWED[package], f"{path.relative_to(REPO)}:{line} imports {module} ({package} -> {target})"
        if package == "serving" and target == "contextd":
            assert module not in DAEMON_SIDE, f"{path.relative_to(REPO)}:{line} reaches into the daemon ({module})"


@pytest.mark.parametrize("name", CLIENT_SIDE)
def test_the_contextd_client_does_not_import_the_daemon(name: str) -> None:
    path = REPO / "contextd" / name
    reached = {module for _, module in imports(path)} & DAEMON_SIDE
    assert not reached, f"contextd/{name} imports {sorted(reached)}"


def test_the_walk_sees_a_wrong_way_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from contextd.client import Client\n    return Client\n")
    assert imports(bad) == [(2, "contextd.client")]


def test_the_pager_names_page_states_as_the_proto_numbers_them() -> None:
    for state in PageState:
        assert state.value == WireState[state.name].value
