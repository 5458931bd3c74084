"""Lost monitors: monitor processes heartbeat through the store, and each watches
the counters of its next peers. A monitor that stops (SIGKILL, SIGSTOP: a lost
node looks the same from outside) gets its rank counted out within
heartbeat_timeout; the rank itself, still alive, finds its seat taken at the
restart barrier and leaves; the other three finish with world size 3."""

from __future__ import annotations

import pytest

from conftest import assert_excluded

pytestmark = [pytest.mark.timeout(120), pytest.mark.multiprocess]

HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.5}
WRAPPER = {"soft_timeout": 5, "hard_timeout": 8, "progress_watchdog_interval": 0.2, "barrier_timeout": 30, **HEARTBEAT}


@pytest.mark.parametrize("kind", ["kill_monitor", "stop_monitor"])
def test_lost_monitor_gets_its_rank_counted_out(job, kind):
    # pg_timeout 3 s < hard_timeout: a rank caught in the known gloo tail (README, "Gloo
    # timeout") is released by gloo and rejoins, instead of being killed as hung.
    plan = {"steps": 60, "step_sleep": 0.1, "pg_timeout": 3,
            "faults": [{"iteration": 0, "rank": 2, "step": 3, "kind": kind}], "wrapper": dict(WRAPPER)}
    res = job(plan, timeout=100)
    assert res.returncodes[2] != 0, res.describe()
    lost = res.rank(2)
    assert lost["exception"] == "RankDiscarded" and "declared lost" in lost["message"], lost
    # Rank 2 itself may also record what the abort did to it ("after_restart").
    restart = assert_excluded(res, 2, {"unresponsive", "after_restart"})
    first_hand = [f["kind"] for f in restart["faults"] if f["rank"] == 2 and f["kind"] != "after_restart"]
    assert first_hand == ["unresponsive"], restart
    # The silence is timed from the last change a watcher saw, up to one interval
    # before the signal; then one interval to see it, plus slack for a loaded machine.
    fault_ns = lost["fault_ns"]
    resumed_ns = max(res.rank(r)["iterations"][1]["started_ns"] for r in (0, 1, 3))
    delay = (resumed_ns - fault_ns) / 1e9
    interval, timeout = HEARTBEAT["heartbeat_interval"], HEARTBEAT["heartbeat_timeout"]
    assert timeout - interval <= delay < timeout + interval + 3.0, delay
