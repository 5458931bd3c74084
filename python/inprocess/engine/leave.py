"""Why a rank leaves the job, and the exception that carries it out of the restart loop."""

from __future__ import annotations

import enum
import traceback
from typing import Optional


class Leave(enum.Enum):
    """Why a rank leaves the job. The value is the fault kind the store records."""

    TERMINATED = "terminated"  # a BaseException that is not the engine's own
    COMPLETION_TIMEOUT = "completion_timeout"  # the other active ranks did not return
    STORE_LOST = "store"  # the restart trigger stopped without an outcome
    ABORT_FAILED = "abort"  # the abort hook raised or did not finish
    FINALIZE_FAILED = "finalize"
    HEALTH_CHECK_FAILED = "health_check"
    COUNTED_OUT = "counted_out"  # a monitor declared this rank lost and counted it out
    DISCARDED = "discarded"  # the rank assignment terminated it
    JOB_ABORTED = "abort_job"  # the decision ended the job on every rank

    @property
    def counted_already(self) -> bool:
        """The store knows already: the rank records no fault and does not count itself out."""
        return self in (Leave.COUNTED_OUT, Leave.DISCARDED, Leave.JOB_ABORTED)


class LeaveJob(Exception):
    """Unwinds the state machine to TERMINATED with the exception this rank leaves with."""

    def __init__(self, exc: BaseException, reason: Leave):
        super().__init__(reason.value)
        self.exc = exc
        self.reason = reason


def drop_frames(exc: BaseException) -> None:
    """Release the frames an exception holds (and with them the failed
    iteration's models and process groups), keeping type and message."""
    seen = set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        e = e.__cause__ or e.__context__
