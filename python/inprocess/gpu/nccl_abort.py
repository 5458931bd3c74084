"""Releases torch's NCCL communicators within a deadline.

The order, and why (torch 2.13's ``ProcessGroupNCCL``, NCCL 2.29.7 which it
pairs with; the sources are cited in tests/fakes/fake_torch_nccl.py,
tests/fakes/fake_nccl.c and tests/test_nccl_release.py):

1. **The rank's device, on this thread and on the native worker.** torch's
   ``_comm_ptr()`` answers for the communicator of the *calling thread's*
   current device, and NCCL's blocking ``ncclGroupEnd`` saves and restores the
   calling thread's device. The restart trigger thread never had one (device
   0): every rank not on GPU 0 would get no pointer, and every group end would
   create a context on GPU 0. The rank's device (the group's
   ``bound_device_id``, else :func:`.device.cuda_ordinal`) is made current on
   both threads through the CUDA driver, only where its context exists.
2. **Revoke: off by default** (``revoke=True`` asks for it). It buys nothing
   measured yet (one rank: the abort's cost is NCCL's proxy poll either way)
   and has a hazard: torch runs a single ``send``/``recv`` over a
   point-to-point communicator of its own that ``_comm_ptr()`` does not
   return; a P2P kernel stuck ahead of a collective on the same stream holds
   the revoke's wait for that stream until the deadline (exit 75), where
   torch's abort alone, which aborts the P2P communicators too, releases it.
   Where asked for, only *blocking* communicators are revoked: completing a
   non-blocking one's revoke takes ``ncclCommGetAsyncError`` polls, and on a
   non-blocking communicator that call completes and frees the group job
   linked to it (NCCL 2.29.7 ``src/init.cc`` lines 3107-3110), which torch's
   watchdog does too, under the communicator's mutex that this library cannot
   take. No other ``ncclCommGetAsyncError`` is made. The pointers are read
   with ``_comm_ptr()``, which holds the GIL and takes the group's mutex: no
   deadline can end it, so it is called only after ``get_error()`` says torch
   has seen no failure on the group and ``_is_initialized()`` (GIL released,
   same mutex) returned within a short bound. The mutex can still be taken
   between the two (by torch's watchdog on an error it has just seen): then
   ``_comm_ptr()`` blocks every Python thread until the rank's hard timeout.
   That is one more reason revoke is off by default: the default path reads
   no pointer at all. Every communicator revoked is in one NCCL group (the
   flags are all set before any revoke waits for its streams); a group left
   out (skipped) leaves all the others to torch's abort too.
3. **torch's ``abort()`` of every backend at once** (:class:`Aborts`), each
   on a thread of its own. torch 2.13 runs each abort's ``ncclCommAbort``
   calls on a ``std::async`` thread, grouped per backend only: aborted one
   after another, the first would wait for the kernel of a group whose abort
   has not started yet. :func:`release` waits for them within the deadline;
   the restart hands them to a reaper instead and waits for them before the
   function runs again (:mod:`.nccl_reaper`).

An abort still running at the deadline raises :class:`NcclAbortTimeout`: the
thread inside NCCL or torch is abandoned (:func:`abandoned` is true from then
on) and holds torch's locks; the rank leaves without touching torch's
process groups again (:mod:`inprocess.engine.leave`).

``ncclCommAbort`` by pointer (:func:`abort_by_pointer`) frees communicators
that torch still holds: torch would later abort or destroy them again. It is
for a rank that leaves the job right after (the process exits before torch
touches its groups again), where it releases the peers and the device without
waiting for torch.

Which communicators the abort is safe with: NCCL documents ``ncclCommAbort``
as safe while an operation is in flight for non-blocking communicators
(``TORCH_NCCL_USE_COMM_NONBLOCKING=1``); on a blocking one (torch's default)
a thread blocked inside NCCL (a creation, a blocking group end) is not
interrupted by the abort. The deadline bounds that case (exit 75).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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
    skipped: list[str] = field(default_factory=list)  # backends released by torch alone, and why
    revoked: bool = False
    revoke_status: _native.GpuStatus | None = None
    torch_aborted: int = 0
    errors: list[str] = field(default_factory=list)
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
    if not is_blocking(backend):
        # Its revoke completes through ncclCommGetAsyncError, which completes and frees the group job
        # linked to a non-blocking communicator, as torch's watchdog does under a mutex not ours.
        return Skipped("non-blocking (left to torch's abort: see the module's docstring)", may_run=True)
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


def _use_device(library: _native.NcclLibrary | None, ordinal: int) -> str:
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


def release(backends: Sequence[Any], timeout: float, revoke: bool = False) -> NcclRelease:
    """Revokes (where asked for and possible) and aborts `backends` (torch NCCL backends)
    within `timeout` seconds. Raises :class:`NcclAbortTimeout` past it."""
    started = time.monotonic()
    report = prepare(backends, started + timeout, revoke)
    report.torch_aborted, errors = Aborts(backends).wait(started + timeout)
    report.errors += errors
    report.elapsed_s = time.monotonic() - started
    return report


def prepare(backends: Sequence[Any], deadline: float, revoke: bool) -> NcclRelease:
    """What comes before torch's aborts: the rank's device made current, then, with `revoke`, the
    revoke (steps 1 and 2 of the module's docstring), by `deadline` (``time.monotonic()``)."""
    report = NcclRelease(backends=len(backends))
    library, reason = libraries.nccl()
    if library is None:
        log.debug("NCCL revoke unavailable: %s", reason)
    report.device = rank_device(backends)
    report.device_message = _use_device(library, report.device) if report.device >= 0 else "no device for this rank"
    if report.device_message:
        log.debug("NCCL release: device %d not made current: %s", report.device, report.device_message)
    if revoke and library is not None and library.has_revoke:
        _revoke(library, backends, deadline, report)
    return report


def _revoke(library: _native.NcclLibrary, backends: Sequence[Any], deadline: float, report: NcclRelease) -> None:
    def left() -> float:
        return max(deadline - time.monotonic(), 0.0)

    comms: list[Communicator] = []
    may_run = False
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
    if not comms:
        return
    pointers = [c.pointer for c in comms]
    outcome = library.revoke(pointers, [c.blocking for c in comms], int(left() * 1e9))
    report.revoke_status = outcome.status
    report.revoked = outcome.status == _native.GpuStatus.DONE
    if outcome.status == _native.GpuStatus.TIMED_OUT:
        _abandoned.set()
        raise NcclAbortTimeout(f"ncclCommRevoke of {len(pointers)} communicators: {outcome.message}")
    if outcome.status != _native.GpuStatus.DONE:
        report.errors.append(outcome.message)


class Aborts:
    """torch's ``abort()`` of every backend, each on a thread of its own, all started at once."""

    def __init__(self, backends: Sequence[Any]):
        self.backends = list(backends)
        self._started = [threading.Event() for _ in self.backends]
        self._done = [threading.Event() for _ in self.backends]
        self._errors: list[BaseException | None] = [None for _ in self.backends]
        for i, backend in enumerate(self.backends):
            threading.Thread(target=self._run, args=(i, backend), name="inprocess-nccl-abort", daemon=True).start()

    def _run(self, i: int, backend: Any) -> None:
        self._started[i].set()
        try:
            backend.abort()
        except BaseException as e:  # handed to the waiter
            self._errors[i] = e
        finally:
            self._done[i].set()

    def started(self, deadline: float) -> bool:
        """Until every thread is at its ``abort()`` call, by `deadline` (``time.monotonic()``)."""
        return all(e.wait(max(deadline - time.monotonic(), 0.0)) for e in self._started)

    def finished(self) -> bool:
        return all(e.is_set() for e in self._done)

    def wait(self, deadline: float) -> tuple[int, list[str]]:
        """Until every abort returned, by `deadline`: (how many returned without an error, the errors).
        Raises :class:`NcclAbortTimeout` (and marks the process abandoned) past it."""
        for done in self._done:
            done.wait(max(deadline - time.monotonic(), 0.0))
        stuck = [str(b) for b, done in zip(self.backends, self._done, strict=True) if not done.is_set()]
        if stuck:
            _abandoned.set()
            raise NcclAbortTimeout(
                f"torch's NCCL abort of {', '.join(stuck)} did not return by its deadline "
                "(see docs/gpu.md for the settings that make an abort safe)"
            )
        errors = [f"{b}: {e}" for b, e in zip(self.backends, self._errors, strict=True) if e is not None]
        return len(self.backends) - len(errors), errors


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
