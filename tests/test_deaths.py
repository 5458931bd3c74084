"""Ranks that die without raising, seen by their monitor process, on a real 4-rank job:
SIGKILL, os._exit, a segfault, a hang holding the GIL and a SIGSTOP (both killed at the
hard timeout: SIGTERM + SIGCONT, then SIGKILL after the grace).
The dead rank is excluded and the other three finish with world size 3."""

from __future__ import annotations

import pytest

from conftest import assert_excluded

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]

TIMEOUTS = {"soft_timeout": 2, "hard_timeout": 4, "progress_watchdog_interval": 0.2, "barrier_timeout": 30}


@pytest.mark.parametrize("kind, fault_kind", [
    ("sigkill", "killed"), ("os_exit", "exited"), ("segfault", "killed"), ("gil_hang", "hard_timeout"),
    ("sigstop", "hard_timeout"),
])
def test_dead_rank_is_excluded_and_the_others_finish(job, kind, fault_kind):
    plan = {"steps": 8, "faults": [{"iteration": 0, "rank": 2, "step": 3, "kind": kind}], "wrapper": dict(TIMEOUTS)}
    res = job(plan, timeout=90)
    assert res.returncodes[2] != 0 and res.logs[2] is None  # it died: no result written
    restart = assert_excluded(res, 2, {fault_kind, "after_restart"})
    assert any(f["rank"] == 2 and f["kind"] == fault_kind for f in restart["faults"]), restart


RANK0_KILLED = {"steps": 8, "faults": [{"iteration": 0, "rank": 0, "step": 3, "kind": "sigkill"}]}


def test_sigkill_of_rank0_leaves_the_store_serving_the_others(job):
    """Rank 0 started the store host: its death must not take the store (nor the
    others' process group, whose rendezvous ran on CallWrapper.store) with it."""
    res = job(dict(RANK0_KILLED, wrapper=dict(TIMEOUTS)), timeout=90)
    assert res.returncodes[0] == -9 and res.logs[0] is None
    assert_excluded(res, 0, {"killed"})
    # The new rank 0 is initial rank 1: ranks were shifted down.
    assert res.rank(1)["iterations"][-1]["rank"] == 0


def test_with_the_server_inside_rank0_its_sigkill_ends_the_job(job):
    """The control for the test above: host_process=False puts the server back
    into rank 0's process, and the same SIGKILL leaves nobody finishing."""
    wrapper = dict(TIMEOUTS, barrier_timeout=20, completion_timeout=20, store_kwargs={"host_process": False})
    res = job(dict(RANK0_KILLED, wrapper=wrapper), timeout=90)
    assert res.returncodes[0] == -9
    assert all(res.returncodes[r] != 0 for r in (1, 2, 3)), res.returncodes
