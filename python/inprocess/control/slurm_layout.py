"""Where a SLURM task sits on its node, from the variables srun gives it.

srun sets ``SLURM_LOCALID`` (the task's index on its node) and ``SLURM_NODEID``
(its node's index among the step's nodes) in every task. How many tasks share
the node is said by ``SLURM_NTASKS_PER_NODE`` only when the job or step asked
for ``--ntasks-per-node``; every step has ``SLURM_STEP_TASKS_PER_NODE``, and
every job ``SLURM_TASKS_PER_NODE``: one count per node, in node order, comma
separated, a run of equal counts written once with its repetition (``2(x3),1``:
three nodes of 2 tasks, then one of 1), as sbatch(1) and srun(1) describe them.
A job started with ``--ntasks=4`` over two nodes has ``3,1``. The step's list
is the step's own layout (a step may use fewer nodes or tasks than its job), so
it comes first.

The node is named by ``SLURMD_NODENAME``, the node the task runs on: a later
step of the job (a replacement node's, ``srun --jobid``) numbers its nodes from
0 again, so ``SLURM_NODEID`` would name another node of the job.

This module imports no torch.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Mapping

log = logging.getLogger("inprocess")

# The lists of counts per node, the step's first (module docstring).
COUNT_LISTS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
_RUN = re.compile(r"(\d+)(?:\(x(\d+)\))?")
_said_off = False


def tasks_per_node(name: str, value: str) -> list[int]:
    """The counts of ``value`` (``2(x3),1`` -> [2, 2, 2, 1]); ValueError naming ``name`` when malformed."""
    counts: list[int] = []
    for run in value.split(","):
        m = _RUN.fullmatch(run.strip())
        if m is None or int(m.group(1)) < 1 or (m.group(2) is not None and int(m.group(2)) < 1):
            raise ValueError(f"{name}={value!r}: expected task counts per node such as '4', '3,1' or '2(x3),1'")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _count(env: Mapping[str, str], node_index: int | None) -> tuple[int | None, str]:
    """This node's task count and the variable it came from; (None, why not) without one."""
    if "SLURM_STEP_TASKS_PER_NODE" in env and node_index is not None:
        counts = tasks_per_node("SLURM_STEP_TASKS_PER_NODE", env["SLURM_STEP_TASKS_PER_NODE"])
        if node_index < len(counts):
            return counts[node_index], "SLURM_STEP_TASKS_PER_NODE"
    if "SLURM_NTASKS_PER_NODE" in env:
        try:
            return int(env["SLURM_NTASKS_PER_NODE"]), "SLURM_NTASKS_PER_NODE"
        except ValueError:
            raise ValueError(f"SLURM_NTASKS_PER_NODE={env['SLURM_NTASKS_PER_NODE']!r}: expected an integer") from None
    if "SLURM_TASKS_PER_NODE" in env and node_index is not None:
        counts = tasks_per_node("SLURM_TASKS_PER_NODE", env["SLURM_TASKS_PER_NODE"])
        if node_index < len(counts):
            return counts[node_index], "SLURM_TASKS_PER_NODE"
    given = [f"{n}={env[n]}" for n in ("SLURM_NODEID", *COUNT_LISTS) if n in env]
    return None, (f"{', '.join(given)} name no count for this node" if given else
                  "none of SLURM_STEP_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE, SLURM_TASKS_PER_NODE is set")


def slurm_layout(env: Mapping[str, str]) -> tuple[str, int, int] | None:
    """(node, local rank, tasks on the node) of a SLURM task; None when ``SLURM_LOCALID`` is not set, or
    (said once, at INFO) when no variable gives this node's task count: node agents are then off."""
    global _said_off
    if "SLURM_LOCALID" not in env:
        return None
    try:
        local_rank = int(env["SLURM_LOCALID"])
        node_index = int(env["SLURM_NODEID"]) if "SLURM_NODEID" in env else None
    except ValueError:
        raise ValueError(f"SLURM_LOCALID={env['SLURM_LOCALID']!r}, SLURM_NODEID={env.get('SLURM_NODEID')!r}: "
                         "expected integers") from None
    size, source = _count(env, node_index)
    if size is None:
        if not _said_off:
            _said_off = True
            log.info("no node agents: SLURM_LOCALID=%d is set, but %s: every rank talks to the store directly",
                     local_rank, source)
        return None
    if not 0 <= local_rank < size:
        raise ValueError(f"SLURM_LOCALID={local_rank} is not in [0, {source}={size})")
    return env.get("SLURMD_NODENAME") or env.get("SLURM_NODEID") or socket.gethostname(), local_rank, size
