"""inprocess: restart a failed distributed PyTorch job inside its running processes.

Decorate the training function with :class:`Wrapper`; on a fault on any rank,
every healthy rank aborts, cleans up, agrees on a new membership and calls
the function again, in the same process.
"""

from . import (
    abort,
    completion,
    exception,
    finalize,
    health_check,
    initialize,
    rank_assignment,
    state,
    store,
    terminate,
)
from .compose import Compose
from .exception import (
    HealthCheckError,
    InternalError,
    RankDiscarded,
    RankShouldRestart,
    RestartAbort,
    RestartError,
    TimeoutError,
)
from .state import FrozenState, Mode, State
from .wrap import CallWrapper, RestartRecord, Wrapper, current_call

__version__ = "0.1.0"

__all__ = [
    "CallWrapper",
    "Compose",
    "FrozenState",
    "HealthCheckError",
    "InternalError",
    "Mode",
    "RankDiscarded",
    "RankShouldRestart",
    "RestartAbort",
    "RestartError",
    "RestartRecord",
    "State",
    "TimeoutError",
    "Wrapper",
    "abort",
    "completion",
    "current_call",
    "exception",
    "finalize",
    "health_check",
    "initialize",
    "rank_assignment",
    "state",
    "store",
    "terminate",
]
