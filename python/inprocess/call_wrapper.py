"""``CallWrapper``: one call of a wrapped function, and its restart loop.

:meth:`CallWrapper._run` is the state machine; it reads top to bottom::

    JOIN ──► ITERATION i ──returned everywhere──► COMPLETE ──► return value
                │  ▲
     fault on   │  │ decision of barrier i+1
     any rank   ▼  │
             RESTART: abort ► finalize ► health check ► barrier i+1
                │
                └─ BaseException, failed recovery hook, or discarded ──► TERMINATED (re-raise)

What the machine runs on (store connections, trigger, watchdog, monitor, …)
is opened and closed by :class:`inprocess.engine.runtime.RankRuntime`. The
rule for exceptions in hooks is in :mod:`inprocess.wrap`.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Optional

import torch.distributed as dist

from . import environment, faults
from . import store as store_mod
from .control import agreement, joining, protocol
from .control.barrier_watch import BarrierWatch
from .control.membership import Membership
from .control.protocol import COMPLETE, Decision, FaultRecord, RestartProtocol, SeatTaken
from .engine import join, phases
from .engine.grow import GrowPoints
from .engine.interrupt import interrupted_by
from .engine.leave import (
    Leave,
    LeaveJob,
    count_out_before_joining,
    drop_frames,
    exit_if_nccl_abort_abandoned,
    release_frames,
)
from .engine.phases import Phase
from .engine.recovery_plan import DecisionSummary, RecoveryPlan
from .engine.restart_record import RestartRecord, is_communication_error
from .engine.runtime import RankRuntime
from .engine.soft_timeout import report_soft_timeout
from .engine.storm import StormBrake, StormLimits, Verdict
from .engine.trigger import IterationOutcome
from .events import call_start_fields, decision_fields
from .exception import (
    BarrierTimeout,
    HealthCheckError,
    InternalError,
    RankDiscarded,
    RankShouldRestart,
    RestartAbort,
    TimeoutError,
)
from .gpu import settings as gpu_settings
from .gpu.errors import leave_for_lost_context, lost_context_in
from .rank_assignment import AssignmentRunner, RankAssignmentMismatch
from .state import FrozenState, Mode, State

if TYPE_CHECKING:
    from .wrap import Wrapper

log = logging.getLogger("inprocess")

_current_lock = threading.Lock()
_current: Optional["CallWrapper"] = None
_call_counter = 0


def current_call() -> Optional["CallWrapper"]:
    """The :class:`CallWrapper` of the wrapped call running in this process, if any.

    Use it where the function cannot take a ``CallWrapper`` parameter (behind
    ``*args, **kwargs`` adapters, decorators, or deep inside a training loop).
    """
    return _current



def _seconds(td: datetime.timedelta) -> float:
    return td.total_seconds()


class CallWrapper:
    """One call of a wrapped function: its state and the restart loop.

    It is passed to the function as the parameter annotated ``CallWrapper``
    (or ``Optional[CallWrapper]``), and is also returned by
    :func:`inprocess.current_call`. The function receives the same argument
    objects on every iteration: state it mutates carries over.
    ``restarts`` lists a :class:`RestartRecord` per restart this rank went through.
    """

    def __init__(self, wrapper: Wrapper):
        self._w = wrapper
        self.state: State
        self.restarts: list[RestartRecord] = []
        self._rt: Optional[RankRuntime] = None  # set while the call runs
        self._membership: Optional[Membership] = None
        self._assignment = AssignmentRunner(wrapper.rank_assignment)
        self._storm = StormBrake(StormLimits.from_environment())  # INPROCESS_RESTART_STORM: a bad value fails here
        # INPROCESS_JOIN=1: this process joins a running job (control/joining.py) with this token.
        self._join_token = ""
        self._job_config: dict[str, str] = {}
        self._grow: Optional[GrowPoints] = None  # the job's safe points (Wrapper(grow=...)): engine/grow.py

    # -- public API (used from inside the wrapped function) --------------------

    @property
    def iteration(self) -> int:
        return self.state.iteration

    @property
    def frozen_state(self) -> FrozenState:
        return self.state.freeze()

    def ping(self) -> None:
        """Manual progress: arms the soft/hard timeouts for the rest of the iteration."""
        self._storm.step()  # a step: progress, for the storm brake (engine/storm.py)
        if self._rt is not None:
            self._rt.hang_guard.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block that a restart does not interrupt: it waits for the block's end.

        Do not run collectives inside: a peer's fault cannot release them.
        """
        with self._runtime.interrupter.lock:
            yield
        self.safe_point()  # its end is a safe point: the job may grow here

    def safe_point(self) -> None:
        """Marks a point between steps where a restart loses no work (an iteration boundary of the
        training loop): with ``Wrapper(grow=GrowPolicy(...))`` the job may restart here, on purpose, to
        take in processes waiting to join it (:mod:`inprocess.engine.grow`). Cheap: one store read
        every ``GrowPolicy.check_every`` calls; nothing without a policy."""
        self._storm.step()  # a step: progress, for the storm brake (engine/storm.py); atomic() ends here too
        grow, s = self._grow, self.state
        if grow is None or s.mode != Mode.ACTIVE or s.active_world_size is None:
            return
        grow.reached(s.active_rank, s.active_world_size, s.world_size, s.initial_world_size, s.initial_rank,
                     wait=self._wait_at_grow_point)

    def _wait_at_grow_point(self) -> None:
        """Until the grow's restart interrupts this rank here (the last rank to arrive requests it)."""
        limit = self._w.timeouts.barrier_wait_s
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise TimeoutError(f"grow: not every active rank reached the grow point within {limit:g}s "
                           f"(their loops differ: safe points must come in the same order on every rank)")

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """Suspends the soft and hard timeouts for a block, re-arming them after."""
        if self._rt is None:
            yield
            return
        with self._rt.hang_guard.suspended():
            yield

    @property
    def store(self) -> dist.Store:
        """A store scoped to this iteration, for ``init_process_group(store=...)``.

        Its keys are deleted once every rank has left the iteration.
        """
        if self._rt is None:
            raise RuntimeError("CallWrapper.store is available inside the wrapped function only")
        return self._rt.iteration_store(self.state.iteration)

    @property
    def _runtime(self) -> RankRuntime:
        if self._rt is None:
            raise RuntimeError("this CallWrapper's call is not running")
        return self._rt

    # -- the restart loop ------------------------------------------------------

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        faults.plan_from_environment()  # a malformed INPROCESS_FAULTS fails here, naming the bad part
        environment.warn_unknown()  # a misspelt INPROCESS_* variable: once per process, with the nearest name
        gpu_settings.warn_once()  # once per process, and only where NCCL can run on a GPU
        call_index = self._enter()
        self._join_token = joining.new_token() if joining.join_requested() else ""
        self._job_config = join.job_config(self._w, fn)
        try:
            try:
                self._rt = RankRuntime.open(
                    self._w, self.state, call_index, join_token=self._join_token,
                    on_soft_timeout=self._on_soft_timeout,
                    release_main_thread=self._release_main_thread,
                    leave_unreleasable=self._leave_unreleasable,
                )
                self._grow = GrowPoints(self._w.grow, self._rt.protocol) if self._w.grow is not None else None
                watch = BarrierWatch.on(self._rt.protocol, self.state.initial_rank, self._expected_at)  # INFO
                try:
                    return self._run(fn, args, kwargs)
                finally:
                    watch.close()  # a long barrier wait was logged by its thread: gone before the runtime
                    if self._grow is not None:
                        self._grow.end()  # a grow scheduled and never reached leaves no keys behind
                    self._rt.close()
            finally:
                faults.report_unfired(self.state.initial_rank, self.state.initial_world_size, self.state.iteration)
                self._exit()
        except BaseException as e:
            # The caller may keep the exception (to log it, to re-raise it later): its frames must
            # not keep the closed runtime, its store clients or the failed iteration's groups alive.
            release_frames(e)
            raise

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rt = self._runtime
        self._emit("call_start", **call_start_fields(self.state.initial_world_size, self._w.timeouts))
        leaving: LeaveJob
        try:
            self._set_phase(Phase.INITIAL_BARRIER)
            if not self._join():
                return self._never_joined()
            while True:
                i = self.state.iteration
                rt.interrupter.reset()
                outcome = rt.trigger.arm(i, active=self.state.mode == Mode.ACTIVE)
                log.debug("iteration %d: rank %d runs as %s", i, self.state.initial_rank, self.state.mode.name)
                self._emit_iteration_start()
                if self.state.mode == Mode.ACTIVE:
                    completed, value = self._run_active(fn, args, kwargs, outcome)
                else:
                    completed, value = self._wait_as_spare(outcome)
                if completed:
                    return self._complete(value)
                self._restart(outcome)
        except LeaveJob as e:
            leaving = e
        except BaseException as e:
            # Outside the function (a KeyboardInterrupt while a spare waits or at a barrier):
            # the rule for "anywhere", this rank leaves, counted out so that nobody waits for it.
            leaving = LeaveJob(e, Leave.TERMINATED)
        # Left outside the except clause: raised there, the exception would get the engine's
        # LeaveJob as its __context__ ("During handling of the above exception ...").
        self._leave_job(leaving)

    def _join(self) -> bool:
        """Into the job: at barrier 0, or (INPROCESS_JOIN=1) admitted by a restart's leader.
        False when the job ended before it admitted this process."""
        s = self.state
        keys = self._assignment.local_keys(s.freeze())
        if self._join_token:
            return self._join_running_job(keys)
        if keys is not None:
            self._runtime.protocol.publish_local_keys(s.initial_rank, keys)
        try:  # ranks launched with other settings (WORLD_SIZE, ...): the job ends at once, naming them
            agreement.agree_at_barrier_zero(self._runtime.protocol, s.initial_rank, self._job_config)
        except agreement.SettingsMismatch as e:
            raise LeaveJob(e, Leave.JOB_ENDED) from None
        decision = self._barrier(0, s.initial_world_size)
        self._storm.started(decision)
        self._emit_decision(decision, DecisionSummary.of(None, decision))
        self._apply(decision, RecoveryPlan.for_rank(None, decision, s.initial_rank))
        return True

    def _join_running_job(self, keys: Optional[list[list[str]]]) -> bool:
        rt, s = self._runtime, self.state
        try:
            t = self._w.timeouts
            beats = rt.monitor is not None and t.heartbeat_interval.total_seconds() > 0
            decision = join.wait_for_admission(rt.protocol, s, self._join_token, self._job_config, keys,
                                               stamp=rt.hang_guard.stamp_progress, timeout=t.barrier_wait_s,
                                               monitor_beat_s=t.heartbeat_timeout.total_seconds() if beats else None)
        except join.JoinClosed as e:
            log.info("rank %d: %s", s.initial_rank, e)
            return False
        rt.trigger_protocol.life = rt.protocol.life
        self._storm.started(decision)
        joined = [seat for seat, _ in decision.joined]
        self._emit_decision(decision, DecisionSummary.of(None, decision, joined))
        self._apply(decision, RecoveryPlan.for_rank(None, decision, s.initial_rank, joined))
        return True

    def _run_active(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], outcome: IterationOutcome
    ) -> tuple[bool, Any]:
        s = self.state
        rt = self._runtime
        s.fn_exception = None
        if self._grow is not None:
            self._grow.begin(s.iteration)
        rt.open_iteration_store()
        try:
            self._set_phase(Phase.RUNNING)
            with rt.interrupter.running(), rt.hang_guard.training(s.iteration, s.world_size):
                if self._w.initialize is not None:
                    self._w.initialize(s.freeze())
                self._check_health_before_iteration()
                if self.restarts:
                    self.restarts[-1].initialized_ns = time.monotonic_ns()
                with faults.arm_from_environment(s.freeze()):  # INPROCESS_FAULTS: rehearsed failures
                    value = fn(*args, **kwargs)
        except RankShouldRestart as e:
            ctrl_c = interrupted_by(e)  # raised on top of a Ctrl-C: the rank leaves with that
            if ctrl_c is not None:
                raise LeaveJob(ctrl_c, Leave.TERMINATED) from None
            if isinstance(e.__context__, Exception):
                # Raised on top of the function's own exception, still on its way out.
                self._fault_in_function(e.__context__)
            return False, None
        except LeaveJob:
            raise
        except BaseException as e:
            self._fault_in_function(e)
            return False, None
        # The function returned: wait until it returned on every active rank.
        self._set_phase(Phase.COMPLETION)
        outcome.completing = True  # before the count: from now on the event may be "complete"
        assert s.active_world_size is not None  # set by _apply before any iteration runs
        rt.protocol.arrive_completed(s.iteration, s.active_world_size)
        timeout = _seconds(self._w.timeouts.completion_timeout)
        if not outcome.done.wait(timeout):
            late = BarrierTimeout(f"the other ranks did not complete iteration {s.iteration} within {timeout:g}s")
            raise LeaveJob(late, Leave.COMPLETION_TIMEOUT)
        self._check_outcome(outcome)
        return outcome.event == COMPLETE, value

    def _fault_in_function(self, e: BaseException) -> None:
        """The function (or ``initialize``) raised ``e``: a fault of this rank, a
        consequence of the restart, or a reason to leave."""
        s = self.state
        p = self._runtime.protocol
        if not isinstance(e, Exception):
            # Never a consequence of the abort (a Ctrl-C during a restart): the rank leaves.
            raise LeaveJob(e, Leave.TERMINATED) from None
        if self._runtime.interrupter.fired:
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
        self._emit("fault", record.t_ns, iteration=s.iteration, fault=kind, type=record.type, message=record.message)
        if first_hand:
            s.fn_exception = e
        what = "exception" if first_hand else "exception while restarting"
        log.log(logging.DEBUG if self._storm.in_storm else logging.INFO, "rank %d: %s in iteration %d: %s: %s",
                s.initial_rank, what, s.iteration, type(e).__name__, e)
        drop_frames(e)

    def _wait_as_spare(self, outcome: IterationOutcome) -> tuple[bool, Any]:
        self._set_phase(Phase.RUNNING)  # as a spare: waiting, ready to take a rank over
        try:
            self._check_health_before_iteration()
        except LeaveJob:
            raise
        except Exception as e:
            # An unfit spare is a fault like any other: the restart's health check decides.
            self._fault_in_function(e)
        s = self.state
        with faults.arm_from_environment(s.freeze()), self._runtime.hang_guard.training(s.iteration, s.world_size):
            self._wait_stamping_progress(outcome)
        self._check_outcome(outcome)
        return outcome.event == COMPLETE, None

    def _wait_stamping_progress(self, outcome: IterationOutcome) -> None:
        """A spare waits for the trigger's event, stamping progress every soft_timeout/4: one
        frozen (SIGSTOP) or holding the GIL stops stamping, and its monitor kills it at hard_timeout."""
        hang_guard = self._runtime.hang_guard
        chunk = _seconds(self._w.timeouts.soft_timeout) / 4
        while not outcome.done.wait(chunk):
            hang_guard.stamp_progress()

    def _check_outcome(self, outcome: IterationOutcome) -> None:
        if outcome.event is None:
            e = outcome.abort_error or InternalError("restart trigger stopped without an outcome")
            raise LeaveJob(e, Leave.STORE_LOST)

    def _restart(self, outcome: IterationOutcome) -> None:
        s = self.state
        abort_wait = self._w.timeouts.abort_wait_s
        fault_iteration = s.iteration
        self._set_phase(Phase.ABORTING)
        if not outcome.done.wait(abort_wait):
            raise LeaveJob(TimeoutError(f"abort did not finish within {abort_wait:g}s"), Leave.ABORT_FAILED)
        self._check_outcome(outcome)
        if outcome.abort_error is not None:
            raise LeaveJob(outcome.abort_error, Leave.ABORT_FAILED)
        record = RestartRecord(fault_iteration, [], 0, [], detected_ns=outcome.detected_ns,
                               aborted_ns=outcome.aborted_ns)
        # Before the decision, which no rank knows yet: what every plan releases today
        # (recovery_plan.RELEASED_BEFORE_DECISION: the iteration's groups and store client).
        self._runtime.release_iteration()
        self._set_phase(Phase.FINALIZING)
        self._run_recovery_hook(self._w.finalize, Leave.FINALIZE_FAILED)
        record.finalized_ns = time.monotonic_ns()
        self._set_phase(Phase.HEALTH_CHECK)
        try:
            self._check_health()
        except BaseException as e:
            raise LeaveJob(e, Leave.HEALTH_CHECK_FAILED) from None
        record.health_checked_ns = time.monotonic_ns()

        self._set_phase(Phase.RESTART_BARRIER)
        decision = self._barrier(fault_iteration + 1, s.world_size)
        record.decided_ns = time.monotonic_ns()
        record.faults, record.n_faults, record.terminated = decision.faults, decision.n_faults, decision.terminated
        record.assignment_ns = decision.assignment_ns
        here = [f.t_ns for f in decision.faults if f.host == protocol.HOST and f.t_ns]
        record.fault_ns = min(here) if here else 0
        joined = [seat for seat, _ in decision.joined]
        plan = RecoveryPlan.for_rank(self._membership, decision, s.initial_rank, joined)
        summary = DecisionSummary.of(self._membership, decision, joined)
        record.joined = summary.joined
        # A joiner enters as a spare: one that became active is counted among the spares activated.
        record.activated = sorted(summary.activated + [r for r in summary.joined
                                                       if decision.membership.mode[r] == Mode.ACTIVE])
        verdict = self._storm.observe(record, decision)
        self.restarts.append(record)
        self._emit_decision(decision, summary)
        self._apply(decision, plan)
        self._log_restart(record, verdict)
        self._storm.wait(verdict)  # a restart storm: every rank waits the same (engine/storm.py)

    def _log_restart(self, record: RestartRecord, verdict: Verdict) -> None:
        """One INFO line on every rank; the summary, as a WARNING, on the lowest active rank
        (in a restart storm, a warning once and reminders: engine/storm.py)."""
        s = self.state
        summary = None
        if s.active_rank == 0 and s.active_world_size is not None:
            summary = record.summary(s.active_world_size, s.world_size)
        self._storm.log_restart(verdict, record, s.initial_rank, summary)

    def _emit_iteration_start(self) -> None:
        s = self.state
        self._emit("iteration_start", iteration=s.iteration, mode=s.mode.name, job_rank=s.rank,
                   active_rank=s.active_rank, world_size=s.world_size, active_world_size=s.active_world_size)

    def _emit_decision(self, decision: Decision, summary: DecisionSummary) -> None:
        m = decision.membership
        records = [{"rank": f.rank, "kind": f.kind, "type": f.type, "message": f.message, "t_ns": f.t_ns,
                    "host": f.host} for f in decision.faults[:8]]
        self._emit("decision", iteration=decision.iteration, world_size=m.world_size,
                   active_world_size=m.active_world_size, terminated=decision.terminated, leader=decision.leader,
                   n_faults=decision.n_faults, faults=records, **summary.fields(),
                   **decision_fields(decision, self._runtime.protocol.life, self._storm.backoff_s))

    def _barrier(self, iteration: int, expected: int) -> Decision:
        s = self.state
        try:
            decision = self._runtime.protocol.barrier(
                iteration, s.initial_rank, expected, decide=self._decide, timeout=self._w.timeouts.barrier_wait_s
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

    def _expected_at(self, barrier: int) -> int:
        """How many ranks barrier ``barrier`` counts, as this rank arrives there."""
        return self.state.initial_world_size if barrier == 0 else self.state.world_size

    def _check_health_before_iteration(self) -> None:
        """``health_check`` also runs before every iteration, after ``initialize``, as in
        nvidia_resiliency_ext: a failure there is a fault of this rank (the job restarts).
        A lost CUDA context is not: no restart repairs it, the rank leaves at once."""
        try:
            self._check_health()
        except HealthCheckError as e:
            if lost_context_in(e) is not None:
                raise LeaveJob(e, Leave.HEALTH_CHECK_FAILED) from None
            raise

    def _check_health(self) -> None:
        """The ``health_check`` hook; an ``Exception`` comes out as a
        :class:`HealthCheckError` chained to it, a ``BaseException`` as itself."""
        hook = self._w.health_check
        if hook is None:
            return
        try:
            hook(self.state.freeze())
        except Exception as e:
            raise HealthCheckError(f"health check failed on initial rank {self.state.initial_rank}: "
                                   f"{type(e).__name__}: {e}") from e

    def _run_recovery_hook(self, hook: Optional[Callable[[FrozenState], Any]], failed: Leave) -> None:
        if hook is None:
            return
        try:
            hook(self.state.freeze())
        except BaseException as e:
            raise LeaveJob(e, failed) from None

    def _decide(self, dead: set[int], faults: list[FaultRecord], leader: int) -> Decision:
        p = self._runtime.protocol
        previous = self._membership
        with self._runtime.hang_guard.deciding():  # a hung rank assignment: killed, and the lead taken over
            join_keys = joining.JoinKeys(p.counted, p.call, p.incarnation)
            joined: list[tuple[int, int]] = []
            if previous is None:
                join_keys.name_running_incarnation()  # a joiner of another incarnation is told so
            else:
                joined = joining.admit(join_keys, self.state.iteration + 1, previous, self._job_config,
                                       seat_table=p.seat_table, publish_keys=p.publish_many_local_keys)
                if joined:
                    previous = previous.with_joined(joined)
                    self._assignment.forget_topology()  # the joiners' keys replace their seats' old ones
            decision = self._assignment.decide(
                previous, dead, faults, leader, state=self.state, read_topology=self._read_topology,
                takeover=p.lead_term > 0,
            )
            decision.joined = joined
            decision.progress = self._storm.judge(p, self.state.iteration).fields() if previous is not None else None
            return decision

    def _read_topology(self) -> list[list[list[str]]]:
        return self._runtime.protocol.read_topology(self.state.initial_world_size)

    def _apply(self, decision: Decision, plan: RecoveryPlan) -> None:
        """This rank takes the role its plan gives it (engine/recovery_plan.py), or leaves."""
        s = self.state
        r = s.initial_rank
        before, previous = s.freeze(), self._membership
        if decision.joined:
            self._assignment.forget_topology()  # the joiners' keys replace their seats' old ones
            if previous is not None:
                previous = previous.with_joined(decision.joined)
        self._membership = decision.membership
        s.iteration = decision.iteration
        if plan.ends_job is not None:
            self._runtime.protocol.leave(decision.iteration, plan.new_world_size)
            # The leader ran the failing hook: it leaves with the hook's own exception, as a
            # per-rank caller would; the others with a RestartAbort that names it.
            failure = self._assignment.take_failure() if decision.leader == r else None
            raise LeaveJob(failure or RestartAbort(plan.ends_job), Leave.JOB_ENDED)
        try:
            # A per-rank rank assignment: this rank's own run must give its row (else the next decision ends the
            # job). A joiner has no previous state of its own to run it on: the leader ran it as a spare's.
            if not (self._join_token and previous is None):
                self._assignment.verify(decision, previous, before, self._read_topology)
        except RankAssignmentMismatch as e:
            raise LeaveJob(e, Leave.TERMINATED) from None
        if plan.leaves:
            raise LeaveJob(RankDiscarded(f"initial rank {r} was terminated by the rank assignment"),
                            Leave.DISCARDED)
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
        self._runtime.hang_guard.begin_iteration(s.iteration, s.world_size)
        if decision.leader == r and decision.iteration > 0:
            self._runtime.delete_user_keys(decision.iteration - 1)

    def _complete(self, value: Any) -> Any:
        s = self.state
        self._set_phase(Phase.DONE)
        self._emit("exit", outcome="completed", reason=None, iteration=s.iteration)
        self._runtime.protocol.leave(s.iteration, s.world_size)
        if self._w.completion is not None:
            self._w.completion(s.freeze())
        return value if s.mode == Mode.ACTIVE else None

    def _never_joined(self) -> None:
        """The job ended while this process waited to join it: it was never a member (it tells
        nobody it leaves), and its call returns what a spare's returns."""
        s = self.state
        self._set_phase(Phase.DONE)
        self._emit("exit", outcome="completed", reason="never joined", iteration=s.iteration)
        return None

    def _leave_job(self, leaving: LeaveJob) -> NoReturn:
        """TERMINATED: tell the others, arrive for this rank at the barrier, re-raise."""
        s = self.state
        p = self._runtime.protocol
        exc = leaving.exc
        # Its frames let go of the failed iteration (groups, models) now; its traceback stays for the caller.
        release_frames(exc)
        self._runtime.hang_guard.off()  # its way out has the engine's own timeouts
        # Before the fault is reported: its restart is for the others, this rank must not abort itself.
        self._runtime.trigger.stop(timeout=0)
        s.mode = Mode.TERMINATED
        log.warning("rank %d leaves the job (%s): %s: %s", s.initial_rank, leaving.reason.value,
                    type(exc).__name__, exc)
        self._emit("exit", outcome="terminated", reason=leaving.reason.value, iteration=s.iteration,
                   type=type(exc).__name__, message=str(exc)[:300])
        if not leaving.reason.counted_already:
            try:
                if self._membership is None and self._join_token:
                    self._withdraw_join(p, leaving.reason.value, exc)
                elif self._membership is None:
                    count_out_before_joining(p, s, leaving.reason.value, exc, self._w.timeouts.barrier_wait_s)
                else:
                    p.report_fault(FaultRecord.from_exception(s.initial_rank, s.iteration, leaving.reason.value, exc))
                    self._arrive_terminated(p, s.iteration)
            except Exception as e:
                log.error("rank %d could not record its termination: %s", s.initial_rank, e)
        # Only now: until the rank is counted out, its monitor must count it out if it dies.
        self._set_phase(Phase.TERMINATED)
        if self._w.terminate is not None:
            try:
                self._w.terminate(s.freeze())
            except BaseException as e:
                log.error("terminate hook raised %s: %s", type(e).__name__, e)
                exc.__context__ = e
        lost = lost_context_in(exc)
        if lost is not None:
            # Counted out above; the process must go so the launcher replaces it (exit status 76).
            leave_for_lost_context(lost)
        exit_if_nccl_abort_abandoned()  # counted out above; torch's groups must not be touched again
        raise exc

    # -- entering and leaving the call -------------------------------------------

    def _enter(self) -> int:
        """Checks the environment, registers this call as the process's current one; returns its index."""
        global _current, _call_counter
        if dist.is_available() and dist.is_initialized():
            # The message names the condition as nvidia_resiliency_ext words it, which callers match on.
            raise ValueError(
                "inprocess.Wrapper: expected not torch.distributed.is_initialized(), but a process group "
                "already exists; create process groups inside the wrapped function, so that a restart can "
                "rebuild them"
            )
        rank = store_mod._env_int("RANK")
        world_size = store_mod._env_int("WORLD_SIZE")
        if not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is not in [0, WORLD_SIZE={world_size})")
        with _current_lock:
            if _current is not None:
                raise RuntimeError("inprocess.Wrapper: a wrapped call is already running in this process")
            _current = self
            call_index = _call_counter
            _call_counter += 1
        self.state = State(initial_rank=rank, initial_world_size=world_size, rank=rank, world_size=world_size)
        return call_index

    def _exit(self) -> None:
        global _current
        self._rt = None
        with _current_lock:
            if _current is self:
                _current = None

    # -- called from the engine's threads ------------------------------------------

    def _release_main_thread(self) -> None:
        """From the restart trigger thread, once the main thread was interrupted: release it from
        whatever the failed iteration blocked it in (the function's store connection shut down, then
        the user's ``abort`` hook, by default the process groups' abort). Not to be confused with the
        decision that ends the job (``Decision.abort``, ``RestartAbort``) nor with NCCL's
        communicator abort that the hook may run (``gpu/nccl_abort.py``)."""
        iteration = self.state.iteration
        self._emit("restart_detected", iteration=iteration)
        try:
            self._runtime.shut_down_iteration_store()
            if self._w.abort is not None:
                self._w.abort(self.state.freeze())
        finally:
            self._emit("abort_done", iteration=iteration)

    def _leave_unreleasable(self, p: RestartProtocol, iteration: int) -> None:
        """From the trigger thread: count this rank out of the next barrier."""
        s = self.state
        e = TimeoutError(f"main thread still blocked {self._w.timeouts.release_wait_s:g}s after the abort")
        p.record_fault(FaultRecord.from_exception(s.initial_rank, iteration, "unreleasable", e))
        self._arrive_terminated(p, iteration)

    def _withdraw_join(self, p: RestartProtocol, kind: str, exc: BaseException) -> None:
        """A joiner leaving before it entered the job: withdrawn; admitted already (the leader
        came first), its seat is counted out where it stands, as any rank's."""
        s = self.state
        admitted = join.withdraw(p, self._join_token, f"{kind}: {type(exc).__name__}: {exc}")
        if admitted is not None:
            p.life = admitted.life
            # The seat is in this life once the admitting decision is out (its leader moves it first).
            p.wait_decision(admitted.barrier, self._w.timeouts.barrier_wait_s)
            count_out_before_joining(p, s, kind, exc, self._w.timeouts.barrier_wait_s)

    def _arrive_terminated(self, p: RestartProtocol, iteration: int) -> None:
        """Count this rank out at the barrier after ``iteration``, so nobody waits for it."""
        s = self.state
        try:
            p.barrier(iteration + 1, s.initial_rank, s.world_size, terminated=True,
                      timeout=self._w.timeouts.barrier_wait_s)
        except SeatTaken:
            log.info("rank %d was counted out by another process already", s.initial_rank)

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
        rt, s = self._rt, self.state
        # Not this iteration's, not running, or already restarting (the abort's release path, then exit
        # code 75, owns a rank that has not come back from a restart).
        if rt is not None and event.iteration == s.iteration and s.mode == Mode.ACTIVE and not rt.interrupter.fired:
            report_soft_timeout(rt.protocol, s, event, _seconds(self._w.timeouts.soft_timeout), self._emit)

    def _set_phase(self, phase: Phase) -> None:
        """Enter ``phase``, as its row of the phase table (engine/phases.py) says."""
        row = phases.row(phase)
        self._storm.phase_entered(phase, self.state, self._rt.protocol if self._rt else None)  # engine/storm.py
        if self._rt is not None:
            self._rt.hang_guard.enter(phase)  # the row's hang rule: a restart's hooks get hard_timeout
            self._emit("phase", phase=row.name, iteration=self.state.iteration)
        if row.fault_name is not None:  # INPROCESS_FAULTS: a fault on entering this phase (phase=NAME)
            s = self.state
            faults.enter_phase(row.fault_name, s.initial_rank, s.initial_world_size, s.iteration, s.mode)

    def _emit(self, kind: str, t_ns: Optional[int] = None, **fields: Any) -> None:
        events = self._rt.events if self._rt is not None else None
        if events is not None:
            events.emit(kind, t_ns, **fields)
