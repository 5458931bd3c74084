"""Releases torch's NCCL communicators within a deadline.

The order, and why (torch 2.13's ``ProcessGroupNCCL``; the sources are cited
in tests/fakes/fake_torch_nccl.py and tests/test_nccl_release.py):

1. **The rank's device, on this thread and on the native worker.** torch's
   ``_comm_ptr()`` answers for the communicator of the *calling thread's*
   current device, and NCCL's blocking ``ncclGroupEnd`` saves and restores the
   calling thread's device. The restart trigger thread never had one (device
   0): every rank not on GPU 0 would get no pointer, and every group end would
   create a context on GPU 0. The rank's device (the group's
   ``bound_device_id``, else :func:`.device.cuda_ordinal`) is made current on
   both threads through the CUDA driver, only where its context exists.
2. **Pointers only when reading them cannot hang and torch cannot free them.**
   ``_comm_ptr()`` holds the GIL and takes the group's mutex (held for the
   whole of a hung ``abortComms()``), and on a non-blocking communicator waits
   until it is ready: no deadline can end a call that holds the GIL. So it is
   called only after ``get_error()`` says torch has seen no failure on the
   group (its watchdog aborts and frees the communicators after one, under
   ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 1 or 2) and ``_is_initialized()``, which
   releases the GIL and takes the same mutex, returned within a short bound.
   A group that fails either check is released by torch's own abort alone,
   and then so are the others: a revoke of theirs would wait for its kernels
   on a stream they share (a group with no communicator ready, or one torch
   aborted already, runs no kernel: the others are revoked).
3. **Revoke, every communicator as one NCCL group** (2.28.7 and later): the
   revokes set every abort flag before any of them waits for its streams, so a
   kernel stuck on one group cannot hold another's revoke; blocking and
   non-blocking communicators go in two groups (NCCL refuses to mix them).
   The communicators stay valid; nothing is freed under torch's feet.
4. **torch's ``abort()`` of every backend at once**, each on a thread of its
   own, bounded by what is left of the deadline. torch 2.13 runs each abort's
   ``ncclCommAbort`` calls on a ``std::async`` thread, grouped per backend
   only: aborted one after another, the first would wait for the kernel of a
   group whose abort has not started yet.

An abort still running at the deadline raises :class:`NcclAbortTimeout`: the
thread inside NCCL or torch is abandoned (:func:`abandoned` is true from then
on) and holds torch's locks; the rank leaves without touching torch's
process groups again (:mod:`inprocess.engine.leave`).

``ncclCommAbort`` by pointer (:func:`abort_by_pointer`) frees communicators
that torch still holds: torch would later abort or destroy them again. It is
for a rank that leaves the job right after (the process exits before torch
touches its groups again), where it releases the peers and the device without
waiting for torch.

Point-to-point and split communicators: ``_comm_ptr()`` gives a group's
collective communicator only, so those are not revoked; torch's ``abort()``
aborts every communicator of the group (its ``devNCCLCommMap_``, which holds
the point-to-point ones too), and a split group is a backend of its own in
the list.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from .. import _native
from . import device as device_mod
from . import libraries
from .bounded import Bounded, call_within
from .errors import NcclAbortTimeout

log = logging.getLogger("inprocess")

# How long _is_initialized() may take before a group counts as busy (its
# mutex held by a running abort or creation): _comm_ptr() would then block
# while holding the GIL.
MUTEX_CHECK_S = 0.5

_abandoned = threading.Event()


def abandoned() -> bool:
    """True once an abort of this process was abandoned at its deadline: a
    thread is still inside NCCL or torch, holding torch's locks."""
    return _abandoned.is_set()


@dataclass
class NcclRelease:
    """What :func:`release` did."""

    backends: int = 0
    pointers: int = 0
    device: int = -1
    device_message: str = ""  # why the device could not be made current, "" when it was
    skipped: List[str] = field(default_factory=list)  # backends released by torch alone, and why
    async_errors: List[int] = field(default_factory=list)  # ncclResult_t per pointer, read before the revoke
    revoked: bool = False
    revoke_status: Optional[_native.GpuStatus] = None
    torch_aborted: int = 0
    errors: List[str] = field(default_factory=list)
    elapsed_s: float = 0.0


@dataclass(frozen=True)
class Communicator:
    pointer: int
    blocking: bool


def rank_device(backends: Sequence[Any]) -> int:
    """The CUDA device of this rank: a backend's ``bound_device_id`` (set by
    ``init_process_group(device_id=...)``), else :func:`.device.cuda_ordinal`
    over the devices torch sees (``LOCAL_RANK=3`` with one visible GPU is device 0)."""
    for backend in backends:
        bound = getattr(backend, "bound_device_id", None)
        index = getattr(bound, "index", None)
        if isinstance(index, int) and index >= 0:
            return index
    try:
        return device_mod.cuda_ordinal(visible=device_mod.torch_visible_devices())
    except ValueError as e:  # a malformed LOCAL_RANK: no device is made current
        log.warning("NCCL release: %s", e)
        return -1


def is_blocking(backend: Any) -> bool:
    """torch writes the mode it chose into ``options.config.blocking`` when it
    creates the communicator (0: non-blocking)."""
    try:
        return int(backend.options.config.blocking) != 0
    except Exception:  # no options: torch's default, blocking
        return True


@dataclass(frozen=True)
class Skipped:
    why: str
    # The group may still run kernels that only torch's abort will stop (a revoke
    # of the other groups would wait for them on a shared stream).
    may_run: bool


def communicator(backend: Any, timeout: float) -> Communicator | Skipped:
    """The collective communicator of `backend`, where reading it cannot hang
    and torch's watchdog has not taken it over; else why not."""
    get = getattr(backend, "_comm_ptr", None)
    if get is None:
        return Skipped("no _comm_ptr()", may_run=True)
    get_error = getattr(backend, "get_error", None)
    if get_error is not None:
        error = call_within(get_error, timeout, "inprocess-nccl-state")
        if not error.finished:
            return Skipped("get_error() did not return", may_run=True)
        if error.error is None and error.value is not None and getattr(error.value, "name", "SUCCESS") != "SUCCESS":
            return Skipped(f"torch saw {error.value.name} on it (its watchdog may free the communicator)", may_run=True)
    is_initialized = getattr(backend, "_is_initialized", None)
    if is_initialized is not None:
        ready: Bounded[bool] = call_within(is_initialized, min(timeout, MUTEX_CHECK_S), "inprocess-nccl-state")
        if not ready.finished:
            return Skipped("its mutex is held (an abort or a creation in progress)", may_run=True)
        if ready.error is not None or not ready.value:
            # No collective has run on a communicator not ready: no kernel of its own.
            return Skipped("no communicator ready", may_run=False)
    try:
        pointer = int(get())
    except Exception as e:  # aborted by torch already (its kernels told to stop), or none made
        return Skipped(f"_comm_ptr(): {e}", may_run=False)
    if not pointer:
        return Skipped("no communicator on this device", may_run=False)
    return Communicator(pointer, is_blocking(backend))


def _use_device(library: Optional[_native.NcclLibrary], ordinal: int) -> str:
    """Makes `ordinal` current on this thread and on `library`'s worker."""
    driver, reason = libraries.current_device()
    if driver is None:
        if library is not None:
            library.use_device(None, -1)
        return f"no CUDA driver: {reason}"
    if library is not None:
        return library.use_device(driver, ordinal)
    return driver.bind(ordinal)


def bind_rank_device(backends: Sequence[Any]) -> str:
    """Makes this rank's device current on the calling thread (and on the NCCL
    worker), where its context exists; "" when done, else why not. For work of
    the restart thread before the release (a flight-recorder dump) that must
    not create a context on GPU 0 either."""
    library, _ = libraries.nccl()
    ordinal = rank_device(backends)
    return _use_device(library, ordinal) if ordinal >= 0 else "no device for this rank"


def release(backends: Sequence[Any], timeout: float, revoke: bool = True) -> NcclRelease:
    """Revokes (where possible) and aborts `backends` (torch NCCL backends)
    within `timeout` seconds. Raises :class:`NcclAbortTimeout` past it."""
    started = time.monotonic()

    def left() -> float:
        return max(timeout - (time.monotonic() - started), 0.0)

    report = NcclRelease(backends=len(backends))
    library, reason = libraries.nccl()
    if library is None:
        log.debug("NCCL revoke unavailable: %s", reason)
    report.device = rank_device(backends)
    report.device_message = _use_device(library, report.device) if report.device >= 0 else "no device for this rank"
    if report.device_message:
        log.debug("NCCL release: device %d not made current: %s", report.device, report.device_message)
    comms: List[Communicator] = []
    may_run = False
    if revoke and library is not None and library.has_revoke:
        for backend in backends:
            found = communicator(backend, left())
            if isinstance(found, Skipped):
                report.skipped.append(f"{backend}: {found.why}")
                may_run = may_run or found.may_run
            else:
                comms.append(found)
    if may_run and comms:
        # A group left out keeps its kernels running until torch aborts it: a
        # revoke of the others waits for those on a shared stream. All or none.
        log.debug("NCCL release: no revoke, %d of %d groups left to torch", len(report.skipped), len(backends))
        comms = []
    report.pointers = len(comms)
    if comms and library is not None:
        pointers = [c.pointer for c in comms]
        seen = library.async_errors(pointers, int(left() * 1e9))
        if seen.status == _native.GpuStatus.DONE:
            report.async_errors = list(seen.results)
            for ptr, error in zip(pointers, seen.results, strict=True):
                if error not in (0, 7):  # ncclSuccess, ncclInProgress
                    log.info("NCCL communicator %#x: async error %s", ptr, library.error_string(error))
        outcome = library.revoke(pointers, [c.blocking for c in comms], int(left() * 1e9))
        report.revoke_status = outcome.status
        report.revoked = outcome.status == _native.GpuStatus.DONE
        if outcome.status == _native.GpuStatus.TIMED_OUT:
            _abandoned.set()
            raise NcclAbortTimeout(f"ncclCommRevoke of {len(pointers)} communicators: {outcome.message}")
        if outcome.status != _native.GpuStatus.DONE:
            report.errors.append(outcome.message)
    _abort_all(backends, started, timeout, report)
    report.elapsed_s = time.monotonic() - started
    return report


def _abort_all(backends: Sequence[Any], started: float, timeout: float, report: NcclRelease) -> None:
    """torch's abort() of every backend, all started at once."""
    done = threading.Semaphore(0)
    results: List[Bounded[None]] = [Bounded(False) for _ in backends]

    def run(i: int, backend: Any) -> None:
        try:
            backend.abort()
        except BaseException as e:  # handed to the caller
            results[i].error = e
        finally:
            results[i].finished = True
            done.release()

    for i, backend in enumerate(backends):
        threading.Thread(target=run, args=(i, backend), name="inprocess-nccl-abort", daemon=True).start()
    for _ in backends:
        if not done.acquire(timeout=max(timeout - (time.monotonic() - started), 0.0)):
            break
    stuck = [str(b) for b, r in zip(backends, results, strict=True) if not r.finished]
    if stuck:
        _abandoned.set()
        raise NcclAbortTimeout(
            f"torch's NCCL abort of {', '.join(stuck)} did not return within {timeout:g}s "
            "(see README 'GPU' for the settings that make an abort safe)"
        )
    for backend, result in zip(backends, results, strict=True):
        if result.error is not None:
            report.errors.append(f"{backend}: {result.error}")
        else:
            report.torch_aborted += 1


def abort_by_pointer(pointers: Sequence[int], timeout: float) -> _native.NcclOutcome:
    """``ncclCommAbort`` of `pointers` as one group, on a native thread,
    within `timeout` seconds. Only for a rank about to exit (see above)."""
    library, reason = libraries.nccl()
    if library is None:
        raise RuntimeError(f"cannot abort NCCL communicators by pointer: {reason}")
    outcome = library.abort(list(pointers), True, int(timeout * 1e9))
    if outcome.status == _native.GpuStatus.TIMED_OUT:
        _abandoned.set()
    return outcome
