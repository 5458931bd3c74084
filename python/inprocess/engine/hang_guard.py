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
* **Every other phase** (the barriers, the wait for completion, leaving): none.
  Those waits are the engine's own, each bounded by its own timeout, and a rank
  waiting at a barrier for a slow peer is not hung.

Which phase has which rule is the phase table's column ``hang_rule``
(``control/phases.py``); this module applies it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .. import _native
from ..control import phases
from ..control.phases import HangRule


class HangGuard:
    """The one Python writer of a rank's heartbeat page: its phase, timeouts, flags and progress.

    (The native watchdog's automatic-progress stamp, run as a pending call in
    the main thread, is the page's only other writer; the monitor only reads it.)
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
        page = self.page
        if phases.row(phase).hang_rule is HangRule.HARD_ONLY:
            self._hard_timeout_only(phase)
            return
        # NONE, and SOFT_AND_HARD: those timeouts are armed by training() around the run, not at the entry.
        page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)
        page.set_phase(phase)

    @contextlib.contextmanager
    def deciding(self) -> Iterator[None]:
        """The hard timeout only, from now, while the leader decides (in a barrier's phase)."""
        self._hard_timeout_only(None)
        try:
            yield
        finally:
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
        self.page.set_flag(_native.FLAG_HANG_PROTECTION_OFF, True)
