"""``terminate`` hooks: run on a rank that is leaving the job."""

from __future__ import annotations

import abc

from .state import FrozenState


class Terminate(abc.ABC):
    """Runs on a terminated rank just before it leaves the wrapper.

    The rank leaves anyway: an exception raised here is logged and chained to
    the exception the rank leaves with.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState | None:
        raise NotImplementedError
