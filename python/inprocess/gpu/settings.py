"""The environment torch and NCCL need for an in-process restart on GPUs,
and one warning per process when the running configuration says otherwise.

Each rule names the torch or NCCL source it follows (torch 2.13.0: the
headers it installs under ``torch/include/torch/csrc/distributed/c10d/``;
the ``.cpp`` files by function, as read in pytorch/pytorch's main branch):

- ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` 2 (or 0). ``ProcessGroupNCCL.hpp``
  lines 160-171: 1 (TearDown) and 3 (SkipCleanUp, the default, lines 64-65)
  tear the process down when the watchdog sees an NCCL error or timeout, so
  every such fault becomes a process restart; 2 (CleanUpOnly) aborts the
  communicators and the failed work raises, 0 leaves it to inprocess.
- ``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``. ``ProcessGroupNCCL.hpp`` line 110,
  default true; ``ProcessGroupNCCL::Watchdog::run`` rethrows the exception of
  a CUDA error out of the watchdog thread, which ends in ``std::terminate``:
  SIGABRT within the watchdog's 100 ms poll, before the health check can
  classify the error and leave with exit status 76. NVRx's usage guide says
  the same (``docs/source/inprocess/usage_guide.rst``, "PyTorch NCCL
  Watchdog forcefully terminates the process").
- ``TORCH_NCCL_NONBLOCKING_TIMEOUT`` where ``TORCH_NCCL_USE_COMM_NONBLOCKING``
  is on: torch waits for a non-blocking communicator (``NCCLUtils.cpp``,
  ``nccl_nonblocking_timeout``) up to it, 30 minutes by default; set it no
  longer than the abort's ``nccl_timeout``.
- ``NCCL_NVLS_ENABLE=0``: nvidia_resiliency_ext's in-process restart requires
  NVLink SHARP (NVLS, on NVSwitch systems) off (its usage guide, "Known issues",
  NCCL); nothing here has measured an abort with NVLS on, so the same holds.
- NCCL without a known abort hang: not 2.17.1, 2.18.x or 2.25.1 (docs/gpu.md
  gives the issues), and not 2.28.3 to 2.28.8, which nvidia_resiliency_ext
  warns against for in-process restart (torch 2.13 pairs with NCCL 2.29.7).

Which communicators the abort is safe with is a fact of NCCL, not a setting:
NCCL documents ``ncclCommAbort`` as safe while an operation is in flight for
non-blocking communicators (``TORCH_NCCL_USE_COMM_NONBLOCKING=1``); with
blocking ones (torch's default) a thread blocked inside NCCL (a
communicator's creation, a blocking group end) is not released by it, and the
abort's deadline (exit 75) is what bounds that case. Not a warning: torch's
default is what most jobs run, and the restart stays bounded either way.

"In use" means this process could run NCCL on a GPU: torch was built with
CUDA and NCCL and a CUDA device is visible. A CPU-only job (a CPU build of
torch, or no device) is never warned.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping

log = logging.getLogger("inprocess")

# torch's getCvarBool (Utils.hpp line 175-181, torch 2.13.0), lower-cased.
_TRUE = ("y", "yes", "1", "t", "true")
_FALSE = ("n", "no", "0", "f", "false")

# NCCL releases whose abort can hang (see docs/gpu.md).
_ABORT_HANGS = {
    (2, 17, 1): "ncclCommAbort waits for the other ranks (pytorch#119215)",
    (2, 18): "aborts from several threads can hang, fixed in 2.19.1 (NVIDIA/nccl#992)",
    (2, 25, 1): "abort can hang, fixed in 2.26.2 (pytorch#149153)",
}
# Ranges of releases, first and last included, and why.
_AVOIDED_RANGES = (
    ((2, 28, 3), (2, 28, 8), "nvidia_resiliency_ext warns against NCCL 2.28.3 to 2.28.8 for in-process restart"),
)

_warned = False
_warned_lock = threading.Lock()


def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """The variable torch reads: the first of `names` that is set (getCvar*
    gives the earlier names priority)."""
    for name in names:
        value = env.get(name)
        if value is not None:
            return name, value
    return None


def _cvar_bool(env: Mapping[str, str], name: str, default: bool) -> bool | None:
    """What torch's getCvarBool reads from `name`; None for a value torch refuses."""
    value = env.get(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    return None


def contradictions(env: Mapping[str, str] | None = None,
                   nccl_version: tuple[int, ...] | None = None) -> list[str]:
    """Each way `env` (os.environ by default) and the loaded NCCL differ from
    the settings above, one sentence each; empty when none does."""
    env = os.environ if env is None else env
    found: list[str] = []

    handling = _first_set(env, ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"))
    mode = handling[1].strip() if handling else "3"
    if mode not in ("0", "2"):
        shown = f"{handling[0]}={handling[1]!r}" if handling else "TORCH_NCCL_ASYNC_ERROR_HANDLING unset (3)"
        found.append(f"{shown}: torch's watchdog tears the process down on an NCCL error or timeout; "
                     "set TORCH_NCCL_ASYNC_ERROR_HANDLING=2 so that the restart happens in-process")

    rethrow = _cvar_bool(env, "TORCH_NCCL_RETHROW_CUDA_ERRORS", True)
    if rethrow is None or rethrow:
        value = env.get("TORCH_NCCL_RETHROW_CUDA_ERRORS")
        shown = "TORCH_NCCL_RETHROW_CUDA_ERRORS unset (true)" if value is None else \
            f"TORCH_NCCL_RETHROW_CUDA_ERRORS={value!r}"
        found.append(f"{shown}: after a sticky CUDA error torch's watchdog aborts the process (SIGABRT) "
                     "before the health check can end the rank with exit status 76; "
                     "set TORCH_NCCL_RETHROW_CUDA_ERRORS=0")

    if _cvar_bool(env, "TORCH_NCCL_USE_COMM_NONBLOCKING", False) and not env.get("TORCH_NCCL_NONBLOCKING_TIMEOUT"):
        found.append("TORCH_NCCL_USE_COMM_NONBLOCKING is on and TORCH_NCCL_NONBLOCKING_TIMEOUT unset: torch waits "
                     "up to 30 minutes for a non-blocking communicator, its abort included; set "
                     "TORCH_NCCL_NONBLOCKING_TIMEOUT (seconds) no longer than the abort's nccl_timeout")

    nvls = env.get("NCCL_NVLS_ENABLE")
    if nvls is None or nvls.strip() != "0":
        shown = "NCCL_NVLS_ENABLE unset" if nvls is None else f"NCCL_NVLS_ENABLE={nvls!r}"
        found.append(f"{shown}: NVLink SHARP (NVLS, on NVSwitch systems) is on; nvidia_resiliency_ext requires it "
                     "off for an in-process restart and no abort with it on has been measured here; "
                     "set NCCL_NVLS_ENABLE=0")

    if nccl_version is not None:
        found += _nccl_release_contradictions(tuple(nccl_version))
    return found


def _nccl_release_contradictions(version: tuple[int, ...]) -> list[str]:
    shown = ".".join(str(v) for v in version[:3])
    found = [f"NCCL {shown}: {why}; use another NCCL release"
             for release, why in _ABORT_HANGS.items() if version[: len(release)] == release]
    found += [f"NCCL {shown}: {why}; use another NCCL release (2.28.9 or later)"
              for first, last, why in _AVOIDED_RANGES if first <= version[:3] <= last]
    return found


def nccl_in_use() -> tuple[bool, tuple[int, ...] | None]:
    """Whether this process can run NCCL on a GPU, and the NCCL version
    torch reports. Reads torch only if it is already imported; creates no
    CUDA context (``torch.cuda.device_count`` does not)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(torch.version, "cuda", None) is None:
        return False, None
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_nccl_available()) or torch.cuda.device_count() == 0:
            return False, None
        version = torch.cuda.nccl.version()
    except Exception as e:  # a broken CUDA install: nothing to advise on
        log.debug("GPU settings not checked: %s", e)
        return False, None
    return True, tuple(version) if isinstance(version, tuple) else None


def warn_once(env: Mapping[str, str] | None = None, in_use: bool | None = None,
              nccl_version: tuple[int, ...] | None = None) -> list[str]:
    """Logs one warning, the first time it is called in this process, when
    NCCL is in use and the configuration contradicts the settings above.
    Returns what it warned about (empty: nothing, or already warned)."""
    global _warned
    with _warned_lock:
        if _warned:
            return []
        _warned = True
    if in_use is None:
        in_use, nccl_version = nccl_in_use()
    if not in_use:
        return []
    found = contradictions(env, nccl_version)
    if found:
        log.warning("inprocess: this configuration works against an in-process restart on GPUs "
                    "(README, 'GPU: settings'):\n  - %s", "\n  - ".join(found))
    return found


def _forget() -> None:
    """For tests: the next warn_once() warns again."""
    global _warned
    with _warned_lock:
        _warned = False
