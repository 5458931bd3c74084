"""``health_check`` hooks: run on every rank during a restart, after finalize."""

from __future__ import annotations

import abc
from typing import Optional

from .exception import HealthCheckError
from .state import FrozenState


class HealthCheck(abc.ABC):
    """Decides whether this rank may take part in the next iteration.

    Any exception raised here (typically
    :class:`~inprocess.exception.HealthCheckError`) terminates this rank; the
    others continue without it.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> Optional[FrozenState]:
        raise NotImplementedError


class FaultCounter(HealthCheck):
    """Terminates a rank whose own function raised more than ``max_rank_faults`` times.

    Only faults that started on this rank count (``state.fn_exception``); a
    restart caused by another rank's fault does not.
    """

    def __init__(self, max_rank_faults: Optional[int] = None):
        if max_rank_faults is not None and (
            not isinstance(max_rank_faults, int) or isinstance(max_rank_faults, bool) or max_rank_faults < 0
        ):
            raise ValueError(f"max_rank_faults={max_rank_faults!r}: expected an int >= 0 or None")
        self.max_rank_faults = max_rank_faults
        self.faults = 0

    def __call__(self, state: FrozenState) -> FrozenState:
        if state.fn_exception is not None:
            self.faults += 1
        if self.max_rank_faults is not None and self.faults > self.max_rank_faults:
            raise HealthCheckError(
                f"initial rank {state.initial_rank} raised {self.faults} faults, "
                f"more than max_rank_faults={self.max_rank_faults}"
            )
        return state
