"""``finalize`` hooks: run on every rank after the abort, before the health check."""

from __future__ import annotations

import abc
import datetime
import threading
from typing import Callable, Optional

from .exception import TimeoutError
from .state import FrozenState


class Finalize(abc.ABC):
    """Releases what the interrupted iteration held (files, caches, threads).

    Any exception raised here terminates this rank: a rank that cannot clean
    up cannot be trusted with the next iteration.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> Optional[FrozenState]:
        raise NotImplementedError


class ThreadedFinalize(Finalize):
    """Runs ``fn(state)`` in a helper thread and gives up after ``timeout``.

    A finalizer that hangs raises :class:`~inprocess.exception.TimeoutError`
    (and so terminates this rank) instead of stalling the whole job.
    """

    def __init__(self, timeout: datetime.timedelta, fn: Callable[[FrozenState], object]):
        given: object = timeout  # checked at run time: callers are not all type-checked
        if not isinstance(given, datetime.timedelta) or given <= datetime.timedelta(0):
            raise ValueError(f"timeout={timeout!r}: expected a positive datetime.timedelta")
        if not callable(fn):
            raise ValueError(f"fn={fn!r}: expected a callable")
        self.timeout = timeout
        self.fn = fn

    def __call__(self, state: FrozenState) -> FrozenState:
        error: list[BaseException] = []

        def target() -> None:
            try:
                self.fn(state)
            except BaseException as e:  # carried to the calling thread
                error.append(e)

        thread = threading.Thread(target=target, name="inprocess-finalize", daemon=True)
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():
            raise TimeoutError(f"finalize {self.fn!r} did not return within {self.timeout.total_seconds():g}s")
        if error:
            raise error[0]
        return state
