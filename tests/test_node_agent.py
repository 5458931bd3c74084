"""Node agents across real processes: 6 ranks as two fake nodes of 3 on 127.0.0.1.

Each node's local rank 0 starts the node's agent; the ranks of a node take
their events, barrier outcomes and decisions from its board. Faults: an
exception (restart through the agents), a SIGKILL of a rank (its monitor
counts it out directly), and a SIGKILL of a node agent (its ranks go on with
the store directly, and the next restart still agrees).
"""

from __future__ import annotations

import pytest

from conftest import assert_excluded
from inprocess.node_agent import NodeLayout

NODES = {"ranks_per_node": 3, "world_size": 6}
AGENT = {"node_agent": True}


def _agents(res, ranks) -> set[int]:  # type: ignore[no-untyped-def]
    return {e["node_agent"] for r in ranks for e in res.rank(r)["iterations"]}


def _check_one_agent_per_node(res) -> None:  # type: ignore[no-untyped-def]
    node0, node1 = _agents(res, [0, 1, 2]), _agents(res, [3, 4, 5])
    assert len(node0) == 1 and len(node1) == 1 and None not in node0 | node1, (node0, node1)
    assert node0 != node1


@pytest.mark.timeout(120)
def test_an_exception_restarts_every_rank_through_the_node_agents(job):
    plan = {"steps": 8, "wrapper": AGENT, "faults": [{"iteration": 0, "rank": 4, "step": 3, "kind": "exception"}]}
    res = job(plan, **NODES)
    for r in range(6):
        log = res.rank(r)
        assert res.returncodes[r] == 0, res.describe()
        assert log["result"]["iteration"] == 1 and log["iterations"][-1]["world_size"] == 6, log
    restart = res.rank(0)["restarts"][0]
    assert [(f["rank"], f["kind"]) for f in restart["faults"] if f["kind"] == "exception"] == [(4, "exception")]
    _check_one_agent_per_node(res)
    # Both barriers (the initial one and the restart's) counted every rank through its agent.
    assert [[e["forwarded"] for e in res.rank(r)["iterations"]] for r in range(6)] == [[0, 1]] * 6


@pytest.mark.timeout(120)
def test_a_killed_rank_is_counted_out_by_its_monitor_past_the_node_agent(job):
    plan = {"steps": 8, "wrapper": AGENT, "faults": [{"iteration": 0, "rank": 4, "step": 3, "kind": "sigkill"}]}
    res = job(plan, **NODES)
    assert_excluded(res, 4, {"killed", "after_restart"})
    assert res.returncodes[4] == -9


@pytest.mark.timeout(120)
def test_ranks_go_on_without_their_killed_node_agent(job):
    # Node 1's agent dies in iteration 0; later rank 1 (node 0) fails. Node 1's
    # ranks see the agent gone and take the restart from the store directly.
    plan = {
        "steps": 10, "step_sleep": 0.1, "wrapper": AGENT,
        "faults": [
            {"iteration": 0, "rank": 3, "step": 2, "kind": "kill_node_agent"},
            {"iteration": 0, "rank": 1, "step": 7, "kind": "exception"},
        ],
    }
    res = job(plan, **NODES)
    for r in range(6):
        assert res.returncodes[r] == 0, res.describe()
        assert res.rank(r)["result"]["iteration"] == 1, res.rank(r)
    assert res.rank(3)["node_agent_killed"] in _agents(res, [3, 4, 5])
    _check_one_agent_per_node(res)
    # Node 0's agent counted its ranks at the restart; node 1's ranks counted themselves.
    assert [res.rank(r)["iterations"][-1]["forwarded"] for r in range(6)] == [1, 1, 1, 0, 0, 0]


@pytest.mark.timeout(60)
def test_without_a_node_layout_there_is_no_agent(job):
    res = job({"steps": 3}, world_size=2)
    assert [e["node_agent"] for r in (0, 1) for e in res.rank(r)["iterations"]] == [None, None]


def test_node_layout_from_the_launchers_environment():
    assert NodeLayout.from_env({}) is None
    assert NodeLayout.from_env({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "5"}) == NodeLayout("5", 2, 8)
    assert NodeLayout.from_env({"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4", "SLURM_NODEID": "1"}) == (
        NodeLayout("1", 0, 4)
    )
    with pytest.raises(ValueError, match="LOCAL_RANK=8 is not in"):
        NodeLayout.from_env({"LOCAL_RANK": "8", "LOCAL_WORLD_SIZE": "8"})
    with pytest.raises(ValueError, match="expected integers"):
        NodeLayout.from_env({"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "8"})


def test_wrapper_refuses_a_node_agent_setting_that_is_not_a_bool():
    import inprocess

    with pytest.raises(ValueError, match="node_agent"):
        inprocess.Wrapper(node_agent="yes")  # type: ignore[arg-type]
