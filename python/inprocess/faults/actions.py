"""What each fault kind does, performed in the calling thread.

These are the primitives; :mod:`inprocess.faults.arming` decides when and in
which thread they run. Everything here is torch-free except the two GPU
faults, which import torch when they run and refuse plainly without a CUDA
device.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from typing import Any

from .plan import Kind

# A sleep that never ends on its own: long enough for any job, small enough for every timeout API.
_FOREVER_S = 10**7


class InjectedException(Exception):
    """Raised in the training code by an injected ``exception`` fault."""


class FaultUnavailable(RuntimeError):
    """The fault cannot be produced here (a GPU fault on a rank without a CUDA device)."""


def require_cuda(kind: Kind) -> Any:
    """The ``torch`` module, if this process has a CUDA device; else FaultUnavailable naming ``kind``."""
    try:
        import torch
    except ImportError:
        raise FaultUnavailable(f"{kind.value} needs a CUDA device, and torch cannot be imported here") from None
    if not torch.cuda.is_available():
        raise FaultUnavailable(f"{kind.value} needs a CUDA device; torch.cuda.is_available() is False on this rank")
    return torch


def cuda_device_for(kind: Kind) -> int:
    """The current CUDA device of the calling thread (capture it in the thread that runs the training code)."""
    return int(require_cuda(kind).cuda.current_device())


def perform(
    kind: Kind,
    message: str = "injected fault",
    code: int = 1,
    duration_s: float | None = None,
    cuda_device: int | None = None,
) -> None:
    """Do what ``kind`` does, now, in this thread. Returns only for a hang with
    a duration, a signal the process survives (SIGTERM/SIGINT with a handler
    that does not raise, SIGSTOP once continued) or a GPU fault."""
    if kind is Kind.EXCEPTION:
        raise InjectedException(message)
    if kind is Kind.HANG:
        sleep_releasing_gil(duration_s)
    elif kind is Kind.GIL_HANG:
        sleep_holding_gil(duration_s)
    elif kind in _SIGNALS:
        os.kill(os.getpid(), _SIGNALS[kind])
    elif kind is Kind.OS_EXIT:
        os._exit(code)
    elif kind is Kind.ABORT:
        os.abort()
    elif kind is Kind.SEGFAULT:
        ctypes.string_at(0)  # strlen(NULL): SIGSEGV
    elif kind is Kind.GPU_ERROR:
        device_side_error(cuda_device)
    elif kind is Kind.GPU_SLEEP:
        gpu_sleep(duration_s, cuda_device)
    else:  # pragma: no cover - every Kind is handled above
        raise ValueError(f"fault kind {kind!r}: not one of {[k.value for k in Kind]}")


_SIGNALS = {
    Kind.SIGKILL: signal.SIGKILL,
    Kind.SIGTERM: signal.SIGTERM,
    Kind.SIGINT: signal.SIGINT,
    Kind.SIGSTOP: signal.SIGSTOP,
}


def sleep_releasing_gil(duration_s: float | None) -> None:
    """Sleep (``None``: until killed) with the GIL released: other threads run on.

    ``time.sleep`` resumes after a signal whose handler returns, and ends with
    the exception of a handler that raises (the restart's interrupt does).
    """
    deadline = time.monotonic() + (_FOREVER_S if duration_s is None else duration_s)
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if duration_s is not None:
                return
            deadline = time.monotonic() + _FOREVER_S
            continue
        time.sleep(remaining)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_EINTR = 4


def sleep_holding_gil(duration_s: float | None) -> None:
    """Sleep (``None``: until killed) in one C call that keeps the GIL: the process runs no Python at all.

    ``ctypes.PyDLL`` does not release the GIL around the call, unlike
    ``ctypes.CDLL``. Signals with a Python handler are blocked in this thread
    for the call, so that none ends the sleep early: as in a stuck C call,
    they stay pending (or go to another thread, whose handler cannot run
    without the GIL). Signals without a handler keep their default action:
    SIGTERM and SIGKILL still end the process.
    """
    libc = ctypes.PyDLL(None, use_errno=True)
    nanosleep = libc.nanosleep
    nanosleep.argtypes = [ctypes.POINTER(_Timespec), ctypes.POINTER(_Timespec)]
    nanosleep.restype = ctypes.c_int
    handled = {s for s in signal.valid_signals() if callable(signal.getsignal(s))}
    seconds = _FOREVER_S if duration_s is None else max(0.0, duration_s)
    request = _Timespec(int(seconds), int((seconds - int(seconds)) * 1e9))
    left = _Timespec(0, 0)
    blocked_before = signal.pthread_sigmask(signal.SIG_BLOCK, handled)
    try:
        while True:
            if nanosleep(ctypes.byref(request), ctypes.byref(left)) == 0:
                if duration_s is not None:
                    return
                continue
            if ctypes.get_errno() != _EINTR:
                raise OSError(ctypes.get_errno(), "nanosleep failed in gil_hang")
            request = _Timespec(left.tv_sec, left.tv_nsec)
    finally:
        # Signals left pending while blocked are delivered now, and their handlers run.
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked_before)


def device_side_error(cuda_device: int | None) -> None:
    """An out-of-bounds index on the GPU: a device-side assertion that poisons the CUDA context.

    Raises ``RuntimeError`` (CUDA error: device-side assert triggered) here
    when synchronised; the context stays unusable, as after a real one.
    """
    torch = require_cuda(Kind.GPU_ERROR)
    device = torch.device("cuda", torch.cuda.current_device() if cuda_device is None else cuda_device)
    target = torch.zeros(1, device=device)
    out_of_bounds = torch.full((1,), 1 << 20, dtype=torch.int64, device=device)
    target[out_of_bounds] = 1.0
    torch.cuda.synchronize(device)


def gpu_sleep(duration_s: float | None, cuda_device: int | None) -> None:
    """Queue a kernel that spins on the GPU (``None``: practically for ever) and return.

    The host goes on until it next waits for the device (a synchronize, a
    collective, ``.item()``): there it hangs with the GIL released.
    """
    torch = require_cuda(Kind.GPU_SLEEP)
    device = torch.cuda.current_device() if cuda_device is None else cuda_device
    with torch.cuda.device(device):
        if duration_s is None:
            cycles = 1 << 62
        else:
            cycles = max(1, int(duration_s * _cycles_per_second(torch)))
        torch.cuda._sleep(cycles)


def _cycles_per_second(torch: Any) -> float:
    """Calibrates ``torch.cuda._sleep``'s cycles against CUDA events (about 10 ms of GPU time)."""
    probe = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    return float(probe / max(start.elapsed_time(end) / 1000.0, 1e-6))
