"""Releases torch's NCCL communicators within a deadline.

The order, and why:

1. **Revoke by pointer** where the loaded NCCL has ``ncclCommRevoke``
   (2.28.7 and later) and torch exposes its communicators
   (``ProcessGroupNCCL._comm_ptr()``): every in-flight operation stops, on a
   native thread, as one call for all communicators, and the communicators
   stay valid. So torch's own abort that follows finds nothing in flight and
   returns quickly, and nothing is freed under torch's feet.
2. **torch's backend ``abort()``** for every NCCL backend, on a thread of its
   own, bounded by what is left of the deadline. Without revoke this is the
   whole release (and the only one where no shared libnccl is loaded, e.g.
   NCCL linked statically into torch).

An abort still running at the deadline raises :class:`NcclAbortTimeout`: the
thread inside NCCL is abandoned and the restart does not wait for it; the
rank leaves (the restart loop's escalation, or the monitor's hard timeout).

``ncclCommAbort`` by pointer (:func:`abort_by_pointer`) frees communicators
that torch still holds: torch would later abort or destroy them again. It is
for a rank that leaves the job right after (the process exits before torch
touches its groups again), where it releases the peers and the device without
waiting for torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from .. import _native
from . import libraries
from .bounded import call_within
from .errors import NcclAbortTimeout

log = logging.getLogger("inprocess")


@dataclass
class NcclRelease:
    """What :func:`release` did."""

    backends: int = 0
    pointers: int = 0
    async_errors: List[int] = field(default_factory=list)  # ncclResult_t per pointer, read before the revoke
    revoked: bool = False
    revoke_status: Optional[_native.GpuStatus] = None
    torch_aborted: int = 0
    errors: List[str] = field(default_factory=list)
    elapsed_s: float = 0.0


def communicator_pointers(backends: Sequence[Any]) -> List[int]:
    """``_comm_ptr()`` of each backend that has one and a communicator made."""
    pointers = []
    for backend in backends:
        get = getattr(backend, "_comm_ptr", None)
        if get is None:
            continue
        try:
            ptr = int(get())
        except Exception as e:  # no communicator created yet, or torch refused
            log.debug("no NCCL communicator pointer from %s: %s", backend, e)
            continue
        if ptr:
            pointers.append(ptr)
    return pointers


def release(backends: Sequence[Any], timeout: float, revoke: bool = True) -> NcclRelease:
    """Revokes (where possible) and aborts `backends` (torch NCCL backends)
    within `timeout` seconds. Raises :class:`NcclAbortTimeout` past it."""
    started = time.monotonic()
    report = NcclRelease(backends=len(backends))
    pointers = communicator_pointers(backends) if revoke else []
    report.pointers = len(pointers)
    if pointers:
        library, reason = libraries.nccl()
        if library is not None:
            # What NCCL saw (a peer gone: ncclRemoteError), for the log.
            seen = library.async_errors(pointers, int(timeout * 1e9))
            if seen.status == _native.GpuStatus.DONE:
                report.async_errors = list(seen.results)
                for ptr, error in zip(pointers, seen.results, strict=True):
                    if error not in (0, 7):  # ncclSuccess, ncclInProgress
                        log.info("NCCL communicator %#x: async error %s", ptr, library.error_string(error))
        if library is not None and library.has_revoke:
            outcome = library.revoke(pointers, int(max(timeout - (time.monotonic() - started), 0.0) * 1e9))
            report.revoke_status = outcome.status
            report.revoked = outcome.status == _native.GpuStatus.DONE
            if outcome.status == _native.GpuStatus.TIMED_OUT:
                raise NcclAbortTimeout(f"ncclCommRevoke of {len(pointers)} communicators: {outcome.message}")
            if outcome.status != _native.GpuStatus.DONE:
                report.errors.append(outcome.message)
        elif library is None:
            log.debug("NCCL revoke unavailable: %s", reason)
    for backend in backends:
        left = timeout - (time.monotonic() - started)
        result = call_within(backend.abort, left, "inprocess-nccl-abort")
        if not result.finished:
            raise NcclAbortTimeout(
                f"torch's NCCL abort of {backend} did not return within {timeout:g}s "
                "(see README 'GPU' for the settings that make an abort safe)"
            )
        if result.error is not None:
            report.errors.append(f"{backend}: {result.error}")
        else:
            report.torch_aborted += 1
    report.elapsed_s = time.monotonic() - started
    return report


def abort_by_pointer(pointers: Sequence[int], timeout: float) -> _native.NcclOutcome:
    """``ncclCommAbort`` of `pointers` as one group, on a native thread,
    within `timeout` seconds. Only for a rank about to exit (see above)."""
    library, reason = libraries.nccl()
    if library is None:
        raise RuntimeError(f"cannot abort NCCL communicators by pointer: {reason}")
    return library.abort(list(pointers), True, int(timeout * 1e9))
