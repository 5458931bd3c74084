"""Node agents across real processes: 6 ranks as two fake nodes of 3 on 127.0.0.1.

Each node's local rank 0 starts the node's agent; the ranks of a node take
their events, barrier outcomes and decisions from its board. Faults: an
exception (restart through the agents), a SIGKILL of a rank (its monitor
counts it out directly), and a SIGKILL of a node agent (its ranks go on with
the store directly, and the next restart still agrees).
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from conftest import assert_excluded
from inprocess import _native
from inprocess.compose import Compose
from inprocess.control import seats
from inprocess.control.counting_out import count_out
from inprocess.control.membership import ACTIVE, Membership
from inprocess.control.node_link import OUTCOME_REFUSED, NodeLayout, NodeLink, socket_name
from inprocess.control.protocol import Decision, FaultRecord, RestartProtocol, SeatTaken
from inprocess.control.tcpstore_client import TCPStoreClient
from inprocess.processes.node_relay import NodeRelay
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, decide

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


@pytest.mark.timeout(120)
def test_a_lost_leader_of_the_initial_barrier_is_replaced_through_the_node_agents(job):
    # The initial barrier's leader (whichever rank its agent named) is killed as it decides:
    # its monitor's lost mark reaches the other ranks through their agents' boards, one of
    # them takes the lead over at the store, and the job starts with the 5 others.
    res = job({"steps": 6, "wrapper": AGENT}, **NODES, env={"INPROCESS_FAULTS": "sigkill@rank=*,phase=reassignment"})
    dead = [r for r in range(6) if res.returncodes[r] == -9]
    assert len(dead) == 1, res.describe()
    for r in set(range(6)) - set(dead):
        log = res.rank(r)
        assert res.returncodes[r] == 0, res.describe()
        assert log["result"]["iteration"] == 0 and log["iterations"][0]["world_size"] == 5, log
        assert log["restarts"] == [], log  # excluded by barrier 0's own decision: nothing restarted
    survivors = sorted(set(range(6)) - set(dead))
    _check_one_agent_per_node_of(res, survivors)


def _check_one_agent_per_node_of(res, ranks) -> None:  # type: ignore[no-untyped-def]
    for node in ([r for r in ranks if r < 3], [r for r in ranks if r >= 3]):
        agents = _agents(res, node)
        assert len(agents) == 1 and None not in agents, agents


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


def test_an_agent_of_an_earlier_incarnation_of_the_job_is_not_found():
    # torchrun restarts its workers with the same store and call index: the
    # agent's name must still differ, or the new ranks could reach an old agent.
    first = socket_name("127.0.0.1", 29500, 0, "3", {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0"})
    again = socket_name("127.0.0.1", 29500, 0, "3", {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "1"})
    assert first != again
    assert socket_name("h", 1, 0, "3", {"SLURM_JOB_ID": "7"}) != socket_name("h", 1, 0, "3", {"SLURM_JOB_ID": "8"})
    assert socket_name("h", 1, 0, "3", {}) != socket_name("h", 1, 1, "3", {})  # and per call
    assert first.startswith(b"\0")  # abstract: nothing in the filesystem


def test_wrapper_refuses_a_node_agent_setting_that_is_not_a_bool():
    import inprocess

    with pytest.raises(ValueError, match="node_agent"):
        inprocess.Wrapper(node_agent="yes")  # type: ignore[arg-type]


# -- the relay and the board, in one process over a real TCPStore ---------------------

class TwoNodes:
    """Ranks 0-1 on node 0, ranks 2-3 on node 1; every rank seated at barrier 0."""

    def __init__(self) -> None:
        timeout = datetime.timedelta(seconds=10)
        self.server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout, wait_for_workers=False)

        def client() -> dist.TCPStore:
            return dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=timeout)

        self.boards = [_native.NodeBoard.create(2, 4096) for _ in range(2)]
        self.relays = [NodeRelay(b) for b in self.boards]
        self.relay_protocols = [RestartProtocol(client()) for _ in range(2)]
        self.ranks = [RestartProtocol(client(), link=NodeLink(self.boards[r // 2], r % 2)) for r in range(4)]
        RestartProtocol(self.server).seat_table.write({r: "0" for r in range(4)})
        self.assignment = Compose(ActivateAllRanks(), ShiftRanks())

    def decide_fn(self, dead, faults, leader):  # type: ignore[no-untyped-def]
        return decide(self.assignment, Membership.all_active(4), dead, faults, 1, leader)

    def node_1_awaits_barrier_1(self) -> tuple[dict[int, str], list[threading.Thread]]:
        """Ranks 2 and 3 await barrier 1's outcome, each on a thread of its own (started): what
        each got (the decision's JSON, once its thread ends) and the threads to join."""
        got: dict[int, str] = {}

        def await_outcome(r: int) -> None:
            got[r] = self.ranks[r].await_outcome(1, r, 4, timeout=10).to_json()

        threads = [threading.Thread(target=await_outcome, args=(r,)) for r in (2, 3)]
        for thread in threads:
            thread.start()
        return got, threads


@pytest.mark.timeout(30)
def test_the_first_batch_names_its_lowest_slot_leader_and_the_last_sets_ready():
    t = TwoNodes()
    for r in (3, 2):
        t.ranks[r].post_arrival(1, r, 4)
    assert t.relays[1].forward(t.relay_protocols[1]) == 2  # healthy 0 -> 2: slot 0 of node 1 leads
    assert t.boards[1].leads(0) == 1 and t.boards[1].leads(1) == -1
    assert not t.server.check([t.ranks[0].key(1, "ready")])
    for r in (0, 1):
        t.ranks[r].post_arrival(1, r, 4)
    assert t.relays[0].forward(t.relay_protocols[0]) == 2
    assert t.boards[0].leads(0) == -1 and t.server.check([t.ranks[0].key(1, "ready")])
    assert t.relays[0].forward(t.relay_protocols[0]) == 0  # nothing new: no second add
    assert [t.relays[n].adds for n in (0, 1)] == [1, 1]

    decision = t.ranks[2].await_outcome(1, 2, 4, decide=t.decide_fn, timeout=10)  # the leader decides
    assert decision.leader == 2 and decision.membership.world_size == 4
    for n in (0, 1):
        assert t.relays[n].relay_decision(t.relay_protocols[n], 1, lambda: False)
    for r in (0, 1, 3):
        assert t.ranks[r].await_outcome(1, r, 4, timeout=10).to_json() == decision.to_json()
    # Per rank, no store call for the whole barrier: the agents took the seats, one compare_set each.
    assert [t.ranks[r].ops for r in (0, 1, 3)] == [0, 0, 0]
    assert [t.ranks[0].read_seat(r) for r in range(4)] == ["1"] * 4


@pytest.mark.timeout(30)
def test_a_rank_whose_agent_vanished_counts_itself_unless_the_agent_had():
    t = TwoNodes()
    for r in range(4):
        t.ranks[r].post_arrival(1, r, 4)
    t.relays[0].forward(t.relay_protocols[0])  # node 0 forwarded (and leads) ...
    t.boards[1].close()  # ... node 1's agent is gone before forwarding
    # Node 1's ranks count themselves directly (then wait for the decision in the store).
    got, threads = t.node_1_awaits_barrier_1()
    decision = t.ranks[0].await_outcome(1, 0, 4, decide=t.decide_fn, timeout=10)  # waits for their count
    for thread in threads:
        thread.join(10)
    assert decision.leader == 0 and got == {2: decision.to_json(), 3: decision.to_json()}
    assert t.server.add(t.ranks[0].key(1, "arrivals"), 0) == 4
    # Node 0's agent goes too, after it had forwarded: rank 1 reads the decision from the store.
    t.boards[0].close()
    assert t.ranks[1].await_outcome(1, 1, 4, timeout=10).to_json() == decision.to_json()
    assert t.server.add(t.ranks[0].key(1, "arrivals"), 0) == 4  # nobody was counted twice


@pytest.mark.timeout(30)
def test_a_seat_counted_out_while_the_agent_batches_makes_its_rank_leave():
    """Rank 3 posted its arrival; before its agent takes the node's seats, rank 3's monitor
    counts it out (the seat's compare_set, as counting_out does, and its terminated arrival).
    The agent's batch finds the seat taken: it counts rank 2 alone and refuses rank 3, which
    looks at its seat itself and leaves. Every rank is counted once."""
    t = TwoNodes()
    for r in range(4):
        t.ranks[r].post_arrival(1, r, 4)
    monitor = RestartProtocol(dist.TCPStore("127.0.0.1", t.server.port, is_master=False,
                                            timeout=datetime.timedelta(seconds=10)))
    counted_out = seats.counted_out(1, "m3", 0)
    assert monitor.seat_table.compare_set(3, "0", counted_out) == counted_out
    monitor.arrive(1, 3, 4, terminated=True, seat_taken=True)
    assert t.relays[1].forward(t.relay_protocols[1]) == 1  # rank 2 only
    assert t.boards[1].wait_outcome(1, 1, 0) == OUTCOME_REFUSED and t.boards[1].forwarded(1) == -1
    with pytest.raises(SeatTaken, match="initial rank 3 was counted out of barrier 1"):
        t.ranks[3].await_outcome(1, 3, 4, timeout=10)
    assert t.relays[0].forward(t.relay_protocols[0]) == 2
    assert t.server.add(t.ranks[0].key(1, "arrivals"), 0) == 3 + (1 << 32)  # 3 healthy, 1 terminated
    decision = t.ranks[2].await_outcome(1, 2, 4, decide=t.decide_fn, timeout=10)  # the first batch's leader
    assert decision.leader == 2 and decision.membership.world_size == 3 and decision.membership.mode[3] != ACTIVE
    assert t.ranks[0].read_seat(3) == counted_out  # the agent never moved it back


@pytest.mark.timeout(30)
def test_a_rank_whose_agent_took_its_seat_and_vanished_counts_itself_once():
    """Node 1's agent took its ranks' seats and is gone before its add: the ranks count
    themselves at the store, their seats' compare_set answering them as taken already."""
    t = TwoNodes()
    for r in range(4):
        t.ranks[r].post_arrival(1, r, 4)
    t.relays[0].forward(t.relay_protocols[0])
    assert t.relay_protocols[1].take_seats(1, [(2, 0), (3, 0)]) == [True, True]
    t.boards[1].close()
    got, threads = t.node_1_awaits_barrier_1()
    decision = t.ranks[0].await_outcome(1, 0, 4, decide=t.decide_fn, timeout=10)
    for thread in threads:
        thread.join(10)
    assert decision.leader == 0 and got == {2: decision.to_json(), 3: decision.to_json()}
    assert t.server.add(t.ranks[0].key(1, "arrivals"), 0) == 4


@pytest.mark.timeout(30)
def test_the_event_comes_from_the_board_and_from_the_store_once_the_board_closed():
    t = TwoNodes()
    t.ranks[0].request_restart(0)
    assert t.relays[0].relay_event(t.relay_protocols[0], 0, lambda: False)
    ops = t.ranks[1].ops
    assert t.ranks[1].wait_event(0, 5) == "restart" and t.ranks[1].ops == ops  # no store call
    t.boards[1].close()
    assert t.ranks[2].wait_event(0, 5) == "restart" and t.ranks[2].ops == 1


@pytest.mark.timeout(30)
def test_a_leader_named_by_its_agent_and_lost_is_replaced_by_a_rank_at_the_store():
    """Rank 2 (slot 0 of node 1) leads barrier 1 as its agent named it, and dies before it
    decided. Its monitor's lost mark comes to both boards as the barrier's outcome; the other
    ranks then follow the barrier's terms at the store, where one takes the lead over."""
    t = TwoNodes()
    for r in (3, 2):
        t.ranks[r].post_arrival(1, r, 4)
    t.relays[1].forward(t.relay_protocols[1])
    for r in (0, 1):
        t.ranks[r].post_arrival(1, r, 4)
    t.relays[0].forward(t.relay_protocols[0])
    assert t.boards[1].leads(0) == 1  # rank 2 leads barrier 1 ... and dies now
    got: dict[str, object] = {}

    def run(name: str, fn) -> threading.Thread:  # type: ignore[no-untyped-def]
        def body() -> None:
            try:
                got[name] = fn()
            except Exception as e:  # reported below
                got[name] = e

        thread = threading.Thread(target=body, name=name)
        thread.start()
        return thread

    threads = [run(f"relay {n}", lambda n=n: t.relays[n].relay_decision(t.relay_protocols[n], 1, lambda: False))
               for n in (0, 1)]
    threads += [run(f"rank {r}", lambda r=r: t.ranks[r].await_outcome(1, r, 4, decide=t.decide_fn, timeout=10))
                for r in (0, 1, 3)]
    monitor = RestartProtocol(TCPStoreClient("127.0.0.1", t.server.port, timeout=10))
    fault = FaultRecord(2, 0, "killed", "SIGKILL", "rank 2 died leading barrier 1")
    assert count_out(monitor, 2, lambda i: fault, lambda b: 4, timeout=10, who="m2") == 1
    for thread in threads:
        thread.join(15)
    decisions = [got[f"rank {r}"] for r in (0, 1, 3)]
    assert all(isinstance(d, Decision) for d in decisions), got
    assert len({d.to_json() for d in decisions}) == 1  # type: ignore[attr-defined]
    d = decisions[0]
    assert d.term == 1 and d.terminated == [2] and d.leader in (0, 1, 3)  # type: ignore[attr-defined]
    assert [f.rank for f in d.faults] == [2]  # type: ignore[attr-defined]
    assert got["relay 0"] is True and got["relay 1"] is True, got
    for board in t.boards:  # each agent posted the final decision after the mark
        assert board.read_decision()[1] == d.to_json().encode()  # type: ignore[attr-defined]
