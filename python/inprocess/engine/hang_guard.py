"""Which hang timeouts apply in which phase of a rank, as its heartbeat page tells the
native watchdog (soft timeout, in the rank) and the monitor's guard (hard timeout).

* **The function** (``initialize``, the health check before an iteration, the
  function itself; a spare's wait): the soft and the hard timeout, from the
  iteration's start. Progress is automatic (the main thread ran Python
  bytecode) and manual (``ping()``, once called in the iteration).
* **A restart's abort, finalize and health check**: the hard timeout only, its
  clock restarted at each phase's entry, automatic progress only (``ping()``
  is the training's clock). A hook that never returns, holding the GIL or not
  (a finalize blocked on a dead file system, a lock nobody releases), gets its
  rank killed by its monitor within ``hard_timeout`` + ``termination_grace_time``
  and counted out, as a hang in training would; the other ranks wait for it at
  the barrier, and ``hard_timeout`` + ``termination_grace_time`` <
  ``barrier_timeout`` lets them go on without it. No soft timeout there: the
  job is restarting already. The abort runs on the restart trigger's thread
  while the main thread waits for it, so the abort as a whole gets one
  ``hard_timeout``.
* **The leader's decision** (the rank assignment, a user's hook among them, run
  inside a barrier): the hard timeout only, from the decision's start, as in a
  restart phase. A leader killed there is counted out by its monitor, and
  another rank takes the lead over (``control/leadership.py``).
* **The restart barrier**: the hard timeout only, while a thread of the rank
  stamps its automatic progress every :data:`STAMP_EVERY_S` (at most a quarter
  of ``hard_timeout``). A rank that waits there for a slow peer, blocked in a
  store call with the GIL released, is alive and stamps; a rank frozen on its
  way in or while it waits (SIGSTOP by a debugger or a cgroup freezer, a C call
  that holds the GIL) stamps nothing: its monitor kills it at ``hard_timeout`` +
  ``termination_grace_time`` and counts it out, and the barrier goes on without
  it, well before ``barrier_timeout``. The stamps stop while the leader decides
  (:meth:`HangGuard.deciding`): there the main thread's own progress counts.
* **Every other phase** (the initial barrier, the wait for completion, leaving):
  none. Those waits are the engine's own, each bounded by its own timeout.

Which phase has which rule is the phase table's column ``hang_rule``
(``control/phases.py``); this module applies it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from .. import _native
from ..control import phases
from ..control.phases import HangRule

STAMP_EVERY_S = 0.5


class _Stamper:
    """Stamps a page's automatic progress every ``every_s`` from a thread of its own until stopped.

    Each stamp takes the GIL: a process whose GIL a C call holds, or that is stopped, stamps nothing.
    """

    def __init__(self, page: _native.HeartbeatPage, every_s: float):
        self._page = page
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="inprocess-waiting-alive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self._page.stamp_auto()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class HangGuard:
    """The one Python writer of a rank's heartbeat page: its phase, timeouts, flags and progress.

    (The native watchdog's automatic-progress stamp, run as a pending call in
    the main thread, and the stamps of a phase whose rule is HARD_WHILE_WAITING,
    run by this guard's thread, are the page's other writes; the monitor only reads it.)
    """

    def __init__(self, page: _native.HeartbeatPage, soft_timeout_s: float, hard_timeout_s: float):
        self.page = page
        self.soft_ns = int(soft_timeout_s * 1e9)
        self.hard_ns = int(hard_timeout_s * 1e9)
        page.set_timeouts(self.soft_ns, self.hard_ns)
        page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)
        self.ping = page.ping  # manual progress (CallWrapper.ping): the page's own method, no call in between
        self.stamp_progress = page.stamp_auto  # automatic progress, stamped by a waiting spare
        self.begin_iteration = page.begin_iteration  # the iteration and world size a decision starts
        self.stamp_every_s = min(STAMP_EVERY_S, hard_timeout_s / 4)
        self._stamper: _Stamper | None = None  # while the phase's rule is HARD_WHILE_WAITING

    def close(self) -> None:
        """Stop the stamps, if any (at every change of rule, and before the page goes)."""
        stamper, self._stamper = self._stamper, None
        if stamper is not None:
            stamper.stop()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Both timeouts off while the block runs (CallWrapper.disable_hang_protection), re-armed after."""
        page = self.page
        page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)
        try:
            yield
        finally:
            # Re-arm from now: the time spent inside the block does not count.
            page.stamp_auto()
            if page.snapshot().flags & _native.FLAG_MANUAL_ARMED:
                page.ping()
            page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, False)

    @contextlib.contextmanager
    def training(self, iteration: int, world_size: int) -> Iterator[None]:
        """Both timeouts, from now, while the block runs (the function, or a spare's wait)."""
        self.close()
        page = self.page
        page.set_timeouts(self.soft_ns, self.hard_ns)
        page.begin_iteration(iteration, world_size)  # restamps both clocks, disarms ping()'s
        page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, False)
        try:
            yield
        finally:
            page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)

    def enter(self, phase: _native.Phase) -> None:
        """The rank enters ``phase``: publish it, and apply what its phase's rule says."""
        self.close()
        page = self.page
        rule = phases.row(phase).hang_rule
        if rule is HangRule.HARD_ONLY or rule is HangRule.HARD_WHILE_WAITING:
            self._hard_timeout_only(phase)
            if rule is HangRule.HARD_WHILE_WAITING:
                self._stamper = _Stamper(self.page, self.stamp_every_s)
            return
        # NONE, and SOFT_AND_HARD: those timeouts are armed by training() around the run, not at the entry.
        page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)
        page.set_phase(phase)

    @contextlib.contextmanager
    def deciding(self) -> Iterator[None]:
        """The hard timeout only, from now, while the leader decides (in a barrier's phase), on the
        main thread's own progress; then the barrier's rule again."""
        self.close()
        self._hard_timeout_only(None)
        try:
            yield
        finally:
            phase = self.page.snapshot().phase  # the barrier's: its rule again
            if phases.row(phase).hang_rule is HangRule.HARD_WHILE_WAITING:
                self.enter(phase)
            else:
                self.page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)

    def _hard_timeout_only(self, phase: _native.Phase | None) -> None:
        # Published before the flag is cleared (the guard reads the flag with acquire):
        # no soft timeout, ping()'s clock disarmed, automatic progress stamped now.
        page = self.page
        page.set_timeouts(0, self.hard_ns)
        page.set_flag(_native.FLAG_MANUAL_ARMED, False)
        page.stamp_auto()
        if phase is not None:
            page.set_phase(phase)
        page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, False)

    def off(self) -> None:
        """The rank leaves the job: its way out is bounded by the engine's own timeouts."""
        self.close()
        self.page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)
