"""Why a rank leaves the job, and the exception that carries it out of the restart loop."""

from __future__ import annotations

import enum
import inspect
import logging
import traceback
from types import FrameType

from ..control.counting_out import count_out, members_at
from ..control.protocol import FaultRecord, RestartProtocol
from ..control.records import ENDS_JOB
from ..exception import RestartAbort, exception_chain
from ..exits import EXIT_CODE_UNRELEASABLE, exit_now
from ..gpu import nccl_abort, nccl_reaper
from ..gpu.errors import NcclAbortTimeout
from ..state import State

log = logging.getLogger("inprocess")


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
    JOB_ENDED = "abort_job"  # the decision ended the job on every rank (Decision.abort; RestartAbort)
    GAVE_UP = "barrier_timeout"  # counted in at a barrier that was not decided in time: it gave up there

    @property
    def counted_already(self) -> bool:
        """The store knows already: the rank records no fault and does not count itself out."""
        return self in (Leave.COUNTED_OUT, Leave.DISCARDED, Leave.JOB_ENDED, Leave.GAVE_UP)


def fault_kind(reason: Leave, exc: BaseException) -> str:
    """The kind of the fault a leaving rank records: ENDS_JOB for a RestartAbort (the job ends on every
    rank at the next decision, rank_assignment/decision.py), else the reason it leaves."""
    return ENDS_JOB if isinstance(exc, RestartAbort) else reason.value


class LeaveJob(Exception):
    """Unwinds the state machine to TERMINATED with the exception this rank leaves with."""

    def __init__(self, exc: BaseException, reason: Leave):
        super().__init__(reason.value)
        self.exc = exc
        self.reason = reason


def drop_frames(exc: BaseException) -> None:
    """Release the frames an exception holds (and with them the failed
    iteration's models and process groups), keeping type and message."""
    for e in exception_chain(exc):
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None


def release_frames(exc: BaseException) -> None:
    """Clear the local variables of every finished frame that ``exc`` and the exceptions it was raised
    from or during (``__cause__`` and ``__context__``, each followed) hold, keeping their tracebacks.

    For the exception that leaves a wrapped call: whoever holds it holds those frames, and with their
    locals the rank's runtime, its store clients (connections to a store host that has exited), the
    failed iteration's process groups and models. The traceback text stays whole (file, line, function
    and source line come from the code, not the locals); what goes is what a post-mortem debugger would
    show of the locals. Frames still executing (the caller's) cannot be cleared and are left alone.

    Besides the frames its traceback lists, an exception caught and kept (a rank assignment's failure,
    raised later in another frame; an abort hook's, caught on the restart trigger's thread) reaches the
    frames that were running when it was caught: each frame holds its caller (``f_back``).
    """
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        e = pending.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        tb = e.__traceback__
        if tb is not None:
            traceback.clear_frames(tb)
            _clear_callers(tb.tb_frame.f_back)
        pending.extend(c for c in (e.__cause__, e.__context__) if c is not None)
        # An exception group (Python 3.11+) holds the frames of its members too.
        pending.extend(getattr(e, "exceptions", None) or ())


_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _clear_callers(frame: FrameType | None) -> None:
    """Clear ``frame`` and its callers up to the first one still executing (its callers execute too)."""
    while frame is not None:
        if not frame.f_code.co_flags & _SUSPENDABLE:  # clearing a suspended generator's frame would close it
            try:
                frame.clear()
            except RuntimeError:
                return  # still executing
        frame = frame.f_back


def count_out_before_joining(p: RestartProtocol, s: State, kind: str, exc: BaseException, timeout: float) -> None:
    """A rank leaving before it applied its first decision is counted out where its seat
    says, as its monitor counts out a rank that died there (barrier 0 if it had not
    arrived), so that nobody waits for it."""
    count_out(p, s.initial_rank, lambda i: FaultRecord.from_exception(s.initial_rank, i, kind, exc),
                members_at(p, s.initial_rank, s.initial_world_size, timeout), timeout=timeout,
                who=f"r{s.initial_rank}")


def exit_if_nccl_abort_abandoned() -> None:
    """A rank whose NCCL abort was abandoned at its deadline (``NcclAbortTimeout``)
    ends its process here, once it is counted out, with exit status 75 (the rank
    the restart could not release), without Python's exit machinery: the
    abandoned thread still holds torch's locks (``ProcessGroupNCCL::abortComms``
    holds the group's mutex for the whole of its aborts), and destroying the
    groups, here or in torch's destructors at exit, waits on that mutex until
    the monitor's hard timeout. An NCCL teardown still running (a rank that
    leaves during a restart) is waited for first, within its deadline."""
    try:
        nccl_reaper.REAPER.wait()
    except NcclAbortTimeout as e:
        log.error("%s", e)
    if not nccl_abort.abandoned():
        return
    log.error("an NCCL abort was abandoned at its deadline: this rank exits (code %d) without touching "
              "torch's process groups again", EXIT_CODE_UNRELEASABLE)
    exit_now(EXIT_CODE_UNRELEASABLE)
