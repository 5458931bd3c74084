"""The phase table (inprocess.control.phases) and what entering each phase does to the heartbeat page.

``test_entering_each_phase_sets_the_page_as_before`` was written against the code before the
table existed (commit 1cbd356, where engine/hang_guard.py kept its own list of restart phases)
and passed there: it pins the hang rule of every phase, so the table cannot change one.
"""

from __future__ import annotations

import threading
import time

import pytest

from inprocess import _native
from inprocess.engine.hang_guard import HangGuard

pytestmark = pytest.mark.timeout(30)

SOFT_S, HARD_S = 3.0, 7.0
SOFT_NS, HARD_NS = int(SOFT_S * 1e9), int(HARD_S * 1e9)

# What HangGuard.enter did for each phase before the table: the hard timeout only, its clock
# restarted, ping()'s clock disarmed, for a restart's abort, finalize and health check; for every
# other phase, protection off and the timeouts left as they were.
HARD_TIMEOUT_ONLY = {"ABORTING", "FINALIZING", "HEALTH_CHECK"}
# Changed on purpose since: the restart barrier has the hard timeout too, its progress stamped by a
# thread of the rank while it waits (a frozen rank there ended the job: test_fault_matrix.py,
# test_a_rank_frozen_at_the_restart_barrier).
STAMPED = {"RESTART_BARRIER"}


@pytest.mark.parametrize("name", list(_native.Phase.__members__))
def test_entering_each_phase_sets_the_page_as_before(name: str) -> None:
    phase = _native.Phase.__members__[name]
    page = _native.HeartbeatPage.create()
    try:
        guard = HangGuard(page, SOFT_S, HARD_S)
        with guard.training(4, 8):
            page.ping()  # ping()'s clock armed, as in a function that pings
            before = page.snapshot()
            assert before.flags & _native.FLAG_MANUAL_ARMED
            assert not before.flags & _native.FLAG_HANG_PROTECTION_OFF
        guard.enter(phase)
        after = page.snapshot()
        assert after.phase == phase
        if name in HARD_TIMEOUT_ONLY | STAMPED:
            assert not after.flags & _native.FLAG_HANG_PROTECTION_OFF
            assert not after.flags & _native.FLAG_MANUAL_ARMED
            assert (after.soft_timeout_ns, after.hard_timeout_ns) == (0, HARD_NS)
            assert after.auto_progress_ns >= before.auto_progress_ns  # its clock restarted at the entry
        else:
            assert after.flags & _native.FLAG_HANG_PROTECTION_OFF
            assert after.flags & _native.FLAG_MANUAL_ARMED  # untouched
            assert (after.soft_timeout_ns, after.hard_timeout_ns) == (SOFT_NS, HARD_NS)
        if name in STAMPED or name == "FINALIZING":  # (a wait each: one phase with stamps, one without)
            time.sleep(3 * guard.stamp_every_s)
            later = page.snapshot().auto_progress_ns
            if name in STAMPED:
                assert later > after.auto_progress_ns  # stamped while the main thread did nothing
            else:
                assert later == after.auto_progress_ns
    finally:
        guard.close()
        page.close()


def test_the_stamps_end_with_the_phase() -> None:
    page = _native.HeartbeatPage.create()
    guard = HangGuard(page, SOFT_S, HARD_S)
    try:
        before = threading.active_count()
        guard.enter(_native.Phase.RESTART_BARRIER)
        assert threading.active_count() == before + 1
        guard.enter(_native.Phase.RUNNING)
        assert threading.active_count() == before
        stopped = page.snapshot().auto_progress_ns
        time.sleep(3 * guard.stamp_every_s)
        assert page.snapshot().auto_progress_ns == stopped
        guard.enter(_native.Phase.RESTART_BARRIER)
        guard.off()  # the rank leaves the job from the barrier
        assert threading.active_count() == before
    finally:
        guard.close()
        page.close()


def test_the_leaders_decision_gets_the_hard_timeout_only() -> None:
    page = _native.HeartbeatPage.create()
    try:
        guard = HangGuard(page, SOFT_S, HARD_S)
        guard.enter(_native.Phase.INITIAL_BARRIER)
        with guard.deciding():
            s = page.snapshot()
            assert not s.flags & _native.FLAG_HANG_PROTECTION_OFF
            assert (s.soft_timeout_ns, s.hard_timeout_ns) == (0, HARD_NS)
            assert s.phase == _native.Phase.INITIAL_BARRIER  # the barrier's phase stays
        assert page.snapshot().flags & _native.FLAG_HANG_PROTECTION_OFF
        guard.enter(_native.Phase.RESTART_BARRIER)
        with guard.deciding():
            s = page.snapshot()
            assert not s.flags & _native.FLAG_HANG_PROTECTION_OFF
            assert (s.soft_timeout_ns, s.hard_timeout_ns) == (0, HARD_NS)
            assert s.phase == _native.Phase.RESTART_BARRIER
            time.sleep(3 * guard.stamp_every_s)  # the leader's own progress counts here, no stamps
            assert page.snapshot().auto_progress_ns == s.auto_progress_ns
        after = page.snapshot()
        assert not after.flags & _native.FLAG_HANG_PROTECTION_OFF  # the restart barrier's rule again
        time.sleep(3 * guard.stamp_every_s)
        assert page.snapshot().auto_progress_ns > after.auto_progress_ns
    finally:
        guard.close()
        page.close()


# -- the table itself -------------------------------------------------------------------------------


def test_every_native_phase_has_one_row_in_the_order_of_a_call() -> None:
    from inprocess.control import phases

    native = list(_native.Phase.__members__.values())
    assert sorted(int(r.phase) for r in phases.TABLE) == sorted(int(p) for p in native)
    assert [r.order for r in phases.TABLE] == list(range(len(phases.TABLE)))
    assert [r.name for r in phases.TABLE] == ["STARTING", "INITIAL_BARRIER", "RUNNING", "ABORTING", "FINALIZING",
                                              "HEALTH_CHECK", "RESTART_BARRIER", "COMPLETION", "DONE", "TERMINATED"]
    for p in native:
        assert phases.row(p).phase == p


def test_the_tables_rules_are_the_lists_each_module_kept_before() -> None:
    """The literals are the lists as they stood in each module at 1cbd356."""
    from inprocess.control import phases
    from inprocess.control.phases import HangRule, Phase
    from inprocess.faults import phases as fault_phases
    from inprocess.processes import monitor
    from inprocess.timeline import model

    # engine/hang_guard.py: RESTART_PHASES got the hard timeout only; RUNNING is armed by training().
    assert {r.name for r in phases.TABLE if r.hang_rule is HangRule.HARD_ONLY} == HARD_TIMEOUT_ONLY
    assert phases.hard_timeout_only() == {Phase.ABORTING, Phase.FINALIZING, Phase.HEALTH_CHECK}
    assert {r.name for r in phases.TABLE if r.hang_rule is HangRule.SOFT_AND_HARD} == {"RUNNING"}
    # processes/monitor.py
    assert monitor._FINISHED == {Phase.DONE, Phase.TERMINATED}
    assert monitor._IN_BARRIER == {Phase.INITIAL_BARRIER, Phase.RESTART_BARRIER}
    # timeline/model.py, in a restart's order
    assert model.RESTART_PHASES == ("ABORTING", "FINALIZING", "HEALTH_CHECK", "RESTART_BARRIER")
    # faults/phases.py: the names INPROCESS_FAULTS gives the wrapper's phases
    assert fault_phases.WRAPPER_PHASES == {"INITIAL_BARRIER": "entry", "RUNNING": "initialize", "ABORTING": "abort",
                                           "FINALIZING": "finalize", "HEALTH_CHECK": "health_check",
                                           "RESTART_BARRIER": "barrier"}
    assert list(phases.fault_names()) == ["entry", "initialize", "abort", "finalize", "health_check", "barrier"]


def test_the_executor_has_a_step_for_every_restart_row_and_no_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/recovery.py runs a restart as the phase table's restart rows in order, one step each."""
    import inprocess
    from inprocess.control import phases
    from inprocess.engine.recovery import Recovery
    from inprocess.state import State

    monkeypatch.delenv("INPROCESS_JOIN", raising=False)
    recovery = Recovery(inprocess.Wrapper(), State(initial_rank=0, initial_world_size=2, rank=0, world_size=2), [],
                        lambda: None)
    assert list(recovery.restart_steps()) == [row.phase for row in phases.restart_rows()]
