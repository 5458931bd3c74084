"""The wrapped call running in this process, if any: the one registry of the process.

:func:`current_call` is public (``inprocess.current_call``); the wrapper
registers a call when it starts and forgets it when it ends. Code that must not
import the engine (the fault injector) asks here. This module imports nothing of
the package.
"""

from __future__ import annotations

import threading
from typing import Any

_lock = threading.Lock()
_current: Any | None = None  # an inprocess.CallWrapper
_started = 0


def current_call() -> Any | None:
    """The :class:`inprocess.CallWrapper` of the wrapped call running in this process, if any.

    Use it where the function cannot take a ``CallWrapper`` parameter (behind
    ``*args, **kwargs`` adapters, decorators, or deep inside a training loop).
    """
    return _current


def register(call: Any) -> int:
    """``call`` is the process's running call from now on; returns its index (0 for the first
    call of the process). Raises RuntimeError while another call runs."""
    global _current, _started
    with _lock:
        if _current is not None:
            raise RuntimeError("inprocess.Wrapper: a wrapped call is already running in this process")
        _current = call
        index = _started
        _started += 1
    return index


def forget(call: Any) -> None:
    """``call`` has ended (nothing happens if another call is registered)."""
    global _current
    with _lock:
        if _current is call:
            _current = None
