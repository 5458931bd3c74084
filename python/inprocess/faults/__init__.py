"""Rehearse failures: inject faults on chosen ranks at a chosen step or time, from an environment variable.

Set ``INPROCESS_FAULTS`` and run the job unchanged::

    INPROCESS_FAULTS="sigkill@rank=2,step=30;exception@rank=1,after=5s,iteration=1"

Each entry names a :class:`Kind`, the *initial* ranks it hits, when (``step=N``
through :func:`maybe_inject`, or ``after=DURATION`` from the start of the
iteration), and the iterations (default: the first only). The grammar is in
:mod:`inprocess.faults.plan`. Random choices (``rank=random``,
``step=10..20``, ``after=1s..5s``) are drawn from the plan's ``seed=N``: the
same plan gives the same faults on the same ranks at the same steps.

Two ways in:

* ``maybe_inject(step)`` in the training loop fires the step faults (with
  the variable unset it costs one environment lookup);
* ``arm_from_environment(state)`` at the start of an iteration starts a
  timer for the timed faults; leave its ``with`` block (or call ``disarm()``)
  when the iteration ends;
* ``enter_phase(...)``, called by the wrapper at each phase change, fires the
  ``phase=NAME`` faults (a fault during the entry, or a restart's abort,
  finalize, health check, barrier, reassignment or a takeover of the lead).

At the end of a wrapped call, ``report_unfired`` (called by the wrapper) warns
about each entry due on the rank that never fired, and why
(:mod:`inprocess.faults.unfired`).

GPU faults (``gpu_error``, ``gpu_sleep``) need a CUDA device and raise
:class:`FaultUnavailable` on a rank they are due on without one.
"""

from .actions import FaultUnavailable, InjectedException, perform
from .arming import (
    DELIVERY_SIGNAL,
    ENV_VAR,
    ArmedFaults,
    arm,
    arm_from_environment,
    maybe_inject,
    plan_from_environment,
    report_unfired,
)
from .phases import enter_phase
from .plan import PHASES, FaultPlan, FaultSpec, Kind, Ranks, ScheduledFault

__all__ = [
    "DELIVERY_SIGNAL",
    "ENV_VAR",
    "ArmedFaults",
    "FaultPlan",
    "FaultSpec",
    "FaultUnavailable",
    "PHASES",
    "InjectedException",
    "Kind",
    "Ranks",
    "ScheduledFault",
    "arm",
    "arm_from_environment",
    "enter_phase",
    "maybe_inject",
    "perform",
    "plan_from_environment",
    "report_unfired",
]
