"""examples/slurm/train.sbatch: syntax-checked with ``bash -n``, and run on this machine
with stand-ins for srun and scontrol (tests/fakes/slurm/) that run the tasks locally with
SLURM's variables, so that the script's own logic (ranks from SLURM_PROCID, the store on the
first node, the done file, the requeue) runs for real; SLURM itself is not available here."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

from test_torchrun import reap_marked

ROOT = pathlib.Path(__file__).parent.parent
SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
FAKES = pathlib.Path(__file__).parent / "fakes" / "slurm"


def test_the_script_parses() -> None:
    res = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr


def test_the_script_says_what_inprocess_needs_of_slurm() -> None:
    text = SCRIPT.read_text()
    # One task's death must not end the step, nor a node's loss the job or its step.
    assert "step=(--kill-on-bad-exit=0 --wait=0 --no-kill " in text and 'srun "${step[@]}" ' in text
    assert "#SBATCH --no-kill" in text
    assert "#SBATCH --requeue" in text  # SLURM's own restart: a new incarnation of the job
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1' in text  # the store: the first node


def free_job_id() -> int:
    """A job id whose port (20000 + id % 20000, as the script computes it) is free now."""
    for port in range(20000 + os.getpid() % 19000, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port  # 20000 + port % 20000 == port in this range
    raise RuntimeError("no free port in 20000..39999")


def run_sbatch(tmp_path: pathlib.Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], str]:
    log = tmp_path / "slurm.log"
    log.touch()
    job_env = dict(os.environ)
    job_env.update({
        "PATH": f"{FAKES}{os.pathsep}{pathlib.Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "FAKE_SLURM_LOG": str(log), "SLURM_JOB_ID": str(free_job_id()), "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "node[1-2]", "DONE_FILE": str(tmp_path / "done"), "INPROCESS_SLURM_TEST": str(tmp_path),
    })
    job_env.update(env)
    try:
        res = subprocess.run(["bash", str(SCRIPT), *args], env=job_env, capture_output=True, text=True, timeout=150,
                             cwd=ROOT)
    finally:
        left = reap_marked(f"INPROCESS_SLURM_TEST={tmp_path}")
    assert not left, left
    return res, log.read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_killed_task_leaves_the_step_running_and_the_job_finishes_without_a_requeue(tmp_path: pathlib.Path) -> None:
    res, log = run_sbatch(tmp_path, {"SCRIPT": "examples/optimal.py", "INPROCESS_FAULTS": "sigkill@rank=1,step=30"},
                          "--steps", "100")
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    assert "store at 127.0.0.1:" in res.stdout
    assert "task statuses [0, 137, 0, 0]" in log, log
    assert "job done (srun status 137: ranks excluded on the way)" in res.stdout
    assert "requeue" not in log
    assert "100 steps done in iteration 1 (1 restarts)" in res.stdout + res.stderr


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_killed_rank_is_named_by_the_task_script_and_a_clean_run_says_only_that_it_is_done(
        tmp_path: pathlib.Path) -> None:
    # Issue 33, finding 5: bash named the user's script ("examples/optimal.py: line 2: ... Killed") for the
    # task's inline `bash -c`, and the end said "ranks excluded on the way" after a step where none was.
    res, _ = run_sbatch(tmp_path, {"SCRIPT": "examples/optimal.py", "INPROCESS_FAULTS": "sigkill@rank=2,step=20"},
                        "--steps", "60")
    assert res.returncode == 0, res.stdout[-5000:] + res.stderr[-5000:]
    # The task script says it, naming the rank; bash's own notice (which named the line of the task
    # script's loop end) is not printed.
    assert "Killed" not in res.stderr, res.stderr[-5000:]
    assert "respawn_task: rank 2 killed by SIGKILL; not respawned (RESPAWNS=0)" in res.stderr
    (tmp_path / "slurm.log").unlink()
    res, log = run_sbatch(tmp_path, {"SCRIPT": "examples/optimal.py"}, "--steps", "20")
    assert res.returncode == 0 and "task statuses [0, 0, 0, 0]" in log, res.stdout[-5000:] + res.stderr[-5000:]
    assert res.stdout.splitlines()[-1] == "job done", res.stdout[-3000:]


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_step_that_no_rank_finished_is_requeued(tmp_path: pathlib.Path) -> None:
    failing = tmp_path / "fails.py"
    failing.write_text("import sys\nsys.exit(75)\n")
    res, log = run_sbatch(tmp_path, {"SCRIPT": str(failing)})
    assert res.returncode == 75, res.stderr
    assert "no rank finished: requeueing" in res.stderr
    assert re.search(r"^requeue \d+$", log, re.M), log


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_the_last_allowed_incarnation_is_not_requeued_again(tmp_path: pathlib.Path) -> None:
    # Issue 33, finding 2: the incarnation after MAX_REQUEUES requeues asked for one more ("restart 4 of 3").
    failing = tmp_path / "fails.py"
    failing.write_text("import sys\nsys.exit(75)\n")
    res, log = run_sbatch(tmp_path, {"SCRIPT": str(failing), "SLURM_RESTART_COUNT": "3"})
    assert res.returncode == 75, res.stderr
    assert "no rank finished; no requeue left: 3 of 3 used" in res.stderr, res.stderr
    assert "requeue " not in log, log
    res, log = run_sbatch(tmp_path, {"SCRIPT": str(failing), "SLURM_RESTART_COUNT": "2"})
    assert "requeueing (restart 3 of 3)" in res.stderr and re.search(r"^requeue \d+$", log, re.M), res.stderr


def test_too_many_requeues_end_the_job(tmp_path: pathlib.Path) -> None:
    res, log = run_sbatch(tmp_path, {"SCRIPT": "examples/optimal.py", "SLURM_RESTART_COUNT": "4"})
    assert res.returncode == 1
    assert "requeued 4 times (MAX_REQUEUES=3): giving up" in res.stderr
    assert "srun" not in log
