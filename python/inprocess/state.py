"""Per-rank view of the job: who this rank is in the current iteration."""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional


class Mode(enum.IntEnum):
    """A rank's mode in one iteration."""

    INITIALIZED = 0  # before the first membership decision
    ACTIVE = 1  # runs the wrapped function
    INACTIVE = 2  # a spare: waits, ready to replace an active rank
    TERMINATED = 3  # left the job; never comes back


@dataclasses.dataclass
class State:
    """Mutable state of one rank, owned by its :class:`inprocess.CallWrapper`.

    ``rank``/``world_size`` count every rank still in the job (active and
    spare); ``active_rank``/``active_world_size`` count the ranks that run the
    function (``active_rank`` is None on a spare). ``initial_*`` never change.
    """

    initial_rank: int
    initial_world_size: int
    rank: int
    world_size: int
    active_rank: Optional[int] = None
    active_world_size: int = 0
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: Optional[BaseException] = None

    def freeze(self) -> "FrozenState":
        return FrozenState(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})


@dataclasses.dataclass(frozen=True)
class FrozenState:
    """Read-only snapshot of :class:`State`, the argument of every hook."""

    initial_rank: int
    initial_world_size: int
    rank: int
    world_size: int
    active_rank: Optional[int] = None
    active_world_size: int = 0
    iteration: int = 0
    mode: Mode = Mode.INITIALIZED
    fn_exception: Optional[BaseException] = None
