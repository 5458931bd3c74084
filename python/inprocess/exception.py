"""Exceptions of the restart engine.

``RestartAbort``, ``RankShouldRestart`` and ``RankDiscarded`` derive from
``BaseException`` on purpose: a training loop's ``except Exception`` must not
swallow the engine's control flow.
"""

from __future__ import annotations

import builtins


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


class RankShouldRestart(BaseException):
    """Raised into the main thread of every rank when the job restarts."""


class RankDiscarded(BaseException):
    """This rank was terminated by the rank assignment and leaves the job."""
