"""A process that joins a running job goes through its node's agent (issue 21, item 5): once
admitted, its restart barriers go through the node board like any linked rank's, whatever the
process it replaced left in its slot; a joiner whose node has no agent talks to the store.

First over one board and a real TCPStore in this process (the relay is the agent's own code),
then as a real job: 2 nodes x 2 ranks, node agents, SIGKILLed ranks, replacements with
INPROCESS_JOIN=1."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from conftest import WORKERS
from inprocess import _native
from inprocess.compose import Compose
from inprocess.control import seats
from inprocess.control.joining import ADMITTED, JoinKeys, Outcome
from inprocess.control.membership import Membership
from inprocess.control.node_link import HELLO, NodeLink, socket_name
from inprocess.control.protocol import Decision, RestartProtocol, SeatTaken
from inprocess.control.store_ops import CountingStore
from inprocess.engine import join, runtime
from inprocess.launch import LocalJob
from inprocess.processes.node_relay import NodeRelay
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, decide
from inprocess.state import State
from test_join_liveness import WRAPPER, announcement_of, finish, job_env, join_job, read_logs, until

# -- one node's board and relay, in this process, over a real TCPStore --------------------------


class OneNode:
    """Seats 0 and 1 on one node (slots 0 and 1) with its relay. Seat 1's first process (life 0)
    was counted out at barrier 2 by its monitor after it had posted that arrival, which the relay
    refused; the leader of barrier 3 admitted a joiner into seat 1 (life 1): its seat holds 3@1."""

    def __init__(self) -> None:
        timeout = datetime.timedelta(seconds=10)
        self.server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout, wait_for_workers=False)

        def client() -> dist.TCPStore:
            return dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=timeout)

        self.client = client
        self.board = _native.NodeBoard.create(2, 4096)
        self.relay = NodeRelay(self.board)
        self.relay_protocol = RestartProtocol(client())
        self.rank0 = RestartProtocol(client(), link=NodeLink(self.board, 0))
        self.old = RestartProtocol(client(), link=NodeLink(self.board, 1))  # seat 1, life 0
        self.joiner = RestartProtocol(client(), link=NodeLink(self.board, 1))  # seat 1, life 1
        self.joiner.life = 1
        self.rank0.seat_table.write({0: "1", 1: "t2:m1"})
        self.old.post_arrival(2, 1, 2)  # the first process's last arrival, ...
        assert self.relay.forward(self.relay_protocol) == 0  # ... refused: its seat was counted out
        assert self.board.leads(1) == -1 and self.board.forwarded(1) == -1
        # Seat 0 went through barriers 2 and 3 (its store side is not what these tests look at).
        self.rank0.seat_table.write({0: "3", 1: seats.healthy(3, 1)})  # barrier 3's leader admitted the joiner
        self.assignment = Compose(ActivateAllRanks(), ShiftRanks())

    def decide_fn(self, barrier: int) -> Callable[[set[int], list[Any], int], Decision]:
        def decide_barrier(dead: set[int], faults: list[Any], leader: int) -> Decision:
            return decide(self.assignment, Membership.all_active(2), dead, faults, barrier, leader)

        return decide_barrier

    def arrives(self, p: RestartProtocol, seat: int) -> Callable[[], Decision]:
        """``p`` (seat ``seat``) arrives at barrier 4: through the board, as a rank of the job does."""
        return lambda: p.barrier(4, seat, 2, decide=self.decide_fn(4), timeout=20)

    def barrier_4(self, arrivals: dict[int, Callable[[], Decision]]) -> dict[int, Decision]:
        """Each seat's arrival at barrier 4 runs on a thread of its own, while the relay runs as
        the agent's two threads do (each over a connection of its own); the decision each got."""
        got: dict[int, Decision] = {}
        stop = threading.Event()

        def arrive(seat: int) -> None:
            got[seat] = arrivals[seat]()

        def relay() -> None:
            while not stop.is_set():
                self.relay.forward(self.relay_protocol)
                time.sleep(0.01)

        def broadcast() -> None:
            self.relay.relay_decision(RestartProtocol(self.client()), 4, stop.is_set)

        threads = [threading.Thread(target=relay), threading.Thread(target=broadcast)]
        threads += [threading.Thread(target=arrive, args=(seat,)) for seat in arrivals]
        for thread in threads:
            thread.start()
        for thread in threads[2:]:
            thread.join(30)
        stop.set()
        for thread in threads[:2]:
            thread.join(30)
        return got


@pytest.mark.timeout(60)
def test_a_joiner_takes_its_seat_through_the_board_in_its_new_life_past_the_old_process_slot() -> None:
    """The slot holds the first process's refused arrival at barrier 2 (its role word says so); the
    joiner's arrival at barrier 4 is counted by the relay with its seat moved from 3@1 to 4@1, and
    the joiner makes no store call for the barrier."""
    node = OneNode()
    got = node.barrier_4({0: node.arrives(node.rank0, 0), 1: node.arrives(node.joiner, 1)})
    assert sorted(got) == [0, 1] and got[0].to_json() == got[1].to_json()
    assert node.board.forwarded(1) == 4 and node.relay.forwarded == [4, 4]
    assert node.rank0.read_seat(1) == seats.healthy(4, 1) and node.rank0.read_seat(0) == "4"
    assert node.server.add(node.rank0.key(4, "arrivals"), 0) == 2  # each counted once, in one add
    assert node.relay.adds == 1
    leader = got[0].leader
    # The rank that did not lead made no store call at all; the leader only its decision's.
    assert (node.rank0 if leader == 1 else node.joiner).ops == 0


@pytest.mark.timeout(60)
def test_the_replaced_process_late_arrival_goes_to_the_store_and_is_told_it_was_counted_out() -> None:
    """The joiner posted at barrier 4; the process it replaced, still alive and late, arrives at
    barrier 2: it must not take the slot back (the joiner's arrival stays), it goes to the store,
    where its seat (in the joiner's life) says it was counted out."""
    node = OneNode()
    node.joiner.post_arrival(4, 1, 2)
    with pytest.raises(SeatTaken):
        node.old.barrier(2, 1, 2, decide=node.decide_fn(2), timeout=5)
    assert node.joiner.link is not None and node.joiner.link.posted() == 4
    assert node.rank0.read_seat(1) == seats.healthy(3, 1)  # untouched


@pytest.mark.timeout(60)
def test_a_joiner_whose_arrival_the_old_process_overwrote_posts_it_again() -> None:
    """The old process posts its barrier-2 arrival over the joiner's barrier-4 one before the relay
    read it (its look at the slot came first): the relay does not count it (it refused the slot at
    that barrier already), the joiner, waiting for its outcome, sees its slot hold an older barrier
    within one board poll and posts again; barrier 4 completes with each seat counted once."""
    node = OneNode()
    node.joiner.post_arrival(4, 1, 2)  # the first half of the joiner's barrier ...
    node.board.arrive(1, 2, 2, 1, 0)  # ... the old process, past its look at the slot ...
    awaits = lambda: node.joiner.await_outcome(4, 1, 2, decide=node.decide_fn(4), timeout=20)  # noqa: E731
    got = node.barrier_4({0: node.arrives(node.rank0, 0), 1: awaits})  # ... and its second half
    assert sorted(got) == [0, 1] and got[0].to_json() == got[1].to_json()
    assert node.board.forwarded(1) == 4 and node.rank0.read_seat(1) == seats.healthy(4, 1)
    assert node.server.add(node.rank0.key(4, "arrivals"), 0) == 2


@pytest.mark.timeout(30)
def test_the_board_wait_for_news_wakes_on_a_later_decision_or_event_only() -> None:
    """NodeBoard.wait_news: what a waiting joiner sleeps on (the notice futex, across threads here)."""
    board = _native.NodeBoard.create(2, 4096)
    assert board.wait_news(-1, -1, 0.05) == -1  # nothing posted: times out
    board.post_decision(3, b"{}")
    board.post_event(3, False)  # event word 6
    assert board.wait_news(-1, 6, 0) == 1 and board.wait_news(3, -1, 0) == 1
    board.set_leader(0, 4)  # a post that is neither: no news
    assert board.wait_news(3, 6, 0.05) == -1
    woke: list[tuple[int, float]] = []
    start = time.monotonic()
    thread = threading.Thread(target=lambda: woke.append((board.wait_news(3, 6, 20), time.monotonic() - start)))
    thread.start()
    time.sleep(0.3)
    board.post_decision(4, b"{}")
    thread.join(20)
    assert woke and woke[0][0] == 1 and 0.3 <= woke[0][1] < 10, woke
    with pytest.raises(ValueError, match="decision_after -2"):
        board.wait_news(-2, 0, 0)
    with pytest.raises(ValueError, match="event_after -2"):
        board.wait_news(0, -2, 0)
    board.close()
    assert board.wait_news(100, 100, 5) == -2  # closed: at once


@pytest.mark.timeout(60)
def test_a_waiting_joiner_reads_its_record_once_per_board_news_and_takes_the_admitting_decision_from_it() -> None:
    """A joiner linked to its node's board waits for its admission without store calls while the
    board holds no news (no read for 3 s: a store wait reads twice a second); a posted event costs
    it one read of its record; its admission, told at the store and decided on the board only, costs
    one read more, and the decision it returns is the board's (the store never held one)."""
    node = OneNode()
    joiner = node.joiner
    joiner.life = 0  # not admitted yet: it learns its life from its admission
    keys = JoinKeys(CountingStore(node.client()), joiner.call, joiner.incarnation)
    keys.name_running_incarnation()
    node.rank0.seat_table.write({1: "t2:m1"})  # free: counted out at barrier 2
    node.board.post_event(2, False)  # the restart after iteration 2 is under way
    state = State(rank=1, world_size=2)
    got: list[Decision] = []
    thread = threading.Thread(target=lambda: got.append(join.wait_for_admission(
        joiner, state, "host-42-beef", {"function": "f"}, None, stamp=lambda: None, timeout=20)))
    thread.start()
    try:
        token = until("the joiner announced", lambda: next(
            (a.token for _, a in keys.pending()[1] if a.token == "host-42-beef"), None), timeout=20)
        time.sleep(0.5)  # past its first read of its record
        calls = joiner.counted.calls
        time.sleep(3)
        assert joiner.counted.calls == calls  # nothing on the board: no store call
        node.board.post_event(3, False)  # the next restart: one look at its record
        until("the joiner's look", lambda: joiner.counted.calls == calls + 1, timeout=10)
        time.sleep(1.5)
        assert joiner.counted.calls == calls + 1
        admitted = Outcome(ADMITTED, barrier=4, seat=1, life=1)
        assert keys.resolve(token, admitted) == admitted
        keys.tell([(token, admitted)])
        decision = node.decide_fn(4)(set(), [], 0)
        node.board.post_decision(4, decision.to_json().encode())
        thread.join(20)
    finally:
        node.board.close()  # a joiner still waiting goes to the store, which ends its wait
        thread.join(30)
    assert [d.to_json() for d in got] == [decision.to_json()]
    assert joiner.life == 1 and joiner.counted.calls == calls + 2  # its record, read once more


# -- a joiner's link to its node's agent: none there, or one that is slow to hand out its board -------


def test_a_joiner_stops_asking_for_an_agent_that_is_not_there_after_absent_s() -> None:
    """A replaced node has no agent and none will start (joiners never start one): its joiner used to
    retry refused connections for 2 s before it went to the store; it now gives up after absent_s."""
    name = b"\0inprocess-test-no-agent-" + str(time.monotonic_ns()).encode()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no node agent listening"):
        NodeLink.connect(name, 0, 30, absent_s=runtime.JOINER_AGENT_ABSENT_S)
    assert time.monotonic() - start < 1.0  # not the 30 s connect timeout
    assert runtime.JOINER_AGENT_ABSENT_S < runtime.JOINER_AGENT_CONNECT_S


def test_an_agent_that_accepts_late_still_hands_its_board_to_a_joiner_within_the_connect_timeout() -> None:
    """absent_s cuts only refusals: an agent that accepted has the whole timeout to send its board
    (a loaded node agent may answer its listener late)."""
    name = b"\0inprocess-test-slow-agent-" + str(time.monotonic_ns()).encode()
    board = _native.NodeBoard.create(2, 4096)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(4)

    def serve_late() -> None:
        conn, _ = listener.accept()
        time.sleep(0.5)  # longer than absent_s
        socket.send_fds(conn, [HELLO], [board.fd])
        time.sleep(2)
        conn.close()

    thread = threading.Thread(target=serve_late, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        link = NodeLink.connect(name, 1, runtime.JOINER_AGENT_CONNECT_S, absent_s=runtime.JOINER_AGENT_ABSENT_S)
        took = time.monotonic() - start
        try:
            assert took >= 0.5 and link.board.slots == 2 and link.board.agent_pid == os.getpid()
        finally:
            link.close()
            link.board.unmap()
    finally:
        thread.join(10)
        listener.close()
        board.unmap()


# -- a real job: 2 nodes x 2 ranks, node agents, SIGKILLed ranks, replacements that join -----------

JOB_WRAPPER = {**WRAPPER}  # barrier_timeout 150 s: agent_connect_s is min(150, 30) = 30 s


def attach_board(job: LocalJob, node: int) -> Any:
    """Node ``node``'s board, mapped in this process. The connection the agent counts is closed at
    once: only the node's ranks keep its agent alive (it exits once they have all left)."""
    env = job.rank_env(node * job.ranks_per_node)
    link = NodeLink.connect(socket_name("127.0.0.1", job.port, 0, str(node), env), 0, 30)
    link.close()
    return link.board


def agent_listens(job: LocalJob, node: int) -> bool:
    env = job.rank_env(node * job.ranks_per_node)
    try:
        NodeLink.connect(socket_name("127.0.0.1", job.port, 0, str(node), env), 0, 0.2).close()
    except (TimeoutError, OSError, RuntimeError):
        return False
    return True


def running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def output_of(job: LocalJob, seat: int, life: int) -> str:
    rp = job.ranks[seat] if life == 0 else [r for r in job.respawned if r.rank == seat][life - 1]
    return rp.output or ""


@pytest.mark.timeout(420)
def test_an_admitted_joiner_arrives_at_every_later_restart_through_its_node_agent(tmp_path: pathlib.Path) -> None:
    """2 nodes x 2 ranks, each node's agent started by its local rank 0, a grow policy. Seat 1 (node
    0, slot 1) is SIGKILLed; its replacement links to node 0's agent (still serving seat 0) and is
    admitted by a grow at barrier 2. Then seat 3 (node 1) is SIGKILLed (barrier 3) and its
    replacement is admitted by a grow (barrier 4). At barriers 3 and 4 node 0's agent counted slot 1:
    the joiner's arrivals went through the board, not to the store. Every rank ends with the same
    parameters at world 4, and both agents exit once their ranks left."""
    out = tmp_path / "out"
    out.mkdir()
    plan = {"steps": 30, "step_s": 0.03, "active": 4, "wrapper": JOB_WRAPPER, "pg_timeout": 150,
            "grow": {"check_every": 2}, "until_world": 4, "steps_at_full": 15,
            "kills": [{"seat": 1, "life": 0, "step": 5},
                      {"seat": 3, "life": 0, "steps_in": 5, "from_iteration": 2, "at_world": 4}]}
    with join_job([str(WORKERS / "join_worker.py")], 4, env=job_env(out, plan), ranks_per_node=2) as job:
        until("seat 1 killed", lambda: job.ranks[1].popen.poll() is not None)
        boards = [attach_board(job, node) for node in (0, 1)]
        agents = [board.agent_pid for board in boards]
        job.respawn(1, 1)
        # Node 0's slot 1 as its agent counted it, while the job runs (each barrier's value stays
        # for seconds: the next one needs a replacement process started, and a grow).
        counted: set[int] = set()

        def seat_3_replaced() -> bool:
            counted.add(boards[0].forwarded(1))
            if job.ranks[3].popen.poll() is not None and not any(r.rank == 3 for r in job.respawned):
                job.respawn(3, 1)
            return any(r.rank == 3 for r in job.respawned)

        until("seat 3 killed and replaced", seat_3_replaced, timeout=240)
        until("barrier 4 counted", lambda: counted.add(boards[0].forwarded(1)) or 4 in counted, timeout=240)
        text = finish(job, 240)
        # Both agents exit once the ranks of their node have left (the joiners' links included).
        until("the node agents exited", lambda: not any(running(pid) for pid in agents), timeout=30)
    logs = read_logs(out)
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat0.life0", "seat1.life1", "seat2.life0", "seat3.life1"], (sorted(finishers), text)
    assert {r["active_world_size"] for r in finishers.values()} == {4}
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1, text
    restarts = finishers["seat0.life0"]["restarts"]
    assert [r["terminated"] for r in restarts] == [[1], [], [3], []], restarts
    assert [r["joined"] for r in restarts] == [[], [1], [], [3]], restarts
    # Seat 1's first process was counted by the agent at barrier 0 only; its replacement, admitted at
    # barrier 2, at 3 and at 4: through the board. Had it gone to the store, slot 1 would stay at 0.
    assert {3, 4} <= counted and max(counted) == 4 and boards[0].forwarded(1) == 4, counted
    joiner = output_of(job, 1, 1)
    assert re.search(r"rank 1: joins through node 0's agent \(pid \d+\), slot 1", joiner), joiner[-3000:]
    assert re.search(r"rank 1: waiting to join the running job \(token [^)]+\), on node board slot 1", joiner)
    assert "talks to the store directly" not in joiner, joiner[-3000:]
    assert re.search(r"rank 3: joins through node 1's agent", output_of(job, 3, 1)), text


@pytest.mark.slow  # a real 4-process job (~20 s): the suite stays within CI's time
@pytest.mark.timeout(420)
def test_a_waiting_joiner_alone_keeps_its_node_agent_which_admits_it_and_counts_it_later(
        tmp_path: pathlib.Path) -> None:
    """2 nodes x 2 ranks. Seat 1 is SIGKILLed and its replacement links to node 0's agent and waits;
    then seat 0, which started that agent, is SIGKILLed: the waiting joiner's link alone keeps the
    agent running, the restart admits the joiner (its decision relayed by that agent), and when
    seat 3 is SIGKILLed the agent counts the joiner at that barrier. The job ends with seats 1 and 2,
    equal parameters, and the agent exits once the joiner left."""
    out = tmp_path / "out"
    out.mkdir()
    plan = {"steps": 40, "step_s": 0.03, "active": 4, "wrapper": JOB_WRAPPER, "pg_timeout": 150,
            "kills": [{"seat": 1, "life": 0, "step": 5}, {"seat": 0, "life": 0, "step": 12, "after_joiners": 1},
                      {"seat": 3, "life": 0, "steps_in": 5, "from_iteration": 2}]}
    with join_job([str(WORKERS / "join_worker.py")], 4, env=job_env(out, plan), ranks_per_node=2) as job:
        until("seat 1 killed", lambda: job.ranks[1].popen.poll() is not None)
        board = attach_board(job, 0)
        agent = board.agent_pid
        job.respawn(1, 1)
        until("seat 0 killed", lambda: job.ranks[0].popen.poll() is not None, timeout=240)
        until("barrier 3 counted for slot 1", lambda: board.forwarded(1) == 3, timeout=240)
        assert running(agent), "node 0's agent exited while the joiner was linked to it"
        text = finish(job, 240)
        until("node 0's agent exited", lambda: not running(agent), timeout=30)
    logs = read_logs(out)
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat1.life1", "seat2.life0"], (sorted(finishers), text)
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1, text
    restarts = finishers["seat2.life0"]["restarts"]
    assert [r["terminated"] for r in restarts] == [[1], [0], [3]], restarts
    assert [r["joined"] for r in restarts] == [[], [1], []], restarts
    joiner = output_of(job, 1, 1)
    assert re.search(r"rank 1: waiting to join the running job \(token [^)]+\), on node board slot 1", joiner)
    assert "rank 1: admitted at barrier 2 (life 1 of its seat)" in joiner, joiner[-3000:]
    assert "talks to the store directly" not in joiner, joiner[-3000:]


@pytest.mark.slow  # a real 4-process job (~20 s): the suite stays within CI's time
@pytest.mark.timeout(420)
def test_a_joiner_whose_node_has_no_agent_joins_directly_without_waiting_for_one(tmp_path: pathlib.Path) -> None:
    """2 nodes x 2 ranks. Both ranks of node 1 are SIGKILLed: its agent exits. Seat 3's replacement
    finds no agent on node 1: it says so, starts none, announces itself well within agent_connect_s
    (30 s here) and is admitted by a grow; the job ends at world 3 with equal parameters."""
    out = tmp_path / "out"
    out.mkdir()
    plan = {"steps": 30, "step_s": 0.03, "active": 4, "wrapper": JOB_WRAPPER, "pg_timeout": 150,
            "grow": {"check_every": 2}, "until_world": 3, "steps_at_full": 15,
            "kills": [{"seat": 2, "life": 0, "step": 5}, {"seat": 3, "life": 0, "step": 5}]}
    with join_job([str(WORKERS / "join_worker.py")], 4, env=job_env(out, plan), ranks_per_node=2) as job:
        client = dist.TCPStore("127.0.0.1", job.port, 1, False, datetime.timedelta(seconds=30))
        keys = JoinKeys(CountingStore(client), 0, "")
        until("seats 2 and 3 killed", lambda: all(job.ranks[r].popen.poll() is not None for r in (2, 3)))
        until("node 1's agent gone", lambda: not agent_listens(job, 1), timeout=60)
        started = time.monotonic()
        joiner = job.respawn(3, 1)
        until("the joiner announced", lambda: announcement_of(keys, joiner.popen.pid), timeout=120)
        announced_s = time.monotonic() - started
        assert not agent_listens(job, 1)  # the joiner started none
        text = finish(job, 240)
    assert announced_s < 30, announced_s  # agent_connect_s: a joiner does not wait for an agent that is not there
    logs = read_logs(out)
    finishers = {name: log["result"] for name, log in logs.items() if log.get("result")}
    assert sorted(finishers) == ["seat0.life0", "seat1.life0", "seat3.life1"], (sorted(finishers), text)
    assert {r["active_world_size"] for r in finishers.values()} == {3}
    assert len({json.dumps(r["params"]) for r in finishers.values()}) == 1, text
    restarts = finishers["seat0.life0"]["restarts"]
    assert sorted(sum((r["terminated"] for r in restarts), [])) == [2, 3], restarts
    assert [r["joined"] for r in restarts][-1] == [3], restarts
    assert "rank 3: no node agent runs on node 1" in joiner.output, joiner.output[-3000:]
    # It stopped asking after JOINER_AGENT_ABSENT_S, not the 2 s connect timeout.
    assert f"within {runtime.JOINER_AGENT_ABSENT_S:.3g}s)" in joiner.output, joiner.output[-3000:]
    assert "joins through" not in joiner.output, joiner.output[-3000:]
