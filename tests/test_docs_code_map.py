"""The code map in docs/design.md lists every module of python/inprocess with its docstring's first
sentence, as tools/code_map.py writes it: a module added, moved or renamed without running
``python tools/code_map.py`` fails here, and the failure says to run it."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"


def load_code_map() -> ModuleType:
    spec = importlib.util.spec_from_file_location("code_map", ROOT / "tools" / "code_map.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["code_map"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


code_map = load_code_map()


def test_the_committed_map_is_what_the_docstrings_give() -> None:
    page = DESIGN.read_text()
    wanted = code_map.replace_map(page, code_map.current_map())
    assert wanted == page, (
        "docs/design.md's code map differs from the module docstrings of python/inprocess: run\n\n"
        "    python tools/code_map.py\n\nand commit docs/design.md. The difference:\n"
        + code_map.diff(page, wanted))


def test_every_module_file_has_a_row() -> None:
    """Counted apart from the generator: every .py file under python/inprocess (and the extension's stub)
    is linked from exactly one row of the map."""
    package = ROOT / "python" / "inprocess"
    files = {p.relative_to(ROOT).as_posix() for p in package.rglob("*.py") if "__pycache__" not in p.parts}
    files.add("python/inprocess/_native.pyi")
    rows = re.findall(r"^\| \[`[\w.]+`\]\(\.\./(python/inprocess/[\w/.]+)\) \| (.+) \|$", DESIGN.read_text(), re.M)
    linked = [path for path, _ in rows]
    assert len(files) > 80, len(files)
    assert sorted(linked) == sorted(files), (
        f"missing from the map: {sorted(files - set(linked))}; not modules: {sorted(set(linked) - files)}; "
        "run python tools/code_map.py")
    assert all(summary.strip() for _, summary in rows)


def test_a_row_is_the_docstrings_first_sentence_in_markdown() -> None:
    assert code_map.first_sentence("A rule. More.\n\nAnd more.") == "A rule."
    assert code_map.first_sentence("Two lines\nof one sentence. Then.") == "Two lines of one sentence."
    assert code_map.first_sentence("Is it one job? The checks. Then.") == "Is it one job? The checks."
    assert code_map.first_sentence("Which GPU: e.g. the first. Then.") == "Which GPU: e.g. the first."
    assert code_map.first_sentence("The loop; it reads::\n\n    a -> b\n") == "The loop; it reads"
    assert code_map.markdown("``x`` and :class:`~a.b.C` and :mod:`a.b`") == "`x` and `C` and `a.b`"


def test_a_module_without_a_docstring_is_named(tmp_path: pathlib.Path) -> None:
    package = tmp_path / "python" / "inprocess"
    (package / "engine").mkdir(parents=True)
    (package / "__init__.py").write_text('"""The package."""\n')
    (package / "engine" / "__init__.py").write_text('"""The engine."""\n')
    (package / "engine" / "recovery.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"python/inprocess/engine/recovery.py has no module docstring.*"
                                         r"python tools/code_map.py"):
        code_map.current_map(package)
    (package / "engine" / "recovery.py").write_text('"""The restart as an executor of the plan.\n\nMore."""\n')
    new_map = code_map.current_map(package)
    assert "| [`recovery`](../python/inprocess/engine/recovery.py) | The restart as an executor of the plan. |" \
        in new_map, new_map
    assert "#### `inprocess.engine`" in new_map


@pytest.mark.timeout(60)
def test_the_command_checks_and_writes(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """``--check`` exits 1 with a diff on a stale map and changes nothing; the plain command writes the map."""
    res = subprocess.run([sys.executable, "tools/code_map.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=50)
    assert res.returncode == 0 and "up to date" in res.stdout, res.stdout + res.stderr
    page = tmp_path / "design.md"
    gone = "| a row of a module long gone |"
    stale = code_map.replace_map(DESIGN.read_text(), f"{code_map.BEGIN}\n{gone}\n{code_map.END}")
    page.write_text(stale)
    monkeypatch.setattr(code_map, "DESIGN", page)
    assert code_map.main(["--check"]) == 1
    out = capsys.readouterr().out
    assert f"-{gone}" in out and "run python tools/code_map.py" in out, out
    assert page.read_text() == stale
    assert code_map.main([]) == 0
    assert page.read_text() == DESIGN.read_text()
    assert code_map.main(["--check"]) == 0
    with pytest.raises(ValueError, match="markers are missing"):
        code_map.replace_map("no markers here", "map")
