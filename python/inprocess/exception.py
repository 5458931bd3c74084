"""Exceptions of the restart engine, with NVRx's names and bases.

``RestartAbort`` and ``RankShouldRestart`` derive from ``BaseException`` on
purpose: a training loop's ``except Exception`` must not swallow the engine's
control flow. ``RankDiscarded`` (a rank the rank assignment terminated; what
that rank's caller gets) is a ``RestartError``, as in NVRx, so a caller's
``except Exception`` sees it there and here alike.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator


class RestartError(Exception):
    """Base class of recoverable errors raised by the restart engine."""


class RestartAbort(BaseException):
    """Terminal: the rank that raises it leaves the job (it is terminated)."""


class HealthCheckError(RestartError):
    """A health check found this rank unfit to continue; the rank is terminated."""


class InternalError(RestartError):
    """The engine reached a state it cannot explain (a bug, or a corrupted store record)."""


class TimeoutError(RestartError, builtins.TimeoutError):
    """A barrier or a wait of the restart engine ran past its timeout."""


class BarrierError(RestartError):
    """A barrier of the restart engine failed (``inprocess.store.BarrierError`` in NVRx)."""


class BarrierTimeout(BarrierError, TimeoutError):
    """A barrier (initial, restart, completion) was not complete within its timeout.

    Also a :class:`TimeoutError` (and so a ``builtins.TimeoutError``): code
    that catches either, as written for this library or for NVRx, sees it.
    """


class BarrierOverflow(BarrierError, InternalError):
    """More ranks arrived at a barrier than it counts: the store holds arrivals
    of another job or of a process that was counted out already."""


class RankShouldRestart(BaseException):
    """Raised into the main thread of every rank when the job restarts."""


class RankDiscarded(RestartError):
    """This rank was terminated by the rank assignment and leaves the job."""


def exception_chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then what it was raised from or during (``__cause__``, else ``__context__``), each once."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__
