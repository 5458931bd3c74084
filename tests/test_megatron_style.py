"""Programs in the style of Megatron-LM's and Megatron-Bridge's in-process restart code
(tests/users/megatron_lm_style.py, tests/users/megatron_bridge_style.py), changed only in their
import line, run as SLURM runs its tasks: five tasks on this machine, four active and one warm spare
(``Tree`` with a ``RESERVE`` layer), each started the way a batch script starts it (``RANK``,
``WORLD_SIZE`` and ``LOCAL_RANK`` exported from ``SLURM_PROCID``, ``SLURM_NTASKS`` and
``SLURM_LOCALID``; ``MASTER_ADDR``/``MASTER_PORT`` set; the job's own store at ``MASTER_PORT + 1``,
the Wrapper's at ``MASTER_PORT + 2``). Once active task 1 is at step 12 of 40 it is SIGKILLed. The
spare must take its place (active rank 1) and every active rank must finish the 40 steps from the
last checkpoint, with the parameters a fault-free job ends with (computed here in one process).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from typing_extensions import Self

from conftest import leftover_processes
from inprocess.launch import free_port

pytestmark = pytest.mark.multiprocess

USERS = pathlib.Path(__file__).parent / "users"
TASKS = 5  # four active ranks and one spare
ACTIVE = 4
TRAIN_ITERS = 40
SAVE_INTERVAL = 5
LR = 0.01
KILLED = 1  # an active task; task 0 hosts the program's own TCPStore, which must outlive the fault
KILL_AT_STEP = 12
# How a batch script hands SLURM's variables to a program that reads RANK and WORLD_SIZE.
SLURM_TASK = 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID; exec "$0" "$@"'


class SlurmStep:
    """The tasks of one job step, each a process started as srun starts it; all reaped on exit."""

    def __init__(self, program: str, args: list[str], tmp_path: pathlib.Path):
        self.tmp_path = tmp_path
        self.port = free_port(count=3)  # MASTER_PORT, the job's own store (+1) and the Wrapper's (+2)
        self.job_id = str(self.port)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs = [tmp_path / f"task{task}.log" for task in range(TASKS)]
        for task in range(TASKS):
            env = dict(os.environ)
            env.update(
                SLURM_JOB_ID=self.job_id, SLURM_STEP_ID="0", SLURM_PROCID=str(task), SLURM_NTASKS=str(TASKS),
                SLURM_LOCALID=str(task), SLURM_NODEID="0", SLURM_NNODES="1", SLURM_NTASKS_PER_NODE=str(TASKS),
                SLURM_JOB_NODELIST=socket.gethostname(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port),
                TORCH_CPP_LOG_LEVEL="error", PYTHONUNBUFFERED="1",
            )
            for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
                env.pop(name, None)
            with open(self.logs[task], "wb") as out:
                self.procs.append(subprocess.Popen(
                    ["bash", "-c", SLURM_TASK, sys.executable, str(USERS / program), *args],
                    env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True))

    def output(self, task: int) -> str:
        return self.logs[task].read_text(errors="replace")

    def outputs(self) -> str:
        return "\n".join(f"--- task {t} (rc={p.poll()})\n{self.output(t)[-4000:]}" for t, p in enumerate(self.procs))

    def wait_for(self, task: int, text: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output(task):
            if self.procs[task].poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"task {task} never printed {text!r}:\n{self.outputs()}")
            time.sleep(0.05)

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not finish within {timeout:g}s:\n{self.outputs()}") from None
        return [p.returncode for p in self.procs]

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the task and what it started (monitor, store host)
            except ProcessLookupError:
                pass
            p.wait()


def results(step: SlurmStep) -> dict[int, dict[str, Any]]:
    found = {}
    for task in range(TASKS):
        for line in step.output(task).splitlines():
            if line.startswith("RESULT "):
                found[task] = json.loads(line[len("RESULT "):])
    return found


def run_with_a_killed_task(program: str, args: list[str], tmp_path: pathlib.Path) -> SlurmStep:
    with SlurmStep(program, args, tmp_path) as step:
        step.wait_for(KILLED, f"step {KILL_AT_STEP}\n", timeout=180)
        os.kill(step.procs[KILLED].pid, signal.SIGKILL)  # bash exec'd python: this is the rank itself
        codes = step.wait(timeout=180)
        # Every task has exited: what they started must go by itself, before __exit__ kills it.
        left = leftover_processes({p.pid for p in step.procs}, grace=10.0)
        assert not left, f"processes still running after every task exited: {left}\n{step.outputs()}"
    assert codes == [0 if t != KILLED else -signal.SIGKILL for t in range(TASKS)], step.outputs()
    return step


def assert_the_spare_took_over_and_training_finished(step: SlurmStep) -> None:
    found = results(step)
    survivors = [t for t in range(TASKS) if t != KILLED]
    assert sorted(found) == survivors, f"results from tasks {sorted(found)}:\n{step.outputs()}"
    spare = TASKS - 1
    assert found[spare]["rank"] == KILLED, found[spare]  # the spare took the killed rank's place
    assert {found[t]["rank"] for t in survivors} == set(range(ACTIVE))
    resumed = {found[t]["resumed_at"] for t in survivors}
    assert len(resumed) == 1, resumed  # every rank resumed from the same checkpoint
    assert SAVE_INTERVAL * 2 <= resumed.pop() <= KILL_AT_STEP + SAVE_INTERVAL
    expected = torch.tensor(_reference())
    for t in survivors:
        r = found[t]
        assert (r["iteration"], r["world_size"], r["steps"]) == (1, ACTIVE, TRAIN_ITERS), r
        assert torch.allclose(torch.tensor(r["parameters"]), expected, rtol=1e-5, atol=1e-6), f"task {t}"
    for t in (0, 2, 3):  # active when the fault came: the custom abort hook and the finalize hooks ran
        out = step.output(t)
        assert "abort: " in out and "destroy_state: global state reset" in out, out[-3000:]
    lines = [line.split("[NestedRestarter] ")[1] for line in step.output(0).splitlines() if "[NestedRestarter]" in line]
    assert lines == ["name=[InProcess] state=initialize", "name=[InProcess] state=handling stage=starting",
                     "name=[InProcess] state=handling stage=completed", "name=[InProcess] state=finalized"], lines


_REFERENCE: list[float] = []


def _reference() -> list[float]:
    """What a fault-free job of four ranks ends with, computed in this process."""
    if not _REFERENCE:
        sys.path.insert(0, str(USERS))
        try:
            import toy_megatron

            _REFERENCE.extend(toy_megatron.reference_parameters(TRAIN_ITERS, ACTIVE, LR))
        finally:
            sys.path.remove(str(USERS))
    return _REFERENCE


@pytest.mark.timeout(420)
def test_megatron_lm_style_program_survives_a_killed_rank_with_its_spare(tmp_path: pathlib.Path) -> None:
    args = ["--inprocess-restart", "--inprocess-granularity", "rank", "--inprocess-active-world-size", str(ACTIVE),
            "--inprocess-empty-cuda-cache", "--train-iters", str(TRAIN_ITERS), "--save-interval",
            str(SAVE_INTERVAL), "--lr", str(LR), "--save", str(tmp_path / "checkpoints")]
    step = run_with_a_killed_task("megatron_lm_style.py", args, tmp_path)
    assert_the_spare_took_over_and_training_finished(step)


@pytest.mark.timeout(420)
def test_megatron_bridge_style_program_survives_a_killed_rank_with_its_spare(tmp_path: pathlib.Path) -> None:
    args = ["--active-world-size", str(ACTIVE), "--max-rank-faults", "2", "--monitor-process-logdir",
            str(tmp_path / "monitor"), "--train-iters", str(TRAIN_ITERS), "--save-interval", str(SAVE_INTERVAL),
            "--lr", str(LR), "--save", str(tmp_path / "checkpoints")]
    (tmp_path / "monitor").mkdir()
    step = run_with_a_killed_task("megatron_bridge_style.py", args, tmp_path)
    assert_the_spare_took_over_and_training_finished(step)
    # The monitor's log file, named from SLURM's variables on task 0 only, as Bridge builds it.
    logs = list((tmp_path / "monitor").iterdir())
    assert [p.name for p in logs] == [f"monitor_{step.job_id}_{socket.gethostname()}_0_0.log"], logs
    assert logs[0].stat().st_size > 0
