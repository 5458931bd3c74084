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

Stage 2 (opt-in, ``AbortTorchDistributed(overlap_next_iteration=True)``): at
the gate, a teardown whose device has room for the next iteration's
communicators beside the old ones is not waited for: it finishes on a thread
of the reaper while the function runs again (its ``init_process_group`` and
first steps), and the old groups are let go once their aborts returned. The
room is checked, not hoped for: the device's free memory
(``torch.cuda.mem_get_info``) must hold what the old communicators free when
their abort returns (NCCL frees their buffers only after the proxy threads
were joined), as measured at an earlier restart that waited (the first one
always waits), or ``overlap_memory_bytes``; where it does not, or cannot be
read, the gate waits (Stage 1). A second fault while the teardown still runs
waits for it in its hand-over, bounded by its deadline, as above; so does the
call's end. This is outside NCCL's documented contract ("make sure no thread
is calling any NCCL operations while calling ncclCommAbort", NCCL's user
guide, Fault Tolerance): the next iteration's creations and kernels run on
other communicators while the old ones' aborts return. NCCL's source keeps
an abort's work to its own communicator, but nothing promises it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from . import nccl_abort
from .errors import NcclAbortTimeout

log = logging.getLogger("inprocess")


@dataclasses.dataclass(frozen=True)
class TeardownReport:
    """One teardown, once the gate let the next call through."""

    backends: int
    aborted: int  # aborts that returned without an error
    errors: list[str]
    took_s: float  # hand-over to the last abort's return, as the gate saw it
    waited_s: float  # how long the gate blocked (0: it finished while the next iteration ran, Stage 2)


@dataclasses.dataclass
class _Teardown:
    aborts: nccl_abort.Aborts
    deadline: float  # time.monotonic() by which every abort must have returned
    handed_at: float
    kept: list[Any] = dataclasses.field(default_factory=list)
    # Stage 2 (beside_next): the rank's device, its free bytes once every abort started,
    # and the free bytes the next iteration needs beside the old communicators (None: as measured).
    beside_next: bool = False
    device: int = -1
    free_at_hand_over: int | None = None
    memory_bytes: int | None = None


def device_free_bytes(device: int) -> int | None:
    """The free bytes of CUDA device `device` (``torch.cuda.mem_get_info``: cudaMemGetInfo's free),
    None where it cannot be read (no device, a CPU build of torch, a CUDA error)."""
    if device < 0:
        return None
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    except Exception as e:  # the memory is unknown: the gate waits
        log.debug("NCCL teardown: the free memory of cuda:%d cannot be read: %s", device, e)
        return None


class Reaper:
    """The teardown of one process's NCCL communicators, one restart at a time (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._teardown: _Teardown | None = None
        self.last: TeardownReport | None = None  # the last teardown the gate let through
        # What the old communicators freed when their aborts returned, measured at a gate that
        # waited (Stage 2's room check); None until one was.
        self.freed_bytes: int | None = None

    def hand_over(self, backends: Sequence[Any], timeout: float, revoke: bool = False, *,
                  beside_next: bool = False, memory_bytes: int | None = None) -> nccl_abort.NcclRelease:
        """From the restart trigger: a teardown still running is awaited first, then (with `revoke`)
        the revoke, then torch's ``abort()`` of every backend starts; returns once every one has
        started. `timeout` bounds all of it and the teardown's wait. Raises
        :class:`~.errors.NcclAbortTimeout` past the deadline (of the earlier teardown, or this one's).
        `beside_next`: the gate may let the next iteration run beside this teardown (Stage 2)
        where the device has room (`memory_bytes` free; None: what an earlier teardown freed)."""
        self.wait()
        handed_at = time.monotonic()
        deadline = handed_at + timeout
        report = nccl_abort.prepare(backends, deadline, revoke)
        aborts = nccl_abort.Aborts(backends)
        teardown = _Teardown(aborts, deadline, handed_at, beside_next=beside_next, memory_bytes=memory_bytes)
        with self._lock:
            self._teardown = teardown
        if not aborts.started(deadline):  # a thread that never ran: the gate's wait raises at the deadline
            log.warning("NCCL teardown: not every abort started within %gs", timeout)
        if beside_next:
            teardown.device = nccl_abort.rank_device(backends)
            teardown.free_at_hand_over = device_free_bytes(teardown.device)
        report.elapsed_s = time.monotonic() - handed_at
        return report

    def gate(self) -> TeardownReport | None:
        """Before the function is called again: the teardown is waited for (:meth:`wait`), unless
        it was handed over `beside_next` and the device has room for the next iteration's
        communicators beside the old ones: then it finishes on a thread of the reaper, and this
        returns at once (None). Raises as :meth:`wait` does."""
        with self._lock:
            teardown = self._teardown
        if teardown is None:
            return None
        if teardown.beside_next and self._room_beside(teardown):
            threading.Thread(target=self._finish_beside, args=(teardown,), name="inprocess-nccl-teardown",
                             daemon=True).start()
            return None
        report = self.wait()
        if teardown.beside_next and teardown.free_at_hand_over is not None:
            free = device_free_bytes(teardown.device)
            if free is not None and free > teardown.free_at_hand_over:
                self.freed_bytes = free - teardown.free_at_hand_over
        return report

    def _room_beside(self, teardown: _Teardown) -> bool:
        need = teardown.memory_bytes if teardown.memory_bytes is not None else self.freed_bytes
        if need is None:
            log.info("NCCL teardown: the next iteration waits for it this time (what the old communicators "
                     "free is not known yet; it is measured now)")
            return False
        free = device_free_bytes(teardown.device)
        if free is None or free < need:
            shown = "unknown" if free is None else f"{free >> 20} MiB"
            log.info("NCCL teardown: the next iteration waits for it: cuda:%d has %s free, the old "
                     "communicators hold %d MiB", teardown.device, shown, need >> 20)
            return False
        return True

    def _finish_beside(self, teardown: _Teardown) -> None:
        try:
            self._finish(teardown, waited_from=None)
        except NcclAbortTimeout as e:
            log.error("NCCL teardown beside the next iteration: %s; the next restart or the call's end "
                      "waits for it again", e)

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
        return self._finish(teardown, waited_from=time.monotonic())

    def _finish(self, teardown: _Teardown, waited_from: float | None) -> TeardownReport:
        """Until `teardown`'s aborts returned (by its deadline); then it is over: reported, and
        what it kept let go in the calling thread. `waited_from`: when a gate began to wait for
        it (None: the reaper's own thread, the next iteration running)."""
        aborted, errors = teardown.aborts.wait(teardown.deadline)
        now = time.monotonic()
        report = TeardownReport(len(teardown.aborts.backends), aborted, errors, now - teardown.handed_at,
                                0.0 if waited_from is None else now - waited_from)
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
