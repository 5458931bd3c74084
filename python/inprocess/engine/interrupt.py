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
  gets there first raises, the other does nothing;
* never on top of what the function raised: ``running()`` lets that
  exception out as it is (the engine then knows the restart was fired). The
  handler may still raise while another exception unwinds through the
  function (Python runs the handlers of a SIGINT and of this signal one
  after the other), so the engine looks for a Ctrl-C in the context of a
  RankShouldRestart (:func:`interrupted_by`).
"""

from __future__ import annotations

import ctypes
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from ..exception import RankShouldRestart, RestartAbort

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

    def running(self) -> _Running:
        """Marks the main thread as inside the wrapped function (a context manager)."""
        return _Running(self)

    def _enter_fn(self) -> None:
        with self.lock:
            self._in_fn = True
            self.outside_fn.clear()
            if self._fired:
                self._in_fn = False
                self.outside_fn.set()
                self._delivered = True
                raise RankShouldRestart(self._reason)

    def _leave_fn(self) -> bool:
        """The main thread leaves the function; True if a fire is pending (not delivered yet)."""
        with self.lock:
            self._in_fn = False
            self.outside_fn.set()
            pending = self._fired and not self._delivered
            self._delivered = self._delivered or self._fired
            if not self._use_signal and self._fired:
                self._clear_async()
        return pending

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes; it must not take the lock
        # (the main thread may hold it). Reading plain attributes is atomic.
        if self._in_fn and self._fired and not self._delivered and not _held_back(frame):
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

    def _set_async(self, exc: type | None) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(
            ctypes.c_ulong(self._thread_id), ctypes.py_object(exc) if exc is not None else None
        )

    def _clear_async(self) -> None:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._thread_id), None)


class _Running:
    """``with interrupter.running():`` A class, not a generator: its own frames are few and
    known, so that the handler never raises inside them (:func:`_held_back`)."""

    def __init__(self, interrupter: MainThreadInterrupter):
        self._interrupter = interrupter

    def __enter__(self) -> None:
        self._interrupter._enter_fn()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        # What the function raised goes on as it is: a RankShouldRestart raised on top
        # would hide it (a KeyboardInterrupt that came out together with the restart's
        # signal must still end the rank). The engine knows the restart was fired.
        if self._interrupter._leave_fn() and exc_type is None:
            raise RankShouldRestart(self._interrupter._reason)


# The interrupter's own code between the function's end and the moment it says so
# (_in_fn False): an exception raised by the handler there would skip that moment, and
# the trigger would wait for a main thread that it believes is still inside.
_OWN_CODE = frozenset({_Running.__enter__.__code__, _Running.__exit__.__code__,
                       MainThreadInterrupter._enter_fn.__code__, MainThreadInterrupter._leave_fn.__code__})


def _held_back(frame: FrameType | None) -> bool:
    """The handler must not raise here: an import runs (a module cut in the middle stays
    broken), or the interrupter's own code does. The trigger sends the signal again."""
    return _importing(frame) or _in_own_code(frame)


def _in_own_code(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code in _OWN_CODE:
            return True
        frame = frame.f_back
    return False


def _importing(frame: FrameType | None) -> bool:
    """True when ``frame`` or a caller of it is importlib's machinery running a module's code."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
            return True
        frame = frame.f_back
    return False


# What ends a rank when it comes out of the function (the rule for "anywhere"). GeneratorExit and
# asyncio's CancelledError are BaseExceptions too, but they unwind a generator or a task being
# closed, not the rank: a restart raised during such a cleanup is a restart.
LEAVING = (KeyboardInterrupt, SystemExit, RestartAbort)


def interrupted_by(restart: RankShouldRestart) -> BaseException | None:
    """The KeyboardInterrupt, SystemExit or RestartAbort that ``restart`` was raised on top
    of (in its context), or None. The rank leaves with that one, as if the restart had
    not come: it is what the function raised first."""
    seen = {id(restart)}
    e = restart.__context__
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, LEAVING):
            return e
        e = e.__cause__ or e.__context__
    return None
