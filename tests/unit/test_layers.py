"""Imports point one way: harness -> serving -> (controller, backends, contextd.client); nothing
points back, and tests/ reach the benchmarks only by running them. The controller reaches into
contextd for exactly one module, contextd.wire, whose page-state and pin-kind enums are the
tree's only ones.

An AST walk over every module of the five packages and of tests/ (imports inside functions
included), so a late, local import cannot hide a dependency the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("backends", "controller", "contextd", "serving", "harness")

# package -> the packages of ours it may import (itself always)
ALLOWED: dict[str, set[str]] = {
    "backends": set(),
    "controller": {"contextd"},  # contextd.wire only (NARROW)
    "contextd": set(),
    "serving": {"backends", "controller", "contextd"},
    "harness": {"backends", "controller", "contextd", "serving"},  # never benchmarks or tests
}
# package -> package: the only modules of it the package may import
NARROW: dict[tuple[str, str], tuple[str, ...]] = {("controller", "contextd"): ("contextd.wire",)}
# Inside contextd: the client side must not reach the daemon side.
CLIENT_SIDE = ("client.py", "wire.py", "errors.py", "paths.py", "ids.py", "blobs.py")
DAEMON_SIDE = {"contextd.daemon", "contextd.service", "contextd.server", "contextd.store", "contextd.tiering"}


def ours(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in PACKAGES or top in ("benchmarks", "tests") else None


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every import; `from pkg import name` is recorded as `pkg.name`, since
    the name may be a module (`from contextd import store` imports contextd.store)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def reaches_daemon(module: str) -> bool:
    return any(module == side or module.startswith(side + ".") for side in DAEMON_SIDE)


MODULES = [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py")) if "_gen" not in p.parts]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_imports_point_one_way(path: Path) -> None:
    package = path.relative_to(REPO).parts[0]
    for line, module in imports(path):
        target = ours(module)
        if target is None or target == package:
            continue
        assert target in ALLOWED[package], f"{path.relative_to(REPO)}:{line} imports {module} ({package} -> {target})"
        narrow = NARROW.get((package, target))
        if narrow is not None:
            assert any(module == name or module.startswith(name + ".") for name in narrow), \
                f"{path.relative_to(REPO)}:{line} imports {module}; of {target}, {package} may import only {narrow}"
        if package == "serving" and target == "contextd":
            assert not reaches_daemon(module), f"{path.relative_to(REPO)}:{line} reaches into the daemon ({module})"


TESTS = sorted((REPO / "tests").rglob("*.py"))


@pytest.mark.parametrize("path", TESTS, ids=lambda p: str(p.relative_to(REPO)))
def test_tests_do_not_import_the_benchmarks(path: Path) -> None:
    """What tests and benchmarks share lives in harness/; a test runs a benchmark as a user would."""
    reached = sorted({module for _, module in imports(path) if ours(module) == "benchmarks"})
    assert not reached, f"{path.relative_to(REPO)} imports {reached}"


@pytest.mark.parametrize("name", CLIENT_SIDE)
def test_the_contextd_client_does_not_import_the_daemon(name: str) -> None:
    path = REPO / "contextd" / name
    reached = {module for _, module in imports(path) if reaches_daemon(module)}
    assert not reached, f"contextd/{name} imports {sorted(reached)}"


def test_the_walk_sees_a_wrong_way_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from contextd.client import Client\n    return Client\n")
    assert imports(bad) == [(2, "contextd.client.Client")]


def test_the_walk_sees_a_module_imported_from_its_package(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from contextd import store\nimport contextd.daemon as daemon\n")
    found = imports(bad)
    assert found == [(1, "contextd.store"), (2, "contextd.daemon")]
    assert all(reaches_daemon(module) for _, module in found)
    assert not reaches_daemon("contextd.storefront")


# The members that make a class a copy of contextd.wire's PageState or PinKind.
STATE_MEMBERS = {"HOT", "COLD"}
PIN_MEMBERS = {"SYSTEM", "TOOLS", "OBJECTIVE"}
ENUM_PACKAGES = ("backends", "controller", "contextd", "serving", "benchmarks", "harness")


def enum_copies(path: Path) -> list[tuple[int, str, str]]:
    """(line, class, "page state" or "pin kind") of every class whose members include the names
    of PageState's HOT and COLD or of PinKind's kinds."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ClassDef):
            continue
        members = {target.id for stmt in node.body
                   for target in (stmt.targets if isinstance(stmt, ast.Assign) else
                                  [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
                   if isinstance(target, ast.Name)}
        if STATE_MEMBERS <= members:
            found.append((node.lineno, node.name, "page state"))
        if PIN_MEMBERS <= members:
            found.append((node.lineno, node.name, "pin kind"))
    return found


def test_page_states_and_pin_kinds_have_one_enum_each() -> None:
    """contextd/wire.py's PageState and PinKind are the only ones; everything else imports them."""
    found = {(str(path.relative_to(REPO)), name, what)
             for package in ENUM_PACKAGES for path in sorted((REPO / package).rglob("*.py"))
             if "_gen" not in path.parts for _, name, what in enum_copies(path)}
    assert found == {("contextd/wire.py", "PageState", "page state"), ("contextd/wire.py", "PinKind", "pin kind")}


def test_the_walk_sees_a_second_enum(tmp_path: Path) -> None:
    copy = tmp_path / "copy.py"
    copy.write_text("class State(IntEnum):\n    HOT = 1\n    COLD: int = 2\n"
                    "class Kind:\n    SYSTEM = TOOLS = 'x'\n    OBJECTIVE = 'y'\n")
    assert enum_copies(copy) == [(1, "State", "page state"), (4, "Kind", "pin kind")]
