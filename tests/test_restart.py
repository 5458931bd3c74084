"""Multi-process restart scenarios: real processes on 127.0.0.1, real TCPStore, gloo, DDP.

Each job is 4 ranks (unless stated) training a small MLP under DDP; the plan
says which rank fails, when and how. Assertions are on what every rank saw.
"""

from __future__ import annotations

import pytest

from inprocess.chaos import invariants
from inprocess.timeline.reading import load

pytestmark = [pytest.mark.timeout(150), pytest.mark.multiprocess]


def exc(kind: str, rank: int, iteration: int, step: int = 3) -> dict:
    return {"iteration": iteration, "rank": rank, "step": step, "kind": kind}


def assert_finished_together(res, ranks, iteration, world_size):
    """The listed ranks returned from the same final iteration with identical parameters."""
    checksums = set()
    for r in ranks:
        log = res.rank(r)
        assert res.returncodes[r] == 0, f"rank {r} rc={res.returncodes[r]}:\n{res.describe()}"
        assert log["result"] is not None, f"rank {r}: {log}"
        assert log["result"]["iteration"] == iteration, (r, log["iterations"])
        last = log["iterations"][-1]
        assert last["world_size"] == world_size, (r, last)
        assert last["steps"] == 8
        checksums.add(round(log["result"]["checksum"], 6))
    # DDP keeps replicas identical only if every allreduce really ran across these ranks.
    assert len(checksums) == 1, checksums


def test_exception_on_one_rank_restarts_every_rank(job):
    res = job({"steps": 8, "faults": [exc("exception", rank=2, iteration=0, step=5)]})
    assert_finished_together(res, range(4), iteration=1, world_size=4)
    for r in range(4):
        its = res.rank(r)["iterations"]
        assert [it["iteration"] for it in its] == [0, 1]
        assert its[1]["rank"] == r and its[1]["env_rank"] == str(r) and its[1]["env_world_size"] == "4"
    # Only the rank that raised has a first-hand fault; peers whose collectives
    # were cut may add records marked after_restart.
    restarts = [res.rank(r)["restarts"] for r in range(4)]
    for rs in restarts:
        assert len(rs) == 1
        first_hand = [f for f in rs[0]["faults"] if f["kind"] == "exception"]
        assert [f["rank"] for f in first_hand] == [2]
        assert first_hand[0]["type"] == "RuntimeError"
        assert all(f["kind"] == "after_restart" for f in rs[0]["faults"] if f["rank"] != 2)


def test_five_faults_in_a_row(job):
    faults = [exc("exception", rank=i % 4, iteration=i, step=2 + i % 3) for i in range(5)]
    res = job({"steps": 8, "faults": faults})
    assert_finished_together(res, range(4), iteration=5, world_size=4)
    seen = [[f["rank"] for f in r["faults"] if f["kind"] == "exception"] for r in res.rank(0)["restarts"]]
    assert seen == [[0], [1], [2], [3], [0]]


def test_faults_on_two_ranks_at_once(job):
    res = job({"steps": 8, "faults": [exc("exception", 1, 0, step=4), exc("exception", 3, 0, step=4)]})
    assert_finished_together(res, range(4), iteration=1, world_size=4)
    # Every fault that was raised before its rank was interrupted is in the one
    # decision; a rank that the other's restart released first never raised its own
    # (the gathering itself is checked deterministically in test_units).
    faults = res.rank(0)["restarts"][0]["faults"]
    raised = {r for r in (1, 3) if res.rank(r).get("injected")}
    assert raised, "neither fault was raised"
    assert raised <= {f["rank"] for f in faults}, (raised, faults)
    assert any(f["kind"] == "exception" and f["rank"] in (1, 3) for f in faults), faults


@pytest.mark.parametrize("kind", ["system_exit", "keyboard_interrupt"])
def test_base_exception_terminates_the_rank(job, kind):
    res = job({"steps": 8, "faults": [exc(kind, rank=1, iteration=0, step=4)]})
    gone = res.rank(1)
    assert res.returncodes[1] == 17 and gone["exception"] == {
        "system_exit": "SystemExit", "keyboard_interrupt": "KeyboardInterrupt",
    }[kind]
    assert_finished_together(res, [0, 2, 3], iteration=1, world_size=3)
    # The survivors were renumbered by ShiftRanks: initial 2 -> 1, 3 -> 2.
    assert [res.rank(r)["iterations"][-1]["rank"] for r in (0, 2, 3)] == [0, 1, 2]
    assert res.rank(3)["iterations"][-1]["env_rank"] == "2"
    assert res.rank(0)["restarts"][0]["terminated"] == [1]


def test_restart_abort_in_the_function_ends_the_job_on_every_rank(job):
    """A RestartAbort stops the restarts (nvidia_resiliency_ext: "bypassing any further restart
    attempts"): every rank leaves at the one decision it causes, none runs the function again."""
    res = job({"steps": 8, "faults": [exc("restart_abort", rank=1, iteration=0, step=4)]})
    for r in range(4):
        log = res.rank(r)
        assert res.returncodes[r] == 17 and log["exception"] == "RestartAbort", f"rank {r}:\n{res.describe()}"
        assert [it["iteration"] for it in log["iterations"]] == [0], log
        assert log["final_iteration"] == 1, log
    assert res.rank(1)["message"] == "injected"  # its own exception; the others' name it
    assert all(res.rank(r)["message"] == "initial rank 1 raised RestartAbort in iteration 0: injected"
               for r in (0, 2, 3))


def test_spare_takes_over_a_terminated_active_rank(job):
    plan = {
        "steps": 8,
        "faults": [exc("system_exit", rank=1, iteration=0, step=4)],
        "wrapper": {"rank_assignment": {"max_active": 4}},
    }
    res = job(plan, world_size=5)
    spare = res.rank(4)
    # The spare never ran iteration 0, then ran iteration 1 as active rank 3.
    assert [it["iteration"] for it in spare["iterations"]] == [1]
    assert spare["iterations"][0]["rank"] == 3 and spare["iterations"][0]["env_rank"] == "3"
    assert_finished_together(res, [0, 2, 3, 4], iteration=1, world_size=4)
    assert res.returncodes[1] == 17


def test_spare_returns_none_when_the_job_completes(job):
    res = job({"steps": 8, "wrapper": {"rank_assignment": {"max_active": 3}}}, world_size=4)
    assert_finished_together(res, [0, 1, 2], iteration=0, world_size=3)
    assert res.returncodes[3] == 0
    assert res.rank(3)["iterations"] == [] and res.rank(3)["result"] is None


def test_retry_controller_stops_the_job(job):
    plan = {
        "steps": 8,
        "faults": [exc("exception", rank=i % 4, iteration=i, step=2) for i in range(4)],
        "wrapper": {"max_iterations": 2},
    }
    res = job(plan)
    for r in range(4):
        log = res.rank(r)
        assert res.returncodes[r] == 17
        assert log["exception"] == "RestartAbort", log
        assert "max_iterations=2" in log["message"]
        assert [it["iteration"] for it in log["iterations"]] == [0, 1]


def test_retry_controller_ends_every_rank_at_one_iteration_when_a_rank_comes_late(job, tmp_path):
    """Issue 31: the ranks that meet max_iterations first must not restart a late one into the next iteration.

    A fault in each of iterations 0 and 1; in iteration 2 initial rank 2 comes to its initialize 3 s
    after the others, whose RetryController raises RestartAbort at once. Every rank leaves with
    RestartAbort at the one decision that ends the job, and nobody calls the function in iteration 2.
    """
    plan = {
        "steps": 6,
        "faults": [exc("exception", rank=i, iteration=i, step=2) for i in range(2)],
        "wrapper": {"max_iterations": 2, "slow_initialize": {"rank": 2, "from_iteration": 2, "seconds": 3}},
    }
    res = job(plan, world_size=3, env={"INPROCESS_EVENTS_DIR": str(tmp_path / "events")})
    finals = {}
    for r in range(3):
        log = res.rank(r)
        assert res.returncodes[r] == 17, f"rank {r}:\n{res.describe()}"
        assert log["exception"] == "RestartAbort", log
        assert "iteration=2 reached max_iterations=2" in log["message"], log
        assert [it["iteration"] for it in log["iterations"]] == [0, 1], log
        assert max(log["initialized"]) <= 2, log  # nobody went on to an iteration 3
        finals[r] = log["final_iteration"]
    assert len(set(finals.values())) == 1, f"ranks ended in different iterations: {finals}\n{res.describe()}"
    # The chaos checker, on the job's own events: every invariant holds, this one checked on every rank.
    segments = [seg for run in load(str(tmp_path / "events")).runs for seg in run.segments.values()]
    findings = invariants.check(segments)
    assert invariants.violations(findings) == []
    assert next(f.checked for f in findings if f.invariant == "same_final_iteration") == 3


def test_fault_counter_terminates_a_rank_that_keeps_failing(job):
    plan = {
        "steps": 8,
        "faults": [exc("exception", rank=2, iteration=0, step=2), exc("exception", rank=2, iteration=1, step=2)],
        "wrapper": {"max_rank_faults": 1},
    }
    res = job(plan)
    assert res.rank(2)["exception"] == "HealthCheckError"
    assert_finished_together(res, [0, 1, 3], iteration=2, world_size=3)


def test_collective_blocked_on_a_hanging_peer_is_released(job):
    """Rank 3 hangs outside any collective, so the others block inside DDP's
    allreduce; then rank 1 raises. The restart must release the blocked ranks
    at once (not at the process group's 60 s timeout) and interrupt rank 3's
    sleep, so all four continue."""
    plan = {
        "steps": 8,
        "pg_timeout": 60,
        "faults": [exc("hang", rank=3, iteration=0, step=3), exc("delayed_exception:1.0", rank=1, iteration=0, step=3)],
    }
    res = job(plan, timeout=60)
    assert_finished_together(res, range(4), iteration=1, world_size=4)
    fault_ns = res.rank(1)["fault_ns"]
    for r in (0, 2):
        released = res.rank(r)["iterations"][0]["released_ns"]
        assert 0 < released - fault_ns < 2e9, f"rank {r} released {(released - fault_ns) / 1e6:.0f} ms after the fault"
    # The hanging rank was interrupted in time.sleep and rejoined.
    assert res.rank(3)["iterations"][-1]["iteration"] == 1


def test_threads_and_descriptors_do_not_grow_over_20_restarts(job):
    faults = [exc("exception", rank=i % 4, iteration=i, step=1) for i in range(20)]
    # Twenty faults of one shape back to back: the storm brake (engine/storm.py) would back off from
    # the third on (1 s, doubling to 30 s); this test counts what restarts leave behind, not storms.
    res = job({"steps": 8, "faults": faults}, timeout=140, env={"INPROCESS_RESTART_STORM": "off"})
    assert_finished_together(res, range(4), iteration=20, world_size=4)
    for r in range(4):
        log = res.rank(r)
        fds, threads = log["fds_pg"], log["threads"]
        assert len(fds) == 21
        # Iteration 1 is the first after a restart. Threads must match it exactly.
        assert threads[1:] == [threads[1]] * 20, f"rank {r} threads per iteration: {threads}"
        # Descriptors must not grow: a leak of one per restart would lift the
        # floor by 20. A socket whose last reference sits in a reference cycle
        # closes at the next garbage collection, so a single iteration may read
        # one above the floor; that never accumulates. Counted once the iteration's process group is
        # made: the failed iteration's connections, held open until then, are closed by then.
        assert min(fds[-5:]) <= min(fds[1:6]), f"rank {r} descriptors per iteration: {fds}"
        assert max(fds[1:]) - min(fds[1:]) <= 2, f"rank {r} descriptors per iteration: {fds}"
        # Once the wrapper returned, nothing of the call stays open.
        assert log["final_fds"] <= min(log["fds"][1:]), (log["final_fds"], log["fds"])
        # Held connections are those of one failed iteration at most (a socket per peer and group).
        assert max(log["held"]) <= 4 * 3, log["held"]
        assert log["final_threads"] == log["threads_before"], log
        # torch's init_process_group wraps sys.excepthook each time; the engine undoes it.
        assert len(set(log["excepthooks"])) == 1, log["excepthooks"][:3]


def test_an_exception_under_the_restart_it_caused_is_named_the_cause(job):
    # Rank 1's ValueError is still in a finally block when rank 0's communication error, the only
    # first-hand fault, brings the restart: the summary names rank 1's exception, not rank 0's error.
    res = job({}, world_size=3, worker="late_cause_worker.py", timeout=60.0)
    assert res.returncodes == [0, 0, 0], res.describe()
    for r in range(3):
        seen = res.rank(r)
        assert seen["causes"] == [[1, "after_restart", "ValueError"]], (r, seen)
        assert seen["consequences"] == [[0, "exception", "RuntimeError"]], (r, seen)
        assert seen["summary"].startswith(
            "restart after iteration 0: cause: rank 1 exception (out after the restart began): ValueError: "
            "rank 1's own fault; consequences (not causes): rank 0 RuntimeError"), seen["summary"]
