"""``Wrapper``: the decorator and its validated configuration.

Each call of the wrapped function runs in a :class:`CallWrapper`
(:mod:`inprocess.call_wrapper`, the restart loop); both names are importable
from here, as in ``nvidia_resiliency_ext.inprocess.wrap``.

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
* :class:`RestartAbort` (``initialize``'s, e.g. ``RetryController``'s, the
  function's, a recovery hook's) ends the job on every rank at the next
  decision: the rank that raised it goes on to the restart barrier and
  leaves there with it, the others with a ``RestartAbort`` naming it.
* Any other ``BaseException`` that is not the engine's own (``SystemExit``,
  ``KeyboardInterrupt``) terminates the rank wherever it is raised.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import re
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from . import store as store_mod
from .abort import AbortTorchDistributed
from .call_wrapper import CallWrapper, RestartRecord, current_call
from .compose import Compose
from .engine.config import GrowPolicy, Timeouts, check_bool, check_callable, check_factory, check_kwargs, check_path
from .rank_assignment import ActivateAllRanks, ShiftRanks, check_rank_assignment
from .state import FrozenState

__all__ = ["CallWrapper", "RestartRecord", "Wrapper", "current_call"]

F = TypeVar("F", bound=Callable[..., Any])

# The default rank assignment, as in nvidia_resiliency_ext (stateless: one instance serves every Wrapper).
_DEFAULT_RANK_ASSIGNMENT = Compose(ActivateAllRanks(), ShiftRanks())


_MAX_DEFAULT_HEARTBEAT_INTERVAL = datetime.timedelta(seconds=30)


def _heartbeat_interval(interval: datetime.timedelta | None, timeout: Any) -> datetime.timedelta | None:
    """The monitors' heartbeat interval: as given, else half of ``heartbeat_timeout``
    up to 30 s (a timeout chosen alone, as nvidia_resiliency_ext allows, stays valid)."""
    if interval is not None:
        return interval  # validated with the other timeouts
    if not isinstance(timeout, datetime.timedelta):
        return _MAX_DEFAULT_HEARTBEAT_INTERVAL  # the validation names heartbeat_timeout itself
    return min(_MAX_DEFAULT_HEARTBEAT_INTERVAL, timeout / 2)


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
      ``heartbeat_interval`` defaults to half of ``heartbeat_timeout``, at
      most 30 s (one store write per monitor and interval).
    - ``monitor_thread_interval``, ``last_call_wait``: accepted for
      compatibility. Faults reach every rank through a blocking wait on the
      store, and concurrent faults are gathered by the barrier itself, so the
      restart path never sleeps for either of them.
    - ``barrier_timeout``: longest wait at the initial and restart barriers,
      and for the abort hook to release the main thread.
    - ``completion_timeout``: longest wait, after the function returned, for
      every other active rank to return too.
    - ``enabled=False`` returns the function untouched.
    - ``events_dir`` (not in nvidia_resiliency_ext): every rank writes its
      structured events (:mod:`inprocess.events`) to ``<dir>/rank<r>.jsonl``;
      None (default) reads ``INPROCESS_EVENTS_DIR``, and without it writes
      nothing. ``python -m inprocess.timeline DIR`` draws them.
    - ``rank_filter`` (deprecated in nvidia_resiliency_ext): refused with a
      ValueError that says what replaced it (filters in ``rank_assignment``).
    - ``grow`` (not in nvidia_resiliency_ext): a :class:`~inprocess.GrowPolicy`: the job
      restarts on purpose, at a safe point (the end of ``atomic()``, or
      ``CallWrapper.safe_point()``), to take in processes waiting to join it
      (:mod:`inprocess.engine.grow`). None (default): only faults restart it.
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
        store_kwargs: dict[str, Any] | None = None,
        initialize: Callable[[FrozenState], Any] | None = None,
        abort: Callable[[FrozenState], Any] | None = AbortTorchDistributed(),  # noqa: B008 (NVRx's default)
        finalize: Callable[[FrozenState], Any] | None = None,
        health_check: Callable[[FrozenState], Any] | None = None,
        rank_assignment: Any = _DEFAULT_RANK_ASSIGNMENT,
        monitor_thread_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        monitor_process_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        progress_watchdog_interval: datetime.timedelta = datetime.timedelta(seconds=1),
        heartbeat_interval: datetime.timedelta | None = None,
        soft_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        hard_timeout: datetime.timedelta = datetime.timedelta(seconds=90),
        heartbeat_timeout: datetime.timedelta = datetime.timedelta(seconds=60),
        barrier_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        completion_timeout: datetime.timedelta = datetime.timedelta(seconds=120),
        last_call_wait: datetime.timedelta = datetime.timedelta(seconds=1),
        termination_grace_time: datetime.timedelta = datetime.timedelta(seconds=5),
        monitor_process_logfile: str | None = None,
        monitor_process_pidfile: str | None = None,
        completion: Callable[[FrozenState], Any] | None = None,
        terminate: Callable[[FrozenState], Any] | None = None,
        enabled: bool = True,
        node_agent: bool | None = None,
        events_dir: str | None = None,
        rank_filter: None = None,
        grow: GrowPolicy | None = None,
    ):
        if rank_filter is not None:
            raise ValueError(
                f"rank_filter={rank_filter!r}: not supported (nvidia_resiliency_ext deprecated it in favour of "
                "rank_assignment); filter ranks in rank_assignment instead, e.g. "
                "Compose(MaxActiveWorldSize(n), ActivateAllRanks(), ShiftRanks()), "
                "ActiveWorldSizeDivisibleBy(k), or Tree(layers, world_size_filter=...)"
            )
        self.enabled = check_bool("enabled", enabled)
        if node_agent is not None:
            check_bool("node_agent", node_agent)
        self.node_agent = node_agent
        self.store_factory = check_factory("store_factory", store_factory)
        self.store_kwargs = check_kwargs("store_kwargs", store_kwargs)
        store_mod.check_store_kwargs(self.store_factory, self.store_kwargs)
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
            heartbeat_interval=_heartbeat_interval(heartbeat_interval, heartbeat_timeout),
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
        self.events_dir = check_path("events_dir", events_dir)
        if grow is not None and not isinstance(grow, GrowPolicy):
            raise ValueError(f"grow={grow!r}: expected an inprocess.GrowPolicy or None")
        self.grow = grow

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


def _call_wrapper_parameter(fn: Callable[..., Any]) -> str | None:
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


