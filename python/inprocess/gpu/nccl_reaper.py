"""The NCCL teardown off the restart's critical path: a reaper that finishes
the failed iteration's NCCL aborts while the rest of the restart runs.

``ncclCommAbort`` stops a communicator's kernels at the call (it sets their
abort flag), but it returns only once the communicator's proxy threads have
exited, and they read that flag only before each 500 ms ``poll`` (NCCL
2.29.7 ``src/proxy.cc`` lines 1663 and 1835): about half a second per
release with peers, up to a second for one rank, whatever the library around
it does. Nothing of a restart but the next iteration's NCCL needs the abort to
have *returned*. So a restart goes:

1. the restart trigger hands torch's NCCL backends to the reaper
   (:meth:`Reaper.hand_over`): torch's ``abort()`` of each starts on a thread
   of its own (:class:`~.nccl_abort.Aborts`), and the trigger goes on once
   every one has started: the main thread is released from the failed
   iteration as soon as the flags are set;
2. back in the main thread, the failed iteration's groups are forgotten
   (torch's registries cleared) instead of destroyed: a destroy would call
   into NCCL beside the aborts. Their objects are handed to the reaper
   (:meth:`Reaper.keep`), which keeps them alive until their abort returned
   (``~ProcessGroupNCCL`` after an ``abort()`` only joins its threads);
3. finalize, the health check and the barrier run meanwhile;
4. before the function is called again, the executor waits for the reaper
   (:meth:`Reaper.wait`), bounded by the NCCL timeout of the hand-over: past
   it, :class:`~.errors.NcclAbortTimeout`, and the rank leaves (exit 75).

When each step happens is the plan's release schedule
(:data:`inprocess.control.recovery_plan.RELEASE_SCHEDULE`):
``Resource.NCCL_TEARDOWN`` is awaited once the decision is known, before the
function runs again; ``Resource.PROCESS_GROUPS`` is released before the
barrier, forgotten while a teardown runs.

No NCCL call runs beside an abort: a revoke (opt-in) finishes before the
aborts start, a teardown still running when the next one is handed over (a
second fault before the gate) is awaited first, within its own deadline, and
the next iteration's NCCL comes after the gate. The finalize and health-check
hooks run beside the aborts: a hook that calls NCCL itself (a collective on a
group of its own) must not; ``AbortTorchDistributed(overlap_teardown=False)``
keeps the whole teardown inside the abort, as before.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from . import nccl_abort

log = logging.getLogger("inprocess")


@dataclasses.dataclass(frozen=True)
class TeardownReport:
    """One teardown, once the gate let the next call through."""

    backends: int
    aborted: int  # aborts that returned without an error
    errors: list[str]
    took_s: float  # hand-over to the last abort's return, as the gate saw it
    waited_s: float  # how long the gate blocked (0: it was over before the restart needed it)


@dataclasses.dataclass
class _Teardown:
    aborts: nccl_abort.Aborts
    deadline: float  # time.monotonic() by which every abort must have returned
    handed_at: float
    kept: list[Any] = dataclasses.field(default_factory=list)


class Reaper:
    """The teardown of one process's NCCL communicators, one restart at a time (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._teardown: _Teardown | None = None
        self.last: TeardownReport | None = None  # the last teardown the gate let through

    def hand_over(self, backends: Sequence[Any], timeout: float, revoke: bool = False) -> nccl_abort.NcclRelease:
        """From the restart trigger: a teardown still running is awaited first, then (with `revoke`)
        the revoke, then torch's ``abort()`` of every backend starts; returns once every one has
        started. `timeout` bounds all of it and the teardown's wait. Raises
        :class:`~.errors.NcclAbortTimeout` past the deadline (of the earlier teardown, or this one's)."""
        self.wait()
        handed_at = time.monotonic()
        deadline = handed_at + timeout
        report = nccl_abort.prepare(backends, deadline, revoke)
        aborts = nccl_abort.Aborts(backends)
        with self._lock:
            self._teardown = _Teardown(aborts, deadline, handed_at)
        if not aborts.started(deadline):  # a thread that never ran: the gate's wait raises at the deadline
            log.warning("NCCL teardown: not every abort started within %gs", timeout)
        report.elapsed_s = time.monotonic() - handed_at
        return report

    def in_flight(self) -> bool:
        with self._lock:
            return self._teardown is not None

    def keep(self, objects: Sequence[Any]) -> bool:
        """Keep `objects` (the failed iteration's process groups) alive until the teardown running
        now is over; False (nothing kept) when none runs."""
        with self._lock:
            if self._teardown is None:
                return False
            self._teardown.kept.extend(objects)
            return True

    def wait(self) -> TeardownReport | None:
        """The gate: until every abort handed over returned, by the teardown's deadline; None when
        none runs. What the teardown kept is let go here, in the calling thread. Past the deadline,
        :class:`~.errors.NcclAbortTimeout`; the teardown stays (its threads hold torch's locks, its
        groups must not be destroyed) and every later wait raises again."""
        with self._lock:
            teardown = self._teardown
        if teardown is None:
            return None
        waited_from = time.monotonic()
        aborted, errors = teardown.aborts.wait(teardown.deadline)
        now = time.monotonic()
        report = TeardownReport(len(teardown.aborts.backends), aborted, errors, now - teardown.handed_at,
                                now - waited_from)
        with self._lock:
            if self._teardown is teardown:
                self._teardown = None
            self.last = report
        for error in errors:  # a communicator already broken by the fault
            log.debug("NCCL teardown: %s", error)
        teardown.kept.clear()  # the groups' last references go here
        return report


REAPER = Reaper()
"""The process's reaper: torch's process groups are the process's, so is their teardown."""
