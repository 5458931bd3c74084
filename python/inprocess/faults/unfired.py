"""Entries of a fault plan that never fired, and why: said at the end of the wrapped call.

A rehearsal whose fault never happened looks like a job that survived it. A
``step=N`` entry fires only where the training loop calls
:func:`inprocess.faults.maybe_inject`, which code written for
nvidia_resiliency_ext does not; an ``after=`` entry only if the iteration
lasts that long; a ``phase=`` entry only if the rank enters that phase; an
``iteration=`` entry only if the job gets there. This module records, in
this process, what the plan needed (the steps reported in each iteration, how
long each iteration was armed, the phases entered, the entries fired), and
:func:`report_unfired`, called by the wrapper when its call ends on the rank,
logs one WARNING per entry due on this rank that never fired, with the reason.
An iteration with step faults due that ends without a single step reported
also says so at once, once per process: the first restart of a rehearsal
that cannot work tells it.
"""

from __future__ import annotations

import logging
import threading

from .plan import MAIN_THREAD_KINDS, FaultPlan, FaultSpec, ScheduledFault

log = logging.getLogger("inprocess.faults")

_lock = threading.Lock()
fired: set[tuple[str, int]] = set()  # (plan key, entry index) of every entry fired in this process
_steps: dict[int, int] = {}  # iteration -> the highest step maybe_inject reported in it
_armed_s: dict[int, float] = {}  # iteration -> how long it was armed (from its start to its end)
_spare: set[int] = set()  # iterations in which this rank was a spare (no training code ran)
_phases: set[tuple[str, int]] = set()  # (phase name as a plan names it, iteration) entered
_warned_no_steps = False

MAX_ITERATIONS_SCANNED = 10_000  # a long job's report looks at this many iterations at most


def step_reported(iteration: int, step: int) -> None:
    with _lock:
        _steps[iteration] = max(step, _steps.get(iteration, -1))


def iteration_ended(iteration: int, armed_s: float, active: bool, step_faults: list[ScheduledFault]) -> None:
    """An arming of ``iteration`` ended after ``armed_s``; ``step_faults`` were due at steps in it."""
    global _warned_no_steps
    with _lock:
        _armed_s[iteration] = max(armed_s, _armed_s.get(iteration, 0.0))
        if not active:
            _spare.add(iteration)
        warn = bool(step_faults) and iteration not in _steps and not _warned_no_steps
        if warn:
            _warned_no_steps = True
    if warn:
        f = step_faults[0]
        log.warning("INPROCESS_FAULTS entry %d (%s) was due at step %d of iteration %d, but no step was reported "
                    "in that iteration: a step= fault fires only where the training loop calls "
                    "inprocess.faults.maybe_inject(step)", f.index + 1, f.spec, f.step, iteration)


def phase_entered(name: str, iteration: int) -> None:
    with _lock:
        _phases.add((name, iteration))


def report_unfired(plan: FaultPlan | None, rank: int, world_size: int, last_iteration: int) -> list[str]:
    """Log a WARNING for each entry of ``plan`` due on initial ``rank`` that never fired in this process,
    saying why; returns the messages. ``last_iteration``: the iteration the call ended in."""
    if plan is None:
        return []
    key = str(plan)
    first = max(0, last_iteration + 1 - MAX_ITERATIONS_SCANNED)
    due: dict[int, list[ScheduledFault]] = {}
    for iteration in range(first, last_iteration + 1):
        for f in plan.schedule(rank, world_size, iteration):
            due.setdefault(f.index, []).append(f)
    messages = []
    with _lock:
        for index, spec in enumerate(plan.faults):
            if (key, index) in fired:
                continue
            reasons = [_why(f) for f in due.get(index, [])]
            if not reasons:
                later = _after_the_end(plan, index, spec, rank, world_size, last_iteration)
                if later is None:
                    continue  # not this rank's entry
                reasons = [later]
            shown = "; ".join(dict.fromkeys(reasons[:3])) + (f"; and {len(reasons) - 3} more" if len(reasons) > 3
                                                              else "")
            messages.append(f"INPROCESS_FAULTS entry {index + 1} ({spec}) never fired on initial rank {rank}: {shown}")
    for message in messages:
        log.warning("%s", message)
    return messages


def _why(f: ScheduledFault) -> str:
    i = f.iteration
    if f.iteration in _spare and f.spec.kind in MAIN_THREAD_KINDS:
        return f"the rank was a spare in iteration {i}: no training code ran there"
    if f.step is not None:
        if i not in _steps:
            return (f"step={f.step}: no step was reported in iteration {i}: call "
                    "inprocess.faults.maybe_inject(step) in the training loop")
        return f"step={f.step}: the steps reported in iteration {i} went up to {_steps[i]}"
    if f.delay_s is not None:
        if i not in _armed_s:
            return f"after={f.delay_s:g}s: iteration {i} never ran the function on this rank"
        return f"after={f.delay_s:g}s: iteration {i} ended {_armed_s[i]:.1f} s after it started"
    phase = f.spec.phase
    if (phase, i) not in _phases:
        leader = " (it runs on the barrier's leader only)" if phase in ("reassignment", "takeover") else ""
        return f"phase={phase}: the rank did not enter that phase in iteration {i}{leader}"
    return f"phase={phase}: entered in iteration {i}, but the fault did not fire"


def _after_the_end(plan: FaultPlan, index: int, spec: FaultSpec, rank: int, world_size: int,
                   last_iteration: int) -> str | None:
    """Why an entry due on ``rank`` only in iterations after the last one never fired; None if it is not due."""
    if spec.iterations is None:
        return None
    for iteration in spec.iterations:
        if iteration > last_iteration and any(f.index == index for f in plan.schedule(rank, world_size, iteration)):
            return f"iteration={iteration}: the call ended in iteration {last_iteration}"
    return None


def reset() -> None:
    """Forget what this process recorded (tests)."""
    global _warned_no_steps
    with _lock:
        fired.clear()
        _steps.clear()
        _armed_s.clear()
        _spare.clear()
        _phases.clear()
        _warned_no_steps = False
