"""A fault plan entry that never fires says so, and why (inprocess/faults/unfired.py)."""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Iterator

import pytest

from conftest import WORKERS, leftover_processes
from inprocess.faults import arming, unfired
from inprocess.faults.plan import FaultPlan

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def fresh_records() -> Iterator[None]:
    unfired.reset()
    arming._fired.clear()
    yield
    unfired.reset()
    arming._fired.clear()


def test_a_step_fault_in_code_that_reports_no_step_warns_when_its_iteration_ends(caplog):
    plan = FaultPlan.parse("exception@rank=0,step=50")
    with caplog.at_level(logging.WARNING, logger="inprocess.faults"):
        with arming.arm(plan, rank=0, world_size=2, iteration=0):
            pass  # an iteration that never calls maybe_inject
        with arming.arm(plan, rank=0, world_size=2, iteration=0):
            pass
    early = [r.getMessage() for r in caplog.records]
    assert len(early) == 1, early  # once per process
    assert "entry 1 (exception@rank=0,step=50) was due at step 50 of iteration 0" in early[0]
    assert "inprocess.faults.maybe_inject(step)" in early[0]
    messages = unfired.report_unfired(plan, 0, 2, last_iteration=0)
    assert messages == ["INPROCESS_FAULTS entry 1 (exception@rank=0,step=50) never fired on initial rank 0: "
                        "step=50: no step was reported in iteration 0: call inprocess.faults.maybe_inject(step) "
                        "in the training loop"]


def test_steps_that_stop_short_of_the_entry_say_how_far_they_went():
    plan = FaultPlan.parse("exception@rank=0,step=50")
    with arming.arm(plan, rank=0, world_size=1, iteration=0):
        for step in range(38):
            arming.maybe_inject(step)
    [message] = unfired.report_unfired(plan, 0, 1, last_iteration=0)
    assert message.endswith("step=50: the steps reported in iteration 0 went up to 37")


def test_a_timed_fault_after_the_iteration_ended_says_how_long_it_lasted():
    plan = FaultPlan.parse("sigkill@rank=1,after=10s")
    with arming.arm(plan, rank=1, world_size=2, iteration=0):
        time.sleep(0.2)
    [message] = unfired.report_unfired(plan, 1, 2, last_iteration=0)
    assert "entry 1 (sigkill@rank=1,after=10s) never fired on initial rank 1: after=10s: iteration 0 ended 0." \
        in message
    assert unfired.report_unfired(plan, 0, 2, last_iteration=0) == []  # not rank 0's entry


def test_an_iteration_the_job_never_reached_is_named():
    plan = FaultPlan.parse("exception@rank=*,after=5s,iteration=3")
    [message] = unfired.report_unfired(plan, 1, 2, last_iteration=1)
    assert message.endswith("iteration=3: the call ended in iteration 1")


def test_a_phase_the_rank_never_entered_is_named():
    plan = FaultPlan.parse("exception@rank=0,phase=reassignment")
    [message] = unfired.report_unfired(plan, 0, 2, last_iteration=0)
    assert message.endswith("phase=reassignment: the rank did not enter that phase in iteration 0 "
                            "(it runs on the barrier's leader only)")


def test_a_fired_entry_is_not_reported():
    plan = FaultPlan.parse("exception@rank=0,step=2;exception@rank=0,step=90")
    with arming.arm(plan, rank=0, world_size=1, iteration=0):
        with pytest.raises(Exception, match="injected fault"):
            for step in range(5):
                arming.maybe_inject(step)
    [message] = unfired.report_unfired(plan, 0, 1, last_iteration=0)
    assert message.startswith("INPROCESS_FAULTS entry 2 (exception@rank=0,step=90) never fired")


@pytest.mark.multiprocess
def test_a_job_ends_with_a_warning_for_each_entry_that_never_fired(tmp_path: pathlib.Path):
    """The README's own kind of plan, on code that never calls maybe_inject: each rank names its entries."""
    from inprocess.launch import LocalJob

    env = {"INPROCESS_FAULTS": "sigkill@rank=1,step=30;exception@rank=0,after=20s;exception@rank=1,after=5s,"
                               "iteration=1",
           "UNFIRED_SECONDS": "1"}
    with LocalJob([str(WORKERS / "unfired_worker.py")], 2, env=env) as job:
        job.wait(50)
        assert not leftover_processes({rp.popen.pid for rp in job.ranks}, grace=10.0)
    assert [rp.returncode for rp in job.ranks] == [0, 0], job.outputs()
    rank0, rank1 = job.ranks[0].output, job.ranks[1].output
    assert "[worker] returned 0" in rank0 and "[worker] returned 0" in rank1
    assert "entry 2 (exception@rank=0,after=20s) never fired on initial rank 0: after=20s: iteration 0 ended " \
        in rank0
    assert "entry 1 (sigkill@rank=1,step=30) never fired on initial rank 1: step=30: no step was reported in " \
        "iteration 0" in rank1
    assert "entry 3 (exception@rank=1,after=5s,iteration=1) never fired on initial rank 1: iteration=1: the call " \
        "ended in iteration 0" in rank1
    assert "never fired" not in rank0.replace("entry 2 (exception@rank=0,after=20s) never fired", "")


@pytest.mark.multiprocess
def test_a_plan_whose_entries_all_fire_says_nothing_of_the_kind(tmp_path: pathlib.Path):
    from inprocess.launch import LocalJob

    env = {"INPROCESS_FAULTS": "exception@rank=1,step=3", "UNFIRED_SECONDS": "1", "UNFIRED_REPORT_STEPS": "1"}
    with LocalJob([str(WORKERS / "unfired_worker.py")], 2, env=env) as job:
        job.wait(50)
        assert not leftover_processes({rp.popen.pid for rp in job.ranks}, grace=10.0)
    assert [rp.returncode for rp in job.ranks] == [0, 0], job.outputs()
    assert "injected fault: exception on initial rank 1" in job.outputs()
    assert "[worker] returned 1" in job.ranks[0].output
    assert "never fired" not in job.outputs() and "no step was reported" not in job.outputs()
