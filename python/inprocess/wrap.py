"""``Wrapper`` (configuration) and ``CallWrapper`` (one call's restart loop).

The loop of :meth:`CallWrapper._run`, as a state machine::

    JOIN ──► ITERATION i ──returned everywhere──► COMPLETE ──► return value
                │  ▲
     fault on   │  │ decision of barrier i+1
     any rank   ▼  │
             RESTART: abort ► finalize ► health check ► barrier i+1
                │
                └─ BaseException, failed recovery hook, or discarded ──► TERMINATED (re-raise)

Rule for exceptions in hooks (the same for every hook, tested hook by hook):

* ``initialize`` is part of the attempt: an ``Exception`` there is a fault of
  this rank, like one raised by the function, and restarts the job.
* ``abort``, ``finalize``, ``health_check`` recover the rank: any exception
  there terminates this rank; the others restart without it.
* ``rank_assignment`` runs once, on the leader: an exception there ends the
  job on every rank with :class:`RestartAbort`.
* ``completion`` runs after the job completed: its exception propagates.
* ``terminate`` runs on a rank that is leaving: its exception is logged and
  chained; the rank leaves with the exception that terminated it.
* A ``BaseException`` that is not the engine's own (``SystemExit``,
  ``KeyboardInterrupt``, :class:`RestartAbort`) terminates the rank wherever
  it is raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import inspect
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import typing
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch.distributed as dist

from . import _native
from . import store as store_mod
from .abort import AbortTorchDistributed
from .compose import Compose
from .control import protocol
from .control.membership import Membership
from .control.node_link import NodeLayout, NodeLink, socket_name
from .control.protocol import COMPLETE, Decision, FaultRecord, RestartProtocol, SeatTaken
from .engine import pg_tracker, sockets
from .engine.config import Timeouts, check_bool, check_callable, check_factory, check_kwargs, check_path
from .engine.interrupt import MainThreadInterrupter
from .engine.trigger import IterationOutcome, RestartTrigger
from .exception import InternalError, RankDiscarded, RankShouldRestart, RestartAbort, TimeoutError
from .processes import store_host
from .processes.node_agent import spawn_node_agent
from .rank_assignment import (
    ActivateAllRanks,
    ShiftRanks,
    Topology,
    check_rank_assignment,
    key_gathering_leaves,
)
from .state import FrozenState, Mode, State

log = logging.getLogger("inprocess")

F = TypeVar("F", bound=Callable[..., Any])
_Phase = _native.Phase

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


class Wrapper:
    """Decorator that restarts the wrapped function in-process after a fault on any rank.

    Every keyword of ``nvidia_resiliency_ext.inprocess.Wrapper`` is accepted
    and validated. What each means here (README, "Timeouts", has the latency
    each implies):

    - ``store_factory``/``store_kwargs``: the coordination store
      (:mod:`inprocess.store`), created once per rank.
    - ``initialize``/``abort``/``finalize``/``health_check``/``completion``/
      ``terminate``/``rank_assignment``: hooks (module docstring: rules).
    - ``soft_timeout``, ``hard_timeout``, ``heartbeat_interval``,
      ``heartbeat_timeout``, ``progress_watchdog_interval``,
      ``monitor_process_interval``, ``termination_grace_time``,
      ``monitor_process_logfile``, ``monitor_process_pidfile``: hang and
      death detection: the native watchdog (soft), the monitor process (hard,
      deaths), and the monitors' store heartbeats, each watching its next
      peers (heartbeat_timeout: a lost monitor or node gets its rank counted
      out). ``monitor_process_interval`` is accepted for compatibility: the
      monitor waits on a pidfd and on the page's deadlines, not on an interval.
    - ``monitor_thread_interval``, ``last_call_wait``: accepted for
      compatibility. Faults reach every rank through a blocking wait on the
      store, and concurrent faults are gathered by the barrier itself, so the
      restart path never sleeps for either of them.
    - ``barrier_timeout``: longest wait at the initial and restart barriers,
      and for the abort hook to release the main thread.
    - ``completion_timeout``: longest wait, after the function returned, for
      every other active rank to return too.
    - ``enabled=False`` returns the function untouched.
    - ``node_agent`` (not in nvidia_resiliency_ext): one process per node
      carries the restart's store traffic for the node's ranks
      (:mod:`inprocess.processes.node_agent`), so the store serves nodes, not ranks.
      None (default): used when the launcher describes several nodes with
      more than one rank each (LOCAL_WORLD_SIZE between 2 and WORLD_SIZE-1,
      or SLURM's equivalents); True: required (ValueError without a node
      layout); False: never.
    """

    def __init__(
        self,
        store_factory: Callable[..., dist.Store] = store_mod.TCPStore,
        store_kwargs: Optional[dict[str, Any]] = None,
        initialize: Optional[Callable[[FrozenState], Any]] = None,
        abort: Optional[Callable[[FrozenState], Any]] = AbortTorchDistributed(),
        finalize: Optional[Callable[[FrozenState], Any]] = None,
        health_check: Optional[Callable[[FrozenState], Any]] = None,
        rank_assignment: Any = Compose(ActivateAllRanks(), ShiftRanks()),
        monitor_thread_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        monitor_process_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        progress_watchdog_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        heartbeat_interval: datetime.timedelta = datetime.timedelta(seconds=30),
        soft_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        hard_timeout: datetime.timedelta = datetime.timedelta(seconds=90),
        heartbeat_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        barrier_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        completion_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        last_call_wait: datetime.timedelta = datetime.timedelta(seconds=1),
        termination_grace_time: datetime.timedelta = datetime.timedelta(seconds=5),
        monitor_process_logfile: Optional[str] = None,
        monitor_process_pidfile: Optional[str] = None,
        completion: Optional[Callable[[FrozenState], Any]] = None,
        terminate: Optional[Callable[[FrozenState], Any]] = None,
        enabled: bool = True,
        node_agent: Optional[bool] = None,
    ):
        self.enabled = check_bool("enabled", enabled)
        if node_agent is not None:
            check_bool("node_agent", node_agent)
        self.node_agent = node_agent
        self.store_factory = check_factory("store_factory", store_factory)
        self.store_kwargs = check_kwargs("store_kwargs", store_kwargs)
        for name, hook in (
            ("initialize", initialize),
            ("abort", abort),
            ("finalize", finalize),
            ("health_check", health_check),
            ("completion", completion),
            ("terminate", terminate),
        ):
            check_callable(name, hook)
        check_rank_assignment(rank_assignment)
        self.initialize = initialize
        self.abort = abort
        self.finalize = finalize
        self.health_check = health_check
        self.completion = completion
        self.terminate = terminate
        self.rank_assignment = rank_assignment
        self.timeouts = Timeouts.validated(
            monitor_thread_interval=monitor_thread_interval,
            monitor_process_interval=monitor_process_interval,
            progress_watchdog_interval=progress_watchdog_interval,
            heartbeat_interval=heartbeat_interval,
            soft_timeout=soft_timeout,
            hard_timeout=hard_timeout,
            heartbeat_timeout=heartbeat_timeout,
            barrier_timeout=barrier_timeout,
            completion_timeout=completion_timeout,
            last_call_wait=last_call_wait,
            termination_grace_time=termination_grace_time,
        )
        self.monitor_process_logfile = check_path("monitor_process_logfile", monitor_process_logfile)
        self.monitor_process_pidfile = check_path("monitor_process_pidfile", monitor_process_pidfile)

    def __call__(self, fn: F) -> F:
        if not self.enabled:
            return fn
        if not callable(fn):
            raise ValueError(f"Wrapper()({fn!r}): expected a callable to wrap")
        inject_as = _call_wrapper_parameter(fn)

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            call = CallWrapper(self)
            if inject_as is not None and inject_as not in kwargs:
                kwargs[inject_as] = call
            return call._call(fn, args, kwargs)

        return typing.cast(F, wrapped)


def _call_wrapper_parameter(fn: Callable[..., Any]) -> Optional[str]:
    """Name of the parameter annotated ``CallWrapper`` or ``Optional[CallWrapper]``."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    for name, p in params.items():
        ann = hints.get(name, p.annotation)
        if ann is CallWrapper or CallWrapper in typing.get_args(ann):
            return name
        # An annotation that could not be evaluated stays a string: a parameter
        # whose annotation names CallWrapper is the one.
        if isinstance(ann, str) and re.search(r"\bCallWrapper\b", ann):
            return name
    return None


@dataclasses.dataclass
class RestartRecord:
    """One restart as this rank saw it (timestamps: CLOCK_MONOTONIC ns of this host)."""

    iteration: int  # the iteration that failed
    faults: list[FaultRecord]
    n_faults: int
    terminated: list[int]
    fault_ns: int = 0  # earliest fault recorded on this host, else 0
    detected_ns: int = 0
    aborted_ns: int = 0
    finalized_ns: int = 0
    health_checked_ns: int = 0
    decided_ns: int = 0
    initialized_ns: int = 0
    assignment_ns: int = 0  # duration of the rank assignment on the leader

    @property
    def duration_s(self) -> float:
        """Fault (or detection, for faults on other hosts) to resumption, in seconds."""
        start = self.fault_ns or self.detected_ns
        end = self.initialized_ns or self.decided_ns
        return max(0, end - start) / 1e9


class _Terminated(Exception):
    """Internal: carries the exception this rank leaves with."""

    def __init__(self, exc: BaseException, kind: str):
        super().__init__(kind)
        self.exc = exc
        self.kind = kind


class CallWrapper:
    """One call of a wrapped function: its state and the restart loop.

    It is passed to the function as the parameter annotated ``CallWrapper``
    (or ``Optional[CallWrapper]``), and is also returned by
    :func:`inprocess.current_call`. The function receives the same argument
    objects on every iteration: state it mutates carries over.
    """

    def __init__(self, wrapper: Wrapper):
        self._w = wrapper
        self.state: State
        self.restarts: list[RestartRecord] = []
        self._membership: Optional[Membership] = None
        self._heartbeat: Optional[_native.HeartbeatPage] = None
        self._watchdog: Optional[_native.Watchdog] = None
        self._monitor: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
        self._interrupter: Optional[MainThreadInterrupter] = None
        self._trigger: Optional[RestartTrigger] = None
        self._store: Optional[dist.Store] = None
        self._user_client: Optional[dist.Store] = None
        self._user_sockets: dict[int, str] = {}
        self._protocol: Optional[RestartProtocol] = None
        self._saved_env: dict[str, Optional[str]] = {}
        self._key_owners: list[Any] = []
        self._topology: Optional[Topology] = None
        self._is_store_host = False
        self._saved_excepthook = sys.excepthook
        self._node_link: Optional[NodeLink] = None
        self._node_agent: Optional[subprocess.Popen] = None  # type: ignore[type-arg]

    # -- public API (used from inside the wrapped function) --------------------

    @property
    def iteration(self) -> int:
        return self.state.iteration

    @property
    def frozen_state(self) -> FrozenState:
        return self.state.freeze()

    def ping(self) -> None:
        """Manual progress: arms the soft/hard timeouts for the rest of the iteration."""
        hb = self._heartbeat
        if hb is not None:
            hb.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """A block that a restart does not interrupt: it waits for the block's end.

        Do not run collectives inside: a peer's fault cannot release them.
        """
        assert self._interrupter is not None
        with self._interrupter.lock:
            yield

    @contextlib.contextmanager
    def disable_hang_protection(self) -> Iterator[None]:
        """Suspends the soft and hard timeouts for a block, re-arming them after."""
        hb = self._heartbeat
        if hb is None:
            yield
            return
        hb.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)
        try:
            yield
        finally:
            # Re-arm from now: the time spent inside the block does not count.
            hb.stamp_auto()
            if hb.snapshot().flags & _native.FLAG_MANUAL_ARMED:
                hb.ping()
            hb.set_flag(_native.FLAG_HANG_PROTECTION_OFF, False)

    @property
    def store(self) -> dist.Store:
        """A store scoped to this iteration, for ``init_process_group(store=...)``.

        Its keys are deleted once every rank has left the iteration.
        """
        if self._protocol is None or self._user_client is None:
            raise RuntimeError("CallWrapper.store is available inside the wrapped function only")
        return dist.PrefixStore(self._user_prefix(self.state.iteration), self._user_client)

    # -- the restart loop ------------------------------------------------------

    def _call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._open()
        try:
            return self._run(fn, args, kwargs)
        finally:
            self._close()

    def _run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        try:
            self._set_phase(_Phase.INITIAL_BARRIER)
            self._join()
            while True:
                i = self.state.iteration
                self._interrupter.reset()  # type: ignore[union-attr]
                outcome = self._trigger.arm(i, active=self.state.mode == Mode.ACTIVE)  # type: ignore[union-attr]
                log.debug("iteration %d: rank %d runs as %s", i, self.state.initial_rank, self.state.mode.name)
                if self.state.mode == Mode.ACTIVE:
                    completed, value = self._run_active(fn, args, kwargs, outcome)
                else:
                    completed, value = self._wait_as_spare(outcome)
                if completed:
                    return self._complete(value)
                self._restart(outcome)
        except _Terminated as t:
            self._leave_terminated(t)
            raise AssertionError("unreachable")  # _leave_terminated always raises

    def _join(self) -> None:
        s = self.state
        if self._key_owners:
            keys = [list(owner.local_keys(s.initial_rank, s.initial_world_size)) for owner in self._key_owners]
            self._protocol.publish_local_keys(s.initial_rank, keys)  # type: ignore[union-attr]
        decision = self._barrier(0, s.initial_world_size)
        assert decision is not None
        self._apply(decision)

    def _run_active(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], outcome: IterationOutcome
    ) -> tuple[bool, Any]:
        s = self.state
        s.fn_exception = None
        interrupter = self._interrupter
        assert interrupter is not None
        self._open_iteration_store()
        try:
            self._set_phase(_Phase.RUNNING)
            with interrupter.running(), self._hang_protection():
                if self._w.initialize is not None:
                    self._w.initialize(s.freeze())
                if self.restarts:
                    self.restarts[-1].initialized_ns = time.monotonic_ns()
                value = fn(*args, **kwargs)
        except RankShouldRestart:
            return False, None
        except BaseException as e:
            if interrupter.fired:
                # Raised because the restart aborted what this rank was doing.
                log.debug("rank %d: %s while restarting", s.initial_rank, type(e).__name__)
                _drop_frames(e)
                return False, None
            if not isinstance(e, Exception):
                raise _Terminated(e, "terminated") from None
            # Publish before the frames are dropped: dropping them may destroy
            # this rank's process group, and a peer that sees its connection
            # close must find the restart already requested.
            first_hand = not self._protocol.restart_requested(s.iteration)  # type: ignore[union-attr]
            # An exception after the restart was requested may be a consequence
            # (a peer's aborted connection) or a fault of its own at the same
            # moment: it is recorded either way, marked, and only a first-hand
            # fault counts as this rank's (fn_exception, FaultCounter).
            kind = "exception" if first_hand else "after_restart"
            self._protocol.report_fault(  # type: ignore[union-attr]
                FaultRecord.from_exception(s.initial_rank, s.iteration, kind, e)
            )
            if first_hand:
                s.fn_exception = e
            log.info("rank %d: %s in iteration %d: %s: %s", s.initial_rank, kind, s.iteration, type(e).__name__, e)
            _drop_frames(e)
            return False, None
        # The function returned: wait until it returned on every active rank.
        self._set_phase(_Phase.COMPLETION)
        outcome.completing = True  # before the count: from now on the event may be "complete"
        self._protocol.arrive_completed(s.iteration, s.active_world_size)  # type: ignore[union-attr]
        timeout = _seconds(self._w.timeouts.completion_timeout)
        if not outcome.done.wait(timeout):
            e = TimeoutError(f"the other ranks did not complete iteration {s.iteration} within {timeout:g}s")
            raise _Terminated(e, "completion_timeout")
        self._check_outcome(outcome)
        return outcome.event == COMPLETE, value

    def _wait_as_spare(self, outcome: IterationOutcome) -> tuple[bool, Any]:
        # A spare blocks on the trigger's event: no CPU burnt while it waits.
        outcome.done.wait()
        self._check_outcome(outcome)
        return outcome.event == COMPLETE, None

    def _check_outcome(self, outcome: IterationOutcome) -> None:
        if outcome.event is None:
            e = outcome.abort_error or InternalError("restart trigger stopped without an outcome")
            raise _Terminated(e, "store")

    def _restart(self, outcome: IterationOutcome) -> None:
        s = self.state
        t = self._w.timeouts
        fault_iteration = s.iteration
        self._set_phase(_Phase.ABORTING)
        if not outcome.done.wait(_seconds(t.barrier_timeout)):
            raise _Terminated(TimeoutError(f"abort did not finish within {_seconds(t.barrier_timeout):g}s"), "abort")
        self._check_outcome(outcome)
        if outcome.abort_error is not None:
            raise _Terminated(outcome.abort_error, "abort")
        record = RestartRecord(fault_iteration, [], 0, [], detected_ns=outcome.detected_ns, aborted_ns=outcome.aborted_ns)
        # Back in the main thread, the failed iteration's frames gone and its
        # collectives ended: destroying the groups here cannot race with DDP
        # nor deadlock on the gloo workers (see inprocess.engine.pg_tracker).
        pg_tracker.release_groups()
        sys.excepthook = self._saved_excepthook
        self._user_client, self._user_sockets = None, {}
        self._set_phase(_Phase.FINALIZING)
        self._run_recovery_hook("finalize", self._w.finalize)
        record.finalized_ns = time.monotonic_ns()
        self._set_phase(_Phase.HEALTH_CHECK)
        self._run_recovery_hook("health_check", self._w.health_check)
        record.health_checked_ns = time.monotonic_ns()

        self._set_phase(_Phase.RESTART_BARRIER)
        decision = self._barrier(fault_iteration + 1, s.world_size)
        assert decision is not None
        record.decided_ns = time.monotonic_ns()
        record.faults, record.n_faults, record.terminated = decision.faults, decision.n_faults, decision.terminated
        record.assignment_ns = decision.assignment_ns
        here = [f.t_ns for f in decision.faults if f.host == protocol.HOST and f.t_ns]
        record.fault_ns = min(here) if here else 0
        self.restarts.append(record)
        self._apply(decision)

    def _barrier(self, iteration: int, expected: int) -> Optional[Decision]:
        s = self.state
        try:
            return self._protocol.barrier(  # type: ignore[union-attr]
                iteration, s.initial_rank, expected, decide=self._decide,
                timeout=_seconds(self._w.timeouts.barrier_timeout),
            )
        except SeatTaken as e:
            # A peer's monitor declared this rank lost (this rank's own monitor
            # stopped heartbeating) and counted it out: it must not count itself in.
            raise _Terminated(RankDiscarded(f"initial rank {s.initial_rank} was declared lost: {e}"),
                              "counted_out") from None

    def _run_recovery_hook(self, name: str, hook: Optional[Callable[[FrozenState], Any]]) -> None:
        if hook is None:
            return
        try:
            hook(self.state.freeze())
        except BaseException as e:
            raise _Terminated(e, name) from None

    def _decide(self, dead: set[int], faults: list[FaultRecord], leader: int) -> Decision:
        iteration = 0 if self._membership is None else self.state.iteration + 1
        previous = self._membership or Membership.all_active(self.state.initial_world_size)
        return protocol.decide(self._w.rank_assignment, previous, dead, faults, iteration, leader, self._read_topology())

    def _read_topology(self) -> Topology:
        if not self._key_owners:
            return Topology.empty()
        if self._topology is None:
            table = self._protocol.read_topology(self.state.initial_world_size)  # type: ignore[union-attr]
            columns = [[tuple(row[j]) for row in table] for j in range(len(self._key_owners))]
            self._topology = Topology(self._key_owners, columns)
        return self._topology

    def _apply(self, decision: Decision) -> None:
        s = self.state
        m = decision.membership
        r = s.initial_rank
        self._membership = m
        s.iteration = decision.iteration
        if decision.abort is not None:
            self._protocol.leave(decision.iteration, m.world_size)  # type: ignore[union-attr]
            raise _Terminated(RestartAbort(decision.abort), "abort_job")
        mode = Mode(m.mode[r])
        if mode == Mode.TERMINATED:
            raise _Terminated(RankDiscarded(f"initial rank {r} was terminated by the rank assignment"), "discarded")
        s.mode = mode
        s.rank = m.rank[r]
        s.world_size = m.world_size
        s.active_rank = m.active_rank[r] if mode == Mode.ACTIVE else None
        s.active_world_size = m.active_world_size
        if mode == Mode.ACTIVE:
            os.environ["RANK"] = str(s.active_rank)
            os.environ["WORLD_SIZE"] = str(s.active_world_size)
        else:
            # A spare has no rank in the running job; it never sees "None" there.
            os.environ.pop("RANK", None)
            os.environ.pop("WORLD_SIZE", None)
        hb = self._heartbeat
        if hb is not None:
            hb.begin_iteration(s.iteration, s.world_size)
        if decision.leader == r and decision.iteration > 0:
            self._delete_user_keys(decision.iteration - 1)

    def _complete(self, value: Any) -> Any:
        s = self.state
        self._set_phase(_Phase.DONE)
        self._protocol.leave(s.iteration, s.world_size)  # type: ignore[union-attr]
        if self._w.completion is not None:
            self._w.completion(s.freeze())
        return value if s.mode == Mode.ACTIVE else None

    def _leave_terminated(self, t: _Terminated) -> None:
        """Leave the job: tell the others, arrive for them at the barrier, re-raise."""
        s = self.state
        p = self._protocol
        assert p is not None
        exc = t.exc
        _drop_frames(exc)
        s.mode = Mode.TERMINATED
        log.warning("rank %d leaves the job (%s): %s: %s", s.initial_rank, t.kind, type(exc).__name__, exc)
        if t.kind not in ("discarded", "abort_job", "counted_out") and self._membership is not None:
            try:
                p.report_fault(FaultRecord.from_exception(s.initial_rank, s.iteration, t.kind, exc))
                self._arrive_terminated(p, s.iteration)
            except Exception as e:
                log.error("rank %d could not record its termination: %s", s.initial_rank, e)
        # Only now: until the rank is counted out, its monitor must count it out if it dies.
        self._set_phase(_Phase.TERMINATED)
        if self._w.terminate is not None:
            try:
                self._w.terminate(s.freeze())
            except BaseException as e:
                log.error("terminate hook raised %s: %s", type(e).__name__, e)
                exc.__context__ = e
        raise exc

    # -- setup and teardown ----------------------------------------------------

    def _open(self) -> None:
        global _current, _call_counter
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError(
                "inprocess.Wrapper: a torch.distributed process group already exists; "
                "create process groups inside the wrapped function, so that a restart can rebuild them"
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
        self._saved_env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE")}
        # init_process_group wraps sys.excepthook every time ("[rankN]:" prefixes):
        # restored at every restart, so that nothing accumulates across iterations.
        self._saved_excepthook = sys.excepthook
        self.state = State(initial_rank=rank, initial_world_size=world_size, rank=rank, world_size=world_size)
        try:
            t = self._w.timeouts
            self._heartbeat = _native.HeartbeatPage.create()
            self._heartbeat.set_timeouts(int(_seconds(t.soft_timeout) * 1e9), int(_seconds(t.hard_timeout) * 1e9))
            self._heartbeat.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)
            pg_tracker.install()
            store_kwargs = dict(self._w.store_kwargs)
            if self._w.store_factory is store_mod.TCPStore:
                # An orphaned store host waits one heartbeat_timeout of silence before it decides the job is gone.
                store_kwargs.setdefault("host_idle_timeout_s", _seconds(t.heartbeat_timeout))
            self._store = self._w.store_factory(**store_kwargs)
            self._is_store_host = store_mod.is_host(self._store)
            if store_mod.host_process(self._store) is not None:
                # The store host exits when this call is done: tell it which call that is.
                self._store.set(store_host.CALL_KEY, str(call_index))
            self._node_link = self._open_node_link(call_index)
            self._protocol = RestartProtocol(self._store, call_index, self._node_link)
            trigger_protocol = RestartProtocol(
                store_mod.clone(self._store, self._w.store_factory, self._w.store_kwargs), call_index, self._node_link
            )
            self._key_owners = key_gathering_leaves(self._w.rank_assignment)
            self._interrupter = MainThreadInterrupter()
            self._interrupter.install()
            self._monitor = self._spawn_monitor(call_index)
            self._watchdog = _native.Watchdog(
                self._heartbeat.fd, int(_seconds(t.progress_watchdog_interval) * 1e9), self._on_soft_timeout
            )
            self._watchdog.start()
            self._trigger = RestartTrigger(
                trigger_protocol,
                self._interrupter,
                self._run_abort_hook,
                release_timeout=_seconds(t.barrier_timeout),
                leave=functools.partial(self._leave_unreleasable, trigger_protocol),
            )
        except BaseException:
            self._close()
            raise

    def _open_node_link(self, call_index: int) -> Optional[NodeLink]:
        """This node's agent (local rank 0 starts it), or None: the store directly."""
        layout = NodeLayout.from_env()
        store = self._store
        wanted = self._w.node_agent
        if wanted is None:
            wanted = (
                layout is not None and 1 < layout.local_world_size < self.state.initial_world_size
                and isinstance(store, dist.TCPStore)
            )
        if not wanted:
            return None
        if layout is None:
            raise ValueError("Wrapper(node_agent=True): no node layout: set LOCAL_RANK, LOCAL_WORLD_SIZE "
                             "and GROUP_RANK (torchrun does), or launch with srun")
        if not isinstance(store, dist.TCPStore):
            raise ValueError(f"Wrapper(node_agent=True): the node agent speaks TCPStore only, the store is "
                             f"{type(store).__name__}")
        t = self._w.timeouts
        connect_timeout = min(_seconds(t.barrier_timeout), 30.0)
        if layout.local_rank == 0:
            self._node_agent = spawn_node_agent(
                store.host, store.port, call_index, layout,
                store_timeout_s=_seconds(t.barrier_timeout), connect_timeout_s=connect_timeout,
            )
        name = socket_name(store.host, store.port, call_index, layout.node)
        try:
            return NodeLink.connect(name, layout.local_rank, connect_timeout)
        except (TimeoutError, OSError, RuntimeError) as e:
            log.warning("rank %d: no node agent (%s): this rank talks to the store directly",
                        self.state.initial_rank, e)
            return None

    def _close_node_link(self) -> None:
        link, self._node_link = self._node_link, None
        if link is not None:
            link.close()  # the agent exits once every rank of its node closed its link
        agent, self._node_agent = self._node_agent, None
        if agent is not None:
            # Reaped if it has exited; the node's other ranks may still be inside the
            # call, and then the agent outlives this rank (nothing waits for it here).
            agent.poll()

    def _spawn_monitor(self, call_index: int) -> Optional[subprocess.Popen]:  # type: ignore[type-arg]
        """The per-rank monitor process: sees this rank's death through a pidfd,
        enforces hard_timeout, and reports for the rank when it cannot."""
        store = self._store
        if not isinstance(store, dist.TCPStore):
            log.info("no monitor process: it speaks TCPStore only (store is %s)", type(store).__name__)
            return None
        from .processes.monitor import spawn_monitor

        t = self._w.timeouts
        assert self._heartbeat is not None
        return spawn_monitor(
            self._heartbeat, store.host, store.port, call_index, self.state.initial_rank,
            _seconds(t.termination_grace_time),
            world_size=self.state.initial_world_size,
            barrier_timeout_s=_seconds(t.barrier_timeout),
            store_timeout_s=_seconds(t.barrier_timeout),
            heartbeat_interval_s=_seconds(t.heartbeat_interval),
            heartbeat_timeout_s=_seconds(t.heartbeat_timeout),
            logfile=self._w.monitor_process_logfile,
            pidfile=self._w.monitor_process_pidfile,
            # Without a log file the monitor shares the rank's stderr: warnings only.
            log_level="INFO" if self._w.monitor_process_logfile else "WARNING",
        )

    def _stop_monitor(self) -> None:
        monitor, self._monitor = self._monitor, None
        if monitor is None or monitor.poll() is not None:
            return
        # Stopped on purpose: the monitor only marks its heartbeat gone (so
        # that its peers do not count this rank out). SIGCONT first: a frozen
        # monitor would not see the SIGTERM.
        monitor.send_signal(signal.SIGCONT)
        monitor.terminate()
        try:
            monitor.wait(timeout=5)
        except subprocess.TimeoutExpired:
            monitor.kill()
            monitor.wait()

    def _leave_unreleasable(self, p: RestartProtocol, iteration: int) -> None:
        """From the trigger thread: count this rank out of the next barrier."""
        s = self.state
        e = TimeoutError(f"main thread still blocked {_seconds(self._w.timeouts.barrier_timeout):g}s after the abort")
        p.record_fault(FaultRecord.from_exception(s.initial_rank, iteration, "unreleasable", e))
        self._arrive_terminated(p, iteration)

    def _arrive_terminated(self, p: RestartProtocol, iteration: int) -> None:
        """Count this rank out at the barrier after ``iteration``, so nobody waits for it."""
        s = self.state
        try:
            p.barrier(iteration + 1, s.initial_rank, s.world_size, terminated=True,
                      timeout=_seconds(self._w.timeouts.barrier_timeout))
        except SeatTaken:
            log.info("rank %d was counted out by another process already", s.initial_rank)

    @contextlib.contextmanager
    def _hang_protection(self) -> Iterator[None]:
        """Soft and hard timeouts apply while the function runs, and only then:
        the engine's own waits (barriers, completion) have timeouts of their own."""
        hb = self._heartbeat
        assert hb is not None
        hb.begin_iteration(self.state.iteration, self.state.world_size)
        hb.set_flag(_native.FLAG_HANG_PROTECTION_OFF, False)
        try:
            yield
        finally:
            hb.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)

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
        s = self.state
        p = self._protocol
        if p is None or event.iteration != s.iteration or s.mode != Mode.ACTIVE:
            return
        if self._interrupter is not None and self._interrupter.fired:
            # A restart is already under way and this rank has not come back from
            # it: the abort's release path (then exit code 75) owns the case.
            return
        since = (event.detected_ns - event.last_progress_ns) / 1e9
        clock = "manual (ping)" if event.manual else "automatic"
        e = TimeoutError(f"no {clock} progress for {since:.1f}s (soft_timeout="
                         f"{_seconds(self._w.timeouts.soft_timeout):g}s)")
        log.warning("rank %d: soft timeout in iteration %d: %s", s.initial_rank, s.iteration, e)
        try:
            p.report_fault(FaultRecord.from_exception(s.initial_rank, s.iteration, "soft_timeout", e))
        except Exception as err:  # the store is gone: the hard timeout is the next line of defence
            log.error("rank %d could not report its soft timeout: %s", s.initial_rank, err)

    def _open_iteration_store(self) -> None:
        """A fresh client connection per iteration for the function's own
        rendezvous, so that a restart can release a rendezvous blocked on a
        peer that failed, by shutting this connection down."""
        self._user_client, self._user_sockets = store_mod.tracked_clone(
            self._store, self._w.store_factory, self._w.store_kwargs
        )

    def _run_abort_hook(self) -> None:
        sockets.shutdown_connected(self._user_sockets)
        if self._w.abort is not None:
            self._w.abort(self.state.freeze())

    def _close(self) -> None:
        global _current
        try:
            self._stop_monitor()
            if self._watchdog is not None:
                self._watchdog.stop(1_000_000_000)
            if self._trigger is not None:
                self._trigger.stop()
            self._close_node_link()
            pg_tracker.release_groups()
            sys.excepthook = self._saved_excepthook
            host = store_mod.host_process(self._store)
            if host is not None and self.state.mode != Mode.TERMINATED:
                # The store host exits once the last rank left; a terminated rank
                # leaves at once (the host outlives it, that is its purpose).
                if not host.wait_exit(_seconds(self._w.timeouts.completion_timeout)):
                    log.warning("store host (pid %d): the other ranks did not all leave within "
                                "completion_timeout; it stays until they do", host.pid)
            if self._is_store_host and self._protocol is not None:
                # The server lives in this process: keep it until every rank left.
                # A terminated host waits for the rest of the job, however long.
                terminated = self.state.mode == Mode.TERMINATED
                try:
                    self._protocol.wait_done(None if terminated else _seconds(self._w.timeouts.completion_timeout))
                except Exception as e:
                    log.warning("store host: the other ranks did not all leave: %s", e)
            if self._interrupter is not None:
                self._interrupter.uninstall()
            if self._heartbeat is not None:
                self._heartbeat.close()
        finally:
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self._trigger = None
            self._watchdog = None
            self._user_client = None
            self._store = None
            with _current_lock:
                if _current is self:
                    _current = None

    def _set_phase(self, phase: Any) -> None:
        hb = self._heartbeat
        if hb is not None:
            hb.set_phase(phase)

    def _user_prefix(self, iteration: int) -> str:
        assert self._protocol is not None
        return f"{self._protocol.prefix}user/{iteration}/"

    def _delete_user_keys(self, iteration: int) -> None:
        """Delete the keys the function's own rendezvous wrote in ``iteration``."""
        client = self._store
        if client is None or not hasattr(client, "list_keys"):
            return
        prefix = self._user_prefix(iteration)
        try:
            for key in client.list_keys():  # type: ignore[attr-defined]
                if key.startswith(prefix):
                    client.delete_key(key)
        except Exception as e:
            log.debug("could not delete keys of iteration %d: %s", iteration, e)


def _drop_frames(exc: BaseException) -> None:
    """Release the frames an exception holds (and with them the failed
    iteration's models and process groups), keeping type and message."""
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        e = e.__cause__ or e.__context__
