"""The package's floors and their imports, read from the source (every import counts: those inside
functions and under ``TYPE_CHECKING`` too).

Floors, bottom up (docs/design.md): ``control/`` and the native module know nothing above them;
``processes/`` use ``control/``; ``engine/`` uses both; the user's surface (``call_wrapper``,
``wrap``) sits on top. A helper process never imports the engine, and no two modules import each
other, however far round.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

pytestmark = pytest.mark.timeout(60)

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "python" / "inprocess"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The package module ``name`` is (or lies in), or None outside the package."""
    while name and name not in MODULES:
        if name == "inprocess._native":
            return None  # the extension: the ground floor
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The package modules ``module`` imports, anywhere in its text."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
            if any(_target(n) != n for n in names):
                names.append(base)  # a name defined in the module (or package) itself
        for name in names:
            if not name.startswith("inprocess"):
                continue
            target = _target(name)
            # "from . import x": the submodule x, not the package's __init__ that holds it.
            if target is not None and target != module:
                found.add(target)
    return {t for t in found if not (module.startswith(t + ".") and MODULES[t].name == "__init__.py")}


GRAPH = {m: imports_of(m) for m in MODULES}


def _floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_no_import_cycle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for m in sorted(GRAPH):
        if m not in index:
            visit(m)
    assert cycles == [], f"modules that import each other (however far round): {cycles}"


@pytest.mark.parametrize("lower,upper", [
    ("control", "engine"), ("control", "processes"), ("control", "call_wrapper"), ("control", "wrap"),
    ("processes", "engine"), ("processes", "call_wrapper"), ("processes", "wrap"),
    ("engine", "call_wrapper"), ("engine", "wrap"),
])
def test_a_floor_never_imports_one_above_it(lower: str, upper: str) -> None:
    bad = sorted(f"{m} -> {t}" for m, targets in GRAPH.items() if _floor(m) == lower
                 for t in targets if _floor(t) == upper)
    assert bad == [], f"{lower}/ imports {upper}: {bad}"


def test_the_users_object_stays_small() -> None:
    """CallWrapper is the user's surface: the restart is the engine's (engine/recovery.py, engine/loop.py)."""
    path = MODULES["inprocess.call_wrapper"]
    assert len(path.read_text().splitlines()) <= 300
    assert len(GRAPH["inprocess.call_wrapper"]) <= 8, sorted(GRAPH["inprocess.call_wrapper"])


def test_the_reader_sees_real_edges() -> None:
    """The graph above is read right: known edges are in it, and a relative import resolves."""
    assert "inprocess.control.protocol" in GRAPH["inprocess.engine.recovery"]
    assert "inprocess.control.recovery_plan" in GRAPH["inprocess.control.counting_out"]
    assert "inprocess.engine.recovery" in GRAPH["inprocess.call_wrapper"]


def test_no_module_over_600_lines() -> None:
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}, f"modules over 600 lines (carve them by concept): {long}"
