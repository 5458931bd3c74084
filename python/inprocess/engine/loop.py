"""The restart loop of one wrapped call, as the state machine it is.

It reads top to bottom::

    ENTER ──► ITERATION i ──returned everywhere──► COMPLETE ──► return value
                │  ▲
     fault on   │  │ the plan of barrier i+1, carried out
     any rank   ▼  │
             RESTART: abort ► finalize ► health check ► barrier i+1
                │
                └─ BaseException, failed recovery hook, or discarded ──► TERMINATED (re-raise)

A ``RestartAbort`` in iteration i takes its rank straight to barrier i+1 (the others restart to it),
whose decision ends the job: every rank leaves there, in one iteration.

:func:`run` is the machine (:func:`run_call` around it opens and closes what it
runs on); an iteration is the function on an active rank (:func:`run_active`)
or a spare's wait (:func:`wait_as_spare`). Entering,
restarting and leaving are the executor's doors (:mod:`inprocess.engine.recovery`);
the rule for exceptions in hooks is in :mod:`inprocess.wrap`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .. import environment, faults
from ..control.barrier_watch import BarrierWatch
from ..control.phases import Phase
from ..control.protocol import COMPLETE, FaultRecord
from ..events import call_start_fields
from ..exception import BarrierTimeout, HealthCheckError, RankShouldRestart, RestartAbort
from ..gpu import settings as gpu_settings
from ..gpu.errors import lost_context_in
from ..state import Mode
from .interrupt import interrupted_by
from .leave import Leave, LeaveJob, drop_frames, release_frames
from .recovery import Recovery
from .restart_record import is_communication_error
from .trigger import IterationOutcome

log = logging.getLogger("inprocess")


def run_call(
    rec: Recovery, call_index: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The whole wrapped call (``call_index``: the process's count of calls so far): checks, the rank's
    resources opened, :func:`run`, everything closed; the faults it rehearsed that never fired reported."""
    s = rec.state
    try:
        try:
            faults.plan_from_environment()  # a malformed INPROCESS_FAULTS fails here, naming the bad part
            environment.warn_unknown()  # a misspelt INPROCESS_* variable: once per process, with the nearest name
            gpu_settings.warn_once()  # once per process, and only where NCCL can run on a GPU
            rec.open(call_index)
            try:
                watch = BarrierWatch.on(rec.runtime.protocol, s.initial_rank, rec.expected_at)  # long waits, at INFO
                try:
                    return run(rec, fn, args, kwargs)
                finally:
                    watch.close()  # its thread logs a long barrier wait: gone before the runtime
            finally:
                rec.close()
        finally:
            faults.report_unfired(s.initial_rank, s.initial_world_size, s.iteration)
    except BaseException as e:
        # The caller may keep the exception (to log it, to re-raise it later): its frames must
        # not keep the closed runtime, its store clients or the failed iteration's groups alive.
        release_frames(e)
        raise


def run(rec: Recovery, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The wrapped call from the initial barrier to its return value, or out of the job."""
    rt, s = rec.runtime, rec.state
    rt.emit("call_start", **call_start_fields(s.initial_world_size, rec.settings.timeouts))
    leaving: LeaveJob
    try:
        if not rec.enter():
            return _never_joined(rec)
        while True:
            outcome = _begin_iteration(rec)
            if s.mode == Mode.ACTIVE:
                completed, value = run_active(rec, fn, args, kwargs, outcome)
            else:
                completed, value = wait_as_spare(rec, outcome)
            if completed:
                return _complete(rec, value)
            if rec.ending is not None:  # this rank raised a RestartAbort: the job ends at the next decision
                rec.end_at_decision(outcome)
            rec.restart(outcome)
    except LeaveJob as e:
        leaving = e
    except BaseException as e:
        # Outside the function (a KeyboardInterrupt while a spare waits or at a barrier):
        # the rule for "anywhere", this rank leaves, counted out so that nobody waits for it.
        leaving = LeaveJob(e, Leave.TERMINATED)
    # Left outside the except clause: raised there, the exception would get the engine's
    # LeaveJob as its __context__ ("During handling of the above exception ...").
    rec.leave(leaving)


def _begin_iteration(rec: Recovery) -> IterationOutcome:
    rt, s = rec.runtime, rec.state
    rt.interrupter.reset()
    outcome = rt.trigger.arm(s.iteration, active=s.mode == Mode.ACTIVE)
    log.debug("iteration %d: rank %d runs as %s", s.iteration, s.initial_rank, s.mode.name)
    rt.emit("iteration_start", iteration=s.iteration, mode=s.mode.name, job_rank=s.rank, active_rank=s.active_rank,
            world_size=s.world_size, active_world_size=s.active_world_size)
    return outcome


def run_active(
    rec: Recovery, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], outcome: IterationOutcome
) -> tuple[bool, Any]:
    """One iteration of the function on an active rank: (completed everywhere, its value), or
    (False, None) when a fault restarts the job."""
    rt, s, settings = rec.runtime, rec.state, rec.settings
    s.fn_exception = None
    if rec.grow is not None:
        rec.grow.begin(s.iteration)
    rt.open_iteration_store()
    try:
        rec.set_phase(Phase.RUNNING)
        with rt.interrupter.running(), rt.hang_guard.training(s.iteration, s.world_size):
            if settings.initialize is not None:
                settings.initialize(s.freeze())
            _check_health_before_iteration(rec)
            if rec.restarts:
                rec.restarts[-1].initialized_ns = time.monotonic_ns()
            with faults.arm_from_environment(s.freeze()):  # INPROCESS_FAULTS: rehearsed failures
                value = fn(*args, **kwargs)
    except RankShouldRestart as e:
        ctrl_c = interrupted_by(e)  # raised on top of a Ctrl-C: the rank leaves with that
        if ctrl_c is not None:
            raise LeaveJob(ctrl_c, Leave.TERMINATED) from None
        if isinstance(e.__context__, (Exception, RestartAbort)):
            # Raised on top of the function's own exception, still on its way out.
            fault_in_function(rec, e.__context__)
        return False, None
    except LeaveJob:
        raise
    except BaseException as e:
        fault_in_function(rec, e)
        return False, None
    # The function returned: wait until it returned on every active rank.
    rec.set_phase(Phase.COMPLETION)
    outcome.completing = True  # before the count: from now on the event may be "complete"
    assert s.active_world_size is not None  # set by the plan before any iteration runs
    rt.protocol.arrive_completed(s.iteration, s.active_world_size)
    timeout = settings.timeouts.completion_timeout.total_seconds()
    if not outcome.done.wait(timeout):
        late = BarrierTimeout(f"the other ranks did not complete iteration {s.iteration} within {timeout:g}s")
        raise LeaveJob(late, Leave.COMPLETION_TIMEOUT)
    rec.check_outcome(outcome)
    return outcome.event == COMPLETE, value


def fault_in_function(rec: Recovery, e: BaseException) -> None:
    """The function (or ``initialize``) raised ``e``: a fault of this rank, a
    consequence of the restart, or a reason to leave."""
    s, rt = rec.state, rec.runtime
    p = rt.protocol
    if isinstance(e, RestartAbort):
        rec.end_job(e)  # every rank leaves at the next decision, this one too
        return
    if not isinstance(e, Exception):
        # Never a consequence of the abort (a Ctrl-C during a restart): the rank leaves.
        raise LeaveJob(e, Leave.TERMINATED) from None
    if rt.interrupter.fired:
        log.debug("rank %d: %s while restarting", s.initial_rank, type(e).__name__)
        if is_communication_error(type(e).__name__, str(e)):
            # What the restart's abort did to this rank's collectives: not worth a record.
            drop_frames(e)
            return
        first_hand = False  # its own fault, out after the restart came: maybe its cause (restart_record)
    else:
        # Publish before the frames are dropped: dropping them may destroy
        # this rank's process group, and a peer that sees its connection
        # close must find the restart already requested.
        first_hand = not p.restart_requested(s.iteration)
    # An exception after the restart was requested may be a consequence
    # (a peer's aborted connection) or a fault of its own at the same
    # moment: it is recorded either way, marked, and only a first-hand
    # fault counts as this rank's (fn_exception, FaultCounter).
    kind = "exception" if first_hand else "after_restart"
    record = FaultRecord.from_exception(s.initial_rank, s.iteration, kind, e)
    p.report_fault(record)
    rt.emit("fault", record.t_ns, iteration=s.iteration, fault=kind, type=record.type, message=record.message)
    if first_hand:
        s.fn_exception = e
    what = "exception" if first_hand else "exception while restarting"
    log.log(logging.DEBUG if rec.storm.in_storm else logging.INFO, "rank %d: %s in iteration %d: %s: %s",
            s.initial_rank, what, s.iteration, type(e).__name__, e)
    drop_frames(e)


def wait_as_spare(rec: Recovery, outcome: IterationOutcome) -> tuple[bool, Any]:
    """One iteration of a spare: it waits, ready to take a rank over; (completed, None)."""
    rec.set_phase(Phase.RUNNING)
    try:
        _check_health_before_iteration(rec)
    except LeaveJob:
        raise
    except (Exception, RestartAbort) as e:
        # An unfit spare is a fault like any other: the restart's health check decides.
        fault_in_function(rec, e)
        if rec.ending is not None:
            return False, None  # a RestartAbort: the job ends at the next decision, nothing to wait for
    s = rec.state
    with faults.arm_from_environment(s.freeze()), rec.runtime.hang_guard.training(s.iteration, s.world_size):
        _wait_stamping_progress(rec, outcome)
    rec.check_outcome(outcome)
    return outcome.event == COMPLETE, None


def _wait_stamping_progress(rec: Recovery, outcome: IterationOutcome) -> None:
    """A spare waits for the trigger's event, stamping progress every soft_timeout/4: one
    frozen (SIGSTOP) or holding the GIL stops stamping, and its monitor kills it at hard_timeout."""
    hang_guard = rec.runtime.hang_guard
    chunk = rec.settings.timeouts.soft_timeout.total_seconds() / 4
    while not outcome.done.wait(chunk):
        hang_guard.stamp_progress()


def _check_health_before_iteration(rec: Recovery) -> None:
    """``health_check`` also runs before every iteration, after ``initialize``, as in
    nvidia_resiliency_ext: a failure there is a fault of this rank (the job restarts).
    A lost CUDA context is not: no restart repairs it, the rank leaves at once."""
    try:
        rec.check_health()
    except HealthCheckError as e:
        if lost_context_in(e) is not None:
            raise LeaveJob(e, Leave.HEALTH_CHECK_FAILED) from None
        raise


def _complete(rec: Recovery, value: Any) -> Any:
    s, rt = rec.state, rec.runtime
    rec.set_phase(Phase.DONE)
    rt.emit("exit", outcome="completed", reason=None, iteration=s.iteration)
    rt.protocol.leave(s.iteration, s.world_size)
    if rec.settings.completion is not None:
        rec.settings.completion(s.freeze())
    return value if s.mode == Mode.ACTIVE else None


def _never_joined(rec: Recovery) -> None:
    """The job ended while this process waited to join it: it was never a member (it tells
    nobody it leaves), and its call returns what a spare's returns."""
    s = rec.state
    rec.set_phase(Phase.DONE)
    rec.runtime.emit("exit", outcome="completed", reason="never joined", iteration=s.iteration)
    return None
