"""Delivering :class:`RankShouldRestart` into the main thread, and only there.

The restart trigger runs in another thread; the main thread may be anywhere:
in the user's function, inside ``CallWrapper.atomic()``, in a blocking call,
or already back in the engine. The rules:

* the exception is raised only while the main thread is inside the wrapped
  function (``running()``), never in the engine's own code;
* never inside ``atomic()``: :meth:`fire` takes the same lock, so it waits for
  the atomic block to end (a real lock, no spinning);
* a blocking call is interrupted: a real-time signal is sent to the main
  thread, whose handler raises (``time.sleep`` and ``Lock.acquire`` return
  early on a signal). Outside the main interpreter thread, where Python runs
  no signal handlers, ``PyThreadState_SetAsyncExc`` is used instead;
* never inside an import: a module half-initialised by an exception stays
  broken in ``sys.modules`` for every later iteration (DDP's first use imports
  ``torch._dynamo`` and sympy, for a second or more). The handler lets the
  import finish; the trigger thread sends the signal again (:meth:`nudge`)
  until the exception is delivered;
* exactly once per fire: whichever of the handler and ``running()``'s exit
  gets there first raises, the other does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
from types import FrameType
from typing import Any, Iterator, Optional

from ..exception import RankShouldRestart

# A real-time signal: SIGUSR1/SIGUSR2 are often taken by schedulers (SLURM's
# --signal) and training scripts for checkpoint-on-preemption.
INTERRUPT_SIGNAL = signal.SIGRTMIN + 5


class MainThreadInterrupter:
    def __init__(self) -> None:
        self.lock = threading.Lock()  # also the lock of CallWrapper.atomic()
        self._in_fn = False
        self._fired = False
        self._delivered = False
        self._reason = ""
        self._thread_id = threading.get_ident()
        self.outside_fn = threading.Event()  # set while the main thread is not in the function
        self.outside_fn.set()
        self._use_signal = threading.current_thread() is threading.main_thread()
        self._previous_handler: Any = None

    # -- lifecycle ------------------------------------------------------------

    def install(self) -> None:
        if self._use_signal:
            self._previous_handler = signal.signal(INTERRUPT_SIGNAL, self._on_signal)

    def uninstall(self) -> None:
        if self._use_signal and self._previous_handler is not None:
            signal.signal(INTERRUPT_SIGNAL, self._previous_handler)
            self._previous_handler = None

    def reset(self) -> None:
        """Start of an iteration: forget the previous fire."""
        with self.lock:
            self._fired = False
            self._delivered = False
            self._reason = ""

    @property
    def fired(self) -> bool:
        return self._fired

    # -- the main thread ------------------------------------------------------

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Marks the main thread as inside the wrapped function."""
        with self.lock:
            self._in_fn = True
            self.outside_fn.clear()
            if self._fired:
                self._in_fn = False
                self.outside_fn.set()
                self._delivered = True
                raise RankShouldRestart(self._reason)
        try:
            yield
        finally:
            with self.lock:
                self._in_fn = False
                self.outside_fn.set()
                pending = self._fired and not self._delivered
                self._delivered = self._delivered or self._fired
                if not self._use_signal and self._fired:
                    self._clear_async()
            if pending:
                raise RankShouldRestart(self._reason)

    def _on_signal(self, signum: int, frame: Optional[FrameType]) -> None:
        # Runs in the main thread between bytecodes; it must not take the lock
        # (the main thread may hold it). Reading plain attributes is atomic.
        if self._in_fn and self._fired and not self._delivered and not _importing(frame):
            self._delivered = True
            raise RankShouldRestart(self._reason)

    @property
    def pending(self) -> bool:
        """Fired while the main thread is inside the function, and not delivered yet."""
        return self._in_fn and self._fired and not self._delivered

    def nudge(self) -> None:
        """Send the signal again while the exception is pending (an import held it back)."""
        with self.lock:
            if self._use_signal and self.pending:
                signal.pthread_kill(self._thread_id, INTERRUPT_SIGNAL)

    # -- the trigger thread ---------------------------------------------------

    def fire(self, reason: str) -> bool:
        """Request the exception; returns True if the main thread was inside the function."""
        with self.lock:
            self._fired = True
            self._reason = reason
            if not self._in_fn:
                return False
            if self._use_signal:
                signal.pthread_kill(self._thread_id, INTERRUPT_SIGNAL)
            else:
                self._set_async(RankShouldRestart)
            return True

    def _set_async(self, exc: Optional[type]) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(self._thread_id), ctypes.py_object(exc) if exc is not None else None
        )

    def _clear_async(self) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)


def _importing(frame: Optional[FrameType]) -> bool:
    """True when ``frame`` or a caller of it is importlib's machinery running a module's code."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False
