"""The phase table: every phase a rank goes through in a wrapped call, in order, with its rules.

A rank's phase is written on its heartbeat page as the native enum
:class:`inprocess._native.Phase` (those are the wire values, read by the
rank's monitor from outside the process). Everything the Python side needs to
know about a phase is one row here, and every place that treats phases
differently reads its list from this table:

* the executor (``engine/recovery.py``) enters phases by their native value, and runs a
  restart as one step per row, in the table's order;
* the hang guard (``engine/hang_guard.py``) applies the row's :class:`HangRule`;
* the monitor (``processes/monitor.py``) reads :func:`finished` (a rank that
  died there had left the wrapper: nothing to do) and :func:`counted_in_barrier`
  (a rank that died there may be counted healthy at a barrier not decided yet);
* the fault injector (``faults/``) names a phase by the row's ``fault_name``
  (``phase=NAME`` in ``INPROCESS_FAULTS``);
* the timeline (``timeline/``) draws the phases that are part of a restart.

The order is a call's life: STARTING, INITIAL_BARRIER, then per iteration
RUNNING (the function, or a spare's wait); at a fault ABORTING, FINALIZING,
HEALTH_CHECK, RESTART_BARRIER, and RUNNING again; at the end COMPLETION and
DONE, or TERMINATED from anywhere. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
import enum

from .. import _native

Phase = _native.Phase


class HangRule(enum.Enum):
    """Which hang timeouts apply while a rank is in a phase (``engine/hang_guard.py`` explains why)."""

    NONE = "none"  # the engine's own wait, bounded by its own timeout: no hang detection
    SOFT_AND_HARD = "soft_and_hard"  # both timeouts, armed by HangGuard.training() around the function's run
    HARD_ONLY = "hard_only"  # the hard timeout only, its clock restarted at the phase's entry
    # The hard timeout only, while a thread of the rank stamps its progress: a rank that waits (for
    # its peers, in a blocking store call) is alive; one frozen (SIGSTOP) or held by a C call that
    # keeps the GIL stamps nothing and is killed.
    HARD_WHILE_WAITING = "hard_while_waiting"


@dataclasses.dataclass(frozen=True)
class PhaseRow:
    """One phase: its native value, its place in a call, and the rules that depend on it."""

    phase: _native.Phase  # the value written on the heartbeat page
    order: int  # position in a call's life (a restart goes through its rows in this order)
    in_restart: bool  # part of a restart: from the main thread's return from the failed iteration to the decision
    hang_rule: HangRule
    counted_in_barrier: bool  # a rank that dies here may be counted healthy at a barrier not yet decided
    finished: bool  # the rank left the wrapper and told the store itself: its monitor has nothing to do
    fault_name: str | None  # phase=NAME in INPROCESS_FAULTS, if a fault may be injected on entering it
    fault_when: str  # when a rank enters it, as the fault injector documents it ("" without a fault_name)

    @property
    def name(self) -> str:
        return self.phase.name


def _row(phase: _native.Phase, in_restart: bool = False, hang_rule: HangRule = HangRule.NONE,
         counted_in_barrier: bool = False, finished: bool = False, fault_name: str | None = None,
         fault_when: str = "") -> PhaseRow:
    return PhaseRow(phase, -1, in_restart, hang_rule, counted_in_barrier, finished, fault_name, fault_when)


_IN_ORDER = (
    _row(Phase.STARTING),
    _row(Phase.INITIAL_BARRIER, counted_in_barrier=True, fault_name="entry",
         fault_when="the wrapped call starts, before the initial barrier (iteration 0)"),
    _row(Phase.RUNNING, hang_rule=HangRule.SOFT_AND_HARD, fault_name="initialize",
         fault_when="an iteration starts, before the initialize hook and the health check before it"),
    _row(Phase.ABORTING, in_restart=True, hang_rule=HangRule.HARD_ONLY, fault_name="abort",
         fault_when="the main thread is back from the interrupted iteration; the abort runs meanwhile"),
    _row(Phase.FINALIZING, in_restart=True, hang_rule=HangRule.HARD_ONLY, fault_name="finalize",
         fault_when="the restart's finalize hook is about to run"),
    _row(Phase.HEALTH_CHECK, in_restart=True, hang_rule=HangRule.HARD_ONLY, fault_name="health_check",
         fault_when="the restart's health check is about to run"),
    _row(Phase.RESTART_BARRIER, in_restart=True, hang_rule=HangRule.HARD_WHILE_WAITING, counted_in_barrier=True,
         fault_name="barrier",
         fault_when="the rank arrives at the restart barrier"),
    _row(Phase.COMPLETION),
    _row(Phase.DONE, finished=True),
    _row(Phase.TERMINATED, finished=True),
)

TABLE: tuple[PhaseRow, ...] = tuple(dataclasses.replace(r, order=i) for i, r in enumerate(_IN_ORDER))
_BY_PHASE = {row.phase: row for row in TABLE}


def row(phase: _native.Phase) -> PhaseRow:
    """The row of ``phase``."""
    return _BY_PHASE[phase]


def hard_timeout_only() -> frozenset[_native.Phase]:
    """Phases whose entry arms the hard timeout only (a restart's abort, finalize and health check)."""
    return frozenset(r.phase for r in TABLE if r.hang_rule is HangRule.HARD_ONLY)


def finished() -> frozenset[_native.Phase]:
    """Phases where the rank has left the wrapper and told the store itself."""
    return frozenset(r.phase for r in TABLE if r.finished)


def counted_in_barrier() -> frozenset[_native.Phase]:
    """Phases where a rank that dies may be counted healthy at a barrier whose decision is not out."""
    return frozenset(r.phase for r in TABLE if r.counted_in_barrier)


def restart_rows() -> tuple[PhaseRow, ...]:
    """A restart's rows, in the order a rank goes through them (the executor's steps)."""
    return tuple(r for r in TABLE if r.in_restart)


def restart_phase_names() -> tuple[str, ...]:
    """The names of a restart's phases, in the order a rank goes through them."""
    return tuple(r.name for r in restart_rows())


def fault_names() -> dict[str, str]:
    """``phase=NAME`` names of the wrapper's phases -> when a rank enters each, in order."""
    return {r.fault_name: r.fault_when for r in TABLE if r.fault_name is not None}

