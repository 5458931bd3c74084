"""Opens the CUDA driver, NCCL and NVML once per process.

Each opener returns the library, or ``None`` with the reason it is
unavailable (a machine without a GPU, a torch built without a shared libnccl).
The paths can be set for tests and diagnostics:

- ``INPROCESS_LIBCUDA``: the CUDA driver library (default ``libcuda.so.1``,
  the copy already loaded first);
- ``INPROCESS_LIBNVML``: NVML (default ``libnvidia-ml.so.1``);
- ``INPROCESS_LIBNCCL``: an NCCL file to load when none is loaded yet. When a
  libnccl is already loaded (torch's), that one is used and a different file
  is refused: torch's communicators must never meet a second copy.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Dict, Optional, Tuple, Union

from .. import _native

Library = Union[_native.CudaDriver, _native.NcclLibrary, _native.NvmlLibrary]

_lock = threading.Lock()
_cache: Dict[str, Tuple[Optional[Library], str]] = {}


def _cached(kind: str, path: str, opener: Callable[[], Library]) -> Tuple[Optional[Library], str]:
    key = f"{kind}:{path}"
    with _lock:
        if key not in _cache:
            try:
                _cache[key] = (opener(), "")
            except (RuntimeError, ValueError, OSError) as e:
                _cache[key] = (None, str(e))
        return _cache[key]


def cuda_driver() -> Tuple[Optional[_native.CudaDriver], str]:
    path = os.environ.get("INPROCESS_LIBCUDA", "")
    library, reason = _cached("cuda", path, lambda: _native.CudaDriver.open(path))
    assert library is None or isinstance(library, _native.CudaDriver)
    return library, reason


def nvml() -> Tuple[Optional[_native.NvmlLibrary], str]:
    path = os.environ.get("INPROCESS_LIBNVML", "")
    library, reason = _cached("nvml", path, lambda: _native.NvmlLibrary.open(path))
    assert library is None or isinstance(library, _native.NvmlLibrary)
    return library, reason


def nccl() -> Tuple[Optional[_native.NcclLibrary], str]:
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
        found = _native.NcclLibrary.find_loaded()
        if found is None:
            return None, "no libnccl is loaded in this process (torch without NCCL, or NCCL linked statically)"
        with _lock:
            _cache["nccl:"] = (found, "")
        library, reason = found, ""
    assert library is None or isinstance(library, _native.NcclLibrary)
    return library, reason


def forget() -> None:
    """Drops every cached library and reason (tests change the paths)."""
    with _lock:
        _cache.clear()
