"""``initialize`` hooks: run on active ranks before each call of the function."""

from __future__ import annotations

import abc

from .exception import RestartAbort
from .state import FrozenState


class Initialize(abc.ABC):
    """Runs before every call of the wrapped function on an active rank.

    An ``Exception`` raised here is a fault of this rank in this iteration:
    the job restarts, as if the function had raised it. A
    :class:`~inprocess.exception.RestartAbort` ends the job on every rank at
    the next decision (this rank leaves with it, the others with a
    ``RestartAbort`` naming it); another ``BaseException`` terminates this rank.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState | None:
        raise NotImplementedError


class RetryController(Initialize):
    """Stops the job when it has restarted too often or shrunk too far.

    Raises :class:`~inprocess.exception.RestartAbort` before iteration
    ``max_iterations`` (so at most ``max_iterations`` calls are made), or when
    fewer than ``min_world_size`` ranks (active and spare) or fewer than
    ``min_active_world_size`` active ranks remain. The first rank to raise
    it ends the job on every rank at one decision, in one iteration, even
    where the others have not reached their own check yet.
    """

    def __init__(
        self,
        max_iterations: int | None = None,
        min_world_size: int = 1,
        min_active_world_size: int = 1,
    ):
        for name, value, low in (
            ("max_iterations", max_iterations, 1),
            ("min_world_size", min_world_size, 1),
            ("min_active_world_size", min_active_world_size, 1),
        ):
            if value is None and name == "max_iterations":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name}={value!r}: expected an int >= {low}")
        self.max_iterations = max_iterations
        self.min_world_size = min_world_size
        self.min_active_world_size = min_active_world_size

    def __call__(self, state: FrozenState) -> FrozenState:
        # Every message starts with "iteration=<n>", as nvidia_resiliency_ext's does: callers match on it.
        if self.max_iterations is not None and state.iteration >= self.max_iterations:
            raise RestartAbort(f"iteration={state.iteration} reached max_iterations={self.max_iterations}")
        if state.world_size < self.min_world_size:
            raise RestartAbort(f"iteration={state.iteration}: world_size={state.world_size} fell below "
                               f"min_world_size={self.min_world_size}")
        if state.active_world_size is not None and state.active_world_size < self.min_active_world_size:
            raise RestartAbort(
                f"iteration={state.iteration}: active_world_size={state.active_world_size} fell below "
                f"min_active_world_size={self.min_active_world_size}"
            )
        return state
