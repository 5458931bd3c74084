"""NVRx #139 end to end (examples/lost_context.py under ``inprocess.launch --respawn 1``): a rank's
CUDA context is lost (simulated on CPU: the error, then a health check that reports it), the rank
leaves with exit status 76, the launcher starts it again, a grow admits it, its state comes from a
peer, and the job ends as the job without the fault, bitwise."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "lost_context.py"


def _launch(lost_at: str) -> str:
    """The example as its docstring runs it; the launcher's and the ranks' output together."""
    env = dict(os.environ, EXAMPLE_LOST_AT=lost_at, EXAMPLE_STEPS="30")
    res = subprocess.run([sys.executable, "-m", "inprocess.launch", "--nproc", "4", "--respawn", "1", "--timeout",
                          "200", str(EXAMPLE)], env=env, capture_output=True, text=True, timeout=230)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-6000:]
    return out


def _the_story(out: str) -> str:
    """Asserts what the example's docstring tells; the final digest."""
    assert re.search(r"CUDA context lost \(.*\(simulated\)\): this rank leaves the job \(exit code 76\)", out), out
    assert "respawning rank 1 (attempt 1 of 1) in 1s: exited with status 76 (the CUDA context is lost)" in out, out
    assert re.search(r"grow after iteration 1: .*joined \(new processes\): \[1\]", out), out[-6000:]
    # the three others resume at step 15 (from their own memory, or a peer's where a restart caught one
    # before its commit of step 15); the new process gets step 15 from a peer
    assert len(re.findall(r"iteration 1, rank \d of 3 at step 15\b", out)) == 3, out[-6000:]
    assert re.search(r"initial rank 1: iteration 2, rank 1 of 4 at step 15, its state from rank \d\n", out), out
    assert "job finished: 4 of 4 seats finished; 2 restarts; 1 respawn; rank 1 exited with status 76 (respawned)" \
        in out, out[-6000:]
    done = re.search(r"\[lost_context\] done: step 30, digest ([0-9a-f]{16})", out)
    assert done, out[-6000:]
    return done.group(1)


@pytest.mark.multiprocess
@pytest.mark.timeout(260)
def test_a_lost_context_leaves_76_is_respawned_rejoins_and_gets_its_state_from_a_peer() -> None:
    _the_story(_launch("1:15"))


@pytest.mark.multiprocess
@pytest.mark.slow  # the job twice, one waiting for a respawned process's start
@pytest.mark.timeout(500)
def test_the_job_ends_bitwise_equal_to_the_job_without_the_fault() -> None:
    digest = _the_story(_launch("1:15"))
    clean = _launch("none")
    assert "job finished: 4 of 4 seats finished; 0 restarts" in clean, clean[-3000:]
    assert f"[lost_context] done: step 30, digest {digest}" in clean, (digest, clean[-3000:])
