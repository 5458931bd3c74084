"""Status lines for a restarter that runs *outside* the job (a nested restarter).

When an in-job launcher (NVIDIA's ``ft_launcher``, or a supervisor of your own)
restarts whole processes and ``inprocess`` restarts the function inside them,
the outer one needs to know what the inner one is doing, so that it does not
act on a fault the inner one is already handling. nvidia_resiliency_ext
defines a log contract for that; these hooks write it, under the same names:

=============================================  ==========  ==================================================
hook (put it in the Wrapper keyword below)     keyword     line it writes on ``special_rank``
=============================================  ==========  ==================================================
:class:`NestedRestarterHandlingCompleted`      initialize  ``state=initialize`` on the first call, then
                                                           ``state=handling stage=completed`` (a restart is
                                                           done: the function runs again)
:class:`NestedRestarterHandlingStarting`       abort       ``state=handling stage=starting`` (a restart began)
:class:`NestedRestarterFinalized`              completion  ``state=finalized`` (the call completed)
:class:`NestedRestarterAborted`                terminate   ``state=aborted`` (this rank leaves the job)
=============================================  ==========  ==================================================

The contract, as written here: one line per event on **standard output**,
flushed at once, from the process of initial rank ``special_rank`` (default
0) only::

    [<time>] [ALWAYS] [InprocessRestarter.Restarter] [NestedRestarter] name=[InProcess] state=<state>[ stage=<stage>]

``<time>`` is ``logging``'s default ``asctime`` (``2026-11-24 13:05:01,234``);
an outer restarter should match from ``[NestedRestarter]`` on. The logger
(``InprocessRestarter.Restarter``) does not propagate to the root logger, so
the lines appear whatever the application's logging configuration.

Combine them with the hooks you already use, e.g.
``abort=Compose(AbortTorchDistributed(), NestedRestarterHandlingStarting())``.

As in NVRx, each hook is a dataclass whose fields are its keywords:
``restarter_state`` and ``restarter_stage`` (the words of its line; each hook
has NVRx's defaults), ``logger`` (what writes the line: any object with
``set_connected_rank(rank)`` and ``log_for_restarter(message)``; by default
one :class:`NestedRestarterLogger` shared by every hook) and ``special_rank``.
:class:`NestedRestarterHandlingCompleted` takes ``special_rank`` only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
from typing import Any

from .abort import Abort
from .completion import Completion
from .initialize import Initialize
from .state import FrozenState
from .terminate import Terminate

LOGGER_NAME = "InprocessRestarter.Restarter"
_FORMAT = "[%(asctime)s] [ALWAYS] [%(name)s] %(message)s"


def restarter_logger() -> logging.Logger:
    """The logger the lines go to: standard output, never propagated, set up once per process."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(getattr(h, "_inprocess_nested_restarter", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._inprocess_nested_restarter = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
    return logger


def status_line(state: str, stage: str | None = None) -> str:
    """The message of one event (what follows the logger's prefix)."""
    line = f"[NestedRestarter] name=[InProcess] state={state}"
    return line if stage is None else f"{line} stage={stage}"


class NestedRestarterLogger(logging.Logger):
    """The logger of the nested-restarter hooks, as NVRx's class of that name.

    A ``logging.Logger`` named ``InprocessRestarter`` (standard error, INFO,
    not propagated; its lines name the process, host and connected rank) whose
    :meth:`log_for_restarter` writes one contract line to standard output
    through the ``InprocessRestarter.Restarter`` logger (:func:`restarter_logger`).
    """

    def __init__(self) -> None:
        super().__init__("InprocessRestarter", logging.INFO)
        self.propagate = False
        self.addHandler(logging.StreamHandler(sys.stderr))
        self.restarter_logger = restarter_logger()
        self.rank: int | None = None
        self.set_connected_rank(None)

    def set_connected_rank(self, rank: int | None) -> None:
        """The rank this process speaks for, shown in the lines of this logger."""
        self.rank = rank
        who = f"{self.name}{os.getpid()}@{socket.gethostname()}:{'<none>' if rank is None else rank}"
        for handler in self.handlers:
            handler.setFormatter(logging.Formatter(f"[%(asctime)s] [%(levelname)s] [{who}] %(message)s"))

    def log_for_restarter(self, message: str, *args: Any, **kwargs: Any) -> None:
        """One contract line for the outer restarter, flushed at once."""
        self.restarter_logger.debug(message, *args, **kwargs)
        for handler in self.restarter_logger.handlers:
            handler.flush()

    def log_restarter_event(self, message: str, *args: Any, **kwargs: Any) -> None:
        """The same as :meth:`log_for_restarter` (NVRx 0.5+: this logger always writes the contract)."""
        self.log_for_restarter(message, *args, **kwargs)


_shared_logger: NestedRestarterLogger | None = None


def shared_logger() -> NestedRestarterLogger:
    """The logger every hook uses unless given one (NVRx shares one per process too)."""
    global _shared_logger
    if _shared_logger is None:
        _shared_logger = NestedRestarterLogger()
    return _shared_logger


@dataclasses.dataclass(repr=False, eq=False)  # hashable by identity, as hooks are
class NestedRestarterCallback:
    """Writes ``status_line(restarter_state, restarter_stage)`` through ``logger`` on ``special_rank``."""

    restarter_state: str
    restarter_stage: str | None = None
    logger: Any = dataclasses.field(default_factory=shared_logger)
    special_rank: int = 0

    def __post_init__(self) -> None:
        check_callback_fields(self)

    def __call__(self, state: FrozenState) -> FrozenState:
        if state.initial_rank == self.special_rank:
            self.logger.set_connected_rank(state.initial_rank)
            self.logger.log_for_restarter(status_line(self.restarter_state, self.restarter_stage))
        return state

    def __repr__(self) -> str:
        stage = "" if self.restarter_stage is None else f", restarter_stage={self.restarter_stage!r}"
        name = type(self).__name__
        return f"{name}(restarter_state={self.restarter_state!r}{stage}, special_rank={self.special_rank})"


def check_callback_fields(hook: NestedRestarterCallback) -> None:
    """ValueError naming the first field of ``hook`` that cannot write a line."""
    if not (type(hook.special_rank) is int and hook.special_rank >= 0):
        raise ValueError(f"special_rank={hook.special_rank!r}: expected an initial rank (an int >= 0)")
    given: object = hook.restarter_state  # checked at run time: callers are not all type-checked
    if not isinstance(given, str) or not given:
        raise ValueError(f"restarter_state={hook.restarter_state!r}: expected a non-empty str")
    if hook.restarter_stage is not None and not isinstance(hook.restarter_stage, str):
        raise ValueError(f"restarter_stage={hook.restarter_stage!r}: expected a str or None")
    for method in ("set_connected_rank", "log_for_restarter"):
        if not callable(getattr(hook.logger, method, None)):
            raise ValueError(f"logger={hook.logger!r}: expected an object with {method}(), "
                             f"e.g. a NestedRestarterLogger")


@dataclasses.dataclass(repr=False, eq=False)  # hashable by identity, as hooks are
class NestedRestarterHandlingCompleted(Initialize, NestedRestarterCallback):
    """``initialize`` hook: ``state=initialize`` at the first iteration, then
    ``state=handling stage=completed`` at each iteration after a restart."""

    restarter_state: str = "initialize"
    restarter_stage: str | None = None

    def __init__(self, special_rank: int = 0):
        self.restarter_state = "initialize"
        self.restarter_stage = None
        self.logger = shared_logger()
        self.special_rank = special_rank
        check_callback_fields(self)

    def __call__(self, state: FrozenState) -> FrozenState:
        state = NestedRestarterCallback.__call__(self, state)
        self.restarter_state, self.restarter_stage = "handling", "completed"
        return state


@dataclasses.dataclass(repr=False, eq=False)  # hashable by identity, as hooks are
class NestedRestarterHandlingStarting(Abort, NestedRestarterCallback):
    """``abort`` hook: ``state=handling stage=starting`` when a restart begins."""

    restarter_state: str = "handling"
    restarter_stage: str | None = "starting"

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)


@dataclasses.dataclass(repr=False, eq=False)  # hashable by identity, as hooks are
class NestedRestarterFinalized(Completion, NestedRestarterCallback):
    """``completion`` hook: ``state=finalized`` once the call completed."""

    restarter_state: str = "finalized"

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)


@dataclasses.dataclass(repr=False, eq=False)  # hashable by identity, as hooks are
class NestedRestarterAborted(Terminate, NestedRestarterCallback):
    """``terminate`` hook: ``state=aborted`` when this rank leaves the job."""

    restarter_state: str = "aborted"

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)
