"""The launcher's incarnation of a job, which scopes every store key of a call.

torchrun restarts its workers (``--max-restarts``) with the same store
address and the same call index; with its shared agent store
(``TORCHELASTIC_USE_AGENT_STORE``) the store even outlives the workers, and
holds whatever the previous workers wrote: seats, barrier counters, events.
SLURM requeues a job (``SLURM_RESTART_COUNT``) with the same addresses. The
keys, the node agent's socket name and the helper processes' view of the
store therefore include the variables the launchers set differently for every
incarnation, so that a new incarnation never reads its predecessor's keys.

SLURM's step id is not one of them: a job's later step (``srun --jobid`` on a
node that replaces a lost one) must join the training step that runs, and
srun numbers every step anew (``SLURM_STEP_ID``). Its processes carry the
job's id and restart count, so they belong to the running incarnation, while
a process left from before a requeue does not. Two steps of one job that each
start a job of their own meet in no store: each step's first rank serves a
store of its own, which ends with the step's wrapped call.

This module imports no torch: the helper processes use it.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Mapping

from .keys import call_prefix

__all__ = ["INCARNATION_VARS", "SLURM_VARS", "TORCHRUN_VARS", "call_prefix", "job_incarnation"]

# Set by the launchers, different for every incarnation of a job.
TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
# Not SLURM_STEP_ID: a job's steps share its incarnation (module docstring).
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_RESTART_COUNT")
INCARNATION_VARS = TORCHRUN_VARS + SLURM_VARS


def _part(launcher: str, names: tuple[str, ...], env: Mapping[str, str]) -> str | None:
    if not any(name in env for name in names):
        return None
    # quote: a run id is the user's text (torchrun's --rdzv-id); a "/" in it must not add a key level.
    return launcher + "." + ".".join(urllib.parse.quote(env.get(name, ""), safe="") for name in names)


def job_incarnation(env: Mapping[str, str] | None = None) -> str:
    """This incarnation of the job, e.g. ``torchrun.<run id>.<restart count>`` or
    ``slurm.<job>.<restart count>`` (both, joined by ``+``, under torchrun
    inside SLURM); ``""`` when no launcher set any of :data:`INCARNATION_VARS`."""
    env = os.environ if env is None else env
    parts = [p for p in (_part("torchrun", TORCHRUN_VARS, env), _part("slurm", SLURM_VARS, env)) if p is not None]
    return "+".join(parts)
