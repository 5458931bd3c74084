"""The restart of one wrapped call on one rank: the executor of its recovery plans.

A decision comes out of a barrier as a value; the rank derives its plan from
it (:meth:`inprocess.control.recovery_plan.RecoveryPlan.for_rank`, a pure
function) and :class:`Recovery` carries the plan out. It has three doors:

* :meth:`Recovery.enter`: into the job, at barrier 0 or by an admission
  (``INPROCESS_JOIN=1``), to the first plan;
* :meth:`Recovery.restart`: after a fault, one step per row of the phase
  table's restart (abort, finalize, health check, barrier), to the next plan;
* :meth:`Recovery.leave`: out of the job, by the way its :class:`Standing` says.

A plan is applied by its transition (stay active, activate, stay a spare,
deactivate, join, leave); a restart releases the failed iteration's resources
when the plan's schedule says (:data:`~inprocess.control.recovery_plan.RELEASE_SCHEDULE`):
the groups before the barrier, NCCL's teardown, which runs from the abort on,
once the decision is known (:mod:`inprocess.gpu.nccl_reaper`).
The callbacks of the engine's threads (the restart trigger's release of the
main thread, the watchdog's soft timeout) and the leader's decision, which the
barrier asks for, are here too: they act on the same state.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .. import faults
from ..control import agreement, joining, phases
from ..control.membership import Membership
from ..control.phases import Phase
from ..control.protocol import HOST, Decision, FaultRecord, RestartProtocol, SeatTaken
from ..control.records import ENDS_JOB
from ..control.recovery_plan import (
    DecisionSummary,
    Moment,
    RecoveryPlan,
    Resource,
    Transition,
    released_at,
    seated,
)
from ..events import decision_fields
from ..exception import BarrierTimeout, HealthCheckError, InternalError, RankDiscarded, RestartAbort, TimeoutError
from ..gpu.errors import NcclAbortTimeout, leave_for_lost_context, lost_context_in
from ..rank_assignment import AssignmentRunner, RankAssignmentMismatch
from ..state import FrozenState, Mode, State
from . import join
from .config import Settings
from .grow import GrowPoints
from .leave import Leave, LeaveJob, count_out_before_joining, exit_if_nccl_abort_abandoned, fault_kind, release_frames
from .restart_record import RestartRecord
from .runtime import RankRuntime
from .soft_timeout import report_soft_timeout
from .storm import StormBrake, StormLimits, Verdict
from .trigger import IterationOutcome

log = logging.getLogger("inprocess")


class Standing(enum.Enum):
    """Where this process stands towards the job, which says how it leaves it."""

    STARTING = "starting"  # before its first decision: counted out where its seat says
    JOINING = "joining"  # waiting to be admitted (INPROCESS_JOIN=1): withdraws, counted out if admitted first
    MEMBER = "member"  # applied a decision: records its fault, arrives terminated at the next barrier


class Recovery:
    """One rank's restart machinery for one wrapped call (module docstring).

    ``restarts`` is the call's list of :class:`RestartRecord` (``CallWrapper.restarts``),
    appended to at every restart.
    """

    def __init__(self, settings: Settings, state: State, restarts: list[RestartRecord], fn: Callable[..., Any]):
        self.settings = settings
        self.state = state
        self.restarts = restarts
        self.job_config = join.job_config(settings, fn)  # what a joiner's must equal
        self.standing = Standing.JOINING if joining.join_requested() else Standing.STARTING
        self.join_token = joining.new_token() if self.standing is Standing.JOINING else ""
        self.membership: Membership | None = None
        self.assignment = AssignmentRunner(settings.rank_assignment)
        self.storm = StormBrake(StormLimits.from_environment())  # INPROCESS_RESTART_STORM: a bad value fails here
        self.rt: RankRuntime | None = None
        self.grow: GrowPoints | None = None  # the job's safe points (Wrapper(grow=...)): engine/grow.py
        self.ending: RestartAbort | None = None  # raised here: this rank leaves with it at the decision it causes

    @property
    def runtime(self) -> RankRuntime:
        if self.rt is None:
            raise RuntimeError("this wrapped call is not running")
        return self.rt

    # -- opening and closing -------------------------------------------------------

    def open(self, call_index: int) -> None:
        """Open the rank's resources (:class:`RankRuntime`), handing it the engine threads' callbacks."""
        self.rt = RankRuntime.open(
            self.settings, self.state, call_index, join_token=self.join_token,
            on_soft_timeout=self._on_soft_timeout,
            release_main_thread=self._release_main_thread,
            leave_unreleasable=self._leave_unreleasable,
        )
        if self.settings.grow is not None:
            self.grow = GrowPoints(self.settings.grow, self.rt.protocol)

    def close(self) -> None:
        try:
            if self.grow is not None:
                self.grow.end()  # a grow scheduled and never reached leaves no keys behind
        finally:
            rt, self.rt = self.rt, None
            if rt is not None:
                rt.close()

    # -- door 1: into the job -------------------------------------------------------

    def enter(self) -> bool:
        """Into the job: at barrier 0, or admitted by a restart's leader. False when the job ended
        before it admitted this process (it was never a member)."""
        s = self.state
        self.set_phase(Phase.INITIAL_BARRIER)
        keys = self.assignment.local_keys(s.freeze())
        if self.standing is Standing.JOINING:
            decision = self._admission(keys)
            if decision is None:
                return False
        else:
            if keys is not None:
                self.runtime.protocol.topology.publish([(s.initial_rank, keys)])
            try:  # ranks launched with other settings (WORLD_SIZE, ...): the job ends at once, naming them
                agreement.agree_at_barrier_zero(self.runtime.protocol, s.initial_rank, self.job_config)
            except agreement.SettingsMismatch as e:
                raise LeaveJob(e, Leave.JOB_ENDED) from None
            decision = self._barrier(0, s.initial_world_size)
        self.storm.started(decision)
        self._carry_out(decision, RecoveryPlan.for_rank(None, decision, s.initial_rank))
        return True

    def _admission(self, keys: list[list[str]] | None) -> Decision | None:
        """Announced as a joiner, the decision that admits this process, or None when the job closed."""
        rt, s, t = self.runtime, self.state, self.settings.timeouts
        beats = rt.monitor is not None and t.heartbeat_interval.total_seconds() > 0
        try:
            decision = join.wait_for_admission(
                rt.protocol, s, self.join_token, self.job_config, keys, stamp=rt.hang_guard.stamp_progress,
                timeout=t.barrier_wait_s, monitor_beat_s=t.heartbeat_timeout.total_seconds() if beats else None)
        except join.JoinClosed as e:
            log.info("rank %d: %s", s.initial_rank, e)
            return None
        rt.trigger_protocol.life = rt.protocol.life
        return decision

    # -- door 2: a restart ------------------------------------------------------------

    def restart(self, outcome: IterationOutcome) -> None:
        """After a fault: the phase table's restart rows in order, each the step below of its
        phase; the barrier's decision is carried out at the last one."""
        record = RestartRecord(self.state.iteration, [], 0, [])
        steps = self.restart_steps()
        for row in phases.restart_rows():
            self.set_phase(row.phase)
            steps[row.phase](record, outcome)

    def restart_steps(self) -> dict[Phase, Callable[[RestartRecord, IterationOutcome], None]]:
        """The step of each restart row of the phase table (a row without one is a test failure)."""
        return {
            Phase.ABORTING: self._abort_step,
            Phase.FINALIZING: self._finalize_step,
            Phase.HEALTH_CHECK: self._health_check_step,
            Phase.RESTART_BARRIER: self._barrier_step,
        }

    def _abort_step(self, record: RestartRecord, outcome: IterationOutcome) -> None:
        """The restart trigger's abort released the main thread: wait for it to finish, then release
        what the schedule releases before the decision."""
        abort_wait = self.settings.timeouts.abort_wait_s
        if not outcome.done.wait(abort_wait):
            raise LeaveJob(TimeoutError(f"abort did not finish within {abort_wait:g}s"), Leave.ABORT_FAILED)
        self.check_outcome(outcome)
        if isinstance(outcome.abort_error, RestartAbort):  # the abort hook's: the job ends, at one decision
            self.end_job(outcome.abort_error)
            self.end_at_decision(outcome)
        if outcome.abort_error is not None:
            raise LeaveJob(outcome.abort_error, Leave.ABORT_FAILED)
        record.detected_ns, record.aborted_ns = outcome.detected_ns, outcome.aborted_ns
        self._release(released_at(Moment.BEFORE_DECISION))

    def _finalize_step(self, record: RestartRecord, outcome: IterationOutcome) -> None:
        self._run_recovery_hook(self.settings.finalize, Leave.FINALIZE_FAILED)
        record.finalized_ns = time.monotonic_ns()

    def _health_check_step(self, record: RestartRecord, outcome: IterationOutcome) -> None:
        try:
            self.check_health()
        except RestartAbort as e:
            self.end_job(e)
        except BaseException as e:
            raise LeaveJob(e, Leave.HEALTH_CHECK_FAILED) from None
        record.health_checked_ns = time.monotonic_ns()

    def _barrier_step(self, record: RestartRecord, outcome: IterationOutcome) -> None:
        """The restart barrier: its decision, this rank's plan from it, carried out."""
        s = self.state
        decision = self._barrier(record.iteration + 1, s.world_size)
        record.decided_ns = time.monotonic_ns()
        record.faults, record.n_faults, record.terminated = decision.faults, decision.n_faults, decision.terminated
        record.assignment_ns = decision.assignment_ns
        here = [f.t_ns for f in decision.faults if f.host == HOST and f.t_ns]
        record.fault_ns = min(here) if here else 0
        plan = RecoveryPlan.for_rank(self.membership, decision, s.initial_rank)
        summary = DecisionSummary.of(self.membership, decision)
        record.joined = summary.joined
        # A joiner enters as a spare: one that became active is counted among the spares activated.
        record.activated = sorted(summary.activated + [r for r in summary.joined
                                                       if decision.membership.mode[r] == Mode.ACTIVE])
        verdict = self.storm.observe(record, decision)
        self.restarts.append(record)
        self._carry_out(decision, plan, summary)
        self._log_restart(record, verdict)
        self.storm.wait(verdict)  # a restart storm: every rank waits the same (engine/storm.py)

    def end_at_decision(self, outcome: IterationOutcome) -> NoReturn:
        """After this rank's RestartAbort in an iteration (:meth:`end_job`): no restart hooks run (nothing
        restarts); it arrives at the restart barrier as a member and leaves at the decision that ends the job."""
        self.set_phase(Phase.RESTART_BARRIER)
        self._barrier_step(RestartRecord(self.state.iteration, [], 0, []), outcome)
        raise LeaveJob(InternalError(f"initial rank {self.state.initial_rank} raised RestartAbort and the "
                                     f"decision after it did not end the job"), Leave.TERMINATED)

    def _barrier(self, iteration: int, expected: int) -> Decision:
        s = self.state
        try:
            decision = self.runtime.protocol.barrier(
                iteration, s.initial_rank, expected, decide=self._decide, timeout=self.settings.timeouts.barrier_wait_s
            )
        except SeatTaken as e:
            # A peer's monitor declared this rank lost (this rank's own monitor
            # stopped heartbeating) and counted it out: it must not count itself in.
            raise LeaveJob(RankDiscarded(f"initial rank {s.initial_rank} was declared lost: {e}"),
                           Leave.COUNTED_OUT) from None
        except BarrierTimeout as e:  # counted in, and given up (protocol.give_up): nothing more to write
            raise LeaveJob(e, Leave.GAVE_UP) from None
        assert decision is not None  # a healthy arrival always gets the decision
        return decision

    def expected_at(self, barrier: int) -> int:
        """How many ranks barrier ``barrier`` counts, as this rank arrives there."""
        return self.state.initial_world_size if barrier == 0 else self.state.world_size

    # -- carrying a plan out -----------------------------------------------------------

    def _carry_out(self, decision: Decision, plan: RecoveryPlan, summary: DecisionSummary | None = None) -> None:
        """This rank takes the role its plan gives it, by the plan's transition, or leaves."""
        s = self.state
        self._emit_decision(decision, summary or DecisionSummary.of(self.membership, decision), plan)
        before = s.freeze()
        previous = self._seated(self.membership, decision.joined)
        self.membership = decision.membership
        self.standing = Standing.MEMBER
        s.iteration = plan.iteration
        self._release(plan.release)  # in the plan's iteration: a rank that fails here leaves it, counted out
        if plan.ends_job is not None:
            self.runtime.protocol.leave(plan.iteration, plan.new_world_size)
            # The leader ran the failing hook: it leaves with the hook's own exception, as a
            # per-rank caller would; the others with a RestartAbort that names it.
            # A rank whose own RestartAbort ended the job leaves with it.
            failure = self.assignment.take_failure() if decision.leader == s.initial_rank else None
            raise LeaveJob(self.ending or failure or RestartAbort(plan.ends_job), Leave.JOB_ENDED)
        if plan.transition is not Transition.JOIN:
            # A per-rank rank assignment: this rank's own run must give its row (else the next decision
            # ends the job). A joiner has no state of its own to run it on: the leader ran it as a spare's.
            try:
                self.assignment.verify(decision, previous, before, self._read_topology)
            except RankAssignmentMismatch as e:
                raise LeaveJob(e, Leave.TERMINATED) from None
        if plan.transition is Transition.LEAVE:
            raise LeaveJob(RankDiscarded(f"initial rank {s.initial_rank} was terminated by the rank assignment"),
                           Leave.DISCARDED)
        self._take_role(plan)
        if decision.leader == s.initial_rank and plan.iteration > 0:
            self.runtime.delete_user_keys(plan.iteration - 1)

    def _release(self, resources: frozenset[Resource]) -> None:
        """What the release schedule releases now; an NCCL teardown past its deadline makes the rank leave."""
        try:
            self.runtime.release(resources)
        except NcclAbortTimeout as e:
            raise LeaveJob(e, Leave.ABORT_FAILED) from None

    def _take_role(self, plan: RecoveryPlan) -> None:
        """The rank's mode, ranks and world sizes from ``plan``, and the environment the function sees."""
        s = self.state
        assert plan.new_rank is not None  # every rank still in the job has one (Membership.validate)
        s.mode = plan.new_mode
        s.rank = plan.new_rank
        s.world_size = plan.new_world_size
        s.active_rank = plan.new_active_rank
        s.active_world_size = plan.new_active_world_size
        for name, value in plan.environment().items():
            if value is None:
                os.environ.pop(name, None)  # a spare has no rank in the running job; it never sees "None" there
            else:
                os.environ[name] = value
        self.runtime.hang_guard.begin_iteration(s.iteration, s.world_size)

    def _seated(self, previous: Membership | None, joined: list[tuple[int, int]]) -> Membership | None:
        """The membership a decision changes (:func:`~inprocess.control.recovery_plan.seated`); the
        joiners' topology keys replace their seats' old ones."""
        changed = seated(previous, joined)
        if changed is not previous:
            self.assignment.forget_topology()
        return changed

    def _decide(self, dead: set[int], faults: list[FaultRecord], leader: int) -> Decision:
        """The leader's decision at a barrier: joiners admitted (after the first), then the rank assignment."""
        p = self.runtime.protocol
        with self.runtime.hang_guard.deciding():  # a hung rank assignment: killed, and the lead taken over
            join_keys = joining.JoinKeys(p.counted, p.call, p.incarnation)
            joined: list[tuple[int, int]] = []
            if self.membership is None:
                join_keys.name_running_incarnation()  # a joiner of another incarnation is told so
            else:
                joined = joining.admit(join_keys, self.state.iteration + 1, self.membership, self.job_config,
                                       seat_table=p.seat_table, publish_keys=p.topology.publish)
            decision = self.assignment.decide(
                self._seated(self.membership, joined), dead, faults, leader, state=self.state,
                read_topology=self._read_topology, takeover=p.lead_term > 0,
            )
            decision.joined = joined
            # Whether the failed iteration made progress, judged once, for every rank's storm brake.
            decision.progress = self.storm.judge(p, self.state.iteration).fields() if self.membership else None
            return decision

    def _read_topology(self) -> list[list[list[str]]]:
        return self.runtime.protocol.topology.read(self.state.initial_world_size)

    # -- door 3: out of the job ---------------------------------------------------------

    def leave(self, leaving: LeaveJob) -> NoReturn:
        """TERMINATED: tell the others (the way this rank's standing says), run ``terminate``, re-raise."""
        s = self.state
        rt = self.runtime
        exc = leaving.exc
        # Its frames let go of the failed iteration (groups, models) now; its traceback stays for the caller.
        release_frames(exc)
        rt.hang_guard.off()  # its way out has the engine's own timeouts
        # Before the fault is reported: its restart is for the others, this rank must not abort itself.
        rt.trigger.stop(timeout=0)
        s.mode = Mode.TERMINATED
        rt.store_may_be_gone = leaving.reason in (Leave.JOB_ENDED, Leave.GAVE_UP)
        log.warning("rank %d leaves the job (%s): %s: %s", s.initial_rank, leaving.reason.value,
                    type(exc).__name__, exc)
        rt.emit("exit", outcome="terminated", reason=leaving.reason.value, iteration=s.iteration,
                type=type(exc).__name__, message=str(exc)[:300])
        if not leaving.reason.counted_already:
            try:
                self._tell_the_others(fault_kind(leaving.reason, exc), exc)
            except Exception as e:
                log.error("rank %d could not record its termination: %s", s.initial_rank, e)
        # Only now: until the rank is counted out, its monitor must count it out if it dies.
        self.set_phase(Phase.TERMINATED)
        if self.settings.terminate is not None:
            try:
                self.settings.terminate(s.freeze())
            except BaseException as e:
                log.error("terminate hook raised %s: %s", type(e).__name__, e)
                exc.__context__ = e
        lost = lost_context_in(exc)
        if lost is not None:
            # Counted out above; the process must go so the launcher replaces it (exit status 76).
            leave_for_lost_context(lost)
        exit_if_nccl_abort_abandoned()  # counted out above; torch's groups must not be touched again
        raise exc

    def _tell_the_others(self, kind: str, exc: BaseException) -> None:
        s, p, wait = self.state, self.runtime.protocol, self.settings.timeouts.barrier_wait_s
        if self.standing is Standing.JOINING:
            self._withdraw_join(p, kind, exc)
        elif self.standing is Standing.STARTING:
            count_out_before_joining(p, s, kind, exc, wait)
        else:
            p.report_fault(FaultRecord.from_exception(s.initial_rank, s.iteration, kind, exc))
            self._arrive_terminated(p, s.iteration)

    def _withdraw_join(self, p: RestartProtocol, kind: str, exc: BaseException) -> None:
        """A joiner leaving before it entered the job: withdrawn; admitted already (the leader
        came first), its seat is counted out where it stands, as any rank's."""
        s, wait = self.state, self.settings.timeouts.barrier_wait_s
        admitted = join.withdraw(p, self.join_token, f"{kind}: {type(exc).__name__}: {exc}")
        if admitted is not None:
            p.life = admitted.life
            # The seat is in this life once the admitting decision is out (its leader moves it first).
            p.wait_decision(admitted.barrier, wait)
            count_out_before_joining(p, s, kind, exc, wait)

    def _arrive_terminated(self, p: RestartProtocol, iteration: int) -> None:
        """Count this rank out at the barrier after ``iteration``, so nobody waits for it."""
        s = self.state
        try:
            p.barrier(iteration + 1, s.initial_rank, s.world_size, terminated=True,
                      timeout=self.settings.timeouts.barrier_wait_s)
        except SeatTaken:
            log.info("rank %d was counted out by another process already", s.initial_rank)

    # -- hooks and checks ----------------------------------------------------------------

    def check_health(self) -> None:
        """The ``health_check`` hook; an ``Exception`` comes out as a
        :class:`HealthCheckError` chained to it, a ``BaseException`` as itself."""
        hook = self.settings.health_check
        if hook is None:
            return
        try:
            hook(self.state.freeze())
        except Exception as e:
            raise HealthCheckError(f"health check failed on initial rank {self.state.initial_rank}: "
                                   f"{type(e).__name__}: {e}") from e

    def check_outcome(self, outcome: IterationOutcome) -> None:
        if outcome.event is None:
            e = outcome.abort_error or InternalError("restart trigger stopped without an outcome")
            raise LeaveJob(e, Leave.STORE_LOST)

    def _run_recovery_hook(self, hook: Callable[[FrozenState], Any] | None, failed: Leave) -> None:
        if hook is None:
            return
        try:
            hook(self.state.freeze())
        except RestartAbort as e:
            self.end_job(e)
        except BaseException as e:
            raise LeaveJob(e, failed) from None

    def end_job(self, e: RestartAbort) -> None:
        """This rank raised ``e`` (in ``initialize``, the function, or a hook): the job ends on every
        rank at one decision. Recorded as a fault of kind ENDS_JOB, which the next barrier's leader
        turns into a decision that ends the job (rank_assignment/decision.py); this rank goes on to that
        barrier as a member and leaves there with ``e``, the others with a RestartAbort naming it. Had
        it left at once, its leaving would restart the others into the next iteration first."""
        s, rt = self.state, self.runtime
        rt.trigger.stop(timeout=0)  # its restart is for the others: this rank runs no abort, nothing restarts
        record = FaultRecord.from_exception(s.initial_rank, s.iteration, ENDS_JOB, e)
        rt.protocol.report_fault(record)
        rt.emit("fault", record.t_ns, iteration=s.iteration, fault=ENDS_JOB, type=record.type, message=record.message)
        log.warning("rank %d: %s in iteration %d: %s; the job ends on every rank at the next decision",
                    s.initial_rank, type(e).__name__, s.iteration, e)
        release_frames(e)  # its traceback stays for the caller; the failed iteration's locals go
        if self.ending is None:
            self.ending = e

    # -- grow points -------------------------------------------------------------------------

    def safe_point(self) -> None:
        """A safe point of the function (``CallWrapper.safe_point``): the job may grow here."""
        self.storm.step()  # a step: progress, for the storm brake (engine/storm.py); atomic() ends here too
        grow, s = self.grow, self.state
        if grow is None or s.mode != Mode.ACTIVE or s.active_world_size is None:
            return
        grow.reached(s.active_rank, s.active_world_size, s.world_size, s.initial_world_size, s.initial_rank,
                     wait=self._wait_at_grow_point)

    def _wait_at_grow_point(self) -> None:
        """Until the grow's restart interrupts this rank here (the last rank to arrive requests it)."""
        limit = self.settings.timeouts.barrier_wait_s
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise TimeoutError(f"grow: not every active rank reached the grow point within {limit:g}s "
                           f"(their loops differ: safe points must come in the same order on every rank)")

    # -- called from the engine's threads ---------------------------------------------------

    def _release_main_thread(self) -> None:
        """From the restart trigger thread, once the main thread was interrupted: release it from
        whatever the failed iteration blocked it in (the function's store connection shut down, then
        the user's ``abort`` hook, by default the process groups' abort). Not to be confused with the
        decision that ends the job (``Decision.abort``, ``RestartAbort``) nor with NCCL's
        communicator abort that the hook may run (``gpu/nccl_abort.py``)."""
        iteration = self.state.iteration
        rt = self.runtime
        rt.emit("restart_detected", iteration=iteration)
        try:
            rt.shut_down_iteration_store()
            if self.settings.abort is not None:
                self.settings.abort(self.state.freeze())
        finally:
            rt.emit("abort_done", iteration=iteration)

    def _leave_unreleasable(self, p: RestartProtocol, iteration: int) -> None:
        """From the trigger thread: count this rank out of the next barrier."""
        s = self.state
        e = TimeoutError(f"main thread still blocked {self.settings.timeouts.release_wait_s:g}s after the abort")
        p.record_fault(FaultRecord.from_exception(s.initial_rank, iteration, "unreleasable", e))
        self._arrive_terminated(p, iteration)

    def _on_soft_timeout(self, event: Any) -> None:
        """Called on a native thread of the watchdog (which never waits for the
        GIL). It hands off at once to a Python thread: anything that asks
        `threading` who is running here (logging does) would register this
        native thread as a _DummyThread that is never removed."""
        threading.Thread(
            target=self._report_soft_timeout, args=(event,), name="inprocess-soft-timeout", daemon=True
        ).start()

    def _report_soft_timeout(self, event: Any) -> None:
        """No progress for soft_timeout restarts the whole job."""
        rt, s = self.rt, self.state
        # Not this iteration's, not running, or already restarting (the abort's release path, then exit
        # code 75, owns a rank that has not come back from a restart).
        if rt is not None and event.iteration == s.iteration and s.mode == Mode.ACTIVE and not rt.interrupter.fired:
            report_soft_timeout(rt.protocol, s, event, self.settings.timeouts.soft_timeout.total_seconds(), rt.emit)

    # -- phases, events and logs ---------------------------------------------------------------

    def set_phase(self, phase: Phase) -> None:
        """Enter ``phase``, as its row of the phase table (control/phases.py) says."""
        row = phases.row(phase)
        self.storm.phase_entered(phase, self.state, self.rt.protocol if self.rt is not None else None)
        if self.rt is not None:
            self.rt.hang_guard.enter(phase)  # the row's hang rule: a restart's hooks get hard_timeout
            self.rt.emit("phase", phase=row.name, iteration=self.state.iteration)
        if row.fault_name is not None:  # INPROCESS_FAULTS: a fault on entering this phase (phase=NAME)
            s = self.state
            faults.enter_phase(row.fault_name, s.initial_rank, s.initial_world_size, s.iteration, s.mode)

    def _emit_decision(self, decision: Decision, summary: DecisionSummary, plan: RecoveryPlan) -> None:
        m = decision.membership
        records = [{"rank": f.rank, "kind": f.kind, "type": f.type, "message": f.message, "t_ns": f.t_ns,
                    "host": f.host} for f in decision.faults[:8]]
        self.runtime.emit("decision", iteration=decision.iteration, world_size=m.world_size,
                          active_world_size=m.active_world_size, terminated=decision.terminated,
                          leader=decision.leader, n_faults=decision.n_faults, faults=records, plan=plan.fields(),
                          **summary.fields(), **decision_fields(decision, self.runtime.protocol.life,
                                                               self.storm.backoff_s))

    def _log_restart(self, record: RestartRecord, verdict: Verdict) -> None:
        """One INFO line on every rank; the summary, as a WARNING, on the lowest active rank
        (in a restart storm, a warning once and reminders: engine/storm.py)."""
        s = self.state
        summary = None
        if s.active_rank == 0 and s.active_world_size is not None:
            summary = record.summary(s.active_world_size, s.world_size)
        self.storm.log_restart(verdict, record, s.initial_rank, summary)

