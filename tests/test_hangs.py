"""Hangs detected by the GIL-free soft timeout (native watchdog), on a real 4-rank job.

A rank that stops making progress for soft_timeout restarts the whole job; it
is interrupted out of its hang and takes part in the next iteration.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]

FAST_TIMEOUTS = {"soft_timeout": 2, "hard_timeout": 8, "progress_watchdog_interval": 0.2, "barrier_timeout": 30}


def run_hang(job, kind):
    plan = {
        "steps": 8,
        "faults": [{"iteration": 0, "rank": 1, "step": 3, "kind": kind}],
        "wrapper": dict(FAST_TIMEOUTS),
    }
    res = job(plan, timeout=90)
    for r in range(4):
        log = res.rank(r)
        assert res.returncodes[r] == 0, f"rank {r}:\n{res.describe()}"
        assert log["result"]["iteration"] == 1
        assert log["iterations"][-1]["world_size"] == 4
        # The watchdog's callback leaves no thread behind (not even a _DummyThread).
        assert log["final_threads"] == log["threads_before"], log
    restart = res.rank(0)["restarts"][0]
    first_hand = [f for f in restart["faults"] if f["kind"] != "after_restart"]
    # The peers blocked in the collective that waits for rank 1 make no progress
    # either, so whichever rank's watchdog fires first reports it: progress alone
    # cannot tell the hung rank from the ranks waiting for it.
    assert first_hand and all(f["kind"] == "soft_timeout" for f in first_hand), restart
    # From the start of the hang to the hung rank's next iteration: soft_timeout
    # (2 s) plus detection and restart, not at once and not a barrier timeout.
    # A waiting peer's last automatic stamp may predate the hang by up to one
    # watchdog interval (0.2 s), so the restart can come that much earlier.
    hung = res.rank(1)
    recovered_s = (hung["iterations"][1]["started_ns"] - hung["fault_ns"]) / 1e9
    assert 2.0 - 0.2 - 0.05 < recovered_s < 6, recovered_s
    return res


def test_hang_with_the_gil_released_restarts_and_the_rank_survives(job):
    """Rank 1 sleeps forever in time.sleep (GIL released): no automatic progress."""
    run_hang(job, "hang")


def test_ping_livelock_restarts(job):
    """Rank 1 keeps running Python but stops calling ping(): the manual clock times out."""
    run_hang(job, "livelock")


def test_disable_hang_protection_suspends_both_timeouts_and_re_arms_them(job):
    """Every rank sleeps 5.5 s (past soft 2 s and hard 4 s) inside
    disable_hang_protection(): nothing fires. Three steps later rank 1 hangs
    outside it: the re-armed soft timeout restarts the job, once. (A soft
    timeout of 1 s fired under load before the first step: the process group's
    creation and DDP's took longer.)"""
    sleep = [{"iteration": 0, "rank": r, "step": 2, "kind": "protected_sleep:5.5"} for r in range(4)]
    hang = {"iteration": 0, "rank": 1, "step": 5, "kind": "hang"}
    wrapper = dict(FAST_TIMEOUTS, soft_timeout=2, hard_timeout=4)
    res = job({"steps": 8, "faults": sleep + [hang], "wrapper": wrapper}, timeout=90)
    for r in range(4):
        log = res.rank(r)
        assert res.returncodes[r] == 0, f"rank {r}:\n{res.describe()}"
        assert log["result"]["iteration"] == 1
        assert log["iterations"][0]["steps"] == 5  # the protected sleep did not end iteration 0
    restarts = res.rank(0)["restarts"]
    assert len(restarts) == 1, restarts
    first_hand = [f for f in restarts[0]["faults"] if f["kind"] != "after_restart"]
    assert first_hand and all(f["kind"] == "soft_timeout" for f in first_hand), restarts
