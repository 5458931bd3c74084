"""The package's lint and type checks, as part of the suite: what `.ci/run` runs is the README's command.

Both tools come with the ``test`` extra; where one is missing, its test skips and says so. The
configuration is pyproject.toml's ([tool.ruff], [tool.mypy]).
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# What the checks cover (the developers' guide: "ruff check python tests benchmarks examples tools" and "mypy").
RUFF_PATHS = ["python", "tests", "benchmarks", "examples", "tools"]


def run_tool(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install '.[test]' installs it)")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=280)


@pytest.mark.timeout(300)
def test_ruff_finds_nothing() -> None:
    res = run_tool("ruff", "check", *RUFF_PATHS)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]


@pytest.mark.timeout(300)
def test_mypy_finds_nothing() -> None:
    res = run_tool("mypy")
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-2000:]
    assert "Success: no issues found" in res.stdout, res.stdout[-2000:]
