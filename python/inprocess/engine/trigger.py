"""The restart trigger: one thread per rank that blocks on the iteration's event key.

When the key says "restart" (set by whichever rank or monitor saw a fault
first) the trigger interrupts the main thread and runs the ``abort`` hook,
which releases a main thread blocked in a collective. Nothing here polls: the
store wakes the thread (design principle 2).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from ..control.protocol import RESTART, RestartProtocol
from ..exits import EXIT_CODE_UNRELEASABLE
from .interrupt import MainThreadInterrupter

__all__ = ["EXIT_CODE_UNRELEASABLE", "IterationOutcome", "RestartTrigger"]

log = logging.getLogger("inprocess")


# How often the trigger re-sends the interrupt that an import held back.
NUDGE_S = 0.02

class IterationOutcome:
    """What the trigger saw for one iteration, for the main thread to collect."""

    def __init__(self, iteration: int):
        self.iteration = iteration
        self.event: str | None = None
        self.detected_ns = 0  # when the trigger woke (CLOCK_MONOTONIC)
        self.aborted_ns = 0
        self.abort_error: BaseException | None = None
        self.done = threading.Event()  # set once the outcome is known and, on restart, the abort ran
        # An active rank runs the function: until its main thread counts it
        # completed, the event can only be "restart" (see RestartProtocol.wait_event).
        self.active = False
        self.completing = False

    def only_restart(self) -> bool:
        return self.active and not self.completing


class RestartTrigger:
    def __init__(
        self,
        protocol: RestartProtocol,
        interrupter: MainThreadInterrupter,
        release_main_thread: Callable[[], None],
        release_timeout: float,
        leave: Callable[[int], None],
    ):
        self._protocol = protocol
        self._interrupter = interrupter
        self._release_main_thread = release_main_thread
        self._release_timeout = release_timeout
        self._leave = leave
        self._cond = threading.Condition()
        self._armed: IterationOutcome | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="inprocess-restart-trigger", daemon=True)
        self._thread.start()

    def arm(self, iteration: int, active: bool = False) -> IterationOutcome:
        outcome = IterationOutcome(iteration)
        outcome.active = active
        with self._cond:
            if self._armed is not None and not self._armed.done.is_set():
                raise RuntimeError(f"trigger armed for iteration {iteration} while {self._armed.iteration} is open")
            self._armed = outcome
            self._cond.notify()
        return outcome

    def stop(self, timeout: float = 1.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _next(self) -> IterationOutcome | None:
        with self._cond:
            while self._armed is None and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            outcome, self._armed = self._armed, None
            return outcome

    def _loop(self) -> None:
        while True:
            outcome = self._next()
            if outcome is None:
                return
            try:
                outcome.event = self._protocol.wait_event(
                    outcome.iteration, None, cancelled=lambda: self._stopping, only_restart=outcome.only_restart
                )
            except BaseException as e:  # store gone, or stopping: the main thread decides
                log.debug("restart trigger stopped waiting on iteration %d: %s", outcome.iteration, e)
                outcome.abort_error = e
                outcome.done.set()
                if self._stopping:
                    return
                continue
            outcome.detected_ns = time.monotonic_ns()
            log.debug("iteration %d: event %s", outcome.iteration, outcome.event)
            if self._stopping:
                # The rank is leaving (or the call is over): a restart it asked for
                # on its way out is for the others to act on, not for this rank.
                outcome.done.set()
                return
            if outcome.event == RESTART:
                self._interrupter.fire(f"iteration {outcome.iteration} restarts")
                try:
                    self._release_main_thread()
                except BaseException as e:
                    outcome.abort_error = e
                outcome.aborted_ns = time.monotonic_ns()
                log.debug("iteration %d: abort done (%.1f ms)", outcome.iteration,
                          (outcome.aborted_ns - outcome.detected_ns) / 1e6)
                outcome.done.set()
                self._escalate_if_stuck(outcome.iteration)
                continue
            outcome.done.set()

    def _escalate_if_stuck(self, iteration: int) -> None:
        """A main thread still inside the function after the abort cannot be
        trusted with the job: the rank leaves it, and the process exits."""
        deadline = time.monotonic() + self._release_timeout
        while not self._interrupter.outside_fn.wait(min(NUDGE_S, max(deadline - time.monotonic(), 0.0))):
            if time.monotonic() >= deadline:
                break
            self._interrupter.nudge()  # an import held the exception back: try again once it is done
        else:
            return
        log.error(
            "iteration %d: the main thread did not return within %.0fs of the abort; "
            "this rank leaves the job (exit code %d)", iteration, self._release_timeout, EXIT_CODE_UNRELEASABLE,
        )
        try:
            self._leave(iteration)
        finally:
            os._exit(EXIT_CODE_UNRELEASABLE)
