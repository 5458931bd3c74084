"""Every benchmark in benchmarks/ runs in its ``--smoke`` mode: it works, it writes no
file where it was not told to (its working directory and benchmarks/ stay as they were),
and it leaves no process running."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from test_torchrun import processes_with as processes_with_marker
from test_torchrun import reap_marked

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"
# Modules of benchmarks/ that are not benchmarks (workers, helpers).
NOT_BENCHMARKS = {"__init__", "latency_worker", "startup_worker", "example_timing", "reaping",
                  "join_latency_worker", "nccl_release_cases"}
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


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["ctrl_c", "kill"])
def test_stopping_the_benchmark_in_its_torchrun_run_leaves_nothing_running(how: str, tmp_path: pathlib.Path) -> None:
    # ctrl_c: a terminal's Ctrl-C, SIGINT to the benchmark's process group; kill: `kill PID`, SIGTERM
    # to the benchmark alone. torchrun and its workers run in sessions of their own and see neither:
    # the benchmark must stop them.
    marker = f"INPROCESS_BENCH_CTRL_C_TEST={tmp_path}"
    env = dict(os.environ, INPROCESS_BENCH_CTRL_C_TEST=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, str(BENCHMARKS / "restart_latency.py"), "--faults", "1"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("torchrun:"):
                break
        assert seen and seen[-1].startswith("torchrun:"), "".join(seen)
        time.sleep(4)  # torchrun has started its workers
        assert len(processes_with_marker(marker)) > 1
        if how == "ctrl_c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
        assert proc.returncode != 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        # Whatever is left after the benchmark's own exit is a failure (then killed).
        left = processes_with_marker(marker)
        reap_marked(marker, grace=0)
    assert not left, left
