"""inprocess: restart a failed distributed PyTorch job inside its running processes.

Decorate the training function with :class:`Wrapper`; on a fault on any rank,
every healthy rank aborts, cleans up, agrees on a new membership and calls
the function again, in the same process.

Names that need torch load on first use, so that a monitor process can import
``inprocess.control.protocol`` without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .compose import Compose
from .engine.config import GrowPolicy
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


def _version() -> str:
    # One source, pyproject.toml: the installed metadata, else the version the
    # build compiled into the extension (a source tree on sys.path).
    from importlib import metadata

    try:
        return metadata.version("inprocess")
    except metadata.PackageNotFoundError:
        from ._native import __version__ as native_version

        return native_version


__version__ = _version()

_LAZY_ATTRIBUTES = {
    "CallWrapper": "call_wrapper",
    "ReplicatedState": "peer_state",
    "RestartRecord": "call_wrapper",
    "ShardedState": "peer_state",
    "Wrapper": "wrap",
    "current_call": "calls",
}

if TYPE_CHECKING:
    from . import abort, completion, finalize, health_check, initialize, rank_assignment, store, terminate
    from .call_wrapper import CallWrapper, RestartRecord, current_call
    from .peer_state import ReplicatedState, ShardedState
    from .wrap import Wrapper


def __getattr__(name: str) -> Any:
    if name in _LAZY_ATTRIBUTES:
        module = importlib.import_module(f".{_LAZY_ATTRIBUTES[name]}", __name__)
        return getattr(module, name)
    if name in __all__:  # a module of the package, loaded on first use
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'inprocess' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(__all__) | {"__version__"})


__all__ = [
    "CallWrapper",
    "Compose",
    "FrozenState",
    "GrowPolicy",
    "HealthCheckError",
    "InternalError",
    "Mode",
    "RankDiscarded",
    "RankShouldRestart",
    "ReplicatedState",
    "RestartAbort",
    "RestartError",
    "RestartRecord",
    "ShardedState",
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
    "nested_restarter",
    "peer_state",
    "rank_assignment",
    "state",
    "store",
    "terminate",
    "tools",
    "wrap",
]
