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
DAEMON_SIDE = {"contextd.daemon", "contextd.service", "contextd.server", "contextd.store", "contextd.tiering",
               "contextd.manifest", "contextd.payloads", "contextd.holds", "contextd.sessions", "contextd.branches",
               "contextd.turns", "contextd.retention", "contextd.pages", "contextd.integrity"}


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


# ------------------------------------------------------------------ import circles

CYCLE_PACKAGES = (*PACKAGES, "benchmarks")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_imports(path: Path, known: set[str], root: Path = REPO) -> set[str]:
    """The modules of `known` that `path` imports, relative imports resolved, `from pkg import
    name` read as the module pkg.name where there is one, else as pkg; imports inside functions
    and under TYPE_CHECKING count (a circle there is still a circle of the design)."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_circles(paths: list[Path], root: Path = REPO) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    known = {module_name(p, root) for p in paths}
    graph = {module_name(p, root): module_imports(p, known, root) for p in paths}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_module_imports_itself_back() -> None:
    """No circle of imports anywhere in our packages, inside a room or between rooms; a package's
    __init__ re-exporting its modules is the one kind allowed (it imports down, never up)."""
    paths = [p for package in CYCLE_PACKAGES for p in sorted((REPO / package).rglob("*.py")) if "_gen" not in p.parts]
    circles = [c for c in import_circles(paths)
               if not any(m + "." in other for m in c if REPO.joinpath(*m.split("."), "__init__.py").exists()
                          for other in c)]
    assert not circles, circles


def test_the_circle_finder_sees_a_relative_and_a_lazy_circle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from pkg import c\n    return c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from . import a\n")
    paths = sorted(pkg.rglob("*.py"))
    assert import_circles(paths, tmp_path) == [["pkg.a", "pkg.b", "pkg.c"]]
