"""``finalize`` hooks: run on every rank after the abort, before the health check."""

from __future__ import annotations

import abc
import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

from .exception import TimeoutError
from .state import FrozenState

log = logging.getLogger("inprocess")


class Finalize(abc.ABC):
    """Releases what the interrupted iteration held (files, caches, threads).

    Any exception raised here terminates this rank: a rank that cannot clean
    up cannot be trusted with the next iteration.
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> FrozenState | None:
        raise NotImplementedError


class ThreadedFinalize(Finalize):
    """Runs ``fn(*args, **kwargs)`` in a helper thread and gives up after ``timeout``.

    As in NVRx: ``fn`` gets the given arguments, not the state (Megatron-LM
    passes a no-argument ``destroy_state`` and ``torch.cuda.empty_cache``);
    where torch sees a CUDA device, the thread first makes this rank's device
    current (``LOCAL_RANK`` modulo the devices torch sees, as every GPU check), so
    that ``fn`` works on the rank's own GPU. Unlike NVRx it also runs on a
    machine without CUDA (there NVRx refuses with ``RuntimeError``).

    A finalizer that hangs raises :class:`~inprocess.exception.TimeoutError`
    (and so terminates this rank) instead of stalling the whole job; one that
    raises terminates the rank with its exception (NVRx drops it, and the
    rank goes on as if ``fn`` had succeeded).
    """

    def __init__(
        self,
        timeout: datetime.timedelta,
        fn: Callable[..., Any],
        args: tuple[Any, ...] | None = (),
        kwargs: dict[str, Any] | None = None,
    ):
        given: object = timeout  # checked at run time: callers are not all type-checked
        if not isinstance(given, datetime.timedelta) or given <= datetime.timedelta(0):
            raise ValueError(f"timeout={timeout!r}: expected a positive datetime.timedelta")
        if not callable(fn):
            raise ValueError(f"fn={fn!r}: expected a callable")
        positional: object = () if args is None else args
        if not isinstance(positional, tuple):
            raise ValueError(f"args={args!r}: expected a tuple of positional arguments for fn")
        keywords: object = {} if kwargs is None else kwargs
        if not isinstance(keywords, dict) or not all(isinstance(k, str) for k in keywords):
            raise ValueError(f"kwargs={kwargs!r}: expected a dict of keyword arguments (str keys) for fn")
        self.timeout = timeout
        self.fn = fn
        self.args: tuple[Any, ...] = positional
        self.kwargs: dict[str, Any] = keywords

    def __call__(self, state: FrozenState) -> FrozenState:
        device = _rank_cuda_device()  # chosen here, in the calling thread, as NVRx does
        error: list[BaseException] = []

        def target() -> None:
            try:
                if device is not None:
                    import torch

                    torch.cuda.set_device(device)
                self.fn(*self.args, **self.kwargs)
            except BaseException as e:  # carried to the calling thread
                error.append(e)

        thread = threading.Thread(target=target, name=f"{type(self).__name__}-{state.rank}", daemon=True)
        thread.start()
        thread.join(self.timeout.total_seconds())
        if thread.is_alive():
            raise TimeoutError(f"finalize {self.fn!r} did not return within {self.timeout.total_seconds():g}s")
        if error:
            raise error[0]
        return state


def _rank_cuda_device() -> int | None:
    """This rank's CUDA device (the rule of :mod:`inprocess.gpu.device`:
    ``LOCAL_RANK`` modulo the devices torch sees); None without CUDA.

    Only asks torch where the rank initialised CUDA already: a finalize hook
    must not create a CUDA context (seconds, and memory) for a rank that
    never used the GPU.
    """
    try:
        import torch
    except ImportError:
        return None
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]
        return None
    from .gpu import device

    try:
        return device.cuda_ordinal(visible=device.torch_visible_devices())
    except ValueError as e:
        log.debug("%s: the finalize thread keeps torch's current device", e)
        return int(torch.cuda.current_device())
