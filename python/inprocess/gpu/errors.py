"""What a GPU fault means for the rank, and the exit status that says it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

from ..exception import HealthCheckError, RestartError, exception_chain
from ..exits import EXIT_CODE_CONTEXT_LOST, exit_now

log = logging.getLogger("inprocess")

# EXIT_CODE_CONTEXT_LOST (76, inprocess.exits): the exit status of a rank whose CUDA context is lost (a
# sticky error: illegal address, launch failure, uncorrectable ECC, ...; or a device that read back other
# data than was written). The context cannot be repaired inside the process, so the rank leaves and the
# outer launcher replaces the process.
__all__ = ["EXIT_CODE_CONTEXT_LOST", "CudaContextLost", "GpuUnavailable", "GpuUnhealthy", "NcclAbortTimeout",
           "leave_for_lost_context", "lost_context_in"]


class GpuUnavailable(HealthCheckError):
    """A GPU check cannot run here (no driver, no device, no library); raised
    only by checks configured to fail rather than skip when unavailable."""


class GpuUnhealthy(HealthCheckError):
    """NVML or a probe says this GPU cannot be trusted (uncorrectable ECC
    errors, a pending row remap or page retirement, a recovery action the
    driver asks for, a link down). The rank is terminated; the device needs
    attention outside the job."""


class CudaContextLost(HealthCheckError):
    """The CUDA context of this process cannot be used again. The rank must
    leave the job with :data:`EXIT_CODE_CONTEXT_LOST` (see
    :func:`leave_for_lost_context`); restarting in-process would only meet
    the same error."""

    exit_status = EXIT_CODE_CONTEXT_LOST

    def __init__(self, message: str, code: int = 0, error_name: str = ""):
        super().__init__(message)
        self.code = code
        self.error_name = error_name


class NcclAbortTimeout(RestartError):
    """Releasing the NCCL communicators did not finish within its deadline.
    The abort thread that is still inside NCCL is abandoned; the rank cannot
    be trusted with another iteration, and its main thread may still be
    blocked: the restart loop's escalation (exit 75, or the monitor's hard
    timeout) takes over."""


def leave_for_lost_context(error: BaseException, leave: Callable[[], object] | None = None) -> NoReturn:
    """Ends the process with :data:`EXIT_CODE_CONTEXT_LOST`, without running
    Python's exit machinery: atexit handlers and finalizers would call into
    the lost context (torch's CUDA caching allocator frees its memory at
    exit) and can hang there.

    `leave` runs first: the restart loop's own way of leaving the job (count
    this rank out in the store), as before exit code 75. Its exceptions are
    logged; the process exits whatever happens."""
    log.error("CUDA context lost (%s): this rank leaves the job (exit code %d)", error, EXIT_CODE_CONTEXT_LOST)
    if leave is not None:
        try:
            leave()
        except BaseException as e:  # the exit below must happen regardless
            log.error("leaving the job before exit %d failed: %s", EXIT_CODE_CONTEXT_LOST, e)
    exit_now(EXIT_CODE_CONTEXT_LOST)


def lost_context_in(exc: BaseException) -> CudaContextLost | None:
    """The :class:`CudaContextLost` that ``exc`` is or was raised from, if any."""
    return next((e for e in exception_chain(exc) if isinstance(e, CudaContextLost)), None)
