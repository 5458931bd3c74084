"""Every benchmark in benchmarks/ runs in its ``--smoke`` mode: it works, it writes no
file where it was not told to (its working directory and benchmarks/ stay as they were),
and it leaves no process running."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

from test_torchrun import reap_marked

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"
# Modules of benchmarks/ that are not benchmarks (workers, helpers).
NOT_BENCHMARKS = {"__init__", "latency_worker", "startup_worker", "example_timing", "reaping"}
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem not in NOT_BENCHMARKS)


def snapshot(root: pathlib.Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_every_benchmark_is_listed() -> None:
    # A new script in benchmarks/ is either a benchmark (and runs below) or named a helper above.
    assert len(SCRIPTS) >= 11, SCRIPTS


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("script", SCRIPTS)
def test_the_smoke_mode_runs(script: str, tmp_path: pathlib.Path) -> None:
    before = snapshot(BENCHMARKS)
    env = dict(os.environ, INPROCESS_BENCH_SMOKE_TEST=str(tmp_path))
    try:
        res = subprocess.run([sys.executable, str(BENCHMARKS / f"{script}.py"), "--smoke"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=200)
    finally:
        left = reap_marked(f"INPROCESS_BENCH_SMOKE_TEST={tmp_path}")
    assert res.returncode == 0, (res.stdout[-4000:], res.stderr[-4000:])
    assert res.stdout.strip(), "a benchmark prints what it measured"
    assert not left, left
    assert list(tmp_path.iterdir()) == [], "written without being told to"
    assert snapshot(BENCHMARKS) == before, "benchmarks/ changed"
