"""examples/slurm/respawn_task.sh, the README's SLURM recipe for respawning a rank inside its srun task.

No SLURM here: the script is run as srun would run one task of a step (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID set), around the stand-in rank of tests/test_launch_respawn.py, whose lives record what
they saw. What srun adds (several tasks, --kill-on-bad-exit=0 keeping the others running) is srun's.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import pytest

from conftest import leftover_processes
from test_launch_respawn import every_pid, launcher_env, lives, write_standin

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90)]

SCRIPT = pathlib.Path(__file__).parent.parent / "examples" / "slurm" / "respawn_task.sh"


def run_task(tmp_path: pathlib.Path, plan: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """One task of a 4-task step: task 2, the first of its node."""
    standin = write_standin(tmp_path)
    full = launcher_env(tmp_path, {2: plan})
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        full.pop(name, None)
    full.update(SLURM_PROCID="2", SLURM_NTASKS="4", SLURM_LOCALID="0", **env)
    full["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{full['PATH']}"  # `python` is this one
    try:
        return subprocess.run(["bash", str(SCRIPT), str(standin), "a1"], env=full, capture_output=True, text=True,
                              timeout=60)
    finally:
        assert not leftover_processes(every_pid(tmp_path), grace=5.0)


def test_a_killed_rank_is_respawned_in_its_task_as_a_joiner_and_the_done_file_marks_the_end(
        tmp_path: pathlib.Path) -> None:
    done = tmp_path / "done"
    res = run_task(tmp_path, ["sigkill", "exit:75", "ok"], RESPAWN_BACKOFF="0.1", DONE_FILE=str(done))
    assert res.returncode == 0, res.stderr
    # Only the script's own lines are compared (python's output goes to the same stream).
    assert [line for line in res.stderr.splitlines() if line.startswith("respawn_task:")] == [
        "respawn_task: respawning rank 2 (attempt 1 of 3) in 0.1s: killed by SIGKILL",
        "respawn_task: respawning rank 2 (attempt 2 of 3) in 0.2s: exited with status 75"]
    first, second, third = lives(tmp_path, 2)
    assert (first["env"]["RANK"], first["env"]["WORLD_SIZE"], first["env"]["LOCAL_RANK"]) == ("2", "4", "0")
    assert "INPROCESS_JOIN" not in first["env"] and "INPROCESS_RESPAWN_COUNT" not in first["env"]
    assert second["env"] == {**first["env"], "INPROCESS_JOIN": "1", "INPROCESS_RESPAWN_COUNT": "1"}
    assert third["env"] == {**first["env"], "INPROCESS_JOIN": "1", "INPROCESS_RESPAWN_COUNT": "2"}
    assert third["argv"] == ["a1"]
    assert done.exists()  # the job completed: the other tasks' loops respawn nothing more


def test_a_rank_that_always_dies_is_respawned_n_times_with_a_doubling_back_off(tmp_path: pathlib.Path) -> None:
    res = run_task(tmp_path, ["sigkill"], RESPAWNS="2", RESPAWN_BACKOFF="0.3")
    assert res.returncode == 137, res.stderr
    seen = lives(tmp_path, 2)
    assert [life["env"].get("INPROCESS_RESPAWN_COUNT") for life in seen] == [None, "1", "2"]
    assert res.stderr.splitlines()[-1] == "respawn_task: rank 2 killed by SIGKILL; no respawn left: 2 of 2 used"
    gaps = [later["t"] - earlier["t"] for earlier, later in zip(seen[:-1], seen[1:], strict=True)]
    assert gaps[0] >= 0.3 and gaps[1] >= 0.6, gaps


@pytest.mark.parametrize("status", [1, 3])
def test_the_ranks_own_failure_is_not_respawned(tmp_path: pathlib.Path, status: int) -> None:
    res = run_task(tmp_path, [f"exit:{status}", "ok"], RESPAWN_BACKOFF="0.1")
    assert res.returncode == status and not res.stderr, res.stderr
    assert len(lives(tmp_path, 2)) == 1


def test_a_replacement_nodes_task_takes_the_rank_and_world_it_is_given_and_joins_from_its_first_process(
        tmp_path: pathlib.Path) -> None:
    # The recipe's replacement step: 4 tasks of their own (SLURM_NTASKS=4) in a job of 8, for ranks 4..7.
    res = run_task(tmp_path, ["ok"], RANK_OFFSET="4", WORLD_SIZE="8", INPROCESS_JOIN="1")
    assert res.returncode == 0, res.stderr
    (life,) = lives(tmp_path, 6)
    assert (life["env"]["RANK"], life["env"]["WORLD_SIZE"], life["env"]["LOCAL_RANK"]) == ("6", "8", "0")
    assert life["env"]["INPROCESS_JOIN"] == "1" and "INPROCESS_RESPAWN_COUNT" not in life["env"]


def test_no_respawn_once_another_rank_finished(tmp_path: pathlib.Path) -> None:
    done = tmp_path / "done"
    done.touch()  # another task's rank exited 0 meanwhile
    start = time.monotonic()
    res = run_task(tmp_path, ["sigkill", "ok"], RESPAWN_BACKOFF="0.1", DONE_FILE=str(done))
    assert res.returncode == 137, res.stderr
    assert res.stderr.splitlines()[-1] == f"respawn_task: rank 2 not respawned: the job is ending ({done} exists)"
    assert len(lives(tmp_path, 2)) == 1
    assert time.monotonic() - start < 30
