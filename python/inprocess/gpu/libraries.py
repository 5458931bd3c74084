"""Opens the CUDA driver, NCCL and NVML once per process.

Each opener returns the library, or ``None`` with the reason it is
unavailable (a machine without a GPU, a torch built without a shared libnccl).
The paths can be set for tests and diagnostics:

- ``INPROCESS_LIBCUDA``: the CUDA driver library (default ``libcuda.so.1``,
  the copy already loaded first);
- ``INPROCESS_LIBNVML``: NVML (default ``libnvidia-ml.so.1``);
- ``INPROCESS_LIBNCCL``: an NCCL file to load when none is loaded yet. When
  torch's NCCL is loaded, that one is used and a different file is refused:
  torch's communicators must never meet a second copy.

torch's NCCL is found through torch's own ``libtorch_cuda.so`` (its handle,
opened with ``RTLD_NOLOAD``, reaches an NCCL linked into it statically as well
as the libnccl it needs), never as "the first libnccl loaded": another package
(cupy, vLLM, nccl4py) may have loaded its own libnccl.so.2 first. Its version
must be the one ``torch.cuda.nccl.version()`` reports.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

from .. import _native

Library = _native.CudaDriver | _native.NcclLibrary | _native.NvmlLibrary | _native.CurrentDevice

_lock = threading.Lock()
_cache: dict[str, tuple[Library | None, str]] = {}


def _cached(kind: str, path: str, opener: Callable[[], Library]) -> tuple[Library | None, str]:
    key = f"{kind}:{path}"
    with _lock:
        if key not in _cache:
            try:
                _cache[key] = (opener(), "")
            except (RuntimeError, ValueError, OSError) as e:
                _cache[key] = (None, str(e))
        return _cache[key]


_Opened = TypeVar("_Opened", _native.CudaDriver, _native.CurrentDevice, _native.NvmlLibrary)


def _opened(kind: str, variable: str, cls: type[_Opened]) -> tuple[_Opened | None, str]:
    """The library of ``cls`` at the path ``variable`` names (its default where unset), opened once."""
    path = os.environ.get(variable, "")
    library, reason = _cached(kind, path, lambda: cls.open(path))
    assert library is None or isinstance(library, cls)
    return library, reason


def cuda_driver() -> tuple[_native.CudaDriver | None, str]:
    return _opened("cuda", "INPROCESS_LIBCUDA", _native.CudaDriver)


def current_device() -> tuple[_native.CurrentDevice | None, str]:
    """The driver calls that make a device current on a thread (the NCCL abort's)."""
    return _opened("current_device", "INPROCESS_LIBCUDA", _native.CurrentDevice)


def torch_nccl_version() -> tuple[int, int, int] | None:
    """The NCCL version torch was built with and loaded, None where torch has no NCCL."""
    try:
        import torch

        found = torch.cuda.nccl.version()
    except Exception:  # torch without CUDA or without NCCL
        return None
    if isinstance(found, tuple) and len(found) >= 3:  # (major, minor, patch[, suffix])
        return (int(found[0]), int(found[1]), int(found[2]))
    return None


def version_tuple(code: int) -> tuple[int, int, int]:
    """NCCL_VERSION_CODE (X*10000 + Y*100 + Z since 2.9) as (X, Y, Z)."""
    return (code // 10000, (code // 100) % 100, code % 100)


def nvml() -> tuple[_native.NvmlLibrary | None, str]:
    return _opened("nvml", "INPROCESS_LIBNVML", _native.NvmlLibrary)


def nccl() -> tuple[_native.NcclLibrary | None, str]:
    """The libnccl this process loaded (torch's); not cached while none is
    loaded, since torch loads it when its first NCCL group is made."""
    path = os.environ.get("INPROCESS_LIBNCCL", "")
    with _lock:
        cached = _cache.get(f"nccl:{path}")
    if cached is not None and cached[0] is not None:
        assert isinstance(cached[0], _native.NcclLibrary)
        return cached[0], ""
    if path:
        library, reason = _cached("nccl", path, lambda: _native.NcclLibrary.open(path))
    else:
        try:
            found = _native.NcclLibrary.find_loaded()
        except RuntimeError as e:  # torch's library reaches an NCCL that lacks a function
            return None, str(e)
        if found is None:
            return None, "torch's NCCL is not loaded in this process (torch without NCCL, or no NCCL group yet)"
        expected = torch_nccl_version()
        if expected is not None and version_tuple(found.version) != expected:
            reason = (f"the NCCL found ({found.path}, {'.'.join(map(str, version_tuple(found.version)))}) is not "
                      f"torch's ({'.'.join(map(str, expected))}): not acting on torch's communicators with it")
            with _lock:
                _cache["nccl:"] = (None, reason)
            return None, reason
        with _lock:
            _cache["nccl:"] = (found, "")
        library, reason = found, ""
    assert library is None or isinstance(library, _native.NcclLibrary)
    return library, reason


def forget() -> None:
    """Drops every cached library and reason (tests change the paths)."""
    with _lock:
        _cache.clear()
