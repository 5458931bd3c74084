"""Validation of :class:`inprocess.Wrapper` keywords (design principle 8).

Every timeout has one meaning, and they nest::

    progress_watchdog_interval, monitor_thread_interval  <  soft_timeout  <  hard_timeout
    hard_timeout + termination_grace_time  <  barrier_timeout
    monitor_process_interval, heartbeat_interval  <  heartbeat_timeout

A value of the wrong type, a negative value or a broken order raises
``ValueError`` naming the keyword and the value.

The keywords are ``timedelta``s, as in nvidia_resiliency_ext; below them every
interface takes float seconds. Each wait the engine and its helper processes
make is a named budget of :class:`Timeouts`, in seconds, so that no code reads
a keyword to bound a wait of its own choosing (README, "Configuration and
timeouts", has the same list).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from collections.abc import Callable
from typing import Any, Protocol

_TIMEDELTA_KEYWORDS = (
    "monitor_thread_interval",
    "monitor_process_interval",
    "progress_watchdog_interval",
    "heartbeat_interval",
    "soft_timeout",
    "hard_timeout",
    "heartbeat_timeout",
    "barrier_timeout",
    "completion_timeout",
    "last_call_wait",
    "termination_grace_time",
)

# Keywords that may be zero: waiting nothing is a meaningful choice for them.
_MAY_BE_ZERO = ("last_call_wait", "termination_grace_time")


def _fmt(td: datetime.timedelta) -> str:
    return f"{td.total_seconds():g}s"


# A rank gives up on reaching its node agent after at most this long (then it
# talks to the store directly); the agent waits as long for its first rank.
AGENT_CONNECT_CAP_S = 30.0


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """The Wrapper's timeout keywords, validated, and the budgets they give.

    Budgets (float seconds; each bounds one wait, and is the only way to read it):

    ``barrier_wait_s`` = barrier_timeout
        a rank's wait for the decision at the initial and restart barriers,
        and at the barrier where it counts itself out.
    ``abort_wait_s`` = barrier_timeout
        the main thread's wait for the abort (run on the restart trigger's
        thread) to finish; past it the rank is terminated.
    ``release_wait_s`` = barrier_timeout
        the restart trigger's wait for the main thread to leave the function
        after the abort; past it the rank counts itself out and exits 75.
    ``monitor_store_op_s`` = barrier_timeout
        the monitor process's deadline for each store operation and for
        connecting to the store.
    ``monitor_barrier_wait_s`` = barrier_timeout
        the monitor's wait for a barrier's decision when it counts a rank out.
    ``agent_store_op_s`` = barrier_timeout
        the node agent's deadline for each store operation.
    ``agent_connect_s`` = min(barrier_timeout, 30 s)
        a rank's wait to reach its node agent (then it uses the store
        directly), and the agent's wait for its first rank (then it exits).
    ``store_host_idle_s`` = heartbeat_timeout
        with the rank that started it gone, how long the store host serves
        on without any monitor heartbeat before it decides the job is gone.
    """

    monitor_thread_interval: datetime.timedelta
    monitor_process_interval: datetime.timedelta
    progress_watchdog_interval: datetime.timedelta
    heartbeat_interval: datetime.timedelta
    soft_timeout: datetime.timedelta
    hard_timeout: datetime.timedelta
    heartbeat_timeout: datetime.timedelta
    barrier_timeout: datetime.timedelta
    completion_timeout: datetime.timedelta
    last_call_wait: datetime.timedelta
    termination_grace_time: datetime.timedelta

    @classmethod
    def validated(cls, **values: Any) -> Timeouts:
        for name in _TIMEDELTA_KEYWORDS:
            value = values[name]
            if not isinstance(value, datetime.timedelta):
                raise ValueError(
                    f"{name}={value!r} ({type(value).__name__}): expected a datetime.timedelta"
                )
            if value < datetime.timedelta(0) or (value == datetime.timedelta(0) and name not in _MAY_BE_ZERO):
                bound = ">= 0" if name in _MAY_BE_ZERO else "> 0"
                raise ValueError(f"{name}={_fmt(value)}: expected a duration {bound}")
        t = cls(**values)
        t._check_order()
        return t

    @property
    def barrier_wait_s(self) -> float:
        return self.barrier_timeout.total_seconds()

    @property
    def abort_wait_s(self) -> float:
        return self.barrier_timeout.total_seconds()

    @property
    def release_wait_s(self) -> float:
        return self.barrier_timeout.total_seconds()

    @property
    def monitor_store_op_s(self) -> float:
        return self.barrier_timeout.total_seconds()

    @property
    def monitor_barrier_wait_s(self) -> float:
        return self.barrier_timeout.total_seconds()

    @property
    def agent_store_op_s(self) -> float:
        return self.barrier_timeout.total_seconds()

    @property
    def agent_connect_s(self) -> float:
        return min(self.barrier_timeout.total_seconds(), AGENT_CONNECT_CAP_S)

    @property
    def store_host_idle_s(self) -> float:
        return self.heartbeat_timeout.total_seconds()

    def _check_order(self) -> None:
        def less(a: str, b: str) -> None:
            va, vb = getattr(self, a), getattr(self, b)
            if not va < vb:
                raise ValueError(f"{a}={_fmt(va)} must be less than {b}={_fmt(vb)}")

        less("progress_watchdog_interval", "soft_timeout")
        less("monitor_thread_interval", "soft_timeout")
        less("soft_timeout", "hard_timeout")
        less("monitor_process_interval", "heartbeat_timeout")
        less("heartbeat_interval", "heartbeat_timeout")
        kill_bound = self.hard_timeout + self.termination_grace_time
        if not kill_bound < self.barrier_timeout:
            raise ValueError(
                f"hard_timeout={_fmt(self.hard_timeout)} + termination_grace_time="
                f"{_fmt(self.termination_grace_time)} must be less than barrier_timeout="
                f"{_fmt(self.barrier_timeout)}: a hung rank must be killed before the barrier gives up on it"
            )


def check_callable(name: str, value: Any, optional: bool = True) -> None:
    if value is None and optional:
        return
    if not callable(value):
        raise ValueError(f"{name}={value!r} ({type(value).__name__}): expected a callable or None")


def check_path(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name}={value!r} ({type(value).__name__}): expected a path (str or os.PathLike) or None")
    return os.fspath(value)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} ({type(value).__name__}): expected True or False")
    return value


def check_kwargs(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"{name}={value!r}: expected a dict of keyword arguments or None")
    return dict(value)


def check_factory(name: str, value: Any) -> Callable[..., Any]:
    if not callable(value):
        raise ValueError(f"{name}={value!r} ({type(value).__name__}): expected a store class or factory")
    factory: Callable[..., Any] = value
    return factory


@dataclasses.dataclass(frozen=True)
class GrowPolicy:
    """When the job restarts on purpose to take waiting joiners in.

    ``min_waiting``: only once at least this many joiners wait. ``min_interval_s``:
    at most one grow per this many seconds (0: as soon as possible).
    ``check_every``: safe points between two looks (each look costs every active
    rank one store read; the grow comes one or two looks after the joiners).
    """

    min_waiting: int = 1
    min_interval_s: float = 0.0
    check_every: int = 10

    def __post_init__(self) -> None:
        if type(self.min_waiting) is not int or self.min_waiting < 1:
            raise ValueError(f"GrowPolicy(min_waiting={self.min_waiting!r}): expected an int >= 1")
        interval: object = self.min_interval_s  # checked as the caller gave it, whatever its type
        if not isinstance(interval, (int, float)) or interval < 0:
            raise ValueError(f"GrowPolicy(min_interval_s={self.min_interval_s!r}): expected seconds >= 0")
        if type(self.check_every) is not int or self.check_every < 1:
            raise ValueError(f"GrowPolicy(check_every={self.check_every!r}): expected an int >= 1")


Hook = Callable[[Any], Any] | None  # called with the rank's FrozenState


class Settings(Protocol):
    """What the engine reads of an :class:`inprocess.Wrapper`: its validated keywords (the
    engine never imports the user's surface)."""

    timeouts: Timeouts
    store_factory: Callable[..., Any]
    store_kwargs: dict[str, Any]
    initialize: Hook
    abort: Hook
    finalize: Hook
    health_check: Hook
    completion: Hook
    terminate: Hook
    rank_assignment: Any
    grow: GrowPolicy | None
    node_agent: bool | None
    events_dir: str | None
    monitor_process_logfile: str | None
    monitor_process_pidfile: str | None
