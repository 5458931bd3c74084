"""Simulated ranks, and how they share threads and connections in direct mode.

A real rank holds two client connections (main thread, restart trigger) and
runs on its own host. Here 16,384 ranks would need 32,768 sockets (over the
20,000 open files a process may hold), and a thread per rank costs about
0.2 ms of CPU per wake-up on a 2-core machine: the simulation would measure
thread switching, not the store. So each client process splits its ranks
into groups; a group has two connections (non-blocking operations; blocking
waits and gets) and one thread, which runs the library's calls for each of
its ranks in turn (:class:`Group`; node mode: :mod:`.nodes`).

Why the leader has a connection of its own: torch's client runs one call at
a time per connection. When the leader blocked on its group's waits
connection, the new thread could reach that connection first, whenever the
leader was descheduled between handing over and sending its wait: the
thread's get of the decision then held the connection, the leader's wait for
``ready`` queued behind it, and the decision never came (the harness stalled
until its timeout; about one run in three of the N = 64 test under a loaded
machine, reproduced at will by a 50 ms sleep at that point).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

from inprocess.control.node_link import NodeLink
from inprocess.control.protocol import COMPLETE, RestartProtocol

from .wire import Deferred, SharedStore, Tally

if TYPE_CHECKING:
    from .job import SimJob


def wire_totals(protocols: tuple[RestartProtocol, ...], tallies: tuple[Tally, ...]) -> tuple[int, int, int]:
    """(requests, bytes out, bytes in) over the connections of one rank or node."""
    return (sum(p.requests for p in protocols), sum(t.out for t in tallies), sum(t.inb for t in tallies))


class SimRank:
    """One simulated rank: a main and a trigger RestartProtocol, as in the wrapper.

    With a node link (node mode) both protocols hold it, as the wrapper's do
    when its node has an agent: the trigger's event and the barrier's outcome
    come from the node's board.
    """

    __slots__ = ("rank", "trigger", "main", "t_tally", "m_tally", "last_ops", "last", "t_woken", "link")

    def __init__(self, rank: int, call: int, op_conn: Any, wait_conn: Any, group: Any,
                 link: NodeLink | None = None):
        self.rank = rank
        self.link = link
        self.t_tally, self.m_tally = Tally(), Tally()
        self.trigger = RestartProtocol(SharedStore(op_conn, wait_conn, self.t_tally, group), call, link)
        self.main = RestartProtocol(SharedStore(op_conn, wait_conn, self.m_tally, group), call, link)
        self.last_ops = 0
        self.last = (0, 0, 0)
        self.t_woken = 0

    @property
    def ops(self) -> int:
        return self.trigger.ops + self.main.ops

    def after_barrier_zero(self) -> None:
        """What the rank learnt taking its seat at the job's barrier 0, which the simulation does
        not run: the call's seats per key (control/seat_table.py). Setup: counted in no restart."""
        self.main.seat_table.per_key  # noqa: B018  # asked once, then known
        self.last_ops, self.last = self.ops, self.tally()

    def tally(self) -> tuple[int, int, int]:
        return wire_totals((self.trigger, self.main), (self.t_tally, self.m_tally))

    def unsent_get(self) -> None:
        """The main side's blocking get of the decision was deferred before it was
        sent (:class:`~.wire.Deferred`), but counted: ``wait_decision`` sends and
        counts it again."""
        counted = self.main.counted
        counted.calls -= 1
        counted.requests -= 2


class Group:
    """Simulated ranks that share two connections and one thread at a time (direct mode).

    Per iteration i the group's thread: (A) runs ``trigger.wait_event(i)``
    for each rank in turn (the first blocks until the fault, the others find
    the key set; each rank still sends its own blocking get: WAIT + GET on
    the wire); (B) runs ``main.barrier(i+1, ...)`` for each rank in turn; a
    non-leader's wait for the decision is deferred (:class:`~.wire.Deferred`,
    nothing is sent) so that the next rank of the group can arrive; if the
    leader is in the group, its wait for ``ready`` hands the rest of the group
    to a new thread and blocks, as a real leader would, on a connection of its
    own (the process's leader connection) which it keeps for the rest of the
    barrier; (C) runs ``main.wait_decision(i+1)`` for each deferred rank
    (the first blocks until the decision, the others find it set).
    """

    def __init__(self, job: SimJob, name: str):
        self.job = job
        self.name = name
        self.ranks: list[SimRank] = []
        self._tls = threading.local()
        self.iteration = 0
        self.todo: collections.deque[SimRank] = collections.deque()
        self.deferred: list[SimRank] = []
        self.leader_thread: threading.Thread | None = None
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)

    # -- Turns --------------------------------------------------------------

    def arriving(self) -> bool:
        return getattr(self._tls, "arriving", False)

    def leading(self) -> bool:
        return getattr(self._tls, "leading", False)

    def hand_over(self) -> None:
        self._tls.arriving = False  # this thread stays with the leader
        self._tls.leading = True  # and uses the leader connection from now on (see SharedStore)
        self.leader_thread = threading.current_thread()
        self.thread = threading.Thread(target=self.run, args=(True,), name=self.name + "+", daemon=True)
        self.thread.start()

    def lead_connection(self) -> Any:
        return self.job.conns.lead

    # -- the group's thread -------------------------------------------------

    def members(self, iteration: int) -> list[SimRank]:
        return [r for r in self.ranks if self.job.alive_in(r.rank, iteration)]

    def run(self, resume: bool = False) -> None:
        job = self.job
        try:
            while True:
                i = self.iteration
                if not resume:
                    members = self.members(i)
                    job.bump(job.armed, i)
                    if not members:
                        if not job.runs_again(self.ranks, i + 1):
                            return
                        self.iteration = i + 1  # its ranks come back later (joiners): skip to that iteration
                        continue
                    complete = False
                    for rs in members:  # (A)
                        if rs.trigger.wait_event(i, job.timeout_s) == COMPLETE:
                            complete = True
                        rs.t_woken = time.monotonic_ns()
                    if complete:
                        return
                    self.todo = collections.deque(members)
                    self.deferred = []
                    self.leader_thread = None
                resume = False
                if self._arrive(i):
                    return  # this thread led the barrier; its successor goes on
                for rs in self.deferred:  # (C)
                    job.record(rs, i, rs.main.wait_decision(i + 1, job.timeout_s))
                if self.leader_thread is not None:
                    self.leader_thread.join(job.timeout_s)
                self.iteration = i + 1
        except BaseException as e:  # reported to the driver, which fails the run
            job.fail(f"{self.name}: {type(e).__name__}: {e}")

    def _arrive(self, i: int) -> bool:
        """(B) Returns True if this thread led the barrier and handed the group over."""
        job = self.job
        self._tls.arriving = True
        try:
            while self.todo:
                rs = self.todo.popleft()
                try:
                    decision = rs.main.barrier(
                        i + 1, rs.rank, job.world_size[i], decide=job.decide_fn(i), timeout=job.timeout_s
                    )
                except Deferred:
                    rs.unsent_get()
                    self.deferred.append(rs)
                    continue
                assert decision is not None
                job.record(rs, i, decision)
                if self.leader_thread is threading.current_thread():
                    return True
            return False
        finally:
            self._tls.arriving = False
