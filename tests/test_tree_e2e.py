"""Tree with spares across real processes: 6 ranks on 127.0.0.1, gloo, the real store.

Two fake nodes (initial ranks 0-2 and 3-5, keys from an environment variable
each rank sets from its RANK); each node runs 2 active ranks and keeps 1
spare. An active rank of node 1 leaves in iteration 0; the spare of node 1
must take its exact rank, the world size must stay 4 and training finish.

The rank leaves either with ``sys.exit(3)`` (SystemExit terminates a rank
under the engine's rules) or by SIGKILL, which its monitor process sees
through a pidfd and reports for it.
"""

from __future__ import annotations

import json
import os
import pathlib

import pytest

from inprocess.launch import LocalJob

pytestmark = pytest.mark.multiprocess

WORKER = pathlib.Path(__file__).parent / "workers" / "tree_worker.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("leave_by", ["exit", "sigkill"])
def test_spare_of_the_node_takes_the_exact_rank_of_a_rank_that_left(tmp_path, leave_by):
    out = tmp_path / "out"
    out.mkdir()
    env = {
        "INPROCESS_TEST_OUT": str(out),
        "INPROCESS_TEST_LEAVER": "3",  # node 1's first active rank: active rank 2 of 0..3
        "INPROCESS_TEST_LEAVE_BY": leave_by,
        "INPROCESS_TEST_LOG": os.environ.get("INPROCESS_TEST_LOG", "WARNING"),
    }
    with LocalJob([str(WORKER)], 6, env=env) as job:
        job.wait(90)
    codes = [rp.returncode for rp in job.ranks]
    logs = {}
    for r in range(6):
        if r == 3 and leave_by == "sigkill":
            continue  # killed: it wrote nothing
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (rc={codes[r]}):\n{job.outputs()[-20000:]}"
        logs[r] = json.loads(path.read_text())
    context = job.outputs()[-20000:]

    # Iteration 0: nodes of 3 with max 2 active each -> initial ranks 2 and 5 are spares.
    for r, active_rank in ((0, 0), (1, 1), (3, 2), (4, 3)):
        if r not in logs:
            continue  # the killed rank
        first = logs[r]["iterations"][0]
        assert (first["iteration"], first["active_rank"], first["active_world_size"]) == (0, active_rank, 4), context
    assert logs[2]["iterations"] == [] and logs[5]["iterations"][0]["iteration"] == 1, context

    # The leaver left with its own exit code; nobody else failed.
    if leave_by == "sigkill":
        assert codes[3] == -9, context
    else:
        assert codes[3] == 3 and logs[3]["exception"] == "SystemExit", context
    assert [codes[r] for r in (0, 1, 2, 4, 5)] == [0] * 5, context

    # Iteration 1: node 1's spare holds rank 2 exactly; everybody else kept theirs.
    expected = {0: 0, 1: 1, 5: 2, 4: 3}
    for r, active_rank in expected.items():
        last = logs[r]["iterations"][-1]
        assert last["iteration"] == 1 and last["active_rank"] == active_rank, (r, last, context)
        assert last["active_world_size"] == 4 and last["env_world_size"] == "4", (r, last)
        assert last["env_rank"] == str(active_rank) and last["rank"] == active_rank, (r, last)
        assert last["steps"] == 4 and last["holders"] == [0, 1, 5, 4], (r, last)
        assert logs[r]["result"] == {"iteration": 1, "sum": 10.0}, (r, logs[r])
    # Node 0's spare stayed a spare to the end: it never ran, and returned None.
    assert logs[2]["iterations"] == [] and logs[2]["result"] is None, logs[2]
