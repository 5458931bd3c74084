"""The documented rule for an exception in each hook, checked hook by hook on a real job.

* initialize: an Exception is a fault of the rank -> the job restarts, every rank continues;
* abort, finalize, health_check: any exception terminates that rank -> the others go on without it
  (health_check's as HealthCheckError; it also runs before every iteration, where it is a fault);
* RestartAbort in initialize, abort, finalize, health_check: the job ends on every rank at one decision;
* rank_assignment (runs once, on the leader): the job ends on every rank, the leader with the hook's own
  exception, the others with RestartAbort naming it;
* completion: the exception propagates to that rank's caller, the others return normally;
* terminate: the rank still leaves with the exception that terminated it.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]

FAULT_ON_2 = {"iteration": 0, "rank": 2, "step": 3, "kind": "exception"}


def plan_with_hook(hook: str, kind: str = "exception", faults=(FAULT_ON_2,), iteration: int = 0,
                   from_call: int = 1) -> dict:
    target = {"hook": hook, "rank": 1, "iteration": iteration, "kind": kind, "from_call": from_call}
    return {"steps": 8, "faults": list(faults), "wrapper": {"raise_in_hook": target}}


def finished(res, ranks, iteration, world_size):
    for r in ranks:
        log = res.rank(r)
        assert res.returncodes[r] == 0, f"rank {r}:\n{res.describe()}"
        assert log["result"]["iteration"] == iteration
        assert log["iterations"][-1]["world_size"] == world_size


def test_initialize_exception_restarts_the_job(job):
    res = job(plan_with_hook("initialize", faults=()))
    finished(res, range(4), iteration=1, world_size=4)
    # Rank 1 raised before its function ran: iteration 0 has no function call there.
    assert [it["iteration"] for it in res.rank(1)["iterations"]] == [1]
    assert [f["rank"] for f in res.rank(0)["restarts"][0]["faults"] if f["kind"] == "exception"] == [1]


def test_initialize_base_exception_terminates_the_rank(job):
    res = job(plan_with_hook("initialize", kind="base", faults=()))
    assert res.rank(1)["exception"] == "SystemExit"
    finished(res, [0, 2, 3], iteration=1, world_size=3)


@pytest.mark.parametrize("hook", ["abort", "finalize", "health_check"])
def test_recovery_hook_exception_terminates_the_rank(job, hook):
    res = job(plan_with_hook(hook))
    log = res.rank(1)
    assert res.returncodes[1] == 17
    # As in nvidia_resiliency_ext, a failed health check comes out as HealthCheckError (chained to the cause).
    expected = "HealthCheckError" if hook == "health_check" else "RuntimeError"
    assert log["exception"] == expected and f"injected {hook} failure" in log["message"]
    finished(res, [0, 2, 3], iteration=1, world_size=3)
    assert res.rank(0)["restarts"][0]["terminated"] == [1]


@pytest.mark.parametrize("hook,faults,from_call", [
    ("initialize", (), 1), ("health_check", (), 1), ("abort", (FAULT_ON_2,), 1), ("finalize", (FAULT_ON_2,), 1),
    ("health_check", (FAULT_ON_2,), 2),
], ids=["initialize", "health_check_before_iteration", "abort", "finalize", "health_check_after_a_fault"])
def test_restart_abort_in_a_hook_ends_the_job_on_every_rank_in_one_iteration(job, hook, faults, from_call):
    res = job(plan_with_hook(hook, kind="restart_abort", faults=faults, from_call=from_call))
    assert res.rank(1)["message"] == f"injected in {hook}", res.describe()
    for r in range(4):
        log = res.rank(r)
        assert res.returncodes[r] == 17 and log["exception"] == "RestartAbort", f"rank {r}:\n{res.describe()}"
        # Every rank leaves at barrier 1's decision (one that never entered its function has no CallWrapper
        # to ask), and nobody calls the function again; before the function, the others may not have started it.
        assert log["final_iteration"] in (1, None) and (log["final_iteration"] == 1 or not log["iterations"]), log
        assert [it["iteration"] for it in log["iterations"]] in (([], [0]) if not faults else ([0],)), log
        assert not (r == 1 and not faults and log["iterations"]), log
        if r != 1:
            assert log["message"] == f"initial rank 1 raised RestartAbort in iteration 0: injected in {hook}", log


@pytest.mark.parametrize("faults,from_call", [((), 1), ((FAULT_ON_2,), 2)], ids=["before_iteration", "after_a_fault"])
def test_lost_cuda_context_in_health_check_ends_the_process_with_76(job, faults, from_call):
    # Before an iteration (1st call) as after a fault (2nd call, the restart's check): no restart repairs a
    # lost context, the rank leaves at once (counted out, so the others restart without waiting) and
    # exits 76 for the launcher to replace the process.
    res = job(plan_with_hook("health_check", kind="context_lost", faults=faults, from_call=from_call))
    assert res.rank(1)["hook_calls"]["health_check"] == from_call
    assert res.returncodes[1] == 76, res.describe()
    finished(res, [0, 2, 3], iteration=1, world_size=3)
    assert res.rank(0)["restarts"][0]["terminated"] == [1]


def test_rank_assignment_exception_ends_the_job_everywhere(job):
    plan = {"steps": 8, "faults": [FAULT_ON_2], "wrapper": {"rank_assignment": {"raise_at_iteration": 1}}}
    res = job(plan)
    raised = {r: res.rank(r)["exception"] for r in range(4)}
    # The leader ran the hook: it leaves with the hook's own exception; every other rank with RestartAbort.
    leaders = [r for r, name in raised.items() if name == "RuntimeError"]
    assert len(leaders) == 1, raised
    assert "injected rank assignment failure" in res.rank(leaders[0])["message"]
    for r in set(range(4)) - set(leaders):
        log = res.rank(r)
        assert log["exception"] == "RestartAbort", log
        assert "rank assignment failed" in log["message"] and "injected rank assignment failure" in log["message"]


def test_completion_exception_propagates_on_that_rank_only(job):
    res = job(plan_with_hook("completion", faults=(), iteration=0))
    assert res.rank(1)["exception"] == "RuntimeError"
    finished(res, [0, 2, 3], iteration=0, world_size=4)
    # The function itself completed on rank 1 too: only the hook failed.
    assert res.rank(1)["iterations"][-1]["steps"] == 8


def test_terminate_exception_does_not_replace_the_terminating_one(job):
    faults = [{"iteration": 0, "rank": 1, "step": 3, "kind": "system_exit"}]
    res = job(plan_with_hook("terminate", faults=faults))
    assert res.rank(1)["exception"] == "SystemExit"
    assert res.rank(1)["hook_calls"]["terminate"] == 1
    finished(res, [0, 2, 3], iteration=1, world_size=3)
