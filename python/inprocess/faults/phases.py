"""Faults that fire when a rank enters a phase of the wrapper (``phase=NAME`` in a plan).

The wrapper calls :func:`enter_phase` each time it changes phase, and the rank
assignment calls it on the leader before it decides. With ``INPROCESS_FAULTS``
unset that costs one environment lookup. The fault runs in the calling thread
(the main thread for every phase), so an ``exception`` there is raised out of
the engine's own code at that point, as a bug or a failing hook would be.
"""

from __future__ import annotations

import logging
import os

from ..control import phases as phase_table
from ..state import Mode
from . import unfired
from .arming import ENV_VAR, fire, plan_from_environment
from .plan import MAIN_THREAD_KINDS, PHASES, FaultPlan, ScheduledFault

log = logging.getLogger("inprocess.faults")

# The wrapper's phase (inprocess._native.Phase's name) -> the name a plan gives it (the phase table's column).
WRAPPER_PHASES = {row.name: row.fault_name for row in phase_table.TABLE if row.fault_name is not None}

# (plan, rank, world size, iteration, active) -> the phase faults due then; the last one only.
_due: dict[tuple[FaultPlan, int, int, int, bool], dict[str, list[ScheduledFault]]] = {}


def enter_phase(phase: str, initial_rank: int, initial_world_size: int, iteration: int, mode: Mode) -> None:
    """The rank enters ``phase`` (a key of :data:`WRAPPER_PHASES` or of ``PHASES``): fire what is due there.

    ``mode`` is the rank's mode: a spare (``Mode.INACTIVE``) initializes no
    iteration, so the faults that act in the training code's thread
    (exception, hang) are not injected into its ``initialize`` phase (its
    wait), as timed faults are not. Every other phase runs the wrapper's own
    code in the main thread, whatever the mode (at ``entry`` no rank has one
    yet).
    """
    if os.environ.get(ENV_VAR) is None:
        return
    name = WRAPPER_PHASES.get(phase, phase)
    if name not in PHASES:
        return  # COMPLETION, DONE, TERMINATED: no fault is named after them
    plan = plan_from_environment()
    if plan is None:
        return
    unfired.phase_entered(name, iteration)
    spare = mode == Mode.INACTIVE
    key = (plan, initial_rank, initial_world_size, iteration, spare)
    due = _due.get(key)
    if due is None:
        due = {}
        for f in plan.schedule(initial_rank, initial_world_size, iteration):
            if f.spec.phase is None:
                continue
            if spare and f.spec.phase == "initialize" and f.spec.kind in MAIN_THREAD_KINDS:
                log.info("initial rank %d is a spare: %s not injected (no training code runs)", initial_rank, f.spec)
                continue
            due.setdefault(f.spec.phase, []).append(f)
        _due.clear()
        _due[key] = due
    for f in due.get(name, ()):
        fire(f, str(plan), initial_rank)

