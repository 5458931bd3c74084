"""A SLURM task's node layout (inprocess/control/slurm_layout.py), from the variables srun sets.

The environments below are those real srun 22.05 gave its tasks on tools/slurm_cluster.py's cluster
(``srun -N2 -n3``: ``SLURM_STEP_TASKS_PER_NODE=2,1``, no ``SLURM_NTASKS_PER_NODE``; ``srun -N3 -n3``:
``1(x3)``); tests/test_slurm_real.py reads the layout inside real tasks too.
"""

from __future__ import annotations

import logging
import re

import pytest

from inprocess.control import slurm_layout
from inprocess.control.node_link import NodeLayout


def task(local: int, node: int, **more: str) -> dict[str, str]:
    return {"SLURM_LOCALID": str(local), "SLURM_NODEID": str(node), **more}


@pytest.mark.parametrize(("value", "counts"), [
    ("4", [4]), ("3,1", [3, 1]), ("2(x3),1", [2, 2, 2, 1]), ("1(x3)", [1, 1, 1]), ("8(x2),4(x2)", [8, 8, 4, 4]),
])
def test_the_counts_per_node_are_read_with_their_repetitions(value: str, counts: list[int]) -> None:
    assert slurm_layout.tasks_per_node("SLURM_STEP_TASKS_PER_NODE", value) == counts


@pytest.mark.parametrize("value", ["", "x", "2(x)", "2(3)", "0", "2(x0)", "2,,1", "-1"])
def test_a_malformed_count_list_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"SLURM_TASKS_PER_NODE={value!r}: expected task counts per node")):
        slurm_layout.tasks_per_node("SLURM_TASKS_PER_NODE", value)


def test_a_step_without_ntasks_per_node_has_its_layout_from_the_steps_count_list() -> None:
    # Finding 4 of issue 33: `sbatch --ntasks=4` over two nodes gives 3,1 and no SLURM_NTASKS_PER_NODE;
    # the wrapper found no layout and ran without node agents, saying nothing.
    env = task(2, 0, SLURM_STEP_TASKS_PER_NODE="3,1", SLURM_TASKS_PER_NODE="3,1", SLURMD_NODENAME="n1")
    assert NodeLayout.from_env(env) == NodeLayout("n1", 2, 3)
    assert NodeLayout.from_env(task(0, 1, SLURM_STEP_TASKS_PER_NODE="3,1", SLURMD_NODENAME="n2")) == (
        NodeLayout("n2", 0, 1))
    assert NodeLayout.from_env(task(1, 2, SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURMD_NODENAME="n3")) == (
        NodeLayout("n3", 1, 2))
    assert NodeLayout.from_env(task(0, 3, SLURM_STEP_TASKS_PER_NODE="2(x3),1", SLURMD_NODENAME="n4")) == (
        NodeLayout("n4", 0, 1))
    # The job's list, where a task has no step list (not seen from srun, which always sets it).
    assert NodeLayout.from_env(task(1, 1, SLURM_TASKS_PER_NODE="2(x2)")) == NodeLayout("1", 1, 2)


def test_the_steps_own_layout_comes_before_the_jobs_ntasks_per_node() -> None:
    # sbatch --ntasks-per-node=4 exports SLURM_NTASKS_PER_NODE=4 to every step; a step of 6 tasks has 4,2.
    env = task(1, 1, SLURM_NTASKS_PER_NODE="4", SLURM_STEP_TASKS_PER_NODE="4,2")
    assert NodeLayout.from_env(env) == NodeLayout("1", 1, 2)
    assert NodeLayout.from_env(task(3, 0, SLURM_NTASKS_PER_NODE="4")) == NodeLayout("0", 3, 4)


def test_a_later_steps_task_is_named_by_the_node_it_runs_on_not_by_the_steps_numbering() -> None:
    # A replacement node's step (srun --jobid --nodelist=<spare>) numbers its one node 0, as the training
    # step numbers its first node: by SLURM_NODEID both would be node "0" (one agent socket on a host).
    replacement = task(1, 0, SLURM_STEP_TASKS_PER_NODE="2", SLURMD_NODENAME="inprocess-node3")
    first = task(1, 0, SLURM_STEP_TASKS_PER_NODE="2(x2)", SLURMD_NODENAME="inprocess-node1")
    assert NodeLayout.from_env(replacement) == NodeLayout("inprocess-node3", 1, 2)
    assert NodeLayout.from_env(first) == NodeLayout("inprocess-node1", 1, 2)


def test_a_local_id_beyond_the_nodes_count_is_refused() -> None:
    with pytest.raises(ValueError, match=r"SLURM_LOCALID=3 is not in \[0, SLURM_STEP_TASKS_PER_NODE=3\)"):
        NodeLayout.from_env(task(3, 0, SLURM_STEP_TASKS_PER_NODE="3,1"))
    with pytest.raises(ValueError, match="SLURM_LOCALID='x'.*expected integers"):
        NodeLayout.from_env({"SLURM_LOCALID": "x", "SLURM_STEP_TASKS_PER_NODE": "2"})


def test_without_a_count_for_the_node_agents_are_off_and_it_is_said_once(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slurm_layout, "_said_off", False)
    caplog.set_level(logging.INFO, logger="inprocess")
    assert NodeLayout.from_env({"SLURM_LOCALID": "0"}) is None
    assert NodeLayout.from_env(task(0, 5, SLURM_STEP_TASKS_PER_NODE="2,2")) is None
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert lines == ["no node agents: SLURM_LOCALID=0 is set, but none of SLURM_STEP_TASKS_PER_NODE, "
                     "SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE is set: every rank talks to the store directly"]
    assert NodeLayout.from_env({}) is None  # not a SLURM task: nothing to say
