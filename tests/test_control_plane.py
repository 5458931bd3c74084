"""The restart control plane at scale: agreement in the simulator, O(1) store operations per rank.

(a) runs the simulator, :mod:`benchmarks.control_plane` (the library's own protocol
against a real TCPStore server in its own process) at N = 64, in direct mode
and in node mode (8 nodes of 8 ranks, each with a board and an agent relay),
and checks that every simulated rank holds the same decision and the
assignment ShiftRanks must give it; (b) counts store operations per rank per
restart over an in-memory store at two world sizes and fails if the count
grows with N, directly and through node agents (then per rank and per node);
the encoded decision must not grow with N either when the faults are fixed;
(c) checks the blocking get behind ``wait_event`` and ``wait_decision`` on
both torch server backends, with torch's client and the torch-free one;
(d) runs the simulator's command line in its smoke mode and reads its JSON.
"""

from __future__ import annotations

import builtins
import datetime
import hashlib
import json
import pathlib
import re
import subprocess
import sys
import threading
from typing import Any

import psutil
import pytest
import torch.distributed as dist
from benchmarks.control_plane import SimConfig, expected_row, pick_faulty, simulate

import inprocess
from inprocess.control import store_ops
from inprocess.control.membership import ACTIVE, TERMINATED, Membership
from inprocess.control.protocol import COMPLETE, RESTART, Decision, FaultRecord, RestartProtocol
from inprocess.control.tcpstore_client import TCPStoreClient
from inprocess.rank_assignment import ActivateAllRanks, Compose, ShiftRanks, decide

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# ---------------------------------------------------------------------------
# (a) the simulator, real TCPStore, N = 64
# ---------------------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["killed", "exception"])
def test_simulated_ranks_agree_on_one_assignment(kind: str) -> None:
    before = _children()
    cfg = SimConfig(procs=2, groups=4, restarts=2, kind=kind, decode="every-rank", check_membership=True,
                        settle_s=0.1, steady_s=0.2, heartbeat_rounds=1, timeout_s=60.0, ranks_per_node=0)
    n = 64
    result = simulate(n, cfg)
    # Every process the simulator started is gone.
    assert _children() - before == set()

    assert result["all_agree"]
    faulty = pick_faulty(n, cfg.restarts)
    for j, r in enumerate(result["per_restart"]):
        dead = len(faulty[: j + 1]) if kind == "killed" else 0
        assert r["ranks"] == n - dead, r
        # One decision, byte for byte, on every rank (the simulator also checked each
        # rank's decoded table and its own row against ShiftRanks, and raised otherwise).
        assert len(r["decisions"]) == 1
        assert r["max_ms"] >= r["median_ms"] > 0
    assert result["steady_requests_per_s"] == 0
    # One heartbeat round: every live monitor's add + multi_get (ADD, WAIT, MULTI_GET).
    monitors = n - (cfg.restarts if kind == "killed" else 0)
    assert result["hb_requests_per_round"] == 3 * monitors


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["killed", "exception"])
def test_simulated_nodes_agree_on_one_assignment(kind: str) -> None:
    """Node mode, N = 64: 8 nodes of 8 ranks, 2 client processes of 2 groups of
    2 nodes (so that the leader's group has a node besides the leader's)."""
    before = _children()
    cfg = SimConfig(procs=2, groups=2, restarts=3, kind=kind, decode="every-rank", check_membership=True,
                        settle_s=0.1, steady_s=0.2, heartbeat_rounds=1, timeout_s=60.0, ranks_per_node=8)
    n = 64
    result = simulate(n, cfg)
    assert _children() - before == set()

    assert result["mode"] == "node" and result["all_agree"]
    faulty = pick_faulty(n, cfg.restarts)
    for j, r in enumerate(result["per_restart"]):
        dead = len(faulty[: j + 1]) if kind == "killed" else 0
        assert r["ranks"] == n - dead, r
        assert r["nodes"] == 8, r  # every node keeps live ranks: each relayed the event and the decision
        # One decision, byte for byte, on every rank and every node's relay (the
        # simulator also checked each rank's table and row, and raised otherwise).
        assert len(r["decisions"]) == 1
        assert r["max_ms"] >= r["median_ms"] > 0
        # Through the node agents: no store call by a plain rank; per node, a blocking get of the
        # event and of the decision (WAIT + GET each), one compare_set of its 8 ranks' seat key and
        # one add (plus the set of "ready" by one node, and a second compare_set by a node whose seat
        # key a monitor wrote since the agent's last write).
        assert r["ops_per_rank_median"] == 0 and r["requests_per_rank_median"] == 0, r
        assert r["ops_per_node_median"] == 3 + 1 and r["ops_per_node_max"] <= 3 + 3, r
        assert r["requests_per_node_median"] == 5 + 1 and r["requests_per_node_max"] <= 5 + 3, r
        assert r["requests_total"] <= 2 * n + 1, r  # + the leader's look for joiners (control/joining.py)
    assert result["steady_requests_per_s"] == 0
    monitors = n - (cfg.restarts if kind == "killed" else 0)
    assert result["hb_requests_per_round"] == 3 * monitors


def test_expected_rows_follow_shift_ranks() -> None:
    faulty = [5, 2]
    assert expected_row(8, faulty, 0, "killed", 5) == (TERMINATED, -1, -1)
    assert expected_row(8, faulty, 0, "killed", 7) == (ACTIVE, 6, 6)
    assert expected_row(8, faulty, 1, "killed", 7) == (ACTIVE, 5, 5)
    assert expected_row(8, faulty, 1, "killed", 1) == (ACTIVE, 1, 1)
    assert expected_row(8, faulty, 1, "exception", 7) == (ACTIVE, 7, 7)


# ---------------------------------------------------------------------------
# (b) operations per rank per restart, in-memory store
# ---------------------------------------------------------------------------


def _b(value: Any) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class MemoryStore:
    """The torch Store methods the protocol uses, in memory, thread-safe.

    Like torch's stores, ``get`` waits for the key up to the store's timeout,
    which ``set_timeout`` changes (a client-side setting, not a request).
    """

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._cv = threading.Condition()
        self.timeout = datetime.timedelta(seconds=30)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout

    def set(self, key: str, value: Any) -> None:
        with self._cv:
            self._data[key] = _b(value)
            self._cv.notify_all()

    def get(self, key: str, timeout: datetime.timedelta | None = None) -> bytes:
        self.wait([key], self.timeout if timeout is None else timeout)
        with self._cv:
            return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._cv:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._cv.notify_all()
            return value

    def append(self, key: str, value: Any) -> None:
        with self._cv:
            self._data[key] = self._data.get(key, b"") + _b(value)
            self._cv.notify_all()

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        with self._cv:
            current = self._data.get(key)
            if current is None:
                if _b(expected) == b"":
                    self._data[key] = _b(desired)
                    self._cv.notify_all()
                    return _b(desired)
                return _b(expected)
            if current == _b(expected):
                self._data[key] = _b(desired)
                self._cv.notify_all()
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._cv:
            return all(k in self._data for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self._cv:
            if not self._cv.wait_for(lambda: all(k in self._data for k in keys), timeout.total_seconds()):
                raise builtins.TimeoutError(f"timeout waiting for {keys}")

    def delete_key(self, key: str) -> bool:
        with self._cv:
            return self._data.pop(key, None) is not None


class CountingView:
    """One rank's view of a shared store: counts every call independently of RestartProtocol.ops."""

    METHODS = ("set", "add", "append", "compare_set", "check", "wait", "delete_key")

    def __init__(self, store: MemoryStore):
        self._store = store
        self.calls = 0
        self.timeout = store.timeout  # this client's own, as each torch client has

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.timeout = timeout  # client-side: not a request, not counted

    def get(self, key: str) -> bytes:
        self.calls += 1
        return self._store.get(key, self.timeout)

    def __getattr__(self, name: str) -> Any:
        if name not in self.METHODS:
            raise AttributeError(name)
        method = getattr(self._store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return method(*args, **kwargs)

        return counted


def rank_threads(
    protocols: dict[int, tuple[RestartProtocol, RestartProtocol]], n: int, dead_rank: int, timeout: float,
    decisions: dict[int, Decision | None], errors: list[BaseException],
) -> list[threading.Thread]:
    """One (unstarted) thread per surviving rank: its trigger waits for the restart of
    iteration 0, its main thread arrives at barrier 1 (ShiftRanks over all N ranks)."""
    assignment = Compose(ActivateAllRanks(), ShiftRanks())
    initial = Membership.all_active(n)

    def decide_fn(dead: set[int], faults: list[FaultRecord], leader: int) -> Decision:
        return decide(assignment, initial, dead, faults, 1, leader)

    def rank_main(r: int) -> None:
        trigger, main = protocols[r]
        try:
            assert trigger.wait_event(0, timeout) == "restart"
            decisions[r] = main.barrier(1, r, n, decide=decide_fn, timeout=timeout)
        except BaseException as e:
            errors.append(e)

    return [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(n) if r != dead_rank]


def read_barrier_0(protocols: dict[int, tuple[RestartProtocol, RestartProtocol]], *, took_seats: bool) -> None:
    """As in a job, each rank's main side read barrier 0's decision (term 0): the leader of
    barrier 1 knows which of barrier 0's keys to delete without asking the store. ``took_seats``:
    each took its seat there itself, so it knows the call's seats per key (one call, counted)."""
    for _, main in protocols.values():
        main.terms.saw(0, 0)
        if took_seats:
            main.seat_table.per_key  # noqa: B018  # asked once, then known


def agreed_decision(decisions: dict[int, Decision | None]) -> Decision:
    """The decision every rank holds; fails if two ranks hold different ones."""
    firsts = {d.to_json() for d in decisions.values() if d is not None}
    assert len(firsts) == 1, "ranks hold different decisions"
    return next(d for d in decisions.values() if d is not None)


def one_restart(n: int, dead_rank: int, timeout: float = 30.0) -> tuple[list[int], list[int], int, Decision]:
    """A restart of N ranks (one killed) over one in-memory store, one thread per rank.

    Returns (RestartProtocol ops per surviving rank, independently counted
    calls per surviving rank, ops of the dead rank's monitor, the decision).
    """
    store = MemoryStore()
    # As barrier 0 left them: every rank counted in at barrier 0 (a seat key per rank, without agents).
    RestartProtocol(store).seat_table.write({r: "0" for r in range(n)})
    views = {r: (CountingView(store), CountingView(store)) for r in range(n)}
    protocols = {r: (RestartProtocol(views[r][0]), RestartProtocol(views[r][1])) for r in range(n)}
    read_barrier_0(protocols, took_seats=True)
    before = {r: (protocols[r][0].ops + protocols[r][1].ops, views[r][0].calls + views[r][1].calls) for r in range(n)}
    decisions: dict[int, Decision | None] = {}
    errors: list[BaseException] = []

    threads = rank_threads(protocols, n, dead_rank, timeout, decisions, errors)
    for t in threads:
        t.start()
    # The dead rank's monitor: records the fault, wakes everyone, arrives for it.
    monitor = protocols[dead_rank][1]
    monitor.report_fault(FaultRecord(dead_rank, 0, "killed", "SIGKILL", "simulated", t_ns=1))
    assert monitor.barrier(1, dead_rank, n, terminated=True, timeout=timeout) is None
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "ranks still blocked"
    assert not errors, errors
    alive = [r for r in range(n) if r != dead_rank]
    ops = [protocols[r][0].ops + protocols[r][1].ops - before[r][0] for r in alive]
    calls = [views[r][0].calls + views[r][1].calls - before[r][1] for r in alive]
    decision = agreed_decision(decisions)
    return ops, calls, monitor.ops, decision


@pytest.mark.timeout(60)
def test_store_operations_per_rank_do_not_grow_with_n() -> None:
    per_n = {}
    for n in (16, 256):
        ops, calls, monitor_ops, decision = one_restart(n, dead_rank=n // 2 + 1)
        # RestartProtocol.ops counts exactly the calls that reached the store.
        assert ops == calls
        ops.sort()
        per_n[n] = (ops[len(ops) // 2], ops[-1], sum(ops) / len(ops), monitor_ops)
        m = decision.membership
        assert m.mode[n // 2 + 1] == TERMINATED and m.world_size == n - 1
    small, large = per_n[16], per_n[256]
    # A plain rank: one blocking get of the event, its seat (compare_set), its
    # arrival (add), one blocking get of the decision.
    assert small[0] == 4, f"a plain rank made {small[0]} store calls per restart, expected 4"
    assert large[0] <= small[0], f"median ops per rank grew with N: {small[0]} at 16, {large[0]} at 256"
    assert large[1] <= small[1], f"max ops per rank (the leader) grew with N: {small[1]} at 16, {large[1]} at 256"
    assert large[3] <= small[3], f"the monitor's ops grew with N: {small[3]} at 16, {large[3]} at 256"
    # The mean may only differ by who completed the count (one extra set of "ready").
    assert large[2] <= small[2] + 1.0 / 16


def one_restart_on_nodes(
    n: int, ranks_per_node: int, dead_rank: int, timeout: float = 30.0
) -> tuple[list[int], list[int], list[int], list[int], int, Decision]:
    """A restart of N ranks (one killed) through node agents, over one in-memory store.

    One thread per rank, as in :func:`one_restart`, with a NodeLink to its
    node's board (:class:`inprocess._native.NodeBoard`, created here); per
    node, an agent's two threads run the library's :class:`NodeRelay`: the
    broadcast thread relays the event of iteration 0 and the decision of
    barrier 1, the forward thread forwards the node's arrivals once all its
    live ranks posted them (one ``add``: the fewest a real agent sends). The
    dead rank's monitor counts it out directly.

    Returns (RestartProtocol ops per surviving rank, independently counted
    calls per surviving rank, ops per node, calls per node, ops of the
    monitor, the decision).
    """
    from inprocess import _native
    from inprocess.control.node_link import NodeLink
    from inprocess.processes.node_relay import DECISION_CAPACITY, NodeRelay

    store = MemoryStore()
    # As barrier 0 left them: every rank counted in, a seat key per node (the agents' proposal).
    RestartProtocol(store, seats_per_key=ranks_per_node).seat_table.write({r: "0" for r in range(n)})
    nodes = [list(range(a, min(a + ranks_per_node, n))) for a in range(0, n, ranks_per_node)]
    boards = [_native.NodeBoard.create(len(members), DECISION_CAPACITY) for members in nodes]
    relays = [NodeRelay(board) for board in boards]
    node_views = [(CountingView(store), CountingView(store)) for _ in nodes]
    node_protocols = [(RestartProtocol(a), RestartProtocol(b, seats_per_key=ranks_per_node))  # broadcast, forward
                      for a, b in node_views]
    for _, forward_p in node_protocols:  # each agent took its node's seats at barrier 0: it knows the layout
        assert forward_p.seat_table.per_key == ranks_per_node
    node_before = [(a.ops + b.ops, va.calls + vb.calls) for (a, b), (va, vb) in zip(node_protocols, node_views,
                                                                                    strict=True)]
    views = {r: (CountingView(store), CountingView(store)) for r in range(n)}
    protocols = {}
    for k, members in enumerate(nodes):
        for slot, r in enumerate(members):
            link = NodeLink(boards[k], slot)
            protocols[r] = (RestartProtocol(views[r][0], link=link), RestartProtocol(views[r][1], link=link))
    read_barrier_0(protocols, took_seats=False)
    decisions: dict[int, Decision | None] = {}
    errors: list[BaseException] = []
    deadline = threading.Event()  # set when the test gives up: relays stop at their next chunk

    def broadcast(k: int) -> None:
        try:
            assert relays[k].relay_event(node_protocols[k][0], 0, deadline.is_set)
            assert relays[k].relay_decision(node_protocols[k][0], 1, deadline.is_set)
        except BaseException as e:
            errors.append(e)

    def forward(k: int) -> None:
        board = boards[k]
        live = [slot for slot, r in enumerate(nodes[k]) if r != dead_rank]
        try:
            seen = board.arrival_seq()
            while sum(board.slot_arrival(slot) == (1, n) for slot in live) < len(live):
                seq = board.wait_arrivals(seen, timeout)
                assert seq >= 0, f"node {k}: the arrivals did not come ({seq})"
                seen = seq
            assert relays[k].forward(node_protocols[k][1]) == len(live)
        except BaseException as e:
            errors.append(e)

    threads = rank_threads(protocols, n, dead_rank, timeout, decisions, errors)
    threads += [threading.Thread(target=f, args=(k,), daemon=True)
                for k in range(len(nodes)) for f in (broadcast, forward)]
    for t in threads:
        t.start()
    monitor_view = CountingView(store)
    monitor = RestartProtocol(monitor_view)  # the monitor process: no node link
    monitor.report_fault(FaultRecord(dead_rank, 0, "killed", "SIGKILL", "simulated", t_ns=1))
    assert monitor.barrier(1, dead_rank, n, terminated=True, timeout=timeout) is None
    for t in threads:
        t.join(timeout)
    deadline.set()
    assert not any(t.is_alive() for t in threads), "ranks or relays still blocked"
    assert not errors, errors
    # One add per node: every node forwarded its arrivals as one batch.
    assert [relay.adds for relay in relays] == [1] * len(nodes)
    alive = [r for r in range(n) if r != dead_rank]
    ops = [protocols[r][0].ops + protocols[r][1].ops for r in alive]
    calls = [views[r][0].calls + views[r][1].calls for r in alive]
    node_ops = [a.ops + b.ops - before for (a, b), (before, _) in zip(node_protocols, node_before, strict=True)]
    node_calls = [a.calls + b.calls - before for (a, b), (_, before) in zip(node_views, node_before, strict=True)]
    assert monitor.ops == monitor_view.calls
    decision = agreed_decision(decisions)
    for board in boards:
        board.unmap()
    return ops, calls, node_ops, node_calls, monitor.ops, decision


@pytest.mark.timeout(60)
def test_store_operations_per_rank_and_node_do_not_grow_with_n() -> None:
    """Through node agents: no store call by a plain rank, four per node (one for its ranks' seats)."""
    per_n = {}
    for n in (16, 64):
        ops, calls, node_ops, node_calls, monitor_ops, decision = one_restart_on_nodes(n, 8, dead_rank=n // 2 + 1)
        assert ops == calls and node_ops == node_calls  # RestartProtocol.ops counts what reached the store
        m = decision.membership
        assert m.mode[n // 2 + 1] == TERMINATED and m.world_size == n - 1
        ops.sort()
        # Each node: a blocking get of the event, one compare_set of its seat key (its live ranks' seats),
        # one add, a blocking get of the decision; plus the set of "ready" on exactly one node, the one whose
        # add completed the count (any node: it is the last to add, which the scheduler picks). The node
        # of the dead rank may make one more: when its monitor moved that seat first, the agent's write
        # (which expects it where the agent last saw it, at barrier 0) is answered with the key as it
        # is, and sent again.
        dead_node = (n // 2 + 1) // 8
        assert any(sorted(got - 4 - (k == dead_node) * retried for k, got in enumerate(node_ops))
                   == [0] * (len(node_ops) - 1) + [1] for retried in (0, 1)), node_ops
        per_n[n] = (ops[len(ops) // 2], ops[-1], max(node_ops), monitor_ops, sum(ops) + sum(node_ops))
    small, large = per_n[16], per_n[64]
    # A plain rank: nothing; its seat is taken by its agent, the event and the decision come from the board.
    assert small[0] == 0, f"a plain rank made {small[0]} store calls per restart, expected 0"
    # A node of 8: at most 4 calls, one more where a seat was moved by another (the dead rank's
    # monitor), and the set of "ready" on the node that completed the count.
    assert small[2] <= 4 + 2 and large[2] <= 4 + 2
    # (the calls per node are exact above, at both sizes)
    for what, k in (("median ops per rank", 0), ("max ops per rank (the leader)", 1), ("the monitor's ops", 3)):
        assert large[k] <= small[k], f"{what} grew with N: {small[k]} at 16, {large[k]} at 64"
    # All calls of the restart: at most 1 per rank (its seat, by its agent) + 4 per node + the leader's 15 more (its
    # publish is a compare_set and an empty append: inprocess.control.leadership, "Cost"; its look
    # for joiners is one read: inprocess.control.joining).
    for n, figures in per_n.items():
        assert figures[4] <= (n - 1) + 4 * (n // 8) + 15, (n, figures)


@pytest.mark.timeout(60)
def test_decision_size_does_not_grow_with_n() -> None:
    assignment = Compose(ActivateAllRanks(), ShiftRanks())
    sizes, shapes, runs = {}, {}, {}
    for n in (16, 256, 4096, 16384):
        dead = {n // 3, n // 2}
        faults = [FaultRecord(r, 0, "killed", "SIGKILL", "simulated", host="h", t_ns=1) for r in sorted(dead)]
        d = decide(assignment, Membership.all_active(n), dead, faults, 1, leader=0)
        d.t_ns = d.assignment_ns = 0
        raw = d.to_json()
        assert Decision.from_json(raw.encode()).membership == d.membership
        sizes[n] = len(raw)
        runs[n] = len(d.membership.encode())
        shapes[n] = re.sub(r"\d+", "0", raw)  # the same record up to the digits of the numbers
    assert len(set(runs.values())) == 1, runs
    assert len(set(shapes.values())) == 1, shapes
    # Only the numbers' digits may grow (O(log N) per number), never O(N).
    numbers = len(re.findall(r"\d+", shapes[16]))
    for n in sizes:
        assert sizes[n] - sizes[16] <= numbers * (len(str(n)) - len(str(16))), sizes
    assert sizes[16384] < 2 * sizes[16], sizes


# ---------------------------------------------------------------------------
# (c) the blocking get behind wait_event and wait_decision, real servers
# ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["libuv", "legacy"])
@pytest.mark.parametrize("client", ["torch", "torch-free"])
def test_blocking_get_is_one_call_and_waits_stay_cancellable(
    backend: str, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    libuv = backend == "libuv"
    ten = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=ten, wait_for_workers=False, use_libuv=libuv)
    if client == "torch":
        store: Any = dist.TCPStore("127.0.0.1", server.port, is_master=False, use_libuv=libuv, timeout=ten)
    else:
        store = TCPStoreClient("127.0.0.1", server.port, timeout=ten)
    p = RestartProtocol(store)

    # Woken by the event (set by compare_set + empty append from another
    # client): one store call, and the store's timeout is restored.
    reporter = threading.Thread(
        target=lambda: (time.sleep(0.2), RestartProtocol(server).request_restart(0)), daemon=True
    )
    start = time.monotonic()
    reporter.start()
    assert p.wait_event(0, 5) == RESTART
    assert time.monotonic() - start < 1.5
    reporter.join(5)
    assert p.ops == 1
    assert store.timeout == ten

    # Waits are cut into chunks; a cancelled waiter notices within one.
    monkeypatch.setattr(store_ops, "WAIT_CHUNK_S", 0.3)
    asked: list[float] = []

    def cancelled() -> bool:
        asked.append(time.monotonic())
        return len(asked) >= 2

    start = time.monotonic()
    with pytest.raises(inprocess.TimeoutError, match="cancelled"):
        p.wait_event(1, None, cancelled=cancelled)
    assert 0.5 <= time.monotonic() - start < 3.0
    assert p.ops == 1 + 2  # one get per chunk
    assert store.timeout == ten

    # A deadline shorter than a chunk is the get's timeout.
    start = time.monotonic()
    with pytest.raises(inprocess.TimeoutError, match="barrier 3"):
        p.wait_decision(3, 0.2)
    assert time.monotonic() - start < 2.0
    assert store.timeout == ten

    # The connection is still good after the cancelled gets.
    server.set("after", "1")
    assert store.get("after") == b"1"


@pytest.mark.timeout(60)
def test_an_active_rank_waits_for_the_event_without_reading_it() -> None:
    """Before it counts itself completed, an active rank knows the event can only
    be "restart": one wait, no get (one request on the wire instead of two).
    Once it may be "complete", the value is read."""
    store = MemoryStore()
    view = CountingView(store)
    p = RestartProtocol(view)
    RestartProtocol(store).request_restart(0)
    assert p.wait_event(0, 5, only_restart=lambda: True) == RESTART
    assert view.calls == p.ops == 1  # the wait alone
    RestartProtocol(store).arrive_completed(1, 1)  # iteration 1 completed
    assert p.wait_event(1, 5, only_restart=lambda: False) == COMPLETE
    assert view.calls == p.ops == 1 + 2  # the wait, then the get


# ---------------------------------------------------------------------------
# (d) the simulator's command line, smoke mode
# ---------------------------------------------------------------------------


def _run_simulator(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """``python benchmarks/control_plane_sim.py ARGS`` (its server and clients die with it: PR_SET_PDEATHSIG)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "control_plane_sim.py"), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=150)


def _json_line(stdout: str) -> dict[str, Any]:
    lines = [line for line in stdout.splitlines() if line.startswith('{"benchmark":"control_plane"')]
    assert len(lines) == 1, stdout
    return json.loads(lines[0])  # type: ignore[no-any-return]


def _check_smoke_figures(run: dict[str, Any]) -> None:
    """N = 64, one restart, both modes: what the protocol costs per rank and per node."""
    by_mode = {r["mode"]: r for r in run["results"]}
    assert sorted(by_mode) == ["direct", "node"] and all(r["n"] == 64 for r in run["results"]), run["results"]
    node, direct = by_mode["node"], by_mode["direct"]
    assert node["all_agree"] and direct["all_agree"]
    assert node["restarts"] == direct["restarts"] == 1
    assert node["ranks"] == direct["ranks"] == 63  # the killed rank holds no decision
    assert (node["ops_per_rank_median"], node["requests_per_rank_median"]) == (0, 0)
    assert (node["ops_per_node_median"], node["requests_per_node_median"]) == (3 + 1, 5 + 1)
    assert (direct["ops_per_rank_median"], direct["requests_per_rank_median"]) == (4, 6)
    assert node["max_ms"] >= node["median_ms"] > 0 and direct["max_ms"] >= direct["median_ms"] > 0


def _digests(folder: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha1(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_simulator_smoke_run_prints_its_figures_and_writes_nothing(tmp_path: pathlib.Path) -> None:
    benchmarks_before = _digests(ROOT / "benchmarks")
    done = _run_simulator("--smoke", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    _check_smoke_figures(_json_line(done.stdout))
    # Progress came as it went, one line per restart and per mode.
    assert "N=64 node: restart 1/1" in done.stderr and "N=64 direct: restart 1/1" in done.stderr, done.stderr
    assert "nothing written" in done.stderr
    assert list(tmp_path.iterdir()) == []
    assert _digests(ROOT / "benchmarks") == benchmarks_before  # the tracked results are left alone


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_simulator_writes_its_results_where_told(tmp_path: pathlib.Path) -> None:
    import importlib.util

    out = tmp_path / "out"
    done = _run_simulator("--smoke", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    printed = _json_line(done.stdout)
    _check_smoke_figures(printed)
    assert json.loads((out / "control_plane.json").read_text()) == printed
    block = (out / "control_plane.md").read_text()
    assert block.startswith("<!-- control-plane results: begin") and block.rstrip().endswith("results: end -->")
    assert "| node | 64 |" in block and "| direct | 64 |" in block
    if importlib.util.find_spec("matplotlib") is None:
        assert not (out / "control_plane.png").exists()
        assert "matplotlib is not installed (pip install inprocess[bench]" in done.stderr, done.stderr
        assert "control_plane.png" not in block
    else:
        assert (out / "control_plane.png").read_bytes().startswith(b"\x89PNG")
        assert "![control-plane time against N](control_plane.png)" in block
    # Redrawn from the saved JSON, without running anything.
    again = _run_simulator("--plot-from", str(out / "control_plane.json"), "--out", str(tmp_path / "again"),
                           cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert json.loads((tmp_path / "again" / "control_plane.json").read_text()) == printed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, expected", [
    (["--n", "1"], "N=1: expected at least 2 ranks"),
    (["--restarts", "0"], "restarts=0: expected an integer >= 1"),
    (["--ranks-per-node", "-1"], "--ranks-per-node=-1: expected >= 0"),
    (["--direct", "--node-only"], "--node-only needs node mode"),
    (["--plot-from", "x.json"], "--plot-from writes files: give --out DIR"),
])
def test_simulator_refuses_bad_arguments_by_name(args: list[str], expected: str, tmp_path: pathlib.Path) -> None:
    done = _run_simulator(*args, cwd=tmp_path)
    assert done.returncode == 2 and expected in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []
