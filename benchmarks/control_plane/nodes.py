"""Simulated nodes (node mode): a board, its ranks, and the node agent's relay.

As the wrapper sets them up when the launcher describes several nodes: each
node has a :class:`inprocess._native.NodeBoard` and the node agent's
:class:`~inprocess.processes.node_agent.NodeRelay` over it, and its ranks are
linked to the board by local slot (``NodeLink(board, slot)``: no agent socket,
no pidfd). A group is a set of whole nodes; the relays run on the group's
thread and connections (broadcast side: blocking gets on the waits
connection; forward side: adds on the operations connection).

The relay is the agent's own (``--relay native``, the default):
:class:`~inprocess.processes.native_relay.NativeNodeRelay`, each step one C++
call over a :class:`inprocess._native.StoreConnection`; the group's nodes
share the group's two (forward; broadcast), where a real agent has two of its
own. ``--relay python`` runs :class:`NodeRelay` instead, as agents did before,
its gets and adds on the group's torch connections and its seats on the
group's ``TCPStoreClient`` (the same requests on the wire).

What differs from a real node: its board, its relay and its ranks live in one
client process and one thread, so the board's posts and waits never cross a
process and never wake a sleeper (each post still makes its FUTEX_WAKE
system call); a real agent forwards whatever arrived when its forward thread
wakes, so a node's arrivals may take several adds, where here the node's
ranks all post before its forward (one add per node, the fewest).
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from typing import TYPE_CHECKING, Any

from inprocess.control.protocol import COMPLETE, RestartProtocol
from inprocess.processes.native_relay import NativeNodeRelay
from inprocess.processes.node_relay import NodeRelay

from .ranks import SimRank, wire_totals
from .wire import SharedStore, Tally

if TYPE_CHECKING:
    from .job import SimJob


def _give_up() -> bool:
    """A relay's blocking get ran out its (capped) chunk: the simulation stalled."""
    return True


class SimNode:
    """One simulated node: its board, its ranks, and its agent's store traffic.

    ``relay`` is the library's relay over the node's board. A real agent runs
    it on two threads with a connection each (broadcast: blocking gets;
    forward: seats and adds); here the node's group runs both over two
    connections, with two RestartProtocols so that the broadcast and the
    forward side are counted apart (``events``, ``arrivals``). ``native``:
    the group's (forward, broadcast) StoreConnections for the native relay;
    None: the Python relay over ``SharedStore``.
    """

    __slots__ = ("index", "board", "relay", "ranks", "events", "arrivals", "e_tally", "a_tally", "last_ops", "last",
                 "native", "_digest")

    def __init__(self, index: int, call: int, board: Any, op_conn: Any, wait_conn: Any, group: NodeGroup,
                 cap_s: float, pipe: Any = None, native: tuple[Any, Any] | None = None):
        self.index = index
        self.board = board
        self.ranks: list[SimRank] = []
        self.e_tally, self.a_tally = Tally(), Tally()
        self.native = native is not None
        self.relay: Any
        if native is not None:
            forward_conn, broadcast_conn = native
            self.relay = NativeNodeRelay(board)
            self.events = RestartProtocol(broadcast_conn, call)
            self.arrivals = RestartProtocol(forward_conn, call, seats_per_key=board.slots)
        else:
            self.relay = NodeRelay(board)
            self.events = RestartProtocol(SharedStore(op_conn, wait_conn, self.e_tally, group, cap_s), call)
            self.arrivals = RestartProtocol(SharedStore(op_conn, wait_conn, self.a_tally, group, cap_s, pipe), call,
                                            seats_per_key=board.slots)
        self.last_ops = 0
        self.last = (0, 0, 0)
        self._digest = (-1, "")

    def after_barrier_zero(self) -> None:
        """What the node's agent learnt at the job's barrier 0, which the simulation does not run:
        the call's seats per key (control/seat_table.py). Setup: not counted in any restart."""
        self.arrivals.seat_table.per_key  # noqa: B018  # asked once, then known
        self.last_ops, self.last = self.ops, self.tally()

    def board_digest(self, barrier: int) -> str:
        """Digest of barrier ``barrier``'s decision as the board holds it ("" when it holds none: an
        overflow, or another barrier's). Read once per barrier: only this node's group thread posts
        to its board, so every rank that reads it in between reads these bytes."""
        if self._digest[0] != barrier:
            posted = self.board.read_decision()
            ok = posted is not None and posted[0] == barrier and posted[1] is not None
            self._digest = (barrier, hashlib.sha1(posted[1]).hexdigest()[:16] if ok else "")
        return self._digest[1]

    def _tallied(self, p: RestartProtocol, tally: Tally, step: Any) -> Any:
        """A native step's bytes on its connection (SharedStore tallies the Python relay's itself)."""
        if not self.native:
            return step()
        conn = p.store
        sent, received = conn.bytes_sent, conn.bytes_received
        try:
            return step()
        finally:
            tally.out += conn.bytes_sent - sent
            tally.inb += conn.bytes_received - received

    def relay_event(self, iteration: int) -> bool:
        return bool(self._tallied(self.events, self.e_tally,
                                  lambda: self.relay.relay_event(self.events, iteration, _give_up)))

    def forward(self) -> int:
        return int(self._tallied(self.arrivals, self.a_tally, lambda: self.relay.forward(self.arrivals)))

    def relay_decision(self, barrier: int) -> bool:
        go_on = bool(self._tallied(self.events, self.e_tally,
                                   lambda: self.relay.relay_decision(self.events, barrier, _give_up)))
        if self.native:  # the bytes it relayed, as SharedStore digests what the Python relay read
            self.e_tally.decision = self.board_digest(barrier) or self.e_tally.decision
        return go_on

    @property
    def ops(self) -> int:
        return self.events.ops + self.arrivals.ops

    def tally(self) -> tuple[int, int, int]:
        return wire_totals((self.events, self.arrivals), (self.e_tally, self.a_tally))


class NodeGroup:
    """Whole simulated nodes that share two connections and one thread at a time (node mode).

    Per iteration i the group's thread, for each node in turn:

    (A) ``relay.relay_event(i)`` (the first node's get blocks until the fault,
        the others find the event set: each node still sends its own WAIT +
        GET), then ``trigger.wait_event(i)`` for each of the node's ranks
        (answered by the board: no store request);
    (B) ``main.post_arrival(i+1)`` for each of the node's ranks (its arrival
        and its seat on the board: no store request), then ``relay.forward``
        (the node's seats, one ``compare_set`` per seat key, pipelined on the
        forward connection, then one ``add`` for the node's batch; the
        batch that completes the count also sets ``ready``). If the forward named one of
        the node's ranks the leader, that rank's ``await_outcome`` runs at
        once: it leads, and its wait for ``ready`` hands the group's remaining
        nodes to a new thread and blocks on the process's leader connection,
        as in direct mode;
    (C) ``relay.relay_decision(i+1)`` (the first node's get blocks until the
        leader published), then ``main.await_outcome(i+1)`` for each of the
        node's ranks but the leader (answered by the board).
    """

    def __init__(self, job: SimJob, name: str):
        self.job = job
        self.name = name
        self.nodes: list[SimNode] = []
        self.ranks: list[SimRank] = []
        self._tls = threading.local()
        self.iteration = 0
        self.live: list[tuple[SimNode, list[SimRank]]] = []  # this iteration's nodes with live ranks
        self.todo: collections.deque[tuple[SimNode, list[SimRank]]] = collections.deque()
        self.leader: SimRank | None = None
        self.leader_thread: threading.Thread | None = None
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)

    # -- Turns --------------------------------------------------------------

    def arriving(self) -> bool:
        return getattr(self._tls, "arriving", False)

    def leading(self) -> bool:
        return getattr(self._tls, "leading", False)

    def hand_over(self) -> None:
        self._tls.arriving = False
        self._tls.leading = True  # this thread stays with the leader, on the leader connection
        self.leader_thread = threading.current_thread()
        self.thread = threading.Thread(target=self.run, args=(True,), name=self.name + "+", daemon=True)
        self.thread.start()

    def lead_connection(self) -> Any:
        return self.job.conns.lead

    # -- the group's thread -------------------------------------------------

    def run(self, resume: bool = False) -> None:
        job = self.job
        try:
            while True:
                i = self.iteration
                if not resume:
                    self.live = []
                    for node in self.nodes:
                        ranks = [rs for rs in node.ranks if job.alive_in(rs.rank, i)]
                        if ranks:
                            self.live.append((node, ranks))
                    job.bump(job.armed, i)
                    if not self.live:
                        if not job.runs_again(self.ranks, i + 1):
                            return
                        self.iteration = i + 1  # its nodes come back later (joiners): skip to that iteration
                        continue
                    if self._wake(i):
                        return  # the call completed
                    self.todo = collections.deque(self.live)
                    self.leader = None
                    self.leader_thread = None
                resume = False
                if self._arrive(i):
                    return  # this thread led the barrier; its successor goes on
                self._outcome(i)
                if self.leader_thread is not None:
                    self.leader_thread.join(job.timeout_s)
                self.iteration = i + 1
        except BaseException as e:  # reported to the driver, which fails the run
            job.fail(f"{self.name}: {type(e).__name__}: {e}")

    def _wake(self, i: int) -> bool:
        """(A) Returns True when the event says the call completed."""
        job = self.job
        complete = False
        for node, ranks in self.live:
            if not node.relay_event(i):
                complete = True
            for rs in ranks:
                if rs.trigger.wait_event(i, job.timeout_s) == COMPLETE:
                    complete = True
                rs.t_woken = time.monotonic_ns()
        return complete

    def _arrive(self, i: int) -> bool:
        """(B) Returns True if this thread led the barrier and handed the group over."""
        job = self.job
        expected = job.world_size[i]
        while self.todo:
            node, ranks = self.todo.popleft()
            for rs in ranks:
                rs.m_tally.decision = ""
                rs.main.post_arrival(i + 1, rs.rank, expected)
            node.forward()
            for rs in ranks:
                assert rs.link is not None
                if rs.link.leads() != i + 1:
                    continue
                self.leader = rs
                self._tls.arriving = True  # its wait for "ready" hands the group over (see hand_over)
                try:
                    decision = rs.main.await_outcome(
                        i + 1, rs.rank, expected, decide=job.decide_fn(i), timeout=job.timeout_s
                    )
                finally:
                    self._tls.arriving = False
                job.record(rs, i, decision)
                if self.leader_thread is threading.current_thread():
                    return True
        return False

    def _outcome(self, i: int) -> None:
        """(C) Every rank of the group but the leader holds the decision."""
        job = self.job
        expected = job.world_size[i]
        decide = job.decide_fn(i)
        for node, ranks in self.live:
            node.relay_decision(i + 1)
            job.record_node(node, i)
            held = []
            for rs in ranks:
                if rs is self.leader:
                    continue
                decision = rs.main.await_outcome(i + 1, rs.rank, expected, decide=decide, timeout=job.timeout_s)
                held.append((rs, decision, time.monotonic_ns()))
                if not rs.m_tally.decision:  # read from the board (else from the store: it was too large)
                    rs.m_tally.decision = node.board_digest(i + 1)
            job.record_ranks(i, held)
