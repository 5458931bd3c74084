"""The GPU side of inprocess: the CUDA driver, NCCL and NVML reached through
the native extension's dlopen layer (no CUDA at build time, design principle 6).

- :mod:`.errors`: the exceptions and the exit status of a rank whose CUDA
  context is lost (design principle 9);
- :mod:`.libraries`: opening the libraries once per process, with a clear
  reason when one is unavailable;
- :mod:`.device`: which device this rank uses (``LOCAL_RANK`` modulo the
  visible devices);
- :mod:`.nccl_abort`: releasing torch's NCCL communicators within a deadline;
- :mod:`.flight_recorder`: dumping torch's NCCL flight recorder before an abort;
- :mod:`.settings`: the torch/NCCL environment an in-process restart needs,
  and the one warning when the running configuration contradicts it.

The first command to run on a GPU machine is a checkout's ``tools/gpu_acceptance.py``
(it runs the checkout's GPU tests and jobs of its own).

The health checks built on them are in :mod:`inprocess.health_check`.
"""

from .errors import (
    EXIT_CODE_CONTEXT_LOST,
    CudaContextLost,
    GpuUnavailable,
    GpuUnhealthy,
    NcclAbortTimeout,
    leave_for_lost_context,
)

__all__ = [
    "EXIT_CODE_CONTEXT_LOST",
    "CudaContextLost",
    "GpuUnavailable",
    "GpuUnhealthy",
    "NcclAbortTimeout",
    "leave_for_lost_context",
]
