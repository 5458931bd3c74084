"""Control-plane simulator: one restart of N simulated ranks against one TCPStore.

Runs the library's own store protocol (:class:`inprocess.protocol.RestartProtocol`
and :func:`inprocess.protocol.decide`, imported, not copied) for N simulated
ranks and reports, per N, how long the restart's control plane takes and what
it costs the store::

    python benchmarks/control_plane_sim.py                  # N = 256 1024 4096 16384
    python benchmarks/control_plane_sim.py --n 1024 --restarts 5 --no-write

One restart, as the wrapper does it (``inprocess/wrap.py``, ``trigger.py``,
``monitor.py``):

0. setup, not measured: every rank's seat (``inprocess/<call>/seat/<r>``) is
   written "0" with ``multi_set``, as the job's initial barrier (barrier 0)
   leaves it, and every monitor's heartbeat counter exists; the simulated
   restarts then go through barriers 1, 2, ...;
1. steady state: every rank's restart trigger blocks in ``wait_event(i)``
   (one blocking ``get`` of the event key);
2. a fault: rank f dies and its monitor counts it out (``count_out``: reads
   and takes its seat, records the fault, requests the restart and arrives
   at barrier i+1 on its behalf; ``--kind killed``, the default), or rank
   f's main thread raises and reports (``--kind exception``);
3. the event wakes every rank's trigger (``wait_event`` returns "restart");
4. every rank arrives at barrier i+1 (``barrier``: its seat, one
   ``compare_set``, then one ``add``); the first healthy arriver leads, runs
   ``decide`` with ``Compose(ActivateAllRanks(), ShiftRanks())`` and
   publishes the decision; the others read it with one blocking ``get``;
5. next iteration: every trigger blocks again in ``wait_event(i+1)``.

After the restarts of each N, the steady state is measured: ``--heartbeat-rounds``
rounds in which every monitor sends what it sends once per
heartbeat interval (one ``add`` of its counter, one ``multi_get`` of the
counters of the next 8 ranks), as fast as the clients go, with the server's
CPU time per round; requests/s and server CPU % follow for the Wrapper's
default interval of 30 s.

Processes: the TCPStore server (``use_libuv=True``) lives alone in a
``python -c`` process; the simulated ranks live in ``--procs`` client
processes; this driver process only commands them and reads CPU times from
``/proc``. Every connection goes to 127.0.0.1 (torch itself reverse-resolves
each connected address, see ``CHILD_ENV``).

How simulated ranks share connections and threads, and what that changes.
A real rank holds two client connections (main thread, restart trigger) and
runs on its own host. Here 16,384 ranks would need 32,768 sockets (over the
20,000 open files a process may hold), and a thread per rank costs about
0.2 ms of CPU per wake-up on this machine: the simulation would measure
thread switching, not the store. So each client process splits its ranks
into ``--groups`` groups; a group has two connections (non-blocking
operations; blocking waits and gets) and one thread, which runs the
library's calls for each of its ranks in turn:

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

Why the leader has a connection of its own: torch's client runs one call at
a time per connection. When the leader blocked on its group's waits
connection, the new thread could reach that connection first, whenever the
leader was descheduled between handing over and sending its wait: the
thread's get of the decision then held the connection, the leader's wait for
``ready`` queued behind it, and the decision never came (the harness stalled
until its timeout; about one run in three of the N = 64 test under a loaded
machine, reproduced at will by a 50 ms sleep at that point).

What is measured: every rank sends the server exactly the requests, keys and
values of the real protocol, in its real order; ``RestartProtocol.ops`` is
counted per rank (the deferred get is counted once). The fault's monitor
knows the expected count from the simulator, where a real monitor reads the
previous decision (one more blocking get, for one process). What differs from
a real job: (a) at most P*(groups+1) requests are in flight and as many
waits are parked on the server (a real job parks N waits and sends up to N
requests at once); (b) within a group the ranks are served one after
another, so a rank's time includes its predecessors' round trips; (c) the
Python work of all N ranks (protocol code, syscalls) shares this machine's
2 cores with the server, where a real job spreads it over N hosts. The
times are therefore an upper bound for the control plane; the server's own
CPU time per restart (from /proc) is the part a real job cannot spread:
the TCPStore server is one event-loop thread. (d) Over loopback the kernel
runs the receiver's TCP receive path and wake-up inside the sender's
``write``: the server's CPU per request includes work that a network would
do on the client's host. (e) With ``--decode shared`` (the default) the
ranks of one client process share one ``Decision.from_json`` of the
identical decision bytes (each rank still fetches the bytes from the
store); decoding builds the whole membership, O(N) per rank (about 0.5 ms
at 16,384), which a real job pays once per rank in parallel: it is measured
and reported in the "decode" column. ``--decode every-rank`` decodes on
every rank (the tests use it).

Bytes per rank are estimated from the torch TCPStore wire format: 1 byte
query type, strings and values sent as an 8-byte length plus the bytes (keys
with the client's "/" prefix), 8-byte integers, 1-byte wait/check answers; a
``get`` (and a ``multi_get``) is a WAIT then a GET on the wire (two
requests); ``set`` and ``append`` have no answer. TCP/IP headers are not
counted.

Outputs: a table and one JSON line on stdout; with writing enabled (default),
``benchmarks/control_plane.png`` (time against N) and the results block of
``benchmarks/control_plane.md``.
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

from inprocess.membership import ACTIVE, TERMINATED, Membership
from inprocess.protocol import (
    COMPLETE, WAIT_CHUNK_S, Decision, FaultRecord, RestartProtocol, decide, monitor_heartbeat_key,
)
from inprocess.rank_assignment import ActivateAllRanks, Compose, ShiftRanks

HOST = "127.0.0.1"
WATCHED_PEERS = 8  # peers whose heartbeat counters each monitor reads per interval (inprocess.monitor)
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

    def __init__(self, op_conn: Any, wait_conn: Any, tally: Tally, group: Optional["Group"]):
        self._op = op_conn
        self._wait_conn = wait_conn
        self._t = tally
        self._group = group
        self._timeout = op_conn.timeout  # what set_timeout gave; applied to the connection of each get

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
        self._timeout = timeout  # no request: a client-side setting

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
    """One simulated rank: a main and a trigger RestartProtocol, as in the wrapper."""

    __slots__ = ("rank", "trigger", "main", "t_tally", "m_tally", "last_ops", "last", "t_woken")

    def __init__(self, rank: int, call: int, op_conn: Any, wait_conn: Any, group: Optional["Group"]):
        self.rank = rank
        self.t_tally, self.m_tally = Tally(), Tally()
        self.trigger = RestartProtocol(SharedStore(op_conn, wait_conn, self.t_tally, group), call)
        self.main = RestartProtocol(SharedStore(op_conn, wait_conn, self.m_tally, group), call)
        self.last_ops = 0
        self.last = (0, 0, 0)
        self.t_woken = 0

    @property
    def ops(self) -> int:
        return self.trigger.ops + self.main.ops

    def tally(self) -> tuple[int, int, int]:
        a, b = self.t_tally.snapshot(), self.m_tally.snapshot()
        return a[0] + b[0], a[1] + b[1], a[2] + b[2]


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
        self.reporters: dict[int, list[Any]] = {}  # restart -> [t0_ns, ops, requests, out, in]
        self.errors: list[str] = []
        self.decision_raw: dict[int, bytes] = {}
        # Ranks of this process that hold each restart's decision (wake the command loop once, not per rank).
        self.expected_done = [sum(1 for r in range(self.lo, self.hi) if self.alive_in(r, j)) for j in range(len(self.faulty))]
        groups = len(conns.ops)
        ranks = list(range(self.lo, self.hi))
        self.groups: list[Group] = []
        self.sims: dict[int, SimRank] = {}
        for g in range(min(groups, len(ranks))):
            part = ranks[len(ranks) * g // min(groups, len(ranks)): len(ranks) * (g + 1) // min(groups, len(ranks))]
            group = Group(self, f"group of ranks {part[0]}..{part[-1]}")
            for r in part:
                rs = SimRank(r, self.call, conns.ops[g], conns.waits[g], group)
                group.ranks.append(rs)
                self.sims[r] = rs
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

    # -- faults ---------------------------------------------------------------

    def _control(self, tally: Tally) -> RestartProtocol:
        c = self.conns.control
        return RestartProtocol(SharedStore(c, c, tally, None), self.call)

    def _kill(self, restart: int) -> None:
        """Rank faulty[restart] died: its monitor counts it out (``count_out``, as
        ``inprocess.monitor`` does): takes its seat, records the fault, requests
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
        barrier = p.count_out(rank, fault, lambda b: self.world_size[b - 1], self.timeout_s)
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
        the next WATCHED_PEERS ranks (as ``inprocess.monitor`` does), over the
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
        self._wait_for(lambda: self.done[j] == self.expected_done[j] and self.armed[j + 1] == len(self.groups),
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
        return {"done": j, "records": self.records.pop(j, []),
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

    def simulate(self, n: int) -> dict[str, Any]:
        """``cfg.restarts`` restarts of a job of N simulated ranks."""
        cfg = self.cfg
        clients = self.clients[: max(1, min(len(self.clients), n))]
        procs = len(clients)
        faulty = pick_faulty(n, cfg.restarts)
        call = self._calls
        self._calls += 1
        bounds = [n * k // procs for k in range(procs + 1)]
        for k, c in enumerate(clients):
            c.send({"cmd": "job", "n": n, "call": call, "lo": bounds[k], "hi": bounds[k + 1], "faulty": faulty,
                    "kind": cfg.kind, "timeout_s": cfg.timeout_s, "check_membership": cfg.check_membership})
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
            r = _restart_figures(n, j, faulty, cfg, done)
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
        return _summary(n, cfg, procs, self.connections, restarts, hb)


def simulate(n: int, cfg: SimConfig) -> dict[str, Any]:
    """One job of N simulated ranks in a session of its own (used by the tests)."""
    with Session(cfg) as s:
        return s.simulate(n)


def _restart_figures(n: int, j: int, faulty: list[int], cfg: SimConfig, done: list[dict[str, Any]]) -> dict[str, Any]:
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
    return {
        "restart": j,
        "ranks": len(records),
        "median_ms": statistics.median(done_ms),
        "p99_ms": _pct(done_ms, 0.99),
        "max_ms": max(done_ms),
        "wake_median_ms": statistics.median(woken_ms),
        "wake_max_ms": max(woken_ms),
        "ops_per_rank_median": statistics.median(ops),
        "ops_per_rank_max": max(ops),
        "ops_leader": leader[3],
        "ops_reporter": rep_ops,
        "ops_total": sum(ops) + rep_ops,
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
             hb: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"n": n, "procs": procs, "connections": connections, "restarts": len(restarts)}
    for key, value in restarts[0].items():
        if isinstance(value, (int, float)) and key != "restart":
            out[key] = statistics.median(r[key] for r in restarts)
    # Steady state, per heartbeat interval (cfg.heartbeat_interval_s): every
    # monitor's add + multi_get (measured above), plus every trigger's blocking
    # get re-sent once per WAIT_CHUNK_S (CANCEL_WAIT + a new WAIT).
    monitors = n - (len(restarts) if cfg.kind == "killed" else 0)
    if hb:
        hb_requests = statistics.median(h["requests"] for h in hb)
        hb_cpu_ms = statistics.median(h["server_cpu_ms"] for h in hb)
        out["hb_requests_per_round"] = hb_requests
        out["hb_server_cpu_ms"] = hb_cpu_ms
        out["hb_wall_ms"] = statistics.median(h["wall_ms"] for h in hb)
        out["hb_bytes_per_monitor"] = statistics.median(h["bytes"] for h in hb) / monitors
        out["hb_server_cpu_us_per_request"] = 1e3 * hb_cpu_ms / hb_requests
        rewaits = 2 * monitors / WAIT_CHUNK_S
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
    ("N", "n", "{:d}"),
    ("median ms", "median_ms", "{:.0f}"),
    ("max ms", "max_ms", "{:.0f}"),
    ("wake max ms", "wake_max_ms", "{:.0f}"),
    ("ops/rank", "ops_per_rank_median", "{:g}"),
    ("ops leader", "ops_leader", "{:g}"),
    ("requests/rank", "requests_per_rank_median", "{:g}"),
    ("B/rank", "bytes_per_rank_median", "{:.0f}"),
    ("B leader", "bytes_leader", "{:.0f}"),
    ("decision B", "decision_bytes", "{:.0f}"),
    ("server req/s", "server_requests_per_s", "{:.0f}"),
    ("server CPU ms", "server_cpu_ms", "{:.0f}"),
    ("server CPU us/req", "server_cpu_us_per_request", "{:.1f}"),
    ("client CPU ms", "client_cpu_ms", "{:.0f}"),
    ("assign ms", "assignment_ms", "{:.1f}"),
    ("decode ms", "decode_ms", "{:.2f}"),
]

# Steady state: no restart under way.
STEADY_COLUMNS = [
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
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|"]
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

    ns = [r["n"] for r in results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(ns, [r["max_ms"] for r in results], "o-", label="max over ranks (fault → decision held)")
    ax.plot(ns, [r["median_ms"] for r in results], "s-", label="median over ranks")
    ax.plot(ns, [r["server_cpu_ms"] for r in results], "^--", label="store server CPU time per restart")
    base = next((r for r in results if r["n"] == 1024), results[0])
    ax.plot(ns, [base["max_ms"] * n / base["n"] for n in ns], ":", color="grey", label=f"linear in N from N={base['n']}")
    ax.axhline(1000, color="red", lw=0.8, label="target: 1 s at 16,384")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns])
    ax.set_xlabel("simulated ranks N")
    ax.set_ylabel("ms")
    ax.set_title(f"Restart control plane, one TCPStore, {cfg.procs} client processes ({os.cpu_count()} cores)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_markdown(results: list[dict[str, Any]], path: str, cfg: SimConfig, command: str, lines: list[str],
                   png: str = DEFAULT_PNG) -> None:
    """Replace the results block of ``path`` (between MD_BEGIN and MD_END), keeping the prose around it."""
    load = ", ".join(f"{r['load_average']:.1f}" for r in results)
    block = "\n".join([
        MD_BEGIN,
        "",
        f"Command: `{command}` — {os.cpu_count()} cores, torch {_torch_version()}, "
        f"{cfg.procs} client processes x {cfg.groups} groups (2 connections each; plus a leader and a control connection per process), "
        f"fault kind `{cfg.kind}`, median of {cfg.restarts} restarts per N, decode `{cfg.decode}`; "
        f"1-minute load average during the runs: {load}.",
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
    """The figures the issue's targets are about, in words."""
    big = {r["n"]: r for r in results}
    scaling: dict[str, Any] = {}
    lines = []
    if 1024 in big and 16384 in big:
        a, b = big[1024], big[16384]
        scaling = {
            "n_ratio": 16.0,
            "server_cpu_ratio": b["server_cpu_ms"] / max(a["server_cpu_ms"], 1e-9),
            "requests_ratio": b["requests_total"] / a["requests_total"],
            "max_ms_ratio": b["max_ms"] / a["max_ms"],
            "ops_per_rank": [a["ops_per_rank_median"], b["ops_per_rank_median"]],
            "bytes_per_rank": [a["bytes_per_rank_median"], b["bytes_per_rank_median"]],
        }
        lines.append(
            f"1024 -> 16384 ranks (x16): server requests x{scaling['requests_ratio']:.1f}, "
            f"server CPU x{scaling['server_cpu_ratio']:.1f}, max time x{scaling['max_ms_ratio']:.1f}; per rank: "
            f"ops {a['ops_per_rank_median']:g} -> {b['ops_per_rank_median']:g}, "
            f"bytes {a['bytes_per_rank_median']:.0f} -> {b['bytes_per_rank_median']:.0f}"
        )
    if 16384 in big:
        b = big[16384]
        scaling["target_1s_met"] = b["max_ms"] < 1000.0
        lines.append(
            f"16384 ranks: every rank held the decision {b['max_ms']:.0f} ms after the fault (median {b['median_ms']:.0f} ms): "
            f"target < 1000 ms {'met' if b['max_ms'] < 1000 else 'NOT met'}; the single-threaded server alone spent "
            f"{b['server_cpu_ms']:.0f} ms of CPU ({b['server_cpu_us_per_request']:.1f} us per request, "
            f"{b['requests_per_rank_median']:g} requests per rank)"
        )
    last = results[-1]
    if "steady_state_requests_per_s" in last:
        lines.append(
            f"steady state at {last['n']} ranks: {last['steady_state_requests_per_s']:.0f} requests/s, "
            f"{last['steady_state_server_cpu_pct']:.2f} % of the server's core: per heartbeat interval "
            f"({cfg_interval(results)}) every monitor sends one add and one multi_get of {WATCHED_PEERS} peers' "
            f"counters (3 requests on the wire: ADD, WAIT, MULTI_GET; measured "
            f"{last['hb_server_cpu_us_per_request']:.1f} us of server CPU each), and every trigger re-sends its "
            f"blocking get once per {WAIT_CHUNK_S:g} s (CANCEL_WAIT + WAIT); the restart protocol sends nothing "
            f"else between restarts (measured with every trigger parked: {last['steady_requests_per_s']:g} "
            f"requests/s). During a restart: {last['server_requests_per_s']:.0f} requests/s "
            f"({last['requests_total']:.0f} requests in {last['max_ms']:.0f} ms)"
        )
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
    ap.add_argument("--steady-s", type=float, default=d.steady_s, help="idle window measured before each fault")
    ap.add_argument("--heartbeat-rounds", type=int, default=d.heartbeat_rounds,
                    help="rounds of monitor heartbeats measured per N (0: none)")
    ap.add_argument("--heartbeat-interval-s", type=float, default=d.heartbeat_interval_s,
                    help="heartbeat interval the steady-state figures are given for")
    ap.add_argument("--timeout-s", type=float, default=d.timeout_s)
    ap.add_argument("--no-write", action="store_true", help="print only; do not write the PNG and markdown")
    ap.add_argument("--png", default=DEFAULT_PNG)
    ap.add_argument("--md", default=DEFAULT_MD)
    args = ap.parse_args(argv)
    cfg = SimConfig(procs=args.procs, groups=args.groups, restarts=args.restarts,
                    kind=args.kind, decode=args.decode, steady_s=args.steady_s, timeout_s=args.timeout_s,
                    heartbeat_rounds=args.heartbeat_rounds, heartbeat_interval_s=args.heartbeat_interval_s)
    results = []
    t = time.monotonic()
    with Session(cfg) as session:
        print(f"session: server + {cfg.procs} client processes, {session.connections} connections "
              f"({time.monotonic() - t:.0f}s)", file=sys.stderr, flush=True)
        for n in args.n:
            t = time.monotonic()
            r = session.simulate(n)
            r["run_s"] = time.monotonic() - t
            results.append(r)
            print(f"N={n}: median {r['median_ms']:.1f} ms, max {r['max_ms']:.1f} ms ({r['run_s']:.0f}s)",
                  file=sys.stderr, flush=True)
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
