"""The simulated ranks of one job (one N) in one client process: setup, faults, bookkeeping.

One restart, as the wrapper does it (``inprocess/engine/trigger.py``, the
call wrapper, ``inprocess/processes/monitor.py`` and ``node_agent.py``):

0. setup, not measured: every rank's seat (in ``inprocess/<call>/seat/<r // K>``) is
   written "0" with ``multi_set`` and barrier 0's decision is out, as the
   job's initial barrier leaves them, and every monitor's heartbeat counter
   exists; the simulated restarts then go through barriers 1, 2, ...;
1. steady state: direct mode: every rank's restart trigger blocks in
   ``wait_event(i)``; node mode: every node agent blocks in
   ``relay_event(i)`` (the same blocking get, once per node) and every
   trigger waits on its node's board;
2. a fault: rank f dies and its monitor counts it out (``count_out``,
   directly at the store in both modes; ``--kind killed``, the default), or
   rank f's main thread raises and reports (``--kind exception``);
3. the event wakes every rank's trigger, in node mode through the board;
4. every rank arrives at barrier i+1 (:mod:`.ranks`, :mod:`.nodes`); the
   first healthy arriver leads, runs ``decide`` with
   ``Compose(ActivateAllRanks(), ShiftRanks())`` and publishes the decision;
5. next iteration: every trigger (direct) or agent (node) blocks again.

The fault's monitor knows the expected count from the simulator, where a
real monitor reads the previous decision (one more blocking get, for one
process).
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from inprocess import _native
from inprocess.compose import Compose
from inprocess.control import joining, seat_table
from inprocess.control.counting_out import count_out
from inprocess.control.membership import Membership
from inprocess.control.node_link import NodeLink
from inprocess.control.protocol import COMPLETE, RestartProtocol, monitor_heartbeat_key
from inprocess.control.records import Decision, FaultRecord
from inprocess.processes.node_relay import DECISION_CAPACITY
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, decide

from .config import WATCHED_PEERS
from .decoding import decode_us
from .joins import JOB_CONFIG, JoinPlan, SimJoiners
from .nodes import NodeGroup, SimNode
from .ranks import Group, SimRank
from .wire import Connections, SharedStore, Tally, key_bytes

# Keys per multi_set while seeding (one request each; bounded so that no request grows with N).
_SEED_BATCH = 4096


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
        self.plan = JoinPlan(self.n, cfg.get("joiners", 0), len(self.faulty), self.faulty,
                             cfg.get("joiner_layout", "nodes"))
        self.joiners: dict[int, SimJoiners] = {}  # restart -> this process's joiners admitted in it
        self.admit_ns: dict[int, int] = {}  # restart -> the leader's joining.admit, when it led here
        self.admit_calls: dict[int, int] = {}  # restart -> the store calls of that admit
        self.decide_ns: dict[int, tuple[int, int]] = {}  # restart -> when the leader's decide_fn ran, when it led here
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
        self.leader_decision: dict[int, Decision] = {}  # encoded again after the window, for its size
        # Ranks of this process that hold each restart's decision (wake the command loop once, not per rank).
        self.expected_done = [sum(1 for r in range(self.lo, self.hi) if self.alive_in(r, j))
                              for j in range(len(self.faulty))]
        self.groups: list[Any] = []  # Group (direct mode) or NodeGroup (node mode)
        self.sims: dict[int, SimRank] = {}
        self.nodes: list[SimNode] = []
        if self.ranks_per_node > 0:
            self._make_nodes(len(conns.ops))
        else:
            self._make_groups(len(conns.ops))

    def _make_groups(self, groups: int) -> None:
        """Direct mode: this process's ranks in ``groups`` groups of consecutive ranks."""
        ranks = list(range(self.lo, self.hi))
        k = min(groups, len(ranks))
        for g in range(k):
            part = ranks[len(ranks) * g // k: len(ranks) * (g + 1) // k]
            group = Group(self, f"group of ranks {part[0]}..{part[-1]}")
            for r in part:
                rs = SimRank(r, self.call, self.conns.ops[g], self.conns.waits[g], group)
                group.ranks.append(rs)
                self.sims[r] = rs
            self.groups.append(group)

    def _make_nodes(self, groups: int) -> None:
        """Node mode: this process's ranks in whole nodes (the driver splits the
        job at node boundaries), each node with a board of its own and its
        ranks linked to it by local slot; the nodes split into groups of whole
        nodes."""
        rpn = self.ranks_per_node
        if self.lo % rpn:
            raise ValueError(f"ranks {self.lo}..{self.hi - 1} do not start at a node boundary ({rpn} ranks per node)")
        nodes = [list(range(a, min(a + rpn, self.hi))) for a in range(self.lo, self.hi, rpn)]
        k = min(groups, len(nodes))
        for g in range(k):
            part = nodes[len(nodes) * g // k: len(nodes) * (g + 1) // k]
            group = NodeGroup(self, f"group of nodes {part[0][0] // rpn}..{part[-1][0] // rpn}")
            conns = self.conns
            native = (conns.relay_forward[g], conns.relay_broadcast[g]) if conns.relay_forward else None
            for members in part:
                board = _native.NodeBoard.create(len(members), DECISION_CAPACITY)
                node = SimNode(members[0] // rpn, self.call, board, self.conns.ops[g], self.conns.waits[g], group,
                               self.timeout_s, self.conns.pipes[g] if self.conns.pipes else None, native)
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
        if self.kind != "killed":
            return True
        return rank not in self.faulty[: iteration + 1] and not self.plan.away(rank, iteration)

    def runs_again(self, ranks: list[SimRank], iteration: int) -> bool:
        """Whether one of ``ranks`` runs iteration ``iteration`` or a later one: a group whose ranks
        are all away (whole nodes lost) waits for the iteration in which their joiners come back."""
        return any(self.alive_in(rs.rank, k) for k in range(iteration, len(self.faulty) + 1) for rs in ranks)

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

    def decide_fn(self, i: int) -> Callable[[set[int], list[FaultRecord], int], Decision]:
        previous = self.memberships[i]

        def decide_fn(dead: set[int], faults: list[FaultRecord], leader: int) -> Decision:
            # As CallWrapper._decide: the pending joiners are admitted into free seats before the assignment.
            p = self.sims[leader].main
            t, calls = time.monotonic_ns(), p.ops
            joined = joining.admit(joining.JoinKeys(p.counted, p.call, p.incarnation), i + 1, previous, JOB_CONFIG,
                                   seat_table=p.seat_table, publish_keys=p.topology.publish)
            self.admit_ns[i] = time.monotonic_ns() - t
            self.admit_calls[i] = p.ops - calls
            decision = decide(self.assignment, previous.with_joined(joined) if joined else previous, dead, faults,
                              i + 1, leader)
            decision.joined = joined
            self.decide_ns[i] = (t, time.monotonic_ns())
            return decision

        return decide_fn

    def record(self, rs: SimRank, i: int, decision: Decision) -> None:
        """``rs`` holds the decision of barrier i+1 (now)."""
        self.record_ranks(i, [(rs, decision, time.monotonic_ns())])

    def record_ranks(self, i: int, held: list[tuple[SimRank, Decision, int]]) -> None:
        """Each (rank, decision, when) of ``held`` held the decision of barrier i+1 from ``when`` on.

        This runs in the timed window, on the thread that goes on with the group's next ranks, and
        a real rank pays none of it: one call and one lock per node, rs.ops and rs.tally() inline.
        """
        rows = self.records[i]
        m = None
        for rs, decision, t_done in held:
            m = decision.membership
            r = rs.rank
            leader = decision.leader == r
            mdigest = ""
            if self.check_membership:  # O(N) per rank: small N only
                mdigest = hashlib.sha1(json.dumps([m.mode, m.rank, m.active_rank]).encode()).hexdigest()[:16]
            if leader:  # not encoded here: at 16,384 ranks that took the leader's thread ~10 ms
                self.leader_decision[i] = decision
            tc, mc, tt, mt = rs.trigger.counted, rs.main.counted, rs.t_tally, rs.m_tally
            ops, now = tc.calls + mc.calls, (tc.requests + mc.requests, tt.out + mt.out, tt.inb + mt.inb)
            last = rs.last
            rows.append([
                r, rs.t_woken, t_done, ops - rs.last_ops, now[0] - last[0], now[1] - last[1], now[2] - last[2],
                int(leader), m.mode[r], m.rank[r], m.active_rank[r], mt.decision, mdigest, decision.assignment_ns,
                0,  # the leader's: its decision's size, set once the restart is over
            ])
            rs.last_ops, rs.last = ops, now
        if m is None:
            return
        with self.cond:
            if i + 1 not in self.world_size:  # Membership.world_size is O(N): once per process
                self.memberships[i + 1] = m
                self.world_size[i + 1] = m.world_size
            self.done[i] += len(held)
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
        ``inprocess.processes.monitor`` does): takes its seat, records the fault,
        requests the restart and arrives for it at the barrier."""
        rank = self.faulty[restart]
        tally = self.sims[rank].m_tally
        monitor = self._control(tally)  # the monitor process has a connection of its own
        before = tally.snapshot()
        t0 = time.monotonic_ns()

        def fault(iteration: int) -> FaultRecord:
            return FaultRecord(rank, iteration, "killed", "SIGKILL", "simulated: process killed", t_ns=t0)

        # A real monitor reads the previous barrier's decision for the expected
        # count (one blocking get); the simulator knows it.
        barrier = count_out(monitor, rank, fault, lambda b: self.world_size[b - 1], timeout=self.timeout_s,
                                    who=f"m{rank}", in_barrier=False)  # its page would say: RUNNING
        if barrier != restart + 1:
            raise RuntimeError(f"rank {rank} was counted out at barrier {barrier}, expected {restart + 1}")
        after = tally.snapshot()
        self.reporters[restart] = [t0, monitor.ops, monitor.requests, after[0] - before[0], after[1] - before[1]]
        # --joiners: more ranks die in this restart; their monitors count them out the same way
        # (here one after another, from this process: they are store calls only).
        for lost in self.plan.lost_in(restart):
            m = self._control(Tally())

            def lost_fault(iteration: int, lost: int = lost) -> FaultRecord:
                return FaultRecord(lost, iteration, "killed", "SIGKILL", "simulated: process killed", t_ns=t0)

            b = count_out(m, lost, lost_fault, lambda b: self.world_size[b - 1], timeout=self.timeout_s,
                            who=f"m{lost}", in_barrier=False)
            if b != restart + 1:
                raise RuntimeError(f"rank {lost} was counted out at barrier {b}, expected {restart + 1}")

    def _raise_exception(self, restart: int) -> None:
        """Rank faulty[restart]'s main thread raises: it checks, records and requests the restart."""
        rank = self.faulty[restart]
        tally = Tally()
        p = self._control(tally)  # the rank's main thread: its own connection, apart from its trigger's
        t0 = time.monotonic_ns()
        if not p.restart_requested(restart):
            p.report_fault(FaultRecord(rank, restart, "exception", "RuntimeError", "simulated fault", t_ns=t0))
        self.reporters[restart] = [t0, p.ops, p.requests, *tally.snapshot()]

    # -- driven by the command loop ---------------------------------------------

    def _wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: predicate() or bool(self.errors), self.timeout_s):
                raise TimeoutError(f"ranks {self.lo}..{self.hi - 1}: {what} within {self.timeout_s:g}s")
            if self.errors:
                raise RuntimeError("; ".join(self.errors[:5]))

    def _seed(self, values: dict[str, str]) -> None:
        items = list(values.items())
        for k in range(0, len(items), _SEED_BATCH):
            chunk = items[k:k + _SEED_BATCH]
            self.conns.control.multi_set([key for key, _ in chunk], [value for _, value in chunk])

    def start(self) -> dict[str, Any]:
        """Setup, not measured, then every group armed for iteration 0.

        A real job's initial barrier (barrier 0) leaves every rank's seat at
        "0", its decision (every rank active) out, read by every rank, and the
        incarnation named under ``running`` for joiners; the
        simulated restarts start at barrier 1 and need that state. Every
        monitor's counter exists (a monitor creates it when it starts, before
        its rank's first barrier). All written over the control connection,
        outside any rank's tally and before the first steady-state window.
        """
        seats = RestartProtocol(None, self.call)
        # Node mode: a seat key per node, as the agents propose (control/seat_table.py); direct mode: per rank.
        per_key = self.ranks_per_node or 1
        if self.lo % per_key or (self.hi % per_key and self.hi != self.n):
            raise ValueError(f"ranks {self.lo}..{self.hi - 1}: this process would share a seat key with another")
        self._seed(seat_table.seeded(seats.prefix, per_key, {r: "0" for r in range(self.lo, self.hi)}))
        for node in self.nodes:
            node.after_barrier_zero()
        if not self.nodes:  # direct mode: every rank took its seat at barrier 0 itself
            for rs in self.sims.values():
                rs.after_barrier_zero()
        initial = Decision(0, Membership.all_active(self.n), [], [], 0, leader=0)
        self.conns.control.set(seats.key(0, "decision"), initial.to_json())  # the same bytes from every process
        # Barrier 0's leader names the job's incarnation for joiners (joining.JoinKeys.name_running_incarnation).
        self.conns.control.set(joining.running_key(self.call), seats.incarnation)
        for rs in self.sims.values():
            rs.main.terms.saw(0, initial.term)
        self._seed({monitor_heartbeat_key(self.call, r): "1" for r in range(self.lo, self.hi)})
        for g in self.groups:
            g.thread.start()
        self._wait_for(lambda: self.armed[0] == len(self.groups), "groups armed")
        return {"ready": 0, "groups": len(self.groups)}

    def heartbeat_round(self) -> dict[str, Any]:
        """What every monitor of this process sends once per heartbeat interval:
        one ``add`` of its own counter and one ``multi_get`` of the counters of
        the next WATCHED_PEERS ranks (as ``inprocess.processes.monitor`` does),
        over the groups' operation connections, one thread per group."""
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
                out += (1 + key_bytes(own) + 8 + 8) + (1 + 8 + sum(key_bytes(k) for k in keys) + 1)
                out += 1 + 8 + sum(key_bytes(k) for k in keys) + sum(8 + len(v) for v in values)
            return requests, out

        last = len(self.faulty)
        with concurrent.futures.ThreadPoolExecutor(len(self.groups)) as pool:
            futures = [pool.submit(beat, self.conns.ops[k], [rs.rank for rs in g.ranks if self.alive_in(rs.rank, last)])
                       for k, g in enumerate(self.groups)]
            for f in futures:
                r, b = f.result(self.timeout_s)
                tally[0] += r
                tally[1] += b
        return {"hb_requests": tally[0], "hb_bytes": tally[1]}

    def announce(self, j: int) -> dict[str, Any]:
        """--joiners: the joiners of this process's free seats announce themselves and wait (restart j admits them)."""
        seats = [s for s in self.plan.admitted_in(j) if s in self.sims]
        joiners = SimJoiners(self.conns.join, self.call, seats, self.timeout_s)
        joiners.announce()
        joiners.start_waiting()
        self.joiners[j] = joiners
        return {"announced": len(seats)}

    def _joined(self, j: int) -> list[list[Any]]:
        """The joiners admitted in restart j have their outcome and decision: from the next iteration on,
        each is its seat's simulated rank again, in its seat's new life."""
        joiners = self.joiners.pop(j, None)
        if joiners is None:
            return []
        joiners.join(self.timeout_s)
        out = []
        for s in joiners.seats:
            t_announced, t_admitted, t_decided, life, barrier, ops = joiners.results[s]
            decision = joiners.decisions[s]
            rs = self.sims[s]
            rs.main.life = rs.trigger.life = life
            rs.main.terms.saw(barrier, decision.term)
            digest = hashlib.sha1(decision.to_json().encode()).hexdigest()[:16]
            m = decision.membership
            out.append([s, t_announced, t_admitted, t_decided, life, barrier, ops,
                        [m.mode[s], m.rank[s], m.active_rank[s]], digest])
        return out

    def fault(self, j: int) -> dict[str, Any]:
        if self.faulty[j] in self.sims:
            if self.kind == "killed":
                self._kill(j)
            else:
                self._raise_exception(j)
        # Every group with a rank that runs iteration j or a later one starts iteration j+1 (and bumps
        # "armed"), also one whose last live rank died in restart j (it then ends at once).
        running = sum(1 for g in self.groups if self.runs_again(g.ranks, j))
        self._wait_for(lambda: self.done[j] == self.expected_done[j] and self.armed[j + 1] == running,
                       f"restart {j} done")
        records = self.records.pop(j, [])
        decision = self.leader_decision.pop(j, None)
        decoding = 0.0
        if decision is not None:  # the leader's process: its decision's size, and what decoding it costs a rank
            raw = decision.to_json().encode()
            for rec in records:
                if rec[7]:
                    rec[14] = len(raw)
            decoding = decode_us(raw)
        return {"done": j, "records": records, "nodes": self.node_records.pop(j, []),
                "reporter": self.reporters.get(j), "decode_us": decoding, "joiners": self._joined(j),
                "admit_ns": self.admit_ns.pop(j, None), "admit_calls": self.admit_calls.pop(j, None),
                "decide_ns": self.decide_ns.pop(j, None)}

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
