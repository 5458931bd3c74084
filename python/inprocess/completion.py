"""``completion`` hooks: run on every remaining rank once the function completed everywhere."""

from __future__ import annotations

import abc

from .state import FrozenState


class Completion(abc.ABC):
    """Runs once the function returned on every active rank (spares included).

    An exception raised here propagates to the caller of the wrapped function:
    the job is over, there is nothing to restart.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState | None:
        raise NotImplementedError
