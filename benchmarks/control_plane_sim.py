"""Control-plane simulator: one restart of N simulated ranks against one TCPStore.

Runs the library's own store protocol (:class:`inprocess.control.protocol.RestartProtocol`,
:func:`inprocess.rank_assignment.decide` and the node agent's
:class:`inprocess.processes.node_agent.NodeRelay` over real
:class:`inprocess._native.NodeBoard` boards; imported, not copied) for N
simulated ranks and reports, per N, how long the restart's control plane takes
and what it costs the store::

    python benchmarks/control_plane_sim.py                  # N = 256 1024 4096 16384, node and direct mode
    python benchmarks/control_plane_sim.py --node-only      # node mode only
    python benchmarks/control_plane_sim.py --direct         # direct mode only (= --ranks-per-node 0)
    python benchmarks/control_plane_sim.py --n 1024 --restarts 5 --no-write
    python benchmarks/control_plane_sim.py --plot-from run.txt  # redraw the PNG from a saved run's stdout

Two modes, run one after the other for each N (same server, same connections):

* **node mode** (the default, ``--ranks-per-node`` 8): ranks are grouped in
  nodes of 8; each node has a board and an agent relay, as ``Wrapper`` sets
  them up when the launcher describes several nodes (``inprocess/node_agent.py``).
* **direct mode** (``--ranks-per-node 0``): every rank talks to the store
  itself, as without node agents.

One restart, as the wrapper does it (``inprocess/wrap.py``, ``trigger.py``,
``monitor.py``, ``node_agent.py``):

0. setup, not measured: every rank's seat (``inprocess/<call>/seat/<r>``) is
   written "0" with ``multi_set``, as the job's initial barrier (barrier 0)
   leaves it, and every monitor's heartbeat counter exists; the simulated
   restarts then go through barriers 1, 2, ...;
1. steady state: direct mode: every rank's restart trigger blocks in
   ``wait_event(i)`` (one blocking ``get`` of the event key); node mode:
   every node agent blocks in ``relay_event(i)`` (the same get, once per
   node) and every trigger waits on its node's board;
2. a fault: rank f dies and its monitor counts it out (``count_out``: reads
   and takes its seat, records the fault, requests the restart and arrives
   at barrier i+1 on its behalf, directly at the store in both modes;
   ``--kind killed``, the default), or rank f's main thread raises and
   reports (``--kind exception``);
3. the event wakes every rank's trigger (``wait_event`` returns "restart"),
   in node mode through the board where its agent posted it;
4. every rank arrives at barrier i+1. Direct mode (``barrier``): its seat
   (one ``compare_set``), then one ``add``; the first healthy arriver leads,
   runs ``decide`` with ``Compose(ActivateAllRanks(), ShiftRanks())`` and
   publishes the decision; the others read it with one blocking ``get``.
   Node mode (``post_arrival``, ``await_outcome``): its seat (one
   ``compare_set``), then its arrival on the board; the agent forwards the
   node's arrivals with one ``add`` (``NodeRelay.forward``; the batch that
   completes the count also sets ``ready``) and names a leader on the board
   when its batch holds the barrier's first healthy arrivals; the leader
   leads as in direct mode (``_lead``); the agent reads the decision with one
   blocking ``get`` (``NodeRelay.relay_decision``) and posts it on the board,
   where the node's ranks read it;
5. next iteration: every trigger (direct) or agent (node) blocks again on
   the event of iteration i+1.

After the restarts of each N, the steady state is measured: ``--heartbeat-rounds``
rounds in which every monitor sends what it sends once per
heartbeat interval (one ``add`` of its counter, one ``multi_get`` of the
counters of the next 8 ranks), as fast as the clients go, with the server's
CPU time per round; requests/s and server CPU % follow for the Wrapper's
default interval of 30 s. Monitors talk to the store directly in both modes.

Processes: the TCPStore server (``use_libuv=True``) lives alone in a
``python -c`` process; the simulated ranks (and, in node mode, their nodes'
boards and relays) live in ``--procs`` client processes, which in node mode
hold whole nodes; this driver process only commands them and reads CPU times
from ``/proc``. Every connection goes to 127.0.0.1 (torch itself
reverse-resolves each connected address, see ``CHILD_ENV``).

How simulated ranks share connections and threads, and what that changes.
A real rank holds two client connections (main thread, restart trigger) and
runs on its own host. Here 16,384 ranks would need 32,768 sockets (over the
20,000 open files a process may hold), and a thread per rank costs about
0.2 ms of CPU per wake-up on this machine: the simulation would measure
thread switching, not the store. So each client process splits its ranks
into ``--groups`` groups; a group has two connections (non-blocking
operations; blocking waits and gets) and one thread, which runs the
library's calls for each of its ranks in turn. Direct mode (``Group``):

(A) ``trigger.wait_event(i)`` for each rank: the first blocks until the
    fault, the others find the event set (each rank still sends its own
    blocking get: WAIT + GET on the wire);
(B) ``main.barrier(i+1, ...)`` for each rank: a non-leader's blocking get of
    the decision is deferred (the store raises ``_Deferred``, nothing is
    sent), so that the next rank of the group can arrive; if the leader is
    in the group, its wait for ``ready`` hands the group's remaining ranks to
    a new thread and blocks, as a real leader would, on a connection of its
    own (the process's leader connection) which it keeps for the rest of the
    barrier;
(C) ``main.wait_decision(i+1)`` for each deferred rank, which is what
    ``barrier`` returns for a non-leader: the first blocks until the
    decision, the others find it set.

Node mode (``NodeGroup``): a group is a set of whole nodes; the node agents'
relays run on the group's thread and connections (broadcast side: blocking
gets on the waits connection; forward side: adds on the operations
connection); for each node in turn:

(A) ``relay.relay_event(i)`` (the group's first node blocks until the fault,
    the others find the event set: each node still sends its own WAIT +
    GET), then ``trigger.wait_event(i)`` for each of the node's ranks
    (answered by the board);
(B) ``main.post_arrival(i+1)`` for each of the node's ranks (its seat in the
    store, then its arrival on the board), then ``relay.forward`` (one
    ``add`` for the node). If that named one of the node's ranks the leader,
    the rank's ``await_outcome`` runs at once and leads; its wait for
    ``ready`` hands the group's remaining nodes to a new thread, and it goes
    on, on the process's leader connection, as in direct mode;
(C) ``relay.relay_decision(i+1)`` (the first blocks until the leader
    published), then ``main.await_outcome(i+1)`` for each of the node's ranks
    but the leader (answered by the board).

Why the leader has a connection of its own: torch's client runs one call at
a time per connection. When the leader blocked on its group's waits
connection, the new thread could reach that connection first, whenever the
leader was descheduled between handing over and sending its wait: the
thread's get of the decision then held the connection, the leader's wait for
``ready`` queued behind it, and the decision never came (the harness stalled
until its timeout; about one run in three of the N = 64 test under a loaded
machine, reproduced at will by a 50 ms sleep at that point).

What is measured: every rank (and in node mode every node's relay) sends the
server exactly the requests, keys and values of the real protocol, in its
real order; ``RestartProtocol.ops`` is counted per rank (the deferred get
once) and per node (its relay's two protocols). The fault's monitor knows the
expected count from the simulator, where a real monitor reads the previous
decision (one more blocking get, for one process). What differs from a real
job: (a) at most P*(groups+1) requests are in flight and as many waits are
parked on the server (a real job parks N waits in direct mode, one per node
in node mode, and sends up to N requests at once); (b) within a group the
ranks (and nodes) are served one after another, so a rank's time includes
its predecessors' round trips; (c) the Python work of all N ranks (protocol
code, syscalls) shares this machine's 2 cores with the server, where a real
job spreads it over N hosts. The times are therefore an upper bound for the
control plane; the server's own CPU time per restart (from /proc) is the
part a real job cannot spread: the TCPStore server is one event-loop thread.
(d) Over loopback the kernel runs the receiver's TCP receive path and
wake-up inside the sender's ``write``: the server's CPU per request includes
work that a network would do on the client's host. (e) With ``--decode
shared`` (the default) the ranks of one client process share one
``Decision.from_json`` of the identical decision bytes (each rank still
fetches the bytes, from the store or its board); decoding builds the whole
membership, O(N) per rank (about 0.5 ms at 16,384), which a real job pays
once per rank in parallel: it is measured and reported in the "decode"
column. ``--decode every-rank`` decodes on every rank (the tests use it).
Node mode only: (f) a node's board, its relay and its ranks live in one
client process and one thread, so the board's posts and waits never cross
a process and never wake a sleeper: the harness calls a rank's board wait
after the relay posted, and it returns at once (each post still makes its
FUTEX_WAKE system call); a real board is shared by the node's separate
processes, whose waits sleep and are woken across processes (a futex
wake-up and a context switch per waiter, on the node's own cores). (g) A real agent forwards
whatever arrived when its forward thread wakes, so a node's arrivals may
take several adds; here the node's ranks all post before its forward: one
add per node, the fewest. (h) A real agent talks through the torch-free
``TCPStoreClient`` on two connections of its own; here the relays use the
group's torch connections: the same requests on the wire. (i) A real job
still opens two connections per rank (and the monitors'), of which node
mode uses one request per rank per restart; the agents add two per node.

Bytes per rank are estimated from the torch TCPStore wire format: 1 byte
query type, strings and values sent as an 8-byte length plus the bytes (keys
with the client's "/" prefix), 8-byte integers, 1-byte wait/check answers; a
``get`` (and a ``multi_get``) is a WAIT then a GET on the wire (two
requests); ``set`` and ``append`` have no answer. TCP/IP headers are not
counted.

Outputs: a table and one JSON line on stdout; with writing enabled (default),
``benchmarks/control_plane.png`` (time against N, both modes) and the results
block of ``benchmarks/control_plane.md``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from inprocess import _native
from inprocess.control.membership import ACTIVE, TERMINATED, Membership
from inprocess.control.node_link import NodeLink
from inprocess.control.protocol import (
    COMPLETE,
    WAIT_CHUNK_S,
    Decision,
    FaultRecord,
    RestartProtocol,
    monitor_heartbeat_key,
)
from inprocess.processes.node_agent import DECISION_CAPACITY, NodeRelay
from inprocess.rank_assignment import ActivateAllRanks, Compose, ShiftRanks, decide

HOST = "127.0.0.1"
WATCHED_PEERS = 8  # peers whose heartbeat counters each monitor reads per interval (inprocess.processes.monitor)
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PNG = os.path.join(HERE, "control_plane.png")
DEFAULT_MD = os.path.join(HERE, "control_plane.md")
MD_BEGIN = "<!-- control-plane results: begin (written by control_plane_sim.py) -->"
MD_END = "<!-- control-plane results: end -->"

# The server: alone in its process, until its stdin closes (the driver closes
# it or exits) or the driver dies (PR_SET_PDEATHSIG), so that it cannot
# outlive the driver.
SERVER_CODE = """
import ctypes, datetime, os, signal, sys
ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))
if os.getppid() == 1:
    sys.exit(1)
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True,
                      timeout=datetime.timedelta(seconds=600))
sys.stdout.write(f"{store.port}\\n")
sys.stdout.flush()
sys.stdin.read()
"""


@dataclasses.dataclass
class SimConfig:
    procs: int = 2  # client processes
    groups: int = 16  # groups of simulated ranks per client process (one thread, two connections each)
    restarts: int = 5  # restarts per N (one fault each); figures are medians over them
    kind: str = "killed"  # "killed" (monitor reports, rank leaves) or "exception" (rank reports, stays)
    decode: str = "shared"  # "shared" or "every-rank" (see the module docstring)
    ranks_per_node: int = 8  # ranks per node agent and board; 0: every rank talks to the store directly
    check_membership: bool = False  # every rank hashes its decoded table (O(N) per rank: small N only)
    settle_s: float = 0.3  # after all ranks armed their waits, before measuring
    steady_s: float = 1.0  # idle window measured before each fault (every trigger parked)
    heartbeat_rounds: int = 3  # rounds of monitor heartbeats measured per N (median)
    heartbeat_interval_s: float = 30.0  # the Wrapper's default heartbeat_interval
    timeout_s: float = 120.0  # every wait and every message from a process


# ---------------------------------------------------------------------------
# Wire model of the torch TCPStore client (see the module docstring)
# ---------------------------------------------------------------------------


def _as_bytes(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _key(key: str) -> int:
    return 8 + 1 + len(key.encode())  # length, "/" prefix, key


class Tally:
    """What one simulated rank (or one fault reporter) sent through the store."""

    __slots__ = ("requests", "out", "inb", "decision")

    def __init__(self) -> None:
        self.requests = 0  # requests on the wire (a get counts 2: WAIT + GET)
        self.out = 0  # bytes sent
        self.inb = 0  # bytes received
        self.decision = ""  # digest of the decision bytes this rank published or read

    def snapshot(self) -> tuple[int, int, int]:
        return self.requests, self.out, self.inb

    @staticmethod
    def total(*tallies: "Tally") -> tuple[int, int, int]:
        """(requests, bytes out, bytes in) summed over the connections of one rank or node."""
        return (sum(t.requests for t in tallies), sum(t.out for t in tallies), sum(t.inb for t in tallies))


class Connections:
    """The TCPStore client connections of one client process.

    Two per group (non-blocking operations; blocking waits and gets), one for
    the barrier's leader once it blocks (see ``Group.hand_over``) and one for
    control (fault injection, end of job).
    """

    def __init__(self, port: int, groups: int, timeout_s: float):
        import torch.distributed as dist

        td = datetime.timedelta(seconds=timeout_s)

        def connect(_: int) -> Any:
            return dist.TCPStore(HOST, port, is_master=False, wait_for_workers=False, use_libuv=True, timeout=td)

        # Connect a few at a time: a connect may wait on the resolver (see CHILD_ENV).
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            made = list(pool.map(connect, range(2 * groups + 2)))
        self.ops = made[0:2 * groups:2]  # per group: non-blocking operations
        self.waits = made[1:2 * groups:2]  # per group: blocking waits and gets
        self.lead = made[-2]  # the leader of a barrier, once its group went on without it
        self.control = made[-1]  # the client's command loop (fault injection, end of job)
        self.count = len(made)


class _Deferred(BaseException):
    """Raised by a rank's wait for the decision while its group is still arriving.

    A BaseException: ``RestartProtocol.get_blocking`` lets it through
    untouched, and ``barrier`` has nothing to unwind. The group then finishes
    the rank with ``wait_decision``, which is what ``barrier`` returns for a
    non-leader.
    """


# Keys whose value the protocol waits for with a blocking get.
_BLOCKING_GETS = ("/event", "/decision")


class SharedStore:
    """One simulated rank's store (main or trigger side) over its group's connections.

    Has the torch Store methods the protocol uses, tallies requests and bytes.
    Non-blocking calls go to the group's operations connection, blocking ones
    (``wait``, the ``get`` of the event and of the decision) to its waits
    connection; a leader that blocked uses the process's leader connection for
    everything, so that its group never queues behind it (torch's client runs
    one call at a time per connection).
    """

    def __init__(self, op_conn: Any, wait_conn: Any, tally: Tally, group: Optional["Group"],
                 cap_s: Optional[float] = None):
        self._op = op_conn
        self._wait_conn = wait_conn
        self._t = tally
        self._group = group
        self._timeout = op_conn.timeout  # what set_timeout gave; applied to the connection of each get
        # A node relay's blocking gets have no deadline (WAIT_CHUNK_S chunks);
        # capped here so that a stalled simulation fails within the job's timeout.
        self._cap = None if cap_s is None else datetime.timedelta(seconds=cap_s)

    def _conns(self) -> tuple[Any, Any]:
        g = self._group
        if g is not None and g.leading():
            lead = g.job.conns.lead
            return lead, lead
        return self._op, self._wait_conn

    def _saw(self, key: str, raw: bytes) -> None:
        if key.endswith("/decision"):
            self._t.decision = hashlib.sha1(raw).hexdigest()[:16]

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout if self._cap is None else min(timeout, self._cap)  # client-side: no request

    def set(self, key: str, value: Any) -> None:
        v = _as_bytes(value)
        t = self._t
        t.requests += 1
        t.out += 1 + _key(key) + 8 + len(v)
        self._conns()[0].set(key, v)
        self._saw(key, v)

    def get(self, key: str) -> bytes:
        op, wait = self._conns()
        conn = op
        if key.endswith(_BLOCKING_GETS):
            g = self._group
            if g is not None and g.arriving() and key.endswith("/decision"):
                raise _Deferred()  # nothing was sent: the group sends this get once it has arrived
            conn = wait
        conn.set_timeout(self._timeout)
        raw = conn.get(key)
        t = self._t
        t.requests += 2  # WAIT (answered once the key exists) + GET
        t.out += (1 + 8 + _key(key)) + (1 + _key(key))
        t.inb += 1 + 8 + len(raw)
        self._saw(key, raw)
        return raw

    def add(self, key: str, amount: int) -> int:
        t = self._t
        t.requests += 1
        t.out += 1 + _key(key) + 8
        t.inb += 8
        return self._conns()[0].add(key, amount)

    def append(self, key: str, value: Any) -> None:
        v = _as_bytes(value)
        t = self._t
        t.requests += 1
        t.out += 1 + _key(key) + 8 + len(v)
        self._conns()[0].append(key, v)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        e, d = _as_bytes(expected), _as_bytes(desired)
        out = self._conns()[0].compare_set(key, e, d)
        t = self._t
        t.requests += 1
        t.out += 1 + _key(key) + 8 + len(e) + 8 + len(d)
        t.inb += 8 + len(out)
        return out

    def check(self, keys: list[str]) -> bool:
        t = self._t
        t.requests += 1
        t.out += 1 + 8 + sum(_key(k) for k in keys)
        t.inb += 1
        return self._conns()[0].check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        g = self._group
        if g is not None and g.arriving():
            g.hand_over()  # the leader blocks here (for "ready"): a new thread goes on with the group
        t = self._t
        t.requests += 1
        t.out += 1 + 8 + sum(_key(k) for k in keys)
        t.inb += 1
        self._conns()[1].wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        t = self._t
        t.requests += 1
        t.out += 1 + _key(key)
        t.inb += 8
        return self._conns()[0].delete_key(key)


def _share_decoding() -> None:
    """Let the ranks of this process share one decode of identical decision bytes."""
    decode = Decision.from_json.__func__  # type: ignore[attr-defined]
    cache: dict[bytes, Decision] = {}

    def from_json(cls: type, raw: bytes) -> Decision:
        key = bytes(raw)
        d = cache.get(key)
        if d is None:
            d = cache[key] = decode(cls, raw)
        return d

    Decision.from_json = classmethod(from_json)  # type: ignore[method-assign,assignment]


def expected_row(n: int, faulty: list[int], restart: int, kind: str, rank: int) -> tuple[int, int, int]:
    """(mode, rank, active_rank) that ShiftRanks must give ``rank`` after ``restart``."""
    if kind != "killed":
        return ACTIVE, rank, rank
    dead = faulty[: restart + 1]
    if rank in dead:
        return TERMINATED, -1, -1
    new = rank - sum(1 for d in dead if d < rank)
    return ACTIVE, new, new


# ---------------------------------------------------------------------------
# Client process: many simulated ranks
# ---------------------------------------------------------------------------


class SimRank:
    """One simulated rank: a main and a trigger RestartProtocol, as in the wrapper.

    With a node link (node mode) both protocols hold it, as the wrapper's do
    when its node has an agent: the trigger's event and the barrier's outcome
    come from the node's board.
    """

    __slots__ = ("rank", "trigger", "main", "t_tally", "m_tally", "last_ops", "last", "t_woken", "link")

    def __init__(self, rank: int, call: int, op_conn: Any, wait_conn: Any, group: Any,
                 link: Optional[NodeLink] = None):
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

    def tally(self) -> tuple[int, int, int]:
        return Tally.total(self.t_tally, self.m_tally)


class Group:
    """Simulated ranks that share two connections and one thread at a time.

    Per iteration i the group's thread: (A) runs ``trigger.wait_event(i)``
    for each rank in turn (the first blocks until the fault, the others find
    the key set); (B) runs ``main.barrier(i+1, ...)`` for each rank in turn; a
    non-leader's wait for the decision is deferred (``_Deferred``) so that the
    next rank of the group can arrive; if the leader is in the group, its wait
    for ``ready`` hands the rest of the group to a new thread and blocks; (C)
    runs ``main.wait_decision(i+1)`` for each deferred rank (the first blocks
    until the decision, the others find it set).
    """

    def __init__(self, job: "SimJob", name: str):
        self.job = job
        self.name = name
        self.ranks: list[SimRank] = []
        self._tls = threading.local()
        self.iteration = 0
        self.todo: collections.deque[SimRank] = collections.deque()
        self.deferred: list[SimRank] = []
        self.leader_thread: Optional[threading.Thread] = None
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)

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
                        return
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
                    decision = rs.main.barrier(i + 1, rs.rank, job.world_size[i], False, job.decide_fn(i, rs), job.timeout_s)
                except _Deferred:
                    rs.main.ops -= 1  # get_blocking counted the get it did not send; wait_decision counts it again
                    self.deferred.append(rs)
                    continue
                assert decision is not None
                job.record(rs, i, decision)
                if self.leader_thread is threading.current_thread():
                    return True
            return False
        finally:
            self._tls.arriving = False


def _give_up() -> bool:
    """A relay's blocking get ran out its (capped) chunk: the simulation stalled."""
    return True


class SimNode:
    """One simulated node: its board, its ranks, and its agent's store traffic.

    ``relay`` is the library's :class:`NodeRelay` over the node's board. A real
    agent runs it on two threads with a connection each (broadcast: blocking
    gets; forward: adds); here the node's group runs both over its two
    connections, with two RestartProtocols so that the broadcast and the
    forward side are counted apart (``events``, ``arrivals``).
    """

    __slots__ = ("index", "board", "relay", "ranks", "events", "arrivals", "e_tally", "a_tally", "last_ops", "last")

    def __init__(self, index: int, call: int, board: Any, op_conn: Any, wait_conn: Any, group: "NodeGroup",
                 cap_s: float):
        self.index = index
        self.board = board
        self.relay = NodeRelay(board)
        self.ranks: list[SimRank] = []
        self.e_tally, self.a_tally = Tally(), Tally()
        self.events = RestartProtocol(SharedStore(op_conn, wait_conn, self.e_tally, group, cap_s), call)
        self.arrivals = RestartProtocol(SharedStore(op_conn, wait_conn, self.a_tally, group, cap_s), call)
        self.last_ops = 0
        self.last = (0, 0, 0)

    @property
    def ops(self) -> int:
        return self.events.ops + self.arrivals.ops

    def tally(self) -> tuple[int, int, int]:
        return Tally.total(self.e_tally, self.a_tally)


class NodeGroup:
    """Whole simulated nodes that share two connections and one thread at a time (node mode).

    Per iteration i the group's thread, for each node in turn:

    (A) ``relay.relay_event(i)`` (the first node's get blocks until the fault,
        the others find the event set), then ``trigger.wait_event(i)`` for
        each of the node's ranks (answered by the board: no store request);
    (B) ``main.post_arrival(i+1)`` for each of the node's ranks (its seat:
        one ``compare_set``; then its arrival on the board), then
        ``relay.forward`` (one ``add`` for the node's batch; the batch that
        completes the count also sets ``ready``). If the forward named one of
        the node's ranks the leader, that rank's ``await_outcome`` runs at
        once: it leads (``_lead``), and its wait for ``ready`` hands the
        group's remaining nodes to a new thread and blocks on the process's
        leader connection, as in direct mode;
    (C) ``relay.relay_decision(i+1)`` (the first node's get blocks until the
        leader published), then ``main.await_outcome(i+1)`` for each of the
        node's ranks but the leader (answered by the board).
    """

    def __init__(self, job: "SimJob", name: str):
        self.job = job
        self.name = name
        self.nodes: list[SimNode] = []
        self.ranks: list[SimRank] = []
        self._tls = threading.local()
        self.iteration = 0
        self.live: list[tuple[SimNode, list[SimRank]]] = []  # this iteration's nodes with live ranks
        self.todo: collections.deque[tuple[SimNode, list[SimRank]]] = collections.deque()
        self.leader: Optional[SimRank] = None
        self.leader_thread: Optional[threading.Thread] = None
        self.thread = threading.Thread(target=self.run, name=name, daemon=True)

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
                        return
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
            if not node.relay.relay_event(node.events, i, _give_up):
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
            node.relay.forward(node.arrivals)
            for rs in ranks:
                assert rs.link is not None
                if node.board.leads(rs.link.slot) != i + 1:
                    continue
                self.leader = rs
                self._tls.arriving = True  # its wait for "ready" hands the group over (see hand_over)
                try:
                    decision = rs.main.await_outcome(i + 1, rs.rank, expected, job.decide_fn(i, rs), job.timeout_s)
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
        for node, ranks in self.live:
            node.relay.relay_decision(node.events, i + 1, _give_up)
            job.record_node(node, i)
            for rs in ranks:
                if rs is self.leader:
                    continue
                decision = rs.main.await_outcome(i + 1, rs.rank, expected, job.decide_fn(i, rs), job.timeout_s)
                if not rs.m_tally.decision:  # read from the board (else from the store: it was too large)
                    posted = node.board.read_decision()
                    if posted is not None and posted[0] == i + 1 and posted[1] is not None:
                        rs.m_tally.decision = hashlib.sha1(posted[1]).hexdigest()[:16]
                job.record(rs, i, decision)


class SimJob:
    """The simulated ranks [lo, hi) of one job (one N), in one client process."""

    def __init__(self, conns: Connections, cfg: dict[str, Any]):
        self.conns = conns
        self.n: int = cfg["n"]
        self.call: int = cfg["call"]
        self.lo, self.hi = cfg["lo"], cfg["hi"]
        self.faulty: list[int] = cfg["faulty"]
        self.kind: str = cfg["kind"]
        self.timeout_s: float = cfg["timeout_s"]
        self.check_membership: bool = cfg["check_membership"]
        self.assignment = Compose(ActivateAllRanks(), ShiftRanks())
        self.memberships: dict[int, Membership] = {0: Membership.all_active(self.n)}
        self.world_size: dict[int, int] = {0: self.n}
        self.cond = threading.Condition()
        self.armed: collections.Counter[int] = collections.Counter()
        self.done: collections.Counter[int] = collections.Counter()
        self.records: dict[int, list[list[Any]]] = collections.defaultdict(list)
        self.node_records: dict[int, list[list[Any]]] = collections.defaultdict(list)
        self.ranks_per_node: int = cfg.get("ranks_per_node", 0)
        self.reporters: dict[int, list[Any]] = {}  # restart -> [t0_ns, ops, requests, out, in]
        self.errors: list[str] = []
        self.decision_raw: dict[int, bytes] = {}
        # Ranks of this process that hold each restart's decision (wake the command loop once, not per rank).
        self.expected_done = [sum(1 for r in range(self.lo, self.hi) if self.alive_in(r, j)) for j in range(len(self.faulty))]
        groups = len(conns.ops)
        ranks = list(range(self.lo, self.hi))
        self.groups: list[Any] = []  # Group (direct mode) or NodeGroup (node mode)
        self.sims: dict[int, SimRank] = {}
        self.nodes: list[SimNode] = []
        if self.ranks_per_node > 0:
            self._make_nodes(groups)
            return
        for g in range(min(groups, len(ranks))):
            part = ranks[len(ranks) * g // min(groups, len(ranks)): len(ranks) * (g + 1) // min(groups, len(ranks))]
            group = Group(self, f"group of ranks {part[0]}..{part[-1]}")
            for r in part:
                rs = SimRank(r, self.call, conns.ops[g], conns.waits[g], group)
                group.ranks.append(rs)
                self.sims[r] = rs
            self.groups.append(group)

    def _make_nodes(self, groups: int) -> None:
        """Node mode: this process's ranks in whole nodes (the driver splits the
        job at node boundaries), each node with a board of its own and its
        ranks linked to it by local slot, as ``Wrapper`` links them
        (``NodeLink(board, slot)``: no agent socket, no pidfd); the nodes split
        into groups of whole nodes."""
        rpn = self.ranks_per_node
        if self.lo % rpn:
            raise ValueError(f"ranks {self.lo}..{self.hi - 1} do not start at a node boundary ({rpn} ranks per node)")
        nodes = [list(range(a, min(a + rpn, self.hi))) for a in range(self.lo, self.hi, rpn)]
        k = min(groups, len(nodes))
        for g in range(k):
            part = nodes[len(nodes) * g // k: len(nodes) * (g + 1) // k]
            group = NodeGroup(self, f"group of nodes {part[0][0] // rpn}..{part[-1][0] // rpn}")
            for members in part:
                board = _native.NodeBoard.create(len(members), DECISION_CAPACITY)
                node = SimNode(members[0] // rpn, self.call, board, self.conns.ops[g], self.conns.waits[g], group,
                               self.timeout_s)
                for slot, r in enumerate(members):
                    rs = SimRank(r, self.call, self.conns.ops[g], self.conns.waits[g], group, NodeLink(board, slot))
                    node.ranks.append(rs)
                    group.ranks.append(rs)
                    self.sims[r] = rs
                group.nodes.append(node)
                self.nodes.append(node)
            self.groups.append(group)

    # -- bookkeeping ----------------------------------------------------------

    def alive_in(self, rank: int, iteration: int) -> bool:
        """Whether ``rank`` runs iteration ``iteration`` (a killed rank dies in its restart)."""
        return self.kind != "killed" or rank not in self.faulty[: iteration + 1]

    def bump(self, counter: collections.Counter[int], key: int) -> None:
        with self.cond:
            counter[key] += 1
            self.cond.notify_all()

    def fail(self, message: str) -> None:
        with self.cond:
            self.errors.append(message)
            self.cond.notify_all()

    def requests(self) -> int:
        return sum(rs.tally()[0] for rs in self.sims.values())

    def decide_fn(self, i: int, rs: SimRank) -> Callable[[set[int], list[FaultRecord], int], Decision]:
        previous = self.memberships[i]

        def decide_fn(dead: set[int], faults: list[FaultRecord], leader: int) -> Decision:
            return decide(self.assignment, previous, dead, faults, i + 1, leader)

        return decide_fn

    def record(self, rs: SimRank, i: int, decision: Decision) -> None:
        """``rs`` holds the decision of barrier i+1."""
        t_done = time.monotonic_ns()
        m = decision.membership
        r = rs.rank
        leader = decision.leader == r
        mdigest = ""
        if self.check_membership:  # O(N) per rank: small N only
            mdigest = hashlib.sha1(json.dumps([m.mode, m.rank, m.active_rank]).encode()).hexdigest()[:16]
        size = 0
        if leader:
            raw = decision.to_json().encode()
            self.decision_raw[i] = raw
            size = len(raw)
        ops, now = rs.ops, rs.tally()
        digest = rs.m_tally.decision
        self.records[i].append([
            r, rs.t_woken, t_done, ops - rs.last_ops, now[0] - rs.last[0], now[1] - rs.last[1], now[2] - rs.last[2],
            int(leader), m.mode[r], m.rank[r], m.active_rank[r], digest, mdigest, decision.assignment_ns, size,
        ])
        rs.last_ops, rs.last = ops, now
        with self.cond:
            if i + 1 not in self.world_size:  # Membership.world_size is O(N): once per process
                self.memberships[i + 1] = m
                self.world_size[i + 1] = m.world_size
            self.done[i] += 1
            if self.done[i] == self.expected_done[i]:
                self.cond.notify_all()

    def record_node(self, node: SimNode, i: int) -> None:
        """``node``'s agent relayed the decision of barrier i+1: its store traffic of restart i."""
        ops, now = node.ops, node.tally()
        self.node_records[i].append([
            node.index, ops - node.last_ops, now[0] - node.last[0], now[1] - node.last[1], now[2] - node.last[2],
            node.e_tally.decision,
        ])
        node.last_ops, node.last = ops, now

    # -- faults ---------------------------------------------------------------

    def _control(self, tally: Tally) -> RestartProtocol:
        c = self.conns.control
        return RestartProtocol(SharedStore(c, c, tally, None), self.call)

    def _kill(self, restart: int) -> None:
        """Rank faulty[restart] died: its monitor counts it out (``count_out``, as
        ``inprocess.processes.monitor`` does): takes its seat, records the fault, requests
        the restart and arrives for it at the barrier."""
        rank = self.faulty[restart]
        rs = self.sims[rank]
        p, tally = rs.main, rs.m_tally
        # The monitor process has a connection of its own.
        p.store = SharedStore(self.conns.control, self.conns.control, tally, None)
        ops0, before = p.ops, tally.snapshot()
        t0 = time.monotonic_ns()

        def fault(iteration: int) -> FaultRecord:
            return FaultRecord(rank, iteration, "killed", "SIGKILL", "simulated: process killed", t_ns=t0)

        # A real monitor reads the previous barrier's decision for the expected
        # count (one blocking get); the simulator knows it.
        barrier = p.count_out(rank, fault, lambda b: self.world_size[b - 1], self.timeout_s, who=f"m{rank}")
        if barrier != restart + 1:
            raise RuntimeError(f"rank {rank} was counted out at barrier {barrier}, expected {restart + 1}")
        after = tally.snapshot()
        self.reporters[restart] = [t0, p.ops - ops0, *(a - b for a, b in zip(after, before))]

    def _raise_exception(self, restart: int) -> None:
        """Rank faulty[restart]'s main thread raises: it checks, records and requests the restart."""
        rank = self.faulty[restart]
        tally = Tally()
        p = self._control(tally)  # the rank's main thread: its own connection, apart from its trigger's
        t0 = time.monotonic_ns()
        if not p.restart_requested(restart):
            p.report_fault(FaultRecord(rank, restart, "exception", "RuntimeError", "simulated fault", t_ns=t0))
        self.reporters[restart] = [t0, p.ops, *tally.snapshot()]

    # -- driven by the command loop ---------------------------------------------

    def _wait_for(self, predicate: Any, what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: predicate() or bool(self.errors), self.timeout_s):
                raise TimeoutError(f"ranks {self.lo}..{self.hi - 1}: {what} within {self.timeout_s:g}s")
            if self.errors:
                raise RuntimeError("; ".join(self.errors[:5]))

    def seed_seats(self) -> None:
        """Setup, not measured: seat every rank of this process at barrier 0.

        A real job's initial barrier (barrier 0) leaves every rank's seat at
        "0"; the simulated restarts start at barrier 1 and need that state.
        Written with ``multi_set`` over the control connection, outside any
        rank's tally and before the first steady-state window.
        """
        keys = [RestartProtocol(None, self.call).seat_key(r) for r in range(self.lo, self.hi)]
        for k in range(0, len(keys), 4096):
            chunk = keys[k:k + 4096]
            self.conns.control.multi_set(chunk, ["0"] * len(chunk))

    # -- monitor heartbeats (steady state) ----------------------------------------

    def _heartbeat_keys(self) -> list[str]:
        return [monitor_heartbeat_key(self.call, r) for r in range(self.lo, self.hi)]

    def heartbeat_round(self) -> dict[str, Any]:
        """What every monitor of this process sends once per heartbeat interval:
        one ``add`` of its own counter and one ``multi_get`` of the counters of
        the next WATCHED_PEERS ranks (as ``inprocess.processes.monitor`` does), over the
        groups' operation connections, one thread per group."""
        peers = min(WATCHED_PEERS, self.n - 1)
        tally = [0, 0]  # requests, bytes

        def beat(conn: Any, ranks: list[int]) -> tuple[int, int]:
            requests = out = 0
            for r in ranks:
                own = monitor_heartbeat_key(self.call, r)
                conn.add(own, 1)
                keys = [monitor_heartbeat_key(self.call, (r + k) % self.n) for k in range(1, peers + 1)]
                values = conn.multi_get(keys)
                # ADD; WAIT (answered at once: the keys exist) + MULTI_GET.
                requests += 3
                out += (1 + _key(own) + 8 + 8) + (1 + 8 + sum(_key(k) for k in keys) + 1)
                out += 1 + 8 + sum(_key(k) for k in keys) + sum(8 + len(v) for v in values)
            return requests, out

        with concurrent.futures.ThreadPoolExecutor(len(self.groups)) as pool:
            futures = [pool.submit(beat, self.conns.ops[k], [rs.rank for rs in g.ranks if self.alive_in(rs.rank, len(self.faulty))])
                       for k, g in enumerate(self.groups)]
            for f in futures:
                r, b = f.result(self.timeout_s)
                tally[0] += r
                tally[1] += b
        return {"hb_requests": tally[0], "hb_bytes": tally[1]}

    def start(self) -> dict[str, Any]:
        self.seed_seats()
        # Setup, not measured: every monitor's counter exists (a monitor creates
        # it when it starts, before its rank's first barrier).
        keys = self._heartbeat_keys()
        for k in range(0, len(keys), 4096):
            chunk = keys[k:k + 4096]
            self.conns.control.multi_set(chunk, ["1"] * len(chunk))
        for g in self.groups:
            g.thread.start()
        self._wait_for(lambda: self.armed[0] == len(self.groups), "groups armed")
        return {"ready": 0, "groups": len(self.groups)}

    def fault(self, j: int) -> dict[str, Any]:
        if self.faulty[j] in self.sims:
            if self.kind == "killed":
                self._kill(j)
            else:
                self._raise_exception(j)
        # Every group that ran iteration j starts iteration j+1 (and bumps "armed"),
        # also one whose last live rank died in restart j (it then ends at once).
        running = sum(1 for g in self.groups if any(self.alive_in(rs.rank, j) for rs in g.ranks))
        self._wait_for(lambda: self.done[j] == self.expected_done[j] and self.armed[j + 1] == running,
                       f"restart {j} done")
        decode_us = 0.0
        raw = self.decision_raw.pop(j, None)
        if raw is not None:  # the leader's process: the per-rank cost of decoding the decision
            ts = []
            for _ in range(5):
                s = time.perf_counter_ns()
                _decode_fresh(raw)
                ts.append(time.perf_counter_ns() - s)
            decode_us = statistics.median(ts) / 1e3
        return {"done": j, "records": self.records.pop(j, []), "nodes": self.node_records.pop(j, []),
                "reporter": self.reporters.get(j), "decode_us": decode_us}

    def complete(self, iteration: int) -> None:
        """End the job's last iteration: every trigger wait returns "complete"."""
        p = self._control(Tally())
        p.store.compare_set(p.key(iteration, "event"), "", COMPLETE)

    def end(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        for g in self.groups:
            while g.thread.is_alive() and time.monotonic() < deadline:
                g.thread.join(0.1)  # a hand-over may replace g.thread meanwhile
        alive = sum(g.thread.is_alive() for g in self.groups)
        for node in self.nodes:
            node.board.unmap()  # a wait still in flight keeps its mapping until it returns
        return {"final": True, "alive_threads": alive, "errors": self.errors[:5]}


_FRESH_DECODE = Decision.from_json.__func__  # type: ignore[attr-defined]


def _decode_fresh(raw: bytes) -> Decision:
    """The library's decode, even where the shared cache replaced it."""
    return _FRESH_DECODE(Decision, raw)


def _die_with_parent() -> None:
    """SIGKILL this process when the driver dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))
    if os.getppid() == 1:
        os._exit(1)


def client_main() -> None:
    """Entry of a client process: JSON commands on stdin, JSON answers on stdout."""
    _die_with_parent()
    out = sys.stdout

    def send(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg, separators=(",", ":")) + "\n")
        out.flush()

    try:
        cfg = json.loads(sys.stdin.readline())
        if cfg["decode"] == "shared":
            _share_decoding()
        conns = Connections(cfg["port"], cfg["groups"], cfg["timeout_s"])
        send({"connections": conns.count})
        job: Optional[SimJob] = None
        for line in sys.stdin:
            cmd = json.loads(line)
            what = cmd["cmd"]
            if what == "job":
                job = SimJob(conns, cmd)
                send(job.start())
            elif what == "snap":
                send({"snap": job.requests() if job else 0})
            elif what == "fault":
                assert job is not None
                send(job.fault(cmd["restart"]))
            elif what == "heartbeats":
                assert job is not None
                send(job.heartbeat_round())
            elif what == "complete":
                assert job is not None
                job.complete(cmd["iteration"])
                send({"completed": cmd["iteration"]})
            elif what == "end":
                assert job is not None
                send(job.end())
                job = None
            elif what == "quit":
                break
    except BaseException as e:
        send({"error": f"{type(e).__name__}: {e}"})
    finally:
        out.flush()
        # Group threads may still block in store waits: leave without joining them.
        os._exit(0)


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------

# torch's socket layer reverse-resolves every connected address (getnameinfo
# without NI_NUMERICHOST, client and server side); "::ffff:127.0.0.1" is not
# in /etc/hosts here, so each connect may wait on the resolver. Bound that wait
# in the processes this benchmark starts.
CHILD_ENV = {"RES_OPTIONS": "timeout:1 attempts:2"}


class Child:
    """A child process speaking JSON lines; its stdout is read by a thread."""

    def __init__(self, argv: list[str]):
        env = dict(os.environ, **CHILD_ENV)
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, msg: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((msg if isinstance(msg, str) else json.dumps(msg)) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float, what: str) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"pid {self.proc.pid}: no {what} within {timeout:g}s") from None
        if line is None:
            raise RuntimeError(f"pid {self.proc.pid} exited (rc={self.proc.poll()}) before {what}")
        return line

    def ask(self, msg: Any, timeout: float, what: str) -> dict[str, Any]:
        self.send(msg)
        return self.answer(timeout, what)

    def answer(self, timeout: float, what: str) -> dict[str, Any]:
        reply = json.loads(self.recv(timeout, what))
        if "error" in reply:
            raise RuntimeError(f"pid {self.proc.pid}: {reply['error']}")
        return reply

    def reap(self, grace: float = 5.0) -> None:
        """Close stdin (the child leaves on EOF), then kill if needed; always wait."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(grace)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pick_faulty(n: int, restarts: int) -> list[int]:
    """Distinct ranks spread over the job (and over the client processes)."""
    out: list[int] = []
    for j in range(restarts):
        r = (n // 2 + 1 + j * (n // (restarts + 1) + 3)) % n
        while r in out:
            r = (r + 1) % n
        out.append(r)
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


class Session:
    """One TCPStore server and ``cfg.procs`` client processes, reused for every N.

    Connecting is the slow part here (see CHILD_ENV), so the connections are
    made once; each N is a separate job under its own key prefix (``call``).
    """

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.server: Optional[Child] = None
        self.clients: list[Child] = []
        self.connections = 0
        self._calls = 0

    def __enter__(self) -> "Session":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self) -> None:
        cfg = self.cfg
        self.server = Child([sys.executable, "-c", SERVER_CODE])
        self.port = int(self.server.recv(cfg.timeout_s, "server port"))
        for _ in range(cfg.procs):
            self.clients.append(Child([sys.executable, os.path.abspath(__file__), "--client"]))
        for c in self.clients:
            c.send({"port": self.port, "groups": cfg.groups,
                    "timeout_s": cfg.timeout_s, "decode": cfg.decode})
        self.connections = sum(c.answer(cfg.timeout_s, "connections")["connections"] for c in self.clients)

    def close(self) -> None:
        for c in self.clients:
            c.reap()
        if self.server is not None:
            self.server.reap()
        self.clients, self.server = [], None

    def server_cpu(self) -> float:
        assert self.server is not None
        return cpu_seconds(self.server.proc.pid)

    def simulate(self, n: int, ranks_per_node: Optional[int] = None) -> dict[str, Any]:
        """``cfg.restarts`` restarts of a job of N simulated ranks, in node mode
        (``ranks_per_node`` > 0; default: ``cfg.ranks_per_node``) or direct mode (0)."""
        cfg = self.cfg
        rpn = cfg.ranks_per_node if ranks_per_node is None else ranks_per_node
        if rpn > 0:  # every process holds whole nodes
            nodes = -(-n // rpn)
            clients = self.clients[: max(1, min(len(self.clients), nodes))]
            procs = len(clients)
            bounds = [min(n, rpn * (nodes * k // procs)) for k in range(procs + 1)]
        else:
            clients = self.clients[: max(1, min(len(self.clients), n))]
            procs = len(clients)
            bounds = [n * k // procs for k in range(procs + 1)]
        faulty = pick_faulty(n, cfg.restarts)
        call = self._calls
        self._calls += 1
        for k, c in enumerate(clients):
            c.send({"cmd": "job", "n": n, "call": call, "lo": bounds[k], "hi": bounds[k + 1], "faulty": faulty,
                    "kind": cfg.kind, "timeout_s": cfg.timeout_s, "check_membership": cfg.check_membership,
                    "ranks_per_node": rpn})
        for c in clients:
            c.answer(cfg.timeout_s, "ranks armed")
        restarts = []
        for j in range(cfg.restarts):
            time.sleep(cfg.settle_s)
            s0 = sum(c.ask({"cmd": "snap"}, cfg.timeout_s, "snap")["snap"] for c in clients)
            cpu_a = self.server_cpu()
            time.sleep(cfg.steady_s)
            cpu_b = self.server_cpu()
            s1 = sum(c.ask({"cmd": "snap"}, cfg.timeout_s, "snap")["snap"] for c in clients)
            cpu_fault = self.server_cpu()
            ccpu_fault = sum(cpu_seconds(c.proc.pid) for c in clients)
            for c in clients:
                c.send({"cmd": "fault", "restart": j})
            done = [c.answer(cfg.timeout_s, f"restart {j} done") for c in clients]
            cpu_c = self.server_cpu()
            ccpu_c = sum(cpu_seconds(c.proc.pid) for c in clients)
            r = _restart_figures(n, j, faulty, cfg, done, rpn)
            r["steady_requests_per_s"] = (s1 - s0) / cfg.steady_s
            r["steady_server_cpu_pct"] = 100.0 * (cpu_b - cpu_a) / cfg.steady_s
            r["server_cpu_ms"] = 1e3 * (cpu_c - cpu_fault)
            r["client_cpu_ms"] = 1e3 * (ccpu_c - ccpu_fault)
            restarts.append(r)
        # Steady state: one heartbeat interval's worth of monitor requests, sent
        # as fast as the clients can, to measure their server CPU.
        hb = []
        for _ in range(cfg.heartbeat_rounds):
            time.sleep(cfg.settle_s)
            cpu_a, t_a = self.server_cpu(), time.monotonic()
            for c in clients:
                c.send({"cmd": "heartbeats"})
            got = [c.answer(cfg.timeout_s, "heartbeat round") for c in clients]
            cpu_b, t_b = self.server_cpu(), time.monotonic()
            hb.append({"requests": sum(g["hb_requests"] for g in got), "bytes": sum(g["hb_bytes"] for g in got),
                       "server_cpu_ms": 1e3 * (cpu_b - cpu_a), "wall_ms": 1e3 * (t_b - t_a)})
        clients[0].ask({"cmd": "complete", "iteration": cfg.restarts}, cfg.timeout_s, "complete")
        for c in clients:
            c.send({"cmd": "end"})
        for c in clients:
            final = c.answer(cfg.timeout_s, "end of job")
            if final["alive_threads"] or final["errors"]:
                raise RuntimeError(f"pid {c.proc.pid}: {final['alive_threads']} rank threads left, {final['errors']}")
        return _summary(n, cfg, procs, self.connections, restarts, hb, rpn)


def simulate(n: int, cfg: SimConfig) -> dict[str, Any]:
    """One job of N simulated ranks in a session of its own (used by the tests)."""
    with Session(cfg) as s:
        return s.simulate(n)


def _restart_figures(n: int, j: int, faulty: list[int], cfg: SimConfig, done: list[dict[str, Any]],
                     rpn: int = 0) -> dict[str, Any]:
    reporters = [d["reporter"] for d in done if d["reporter"] is not None]
    if len(reporters) != 1:
        raise RuntimeError(f"restart {j}: {len(reporters)} fault reports, expected 1")
    t0, rep_ops, rep_req, rep_out, rep_in = reporters[0]
    records = [rec for d in done for rec in d["records"]]
    alive = [r for r in range(n) if expected_row(n, faulty, j, cfg.kind, r)[0] != TERMINATED]
    if sorted(rec[0] for rec in records) != alive:
        raise RuntimeError(f"restart {j}: {len(records)} ranks hold a decision, expected {len(alive)}")
    digests = {rec[11] for rec in records}
    mdigests = {rec[12] for rec in records}
    wrong = [rec[0] for rec in records if tuple(rec[8:11]) != expected_row(n, faulty, j, cfg.kind, rec[0])]
    leaders = [rec for rec in records if rec[7]]
    if len(digests) != 1 or len(mdigests) != 1 or wrong or len(leaders) != 1:
        raise RuntimeError(
            f"restart {j}: ranks disagree: {len(digests)} decision digests, {len(mdigests)} table digests, "
            f"{len(wrong)} wrong assignments (e.g. {wrong[:5]}), {len(leaders)} leaders"
        )
    done_ms = [(rec[2] - t0) / 1e6 for rec in records]
    woken_ms = [(rec[1] - t0) / 1e6 for rec in records]
    ops = [rec[3] for rec in records]
    reqs = [rec[4] for rec in records]
    bytes_ = [rec[5] + rec[6] for rec in records]
    leader = leaders[0]
    window_s = max(done_ms) / 1e3
    total_requests = sum(reqs) + rep_req
    node_figures: dict[str, Any] = {}
    if rpn > 0:
        # Node mode: every node with a live rank relayed the event and the
        # decision and forwarded its arrivals, and its relay read the same
        # decision bytes as the ranks.
        nodes = [d for rec in done for d in rec["nodes"]]
        live_nodes = sorted({r // rpn for r in alive})
        if sorted(rec[0] for rec in nodes) != live_nodes:
            raise RuntimeError(f"restart {j}: {len(nodes)} nodes relayed the decision, expected {len(live_nodes)}")
        node_digests = {rec[5] for rec in nodes}
        if node_digests != digests:
            raise RuntimeError(f"restart {j}: node relays read {len(node_digests)} decisions, not the ranks' one")
        n_ops = [rec[1] for rec in nodes]
        n_reqs = [rec[2] for rec in nodes]
        n_bytes = [rec[3] + rec[4] for rec in nodes]
        total_requests += sum(n_reqs)
        node_figures = {
            "nodes": len(nodes),
            "ops_per_node_median": statistics.median(n_ops),
            "ops_per_node_max": max(n_ops),
            "ops_nodes_total": sum(n_ops),
            "requests_per_node_median": statistics.median(n_reqs),
            "requests_per_node_max": max(n_reqs),
            "requests_nodes_total": sum(n_reqs),
            "bytes_per_node_median": statistics.median(n_bytes),
        }
    return {
        "restart": j,
        "ranks": len(records),
        **node_figures,
        "requests_ranks_total": sum(reqs),
        "requests_reporter": rep_req,
        "median_ms": statistics.median(done_ms),
        "p99_ms": _pct(done_ms, 0.99),
        "max_ms": max(done_ms),
        "wake_median_ms": statistics.median(woken_ms),
        "wake_max_ms": max(woken_ms),
        "ops_per_rank_median": statistics.median(ops),
        "ops_per_rank_max": max(ops),
        "ops_leader": leader[3],
        "ops_reporter": rep_ops,
        "ops_total": sum(ops) + rep_ops + node_figures.get("ops_nodes_total", 0),
        "requests_per_rank_median": statistics.median(reqs),
        "requests_total": total_requests,
        "bytes_per_rank_median": statistics.median(bytes_),
        "bytes_per_rank_mean": sum(bytes_) / len(bytes_),
        "bytes_leader": leader[5] + leader[6],
        "bytes_reporter": rep_out + rep_in,
        "server_requests_per_s": total_requests / window_s,
        "decision_bytes": leader[14],
        "assignment_ms": leader[13] / 1e6,
        "decode_ms": max(d["decode_us"] for d in done) / 1e3,
        "decisions": sorted(digests),
    }


def _summary(n: int, cfg: SimConfig, procs: int, connections: int, restarts: list[dict[str, Any]],
             hb: list[dict[str, Any]], rpn: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {"mode": "node" if rpn > 0 else "direct", "n": n, "ranks_per_node": rpn, "procs": procs,
                           "connections": connections, "restarts": len(restarts)}
    for key, value in restarts[0].items():
        if isinstance(value, (int, float)) and key != "restart":
            out[key] = statistics.median(r[key] for r in restarts)
    # Steady state, per heartbeat interval (cfg.heartbeat_interval_s): every
    # monitor's add + multi_get (measured above), plus every blocking get of
    # the event re-sent once per WAIT_CHUNK_S (CANCEL_WAIT + a new WAIT): one
    # per trigger in direct mode, one per node agent (its broadcast thread) in
    # node mode, where the triggers wait on the board.
    monitors = n - (len(restarts) if cfg.kind == "killed" else 0)
    waiters = restarts[-1]["nodes"] if rpn > 0 else monitors
    if hb:
        hb_requests = statistics.median(h["requests"] for h in hb)
        hb_cpu_ms = statistics.median(h["server_cpu_ms"] for h in hb)
        out["hb_requests_per_round"] = hb_requests
        out["hb_server_cpu_ms"] = hb_cpu_ms
        out["hb_wall_ms"] = statistics.median(h["wall_ms"] for h in hb)
        out["hb_bytes_per_monitor"] = statistics.median(h["bytes"] for h in hb) / monitors
        out["hb_server_cpu_us_per_request"] = 1e3 * hb_cpu_ms / hb_requests
        rewaits = 2 * waiters / WAIT_CHUNK_S
        out["steady_state_requests_per_s"] = hb_requests / cfg.heartbeat_interval_s + rewaits
        out["steady_state_server_cpu_pct"] = 100.0 * (
            hb_cpu_ms / 1e3 / cfg.heartbeat_interval_s
            + rewaits * out["hb_server_cpu_us_per_request"] / 1e6
        )
    out["worst_max_ms"] = max(r["max_ms"] for r in restarts)
    out["server_cpu_us_per_rank"] = 1e3 * out["server_cpu_ms"] / n
    out["server_cpu_us_per_request"] = 1e3 * out["server_cpu_ms"] / out["requests_total"]
    out["load_average"] = os.getloadavg()[0]
    out["all_agree"] = True  # _restart_figures raises otherwise
    out["heartbeat_interval_s"] = cfg.heartbeat_interval_s
    out["per_restart"] = restarts
    return out


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------

COLUMNS = [
    ("mode", "mode", "{}"),
    ("N", "n", "{:d}"),
    ("nodes", "nodes", "{:.0f}"),
    ("median ms", "median_ms", "{:.0f}"),
    ("max ms", "max_ms", "{:.0f}"),
    ("wake max ms", "wake_max_ms", "{:.0f}"),
    ("ops/rank", "ops_per_rank_median", "{:g}"),
    ("ops leader", "ops_leader", "{:g}"),
    ("ops/node", "ops_per_node_median", "{:g}"),
    ("requests/rank", "requests_per_rank_median", "{:g}"),
    ("requests/node", "requests_per_node_median", "{:g}"),
    ("requests/restart", "requests_total", "{:.0f}"),
    ("B/rank", "bytes_per_rank_median", "{:.0f}"),
    ("B/node", "bytes_per_node_median", "{:.0f}"),
    ("B leader", "bytes_leader", "{:.0f}"),
    ("decision B", "decision_bytes", "{:.0f}"),
    ("server req/s", "server_requests_per_s", "{:.0f}"),
    ("server CPU ms", "server_cpu_ms", "{:.0f}"),
    ("server CPU us/req", "server_cpu_us_per_request", "{:.1f}"),
    ("client CPU ms", "client_cpu_ms", "{:.0f}"),
    ("assign ms", "assignment_ms", "{:.1f}"),
    ("decode ms", "decode_ms", "{:.2f}"),
    ("load", "load_average", "{:.1f}"),
]

# Steady state: no restart under way.
STEADY_COLUMNS = [
    ("mode", "mode", "{}"),
    ("N", "n", "{:d}"),
    ("idle req/s", "steady_requests_per_s", "{:g}"),
    ("idle server CPU %", "steady_server_cpu_pct", "{:.1f}"),
    ("heartbeat requests/round", "hb_requests_per_round", "{:.0f}"),
    ("B/monitor/round", "hb_bytes_per_monitor", "{:.0f}"),
    ("round server CPU ms", "hb_server_cpu_ms", "{:.0f}"),
    ("server CPU us/req", "hb_server_cpu_us_per_request", "{:.1f}"),
    ("steady req/s", "steady_state_requests_per_s", "{:.0f}"),
    ("steady server CPU %", "steady_state_server_cpu_pct", "{:.2f}"),
]


def table(results: list[dict[str, Any]], markdown: bool = False, columns: Optional[list[tuple[str, str, str]]] = None) -> str:
    columns = COLUMNS if columns is None else columns
    head = [c[0] for c in columns]
    rows = [[fmt.format(r[key]) if key in r else "-" for _, key, fmt in columns] for r in results]
    if markdown:
        align = [":---" if key == "mode" else "---:" for _, key, _ in columns]
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str, cfg: SimConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    colours = {"node": "tab:blue", "direct": "tab:orange"}
    every_n: set[int] = set()
    for mode in ("node", "direct"):
        rs = [r for r in results if r["mode"] == mode]
        if not rs:
            continue
        ns = [r["n"] for r in rs]
        every_n.update(ns)
        c = colours[mode]
        what = f"node agents, {rs[0]['ranks_per_node']} ranks/node" if mode == "node" else "direct (every rank)"
        ax.plot(ns, [r["max_ms"] for r in rs], "o-", color=c, label=f"{what}: max over ranks (fault → decision held)")
        ax.plot(ns, [r["median_ms"] for r in rs], "s-", color=c, alpha=0.6, label=f"{what}: median over ranks")
        # /proc counts CPU time in 10 ms ticks: a restart under one tick reads 0, not drawn on the log scale.
        cpu = [r["server_cpu_ms"] if r["server_cpu_ms"] > 0 else float("nan") for r in rs]
        ax.plot(ns, cpu, "^--", color=c, label=f"{what}: store server CPU per restart (10 ms ticks)")
    ax.axhline(1000, color="red", lw=0.8, label="target: median under 1 s at 16,384")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted(every_n)
    ax.set_xticks(ticks)
    ax.set_xticklabels([str(n) for n in ticks])
    ax.set_xlabel("simulated ranks N")
    ax.set_ylabel("ms")
    ax.set_title(f"Restart control plane, one TCPStore, {cfg.procs} client processes ({os.cpu_count()} cores)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(results: list[dict[str, Any]], path: str, cfg: SimConfig, command: str, lines: list[str],
                   png: str = DEFAULT_PNG) -> None:
    """Replace the results block of ``path`` (between MD_BEGIN and MD_END), keeping the prose around it."""
    modes = " and ".join(
        f"node mode ({r['ranks_per_node']} ranks per node: one board and one agent relay per node)"
        if r["mode"] == "node" else "direct mode (every rank talks to the store)"
        for r in {r["mode"]: r for r in results}.values()
    )
    block = "\n".join([
        MD_BEGIN,
        "",
        f"Command: `{command}` — {os.cpu_count()} cores, torch {_torch_version()}, {modes}; "
        f"{cfg.procs} client processes x {cfg.groups} groups (2 connections each; plus a leader and a control connection per process), "
        f"fault kind `{cfg.kind}`, median of {cfg.restarts} restarts per N, decode `{cfg.decode}`; "
        f"\"load\": the 1-minute load average at the end of each job (this machine's {os.cpu_count()} cores "
        f"are shared with whatever else runs on it).",
        "",
        table(results, markdown=True),
        "",
        f"Steady state (no restart; heartbeat interval {cfg.heartbeat_interval_s:g} s, the Wrapper's default):",
        "",
        table(results, markdown=True, columns=STEADY_COLUMNS),
        "",
        *[f"- {line}" for line in lines],
        "",
        f"![control-plane time against N]({os.path.relpath(png, os.path.dirname(os.path.abspath(path)))})",
        "",
        MD_END,
    ])
    text = open(path).read() if os.path.exists(path) else MD_BEGIN + "\n" + MD_END + "\n"
    if MD_BEGIN in text and MD_END in text:
        head, rest = text.split(MD_BEGIN, 1)
        tail = rest.split(MD_END, 1)[1]
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(path, "w") as f:
        f.write(text)


def verdicts(results: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The figures the issue's targets are about, in words, per mode."""
    scaling: dict[str, Any] = {}
    lines = []
    for mode in ("node", "direct"):
        rs = [r for r in results if r["mode"] == mode]
        if not rs:
            continue
        big = {r["n"]: r for r in rs}
        sc: dict[str, Any] = {}
        what = f"{mode} mode" + (f" ({rs[0]['ranks_per_node']} ranks per node)" if mode == "node" else "")
        if 1024 in big and 16384 in big:
            a, b = big[1024], big[16384]
            sc = {
                "n_ratio": 16.0,
                "server_cpu_ratio": b["server_cpu_ms"] / max(a["server_cpu_ms"], 1e-9),
                "requests_ratio": b["requests_total"] / a["requests_total"],
                "median_ms_ratio": b["median_ms"] / a["median_ms"],
                "ops_per_rank": [a["ops_per_rank_median"], b["ops_per_rank_median"]],
                "bytes_per_rank": [a["bytes_per_rank_median"], b["bytes_per_rank_median"]],
            }
            per_node = ""
            if mode == "node":
                sc["ops_per_node"] = [a["ops_per_node_median"], b["ops_per_node_median"]]
                per_node = f"; per node: ops {a['ops_per_node_median']:g} -> {b['ops_per_node_median']:g}"
            lines.append(
                f"{what}, 1024 -> 16384 ranks (x16): server requests x{sc['requests_ratio']:.1f}, "
                f"server CPU x{sc['server_cpu_ratio']:.1f}, median time x{sc['median_ms_ratio']:.1f}; per rank: "
                f"ops {a['ops_per_rank_median']:g} -> {b['ops_per_rank_median']:g}, "
                f"bytes {a['bytes_per_rank_median']:.0f} -> {b['bytes_per_rank_median']:.0f}{per_node}"
            )
        if 16384 in big:
            b = big[16384]
            sc["target_1s_median_met"] = b["median_ms"] < 1000.0
            sc["max_under_1s"] = b["max_ms"] < 1000.0
            requests = f"{b['requests_per_rank_median']:g} per rank"
            if mode == "node":
                requests += f", {b['requests_per_node_median']:g} per node"
            lines.append(
                f"{what}, 16384 ranks: the median rank held the decision {b['median_ms']:.0f} ms after the fault, "
                f"the last {b['max_ms']:.0f} ms: target (median < 1000 ms) "
                f"{'met' if b['median_ms'] < 1000 else 'NOT met'}; {b['requests_total']:.0f} server requests per "
                f"restart ({requests}); server CPU {b['server_cpu_ms']:.0f} ms "
                f"({b['server_cpu_us_per_request']:.1f} us per request), client CPU {b['client_cpu_ms']:.0f} ms, "
                f"1-minute load average {b['load_average']:.1f}"
            )
        last = rs[-1]
        if "steady_state_requests_per_s" in last:
            waiters = (f"every node agent (not every trigger: they wait on the board) re-sends its blocking get "
                       f"of the event once per {WAIT_CHUNK_S:g} s" if mode == "node" else
                       f"every trigger re-sends its blocking get once per {WAIT_CHUNK_S:g} s")
            lines.append(
                f"{what}, steady state at {last['n']} ranks: {last['steady_state_requests_per_s']:.0f} requests/s, "
                f"{last['steady_state_server_cpu_pct']:.2f} % of the server's core: per heartbeat interval "
                f"({cfg_interval(results)}) every monitor sends one add and one multi_get of {WATCHED_PEERS} peers' "
                f"counters (3 requests on the wire: ADD, WAIT, MULTI_GET; measured "
                f"{last['hb_server_cpu_us_per_request']:.1f} us of server CPU each), and {waiters} "
                f"(CANCEL_WAIT + WAIT); the restart protocol sends nothing else between restarts (measured with "
                f"every wait parked: {last['steady_requests_per_s']:g} requests/s). During a restart: "
                f"{last['server_requests_per_s']:.0f} requests/s ({last['requests_total']:.0f} requests in "
                f"{last['max_ms']:.0f} ms)"
            )
        scaling[mode] = sc
    return scaling, lines


def cfg_interval(results: list[dict[str, Any]]) -> str:
    return f"{results[-1].get('heartbeat_interval_s', 30.0):g} s"


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:
        return "?"


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, nargs="+", default=[256, 1024, 4096, 16384], help="simulated world sizes")
    d = SimConfig()
    ap.add_argument("--procs", type=int, default=d.procs, help="client processes")
    ap.add_argument("--groups", type=int, default=d.groups, help="groups of ranks per client process")
    ap.add_argument("--restarts", type=int, default=d.restarts, help="restarts per N (medians are over them)")
    ap.add_argument("--kind", choices=["killed", "exception"], default=d.kind)
    ap.add_argument("--decode", choices=["shared", "every-rank"], default=d.decode)
    ap.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node,
                    help="ranks per node agent (node mode); 0: direct mode only")
    ap.add_argument("--direct", action="store_true", help="direct mode only (same as --ranks-per-node 0)")
    ap.add_argument("--node-only", action="store_true", help="node mode only: skip the direct mode's comparison")
    ap.add_argument("--steady-s", type=float, default=d.steady_s, help="idle window measured before each fault")
    ap.add_argument("--heartbeat-rounds", type=int, default=d.heartbeat_rounds,
                    help="rounds of monitor heartbeats measured per N (0: none)")
    ap.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
                    help="heartbeat interval the steady-state figures are given for")
    ap.add_argument("--timeout-s", type=float, default=d.timeout_s)
    ap.add_argument("--no-write", action="store_true", help="print only; do not write the PNG and markdown")
    ap.add_argument("--png", default=DEFAULT_PNG)
    ap.add_argument("--md", default=DEFAULT_MD)
    ap.add_argument("--plot-from", metavar="FILE",
                    help="only redraw the PNG from the JSON line of an earlier run's stdout saved in FILE")
    args = ap.parse_args(argv)
    if args.plot_from:
        with open(args.plot_from) as f:
            run = next(json.loads(line) for line in f if line.startswith('{"benchmark":"control_plane"'))
        plot(run["results"], args.png, SimConfig(**run["config"]))
        return 0
    if args.ranks_per_node < 0:
        ap.error("--ranks-per-node must be >= 0")
    rpn = 0 if args.direct else args.ranks_per_node
    if args.node_only and rpn == 0:
        ap.error("--node-only needs node mode (--ranks-per-node > 0, no --direct)")
    # Node mode first, then (unless --node-only) direct mode, for each N in turn:
    # both modes of one N run a few seconds apart, under the same load.
    modes = [rpn] if rpn == 0 or args.node_only else [rpn, 0]
    cfg = SimConfig(procs=args.procs, groups=args.groups, restarts=args.restarts,
                    kind=args.kind, decode=args.decode, steady_s=args.steady_s, timeout_s=args.timeout_s,
                    heartbeat_rounds=args.heartbeat_rounds, heartbeat_interval_s=args.heartbeat_interval_s,
                    ranks_per_node=rpn)
    results = []
    t = time.monotonic()
    with Session(cfg) as session:
        print(f"session: server + {cfg.procs} client processes, {session.connections} connections "
              f"({time.monotonic() - t:.0f}s)", file=sys.stderr, flush=True)
        for n in args.n:
            for k in modes:
                t = time.monotonic()
                r = session.simulate(n, k)
                r["run_s"] = time.monotonic() - t
                results.append(r)
                print(f"N={n} {r['mode']}: median {r['median_ms']:.1f} ms, max {r['max_ms']:.1f} ms "
                      f"({r['run_s']:.0f}s)", file=sys.stderr, flush=True)
    results.sort(key=lambda r: (r["mode"] != "node", r["n"]))  # tables: node mode first
    print(table(results))
    print(table(results, columns=STEADY_COLUMNS))
    scaling, lines = verdicts(results)
    for line in lines:
        print(line)
    summary = [{k: v for k, v in r.items() if k != "per_restart"} for r in results]
    print(json.dumps({"benchmark": "control_plane", "config": dataclasses.asdict(cfg), "results": summary,
                      "scaling": scaling}, separators=(",", ":")))
    if not args.no_write:
        plot(results, args.png, cfg)
        command = "python benchmarks/control_plane_sim.py " + " ".join(argv if argv is not None else sys.argv[1:])
        write_markdown(results, args.md, cfg, command.strip(), lines, args.png)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--client"]:
        client_main()
    else:
        sys.exit(main())
