"""The examples a user starts with ``python -m inprocess.launch --respawn`` (their docstrings name that
launcher) survive a rank's death and its respawn, run as a user would: the launcher, the example unchanged,
a SIGKILL from INPROCESS_FAULTS (issue 33, finding 6: a joiner admitted at a fault made optimal.py's old
ranks fail an assertion, a joiner never admitted crashed on its ``None``, a waiting joiner printed torch's
warnings twice a second, a late one a traceback).

What each shows: examples/optimal.py takes the respawned rank in at a grow and ends with 4 ranks of equal
parameters; examples/spares.py keeps it as a spare (its seat's spare activated, the joiner waits like
one) and examples/minimal.py gives it ``None`` at the end; every run exits 0 with nothing on stderr but the
expected lines. docs/slurm.md names optimal.py as the example to run with ``--respawn``.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from inprocess.launch import free_port
from test_torchrun import reap_marked

ROOT = pathlib.Path(__file__).parent.parent
# Unanchored: the ranks' lines reach one stream, and one can start where another has not ended its line.
DONE = re.compile(r"\[optimal\] rank (\d) done in [\d.]+ s, loss [\d.]+, world (\d), parameters ([0-9a-f]{12})")

pytestmark = [pytest.mark.multiprocess]


def launch(tmp_path: pathlib.Path, argv: list[str], faults: str, timeout: float = 200) -> tuple[int, str]:
    env = dict(os.environ, INPROCESS_FAULTS=faults, INPROCESS_RESPAWN_TEST=str(tmp_path))
    command = [sys.executable, "-m", "inprocess.launch", "--nproc", "4", "--respawn", "1", "--timeout",
               str(int(timeout)), *argv]
    try:
        res = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout + 30)
    finally:
        left = reap_marked(f"INPROCESS_RESPAWN_TEST={tmp_path}")
    assert not left, left
    return res.returncode, res.stdout + res.stderr


def quiet(out: str) -> None:
    """No traceback, and none of torch's c10d warnings that a waiting joiner's store waits printed."""
    assert "Traceback" not in out and "socket.cpp" not in out, out[-8000:]


@pytest.mark.timeout(240)
def test_optimal_takes_the_respawned_rank_back_in_and_ends_with_equal_parameters(tmp_path: pathlib.Path) -> None:
    code, out = launch(tmp_path, ["examples/optimal.py", "--steps", "600", "--step-time", "0.05"],
                       "sigkill@rank=1,step=20")
    assert code == 0, out[-8000:]
    assert "job finished: 4 of 4 seats finished; 2 restarts; 1 respawn; rank 1 killed by SIGKILL (respawned)" in out
    assert re.search(r"^grow after iteration 1: .*joined \(new processes\): \[1\]", out, re.M), out[-8000:]
    done = {int(r): (int(w), d) for r, w, d in DONE.findall(out)}
    assert sorted(done) == [0, 1, 2, 3] and {w for w, _ in done.values()} == {4}, out[-8000:]
    assert len({d for _, d in done.values()}) == 1, done
    quiet(out)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_spares_keeps_the_respawned_rank_as_a_spare(tmp_path: pathlib.Path) -> None:
    code, out = launch(tmp_path, ["examples/spares.py", "--steps", "600", "--step-time", "0.05"],
                       "sigkill@rank=1,step=20")
    assert code == 0, out[-8000:]
    assert "spares activated: [3]" in out and "rank 1 killed by SIGKILL (respawned)" in out, out[-8000:]
    assert "[spares] initial rank 1: spare, never activated" in out, out[-8000:]
    quiet(out)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_minimal_returns_none_to_a_joiner_never_taken_in(tmp_path: pathlib.Path) -> None:
    code, out = launch(tmp_path, ["examples/minimal.py", "--steps", "2000"], "sigkill@rank=1,after=1s")
    assert code == 0, out[-8000:]
    assert "job finished: 4 of 4 seats finished; 1 restart; 1 respawn; rank 1 killed by SIGKILL (respawned)" in out
    assert re.search(r"^\[minimal\] 2000 steps in", out, re.M), out[-8000:]
    quiet(out)


@pytest.mark.timeout(60)
def test_a_joiner_whose_job_is_gone_leaves_with_one_line(tmp_path: pathlib.Path) -> None:
    # What a respawned process that came too late meets: no store at MASTER_ADDR:MASTER_PORT any more.
    port = free_port(2)
    env = dict(os.environ, INPROCESS_JOIN="1", INPROCESS_RESPAWN_COUNT="1", RANK="1", WORLD_SIZE="4",
               LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), INPROCESS_RESPAWN_TEST=str(tmp_path))
    res = subprocess.run([sys.executable, "examples/optimal.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=50)
    assert res.returncode == 1, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("inprocess")]
    assert lines == [f"inprocess: rank 1: INPROCESS_JOIN=1, but the job it would join is not running (nothing listens "
                     f"at 127.0.0.1:{port} (MASTER_ADDR, MASTER_PORT) after 10s: expected the store that the host "
                     f"rank serves (is it running, and is this its port?)): this process leaves"], res.stderr
    assert "Traceback" not in res.stderr, res.stderr
