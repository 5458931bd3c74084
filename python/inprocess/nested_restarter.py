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
"""

from __future__ import annotations

import logging
import sys
from typing import Optional

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


def status_line(state: str, stage: Optional[str] = None) -> str:
    """The message of one event (what follows the logger's prefix)."""
    line = f"[NestedRestarter] name=[InProcess] state={state}"
    return line if stage is None else f"{line} stage={stage}"


class NestedRestarterCallback:
    """Writes ``status_line(restarter_state, restarter_stage)`` on ``special_rank``."""

    def __init__(self, restarter_state: str, restarter_stage: Optional[str] = None, special_rank: int = 0):
        if not (type(special_rank) is int and special_rank >= 0):
            raise ValueError(f"special_rank={special_rank!r}: expected an initial rank (an int >= 0)")
        self.restarter_state = restarter_state
        self.restarter_stage = restarter_stage
        self.special_rank = special_rank

    def __call__(self, state: FrozenState) -> FrozenState:
        if state.initial_rank == self.special_rank:
            restarter_logger().info(status_line(self.restarter_state, self.restarter_stage))
            for handler in restarter_logger().handlers:
                handler.flush()
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(special_rank={self.special_rank})"


class NestedRestarterHandlingCompleted(Initialize, NestedRestarterCallback):
    """``initialize`` hook: ``state=initialize`` at the first iteration, then
    ``state=handling stage=completed`` at each iteration after a restart."""

    def __init__(self, special_rank: int = 0):
        NestedRestarterCallback.__init__(self, "initialize", None, special_rank)

    def __call__(self, state: FrozenState) -> FrozenState:
        state = NestedRestarterCallback.__call__(self, state)
        self.restarter_state, self.restarter_stage = "handling", "completed"
        return state


class NestedRestarterHandlingStarting(Abort, NestedRestarterCallback):
    """``abort`` hook: ``state=handling stage=starting`` when a restart begins."""

    def __init__(self, special_rank: int = 0):
        NestedRestarterCallback.__init__(self, "handling", "starting", special_rank)

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)


class NestedRestarterFinalized(Completion, NestedRestarterCallback):
    """``completion`` hook: ``state=finalized`` once the call completed."""

    def __init__(self, special_rank: int = 0):
        NestedRestarterCallback.__init__(self, "finalized", None, special_rank)

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)


class NestedRestarterAborted(Terminate, NestedRestarterCallback):
    """``terminate`` hook: ``state=aborted`` when this rank leaves the job."""

    def __init__(self, special_rank: int = 0):
        NestedRestarterCallback.__init__(self, "aborted", None, special_rank)

    def __call__(self, state: FrozenState) -> FrozenState:
        return NestedRestarterCallback.__call__(self, state)
