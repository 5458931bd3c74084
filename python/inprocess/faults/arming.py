"""When faults fire: at a step the training loop reports, or on a timer armed at an iteration's start.

An :class:`ArmedFaults` holds the faults a plan schedules for one rank in one
iteration. Step faults fire in the thread that calls :meth:`maybe_inject`.
Timed faults wait in one timer thread; when one is due, the timer

* does it itself when it acts on the whole process (signals, exits, the
  GIL-held hang, which stops every thread by holding the GIL, the GPU faults);
* hands ``exception`` and ``hang`` to the main thread, which runs the
  training code: it queues the action and sends the main thread
  :data:`DELIVERY_SIGNAL`, whose handler runs it. A signal, not
  ``PyThreadState_SetAsyncExc``, so that a main thread in ``time.sleep`` or a
  lock wait is reached at once (the handler's exception ends the wait).

Every fault fires at most once per process for each plan entry and iteration.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from .. import calls
from ..environment import env_int
from ..state import FrozenState, Mode
from . import actions, unfired
from .plan import GPU_KINDS, MAIN_THREAD_KINDS, FaultPlan, Kind, ScheduledFault

if TYPE_CHECKING:
    from typing_extensions import Self


class CallWrapper(Protocol):
    """What the fault injector reads of an :class:`inprocess.CallWrapper`."""

    @property
    def iteration(self) -> int: ...
    @property
    def frozen_state(self) -> FrozenState: ...

log = logging.getLogger("inprocess.faults")

ENV_VAR = "INPROCESS_FAULTS"

# SIGRTMIN+5 is the restart's interrupt (inprocess.engine.interrupt); SIGUSR1/2 belong to schedulers and users.
DELIVERY_SIGNAL = signal.SIGRTMIN + 6

# (plan text, entry index, iteration) of every fault fired in this process. dict.setdefault
# is one atomic step under the GIL, so a signal handler may use it without a lock.
_fired: dict[tuple[str, int, int], object] = {}
_current: ArmedFaults | None = None
_plan_cache: dict[str, FaultPlan] = {}
# The step faults of the last (plan, rank, world size, iteration, active) maybe_inject scheduled unarmed.
_unarmed_steps: dict[tuple[FaultPlan, int, int, int, bool], dict[int, list[ScheduledFault]]] = {}


class _MainThreadDelivery:
    """Runs actions in the main thread on behalf of timer threads.

    The handler is installed while an arming needs it. It goes back only when
    no arming needs it and no signal is on its way: a pending real-time signal
    that met the default disposition would kill the process. The handler
    takes no lock (the main thread may hold one when it runs).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0  # changed by the main thread only
        self._queue: list[Callable[[], None]] = []
        self._previous: Any = None
        self._installed = False

    def acquire(self) -> None:
        """Main thread: an arming will deliver through the handler."""
        with self._lock:
            if not self._installed:
                self._previous = signal.signal(DELIVERY_SIGNAL, self._on_signal)
                self._installed = True
            self._users += 1

    def release(self) -> None:
        """Main thread, outside the handler, after the arming's timer stopped: an arming is done with it."""
        self._users -= 1
        with self._lock:
            if not self._installed or self._users > 0 or self._queue:
                return  # still needed, or a queued action's signal has not been handled yet
            # With the signal blocked, one that was sent and not yet delivered shows as pending.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {DELIVERY_SIGNAL})
            try:
                if DELIVERY_SIGNAL not in signal.sigpending():
                    signal.signal(DELIVERY_SIGNAL, self._previous)
                    self._previous = None
                    self._installed = False
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    @property
    def installed(self) -> bool:
        return self._installed

    def send(self, action: Callable[[], None]) -> bool:
        """Any thread: queue ``action`` for the main thread and signal it. False if no handler is installed."""
        main = threading.main_thread().ident
        assert main is not None
        with self._lock:
            if not self._installed:
                return False
            self._queue.append(action)
            signal.pthread_kill(main, DELIVERY_SIGNAL)
        return True

    def drop_user(self) -> None:
        """Main thread, in the handler: a persistent arming is done; the next release may put the handler back."""
        self._users -= 1

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Several signals may reach Python as one call: run everything queued.
        while self._queue:
            self._queue.pop(0)()


_delivery = _MainThreadDelivery()


class ArmedFaults:
    """The faults ``plan`` schedules for initial ``rank`` in ``iteration``, armed.

    Step faults fire through :meth:`maybe_inject`; timed ones count from the
    moment of arming. A context manager: leaving it disarms (the timer
    thread stops, the delivery handler goes back). ``active=False`` (a spare,
    which runs no training code) skips the faults that act in the main thread.
    ``persistent`` armings are never disarmed (NVRx's ``inject_fault``): their
    timer is a daemon. ``key`` replaces the plan's text in the fire-once record.
    """

    def __init__(
        self,
        plan: FaultPlan | None,
        rank: int,
        world_size: int,
        iteration: int,
        active: bool = True,
        callback: Callable[[], Any] | None = None,
        persistent: bool = False,
        key: str | None = None,
    ):
        self.plan = plan
        self.rank = rank
        self.iteration = iteration
        # What "fires once per process" counts by: the plan's text, unless the caller names the arming.
        self._plan_key = key if key is not None else (str(plan) if plan is not None else "")
        self._callback = callback
        self._persistent = persistent
        self._cancelled = threading.Event()
        self._timer: threading.Thread | None = None
        self._uses_delivery = False
        self._armed_at = time.monotonic()
        self._active = active
        self._ended = False
        scheduled = [] if plan is None else plan.schedule(rank, world_size, iteration)
        if not active:
            skipped = [f for f in scheduled if f.spec.kind in MAIN_THREAD_KINDS]
            for f in skipped:
                log.info("initial rank %d is a spare in iteration %d: %s not injected (no training code runs)",
                         rank, iteration, f.spec)
            scheduled = [f for f in scheduled if f.spec.kind not in MAIN_THREAD_KINDS]
        self._cuda_device: int | None = None
        gpu = [f.spec.kind for f in scheduled if f.spec.kind in GPU_KINDS]
        if gpu:
            self._cuda_device = actions.cuda_device_for(gpu[0])  # FaultUnavailable without CUDA
        self._at_step: dict[int, list[ScheduledFault]] = {}
        for f in scheduled:
            if f.step is not None:
                self._at_step.setdefault(f.step, []).append(f)
        self._timed = sorted((f for f in scheduled if f.delay_s is not None), key=lambda f: (f.delay_s, f.index))
        self._target_thread = threading.get_ident()
        # Fixed here: the timer reads it without a lock.
        self._deliver_by_signal = threading.current_thread() is threading.main_thread()
        if any(f.spec.kind in MAIN_THREAD_KINDS for f in self._timed):
            if self._deliver_by_signal:
                _delivery.acquire()
                self._uses_delivery = True
            elif any(f.spec.kind is Kind.HANG for f in self._timed):
                raise actions.FaultUnavailable(
                    "a timed hang makes the main thread sleep through a signal handler: arm it in the main thread")
        if self._timed:
            self._timer = threading.Thread(target=self._run_timer, name="inprocess-faults-timer", daemon=True)
            self._timer.start()

    @property
    def scheduled(self) -> list[ScheduledFault]:
        return [f for fs in self._at_step.values() for f in fs] + list(self._timed)

    def maybe_inject(self, step: int) -> None:
        """Fire, in this thread, the faults due at ``step`` (each once)."""
        unfired.step_reported(self.iteration, step)
        for f in self._at_step.get(step, ()):
            self._fire(f)

    def disarm(self) -> None:
        """No timed fault of this arming fires after this returns. Call it from the arming thread."""
        global _current
        self._cancelled.set()
        if self._timer is not None and self._timer is not threading.current_thread():
            # The timer wakes at once unless it is doing a fault (a bounded gil_hang, a GPU call).
            self._timer.join(timeout=10.0)
            if self._timer.is_alive():
                log.warning("inprocess.faults: the timer thread is still busy with a fault after 10s")
        if self._uses_delivery:
            self._uses_delivery = False
            _delivery.release()
        if _current is self:
            _current = None
        if not self._ended and self.plan is not None and not self._persistent:
            self._ended = True
            step_faults = [f for fs in self._at_step.values() for f in fs]
            unfired.iteration_ended(self.iteration, time.monotonic() - self._armed_at, self._active, step_faults)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()

    # -- firing ---------------------------------------------------------------

    def _fire(self, f: ScheduledFault) -> None:
        fire(f, self._plan_key, self.rank, self._callback, self._cuda_device)

    def _run_timer(self) -> None:
        for f in self._timed:
            assert f.delay_s is not None
            if self._cancelled.wait(max(0.0, self._armed_at + f.delay_s - time.monotonic())):
                return
            try:
                if f.spec.kind in MAIN_THREAD_KINDS:
                    self._hand_to_main_thread(f)
                else:
                    self._fire(f)
            except Exception:
                log.exception("inprocess.faults: injecting %s failed in the timer thread", f.spec)

    def _hand_to_main_thread(self, f: ScheduledFault) -> None:
        if self._deliver_by_signal:
            def action() -> None:
                if self._persistent:
                    _delivery.drop_user()
                if not self._cancelled.is_set():
                    self._fire(f)

            _delivery.send(action)
            return
        # Armed outside the main thread: only an exception can be delivered, at
        # the thread's next bytecode (a blocking call is not interrupted).
        assert f.spec.kind is Kind.EXCEPTION
        if not self._cancelled.is_set():
            raise_in_thread(self._target_thread, actions.InjectedException)


def fire(
    f: ScheduledFault,
    plan_key: str,
    rank: int,
    callback: Callable[[], Any] | None = None,
    cuda_device: int | None = None,
) -> None:
    """Perform ``f`` in this thread, unless it fired already in this process."""
    token = object()
    if _fired.setdefault((plan_key, f.index, f.iteration), token) is not token:
        return
    unfired.fired.add((plan_key, f.index))
    if f.step is not None:
        when = f"step {f.step}"
    elif f.delay_s is not None:
        when = f"{f.delay_s:g}s after arming"
    else:
        when = f"entering phase {f.spec.phase}"
    message = f"injected fault: {f.spec.kind.value} on initial rank {rank}, iteration {f.iteration}, {when}"
    log.warning("%s (entry %d: %s)", message, f.index + 1, f.spec)
    for handler in logging.getLogger().handlers + log.handlers:
        handler.flush()  # the fault may end the process, which then flushes nothing
    if callback is not None:
        callback()
    duration = None if f.spec.for_ms is None else f.spec.for_ms / 1000.0
    code = 1 if f.spec.code is None else f.spec.code
    actions.perform(f.spec.kind, message, code=code, duration_s=duration, cuda_device=cuda_device)


def raise_in_thread(thread_id: int, exc_type: type[BaseException]) -> None:
    """Raise ``exc_type`` in another thread at its next bytecode (``PyThreadState_SetAsyncExc``)."""
    import ctypes

    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
    set_async_exc.restype = ctypes.c_int
    if set_async_exc(thread_id, exc_type) > 1:  # pragma: no cover - only with a corrupt thread id
        set_async_exc(thread_id, None)
        raise SystemError(f"PyThreadState_SetAsyncExc reached several threads for id {thread_id}")


# -- entry points ------------------------------------------------------------


def plan_from_environment(environ: Mapping[str, str] | None = None) -> FaultPlan | None:
    """The plan in ``INPROCESS_FAULTS`` (None if unset or blank); ValueError naming a malformed part."""
    text = (os.environ if environ is None else environ).get(ENV_VAR)
    if text is None or not text.strip():
        return None
    plan = _plan_cache.get(text)
    if plan is None:
        plan = FaultPlan.parse(text, ENV_VAR)
        _plan_cache.clear()
        _plan_cache[text] = plan
    return plan


def arm(
    plan: FaultPlan | None,
    rank: int,
    world_size: int,
    iteration: int,
    active: bool = True,
    callback: Callable[[], Any] | None = None,
) -> ArmedFaults:
    """Arm ``plan`` for one rank and iteration; the result is what :func:`maybe_inject` uses until disarmed."""
    global _current
    armed = ArmedFaults(plan, rank, world_size, iteration, active=active, callback=callback)
    _current = armed
    return armed


def arm_from_environment(state: FrozenState, environ: Mapping[str, str] | None = None) -> ArmedFaults:
    """Arm ``INPROCESS_FAULTS`` for the iteration ``state`` describes; disarm (leave the ``with``) when it ends.

    Call it in the thread that runs the training code, when the iteration
    starts: timed faults count from here. With the variable unset it arms
    nothing (one environment lookup). Raises ValueError for a malformed plan
    or a rank outside the job, FaultUnavailable for a GPU fault due on a rank
    without CUDA.
    """
    plan = plan_from_environment(environ)
    return arm(plan, state.initial_rank, state.initial_world_size, state.iteration,
               active=state.mode == Mode.ACTIVE)


def maybe_inject(step: object, call_wrapper: CallWrapper | None = None) -> None:
    """Call once per training step: fires the faults ``INPROCESS_FAULTS`` schedules for ``step`` on this rank.

    Does nothing (one environment lookup) when the variable is unset. The
    faults are those of the current arming (:func:`arm_from_environment`),
    else the plan is scheduled for ``call_wrapper``'s rank and iteration (or
    the running wrapped call's), else for ``RANK`` and ``WORLD_SIZE`` at
    iteration 0.
    """
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r}: expected a non-negative integer")
    armed = _current
    if armed is not None and (call_wrapper is None or call_wrapper.iteration == armed.iteration):
        armed.maybe_inject(step)
        return
    plan = plan_from_environment()
    if plan is None:
        return
    where = _whereabouts(call_wrapper)
    key = (plan,) + where
    due = _unarmed_steps.get(key)
    if due is None:
        rank, world_size, iteration, active = where
        due = {}
        for f in plan.schedule(rank, world_size, iteration):
            if f.step is not None and (active or f.spec.kind not in MAIN_THREAD_KINDS):
                due.setdefault(f.step, []).append(f)
        _unarmed_steps.clear()
        _unarmed_steps[key] = due
    unfired.step_reported(where[2], step)
    for f in due.get(step, ()):
        fire(f, str(plan), where[0])


def report_unfired(rank: int, world_size: int, last_iteration: int) -> list[str]:
    """At the end of a wrapped call on initial ``rank``: a WARNING for each entry of ``INPROCESS_FAULTS``
    due on it that never fired, with the reason (:mod:`inprocess.faults.unfired`); the messages."""
    try:
        return unfired.report_unfired(plan_from_environment(), rank, world_size, last_iteration)
    except Exception as e:  # never in the way of the call's own outcome
        log.warning("inprocess.faults: could not tell which faults fired: %s: %s", type(e).__name__, e)
        return []


def _whereabouts(call_wrapper: CallWrapper | None) -> tuple[int, int, int, bool]:
    if call_wrapper is None:
        call_wrapper = calls.current_call()
    if call_wrapper is not None:
        s = call_wrapper.frozen_state
        return s.initial_rank, s.initial_world_size, s.iteration, s.mode == Mode.ACTIVE
    return env_int("RANK", 0), env_int("WORLD_SIZE", 1), 0, True


