"""The demo end to end: a raised fault, then a SIGKILL of rank 0's process (the
one that started the store host); the three survivors finish the training."""

from __future__ import annotations

import pathlib
import re
import signal

import pytest

from conftest import leftover_processes
from inprocess.launch import LocalJob

pytestmark = pytest.mark.multiprocess

DEMO = pathlib.Path(__file__).parent.parent / "examples" / "demo.py"


@pytest.mark.timeout(150)
def test_demo_survives_a_sigkill_of_rank0() -> None:
    env = {"DEMO_STEPS": "40", "DEMO_FAULTS": "2:10,0:20:kill"}
    with LocalJob([str(DEMO)], 4, env=env) as job:  # reaps every rank on every path
        ranks = job.wait(timeout=120)
        assert not leftover_processes({r.popen.pid for r in ranks}, grace=10.0)
    codes = [r.returncode for r in ranks]
    assert codes == [-signal.SIGKILL, 0, 0, 0], job.outputs()[-8000:]
    out = ranks[1].output  # initial rank 1 is rank 0 once rank 0 is gone
    assert "cause: rank 0 killed: SIGKILL" in out, job.outputs()[-8000:]
    # A restart may catch a rank between a step's allreduce and its commit: the
    # ranks agree on the lowest committed step, so they resume at 19 or 20.
    assert re.search(r"iteration 2: 3 ranks resume at step (19|20)\b", out), out
    assert "finished 40 steps" in out, out
    assert "injected fault at step 10" in ranks[0].output, ranks[0].output
    # Each restart is told once: the library's summary, not a second line of the demo's own.
    assert job.outputs().count("injected fault at step 10") == 1, job.outputs()[-8000:]
