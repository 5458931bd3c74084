"""The node agent's relay in C++ (inprocess._native.StoreConnection, NodeRelay; processes/native_relay.py).

StoreConnection is checked against torch's own TCPStore server and client;
the native relay against the Python NodeRelay: every scenario runs once with
each, on a fresh server, and both must leave the same store contents and the
same board.
"""

from __future__ import annotations

import builtins
import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

from inprocess import _native
from inprocess.control import seats, store_ops
from inprocess.control.leadership import lost_mark
from inprocess.control.membership import Membership
from inprocess.control.protocol import COMPLETE, RESTART, FaultRecord, RestartProtocol
from inprocess.control.tcpstore_client import StoreConnectionError, StoreTimeoutError, TCPStoreClient
from inprocess.exception import BarrierOverflow, InternalError
from inprocess.exception import TimeoutError as RestartTimeout
from inprocess.processes.native_relay import NativeNodeRelay, check_layout, relay_layout
from inprocess.processes.node_relay import DECISION_CAPACITY, NodeRelay
from inprocess.rank_assignment import ActivateAllRanks, Compose, ShiftRanks, decide

HOST = "127.0.0.1"
SLOTS = 4
WORLD = 8


def _server(use_libuv: bool = True) -> dist.TCPStore:
    return dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False, use_libuv=use_libuv, timeout=_td(10))


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


@pytest.fixture(params=[True, False], ids=["libuv", "legacy"])
def server(request: pytest.FixtureRequest) -> Iterator[dist.TCPStore]:
    store = _server(request.param)
    yield store
    del store


# -- StoreConnection ---------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_requests_read_back_by_torchs_client_and_pipelined_compare_sets(server: dist.TCPStore) -> None:
    conn = _native.StoreConnection(HOST, server.port, timeout=5, connect_timeout=5)
    try:
        conn.set("a", "x")
        assert server.get("a") == b"x"
        server.set("b", b"\x00\xffraw")
        assert conn.get("b") == b"\x00\xffraw"
        assert conn.add("n", 5) == 5 and server.add("n", 2) == 7 and conn.add("n", -1) == 6
        conn.append("a", "yz")
        assert server.get("a") == b"xyz"
        assert conn.check(["a", "b"]) and not conn.check(["a", "missing"])
        # 600 compare_sets (three pipelined batches) with a value larger than one receive among small ones.
        big = "v" * 300_000
        items = [(f"cs/{i}", "", big if i == 257 else str(i)) for i in range(600)]
        values = conn.compare_set_many(items)
        assert values == [(big if i == 257 else str(i)).encode() for i in range(600)]
        assert server.get("cs/257") == big.encode() and server.get("cs/599") == b"599"
        # compare_set semantics: a wrong expected value changes nothing and answers what is there.
        assert conn.compare_set_many([("cs/1", "nope", "x"), ("cs/2", "2", "two")]) == [b"1", b"two"]
        assert conn.compare_set("cs/3", "3", "three") == b"three" and server.get("cs/3") == b"three"
    finally:
        conn.close()
    assert conn.closed


@pytest.mark.timeout(30)
def test_the_byte_counters_count_each_request_and_reply_on_the_wire(server: dist.TCPStore) -> None:
    """What the simulator reports as a node's bytes: each request's and reply's size as tcpstore_wire.py
    lays them out ("/" key prefix, u64 lengths), counted from the handshake on."""
    conn = _native.StoreConnection(HOST, server.port, timeout=5, connect_timeout=5)
    try:
        assert (conn.bytes_sent, conn.bytes_received) == (0, 0)  # the handshake is not the caller's traffic
        conn.add("k", 3)  # ADD, key, i64 -> i64
        assert (conn.bytes_sent, conn.bytes_received) == (1 + 8 + 2 + 8, 8)
        server.set("v", b"12345")
        assert conn.wait_get("v", 5) == b"12345"  # WAIT of 1 key, then GET -> STOP_WAITING, vector
        assert conn.bytes_sent == 19 + (1 + 8 + 8 + 2) + (1 + 8 + 2)
        assert conn.bytes_received == 8 + 1 + (8 + 5)
    finally:
        conn.close()


@pytest.mark.timeout(30)
def test_a_wait_that_times_out_is_cancelled_and_the_connection_goes_on(server: dist.TCPStore) -> None:
    conn = _native.StoreConnection(HOST, server.port, timeout=5, connect_timeout=5)
    try:
        start = time.monotonic()
        with pytest.raises(StoreTimeoutError, match=r"get\('late'\).*0.3s") as info:
            conn.wait_get("late", 0.3)
        assert isinstance(info.value, builtins.TimeoutError)
        assert time.monotonic() - start >= 0.3
        with pytest.raises(StoreTimeoutError):
            conn.wait(["late"], 0.1)
        assert not conn.closed and conn.add("after", 1) == 1  # the stream is still in step
        # A wait that another client ends: the server wakes it, no polling.
        timer = threading.Timer(0.2, lambda: server.set("late", "here"))
        timer.start()
        try:
            assert conn.wait_get("late", 10) == b"here"
        finally:
            timer.join()
    finally:
        conn.close()


@pytest.mark.timeout(30)
def test_close_from_another_thread_ends_a_blocked_wait_at_once(server: dist.TCPStore) -> None:
    conn = _native.StoreConnection(HOST, server.port, timeout=30, connect_timeout=5)
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            conn.wait_get("never", 30)
        except BaseException as e:  # checked below
            failed.append(e)

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.3)  # the wait is on the server now
    start = time.monotonic()
    conn.close()
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 2.0
    assert len(failed) == 1 and isinstance(failed[0], StoreConnectionError), failed
    assert conn.closed


@pytest.mark.timeout(30)
def test_the_server_gone_closes_the_connection_with_a_clear_error() -> None:
    server = _server()
    port = server.port
    conn = _native.StoreConnection(HOST, port, timeout=5, connect_timeout=5, retry_refused=False)
    conn.set("k", "1")
    assert conn.get("k") == b"1"
    del server
    time.sleep(0.2)
    with pytest.raises(StoreConnectionError, match=rf"add\('k'\).*{HOST}:{port}"):
        conn.add("k", 1)
    assert conn.closed
    with pytest.raises(StoreConnectionError, match=r"is closed \(add\('k'\) failed"):
        conn.get("k")
    start = time.monotonic()
    with pytest.raises(StoreConnectionError, match=rf"cannot connect to the store server at {HOST}:{port}"):
        _native.StoreConnection(HOST, port, timeout=5, connect_timeout=5, retry_refused=False)
    assert time.monotonic() - start < 1.0  # a refusal is final without retry_refused


@pytest.mark.timeout(30)
def test_bad_input_is_refused_before_anything_is_sent(server: dist.TCPStore) -> None:
    with pytest.raises(ValueError, match="port must be an integer in 1..65535, got 0"):
        _native.StoreConnection(HOST, 0)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or a number of seconds"):
        _native.StoreConnection(HOST, server.port, timeout="5")  # type: ignore[arg-type]
    conn = _native.StoreConnection(HOST, server.port, timeout=5, connect_timeout=5)
    try:
        with pytest.raises(ValueError, match="store key of 9001 bytes"):
            conn.set("k" * 9000, "v")
        with pytest.raises(TypeError, match="a store value is str or bytes, got int"):
            conn.set("k", 3)  # type: ignore[arg-type]
        assert conn.add("still", 1) == 1
    finally:
        conn.close()


# -- the relay's templates ---------------------------------------------------------------


@pytest.mark.timeout(30)
def test_the_templates_expand_as_the_protocol_computes_for_any_call_and_incarnation() -> None:
    board = _native.NodeBoard.create(SLOTS, 4096)
    try:
        for p in (RestartProtocol(None), RestartProtocol(None, 3, incarnation="job-7")):
            relay = _native.NodeRelay(board, _native.RelayLayout(relay_layout(p)))
            check_layout(relay, p)
            assert relay.expand("seat_desired", 4, life=2) == seats.healthy(4, 2)
            assert relay.expand("outcome", 4, term=2) == p.terms.outcome_key(4, 2)
        # A relay built for one incarnation writes another's keys: the check says so.
        job_8 = RestartProtocol(None, 3, incarnation="job-8")
        other = _native.NodeRelay(board, _native.RelayLayout(relay_layout(job_8)))
        with pytest.raises(InternalError, match="diverge from the protocol: ready.*and 4[0-9] more"):
            check_layout(other, RestartProtocol(None, 3, incarnation="job-7"))
    finally:
        board.unmap()


@pytest.mark.timeout(30)
def test_a_change_of_the_seat_values_is_followed_or_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    board = _native.NodeBoard.create(SLOTS, 4096)
    p = RestartProtocol(None)
    try:
        # Another spelling of a healthy seat: the templates follow it, no C++ change.
        monkeypatch.setattr(seats, "healthy", lambda barrier, life=0: f"h{barrier}" + (f"~{life}" if life else ""))
        relay = _native.NodeRelay(board, _native.RelayLayout(relay_layout(p)))
        check_layout(relay, p)
        assert relay.expand("seat_expected", 5, life=3) == "h4~3"
        # A value that is no template of the barrier (here: its square) cannot be followed: refused.
        monkeypatch.setattr(seats, "healthy", lambda barrier, life=0: str(barrier * barrier))
        relay = _native.NodeRelay(board, _native.RelayLayout(relay_layout(p)))
        with pytest.raises(InternalError, match="diverge from the protocol: seat move"):
            check_layout(relay, p)
    finally:
        board.unmap()


# -- the relay, Python and native side by side -------------------------------------------


class Node:
    """A fresh server, a board of SLOTS slots and a relay of one kind over its own connections;
    ``per_key`` seats per key (control/seat_table.py), as the test's own protocol proposes first."""

    def __init__(self, kind: str, per_key: int = 1):
        self.kind = kind
        self.server = _server()
        self.address = f"{HOST}:{self.server.port}"
        self.board = _native.NodeBoard.create(SLOTS, DECISION_CAPACITY)
        self.relay: Any = NodeRelay(self.board) if kind == "python" else NativeNodeRelay(self.board)
        self.p = RestartProtocol(dist.TCPStore(HOST, self.server.port, is_master=False, timeout=_td(10)),
                                 seats_per_key=per_key)
        assert self.p.seat_table.per_key == per_key
        self.forward_p = RestartProtocol(self.connect(), seats_per_key=SLOTS)  # an agent's proposal: adopts p's
        self.broadcast_p = RestartProtocol(self.connect())

    def connect(self) -> Any:
        if self.kind == "python":
            return TCPStoreClient(HOST, self.server.port, timeout=5, connect_timeout=5, retry_refused=False)
        return _native.StoreConnection(HOST, self.server.port, timeout=5, connect_timeout=5, retry_refused=False)

    def close(self) -> None:
        for p in (self.forward_p, self.broadcast_p):
            p.store.close()
        self.board.unmap()

    def seat(self, rank: int, value: str) -> None:
        self.p.seat_table.write({rank: value})

    def state(self, barriers: range) -> dict[str, Any]:
        """What the store and the board hold, as both relays must leave them."""
        p, server, board = self.p, self.server, self.board

        def value(key: str) -> bytes | None:
            return server.get(key) if server.check([key]) else None

        return {
            "seats": [None if s is None else s.encode() for s in map(RestartProtocol(server).read_seat, range(WORLD))],
            "arrivals": [value(p.key(b, "arrivals")) for b in barriers],
            "ready": [value(p.key(b, "ready")) for b in barriers],
            "forwarded": [board.forwarded(s) for s in range(SLOTS)],
            "leads": [board.leads(s) for s in range(SLOTS)],
            "refused": [[board.wait_outcome(s, b, 0.0) == 3 for b in barriers] for s in range(SLOTS)],
            "decision": board.read_decision(),
            "event": board.event(),
        }


def both(scenario: Callable[[Node], Any], barriers: range = range(4), per_key: int = 1) -> tuple[Any, dict[str, Any]]:
    """Run ``scenario`` with each relay; assert they end alike; returns what it returned and the state."""
    results = {}
    for kind in ("python", "native"):
        node = Node(kind, per_key)
        try:
            try:
                out: Any = scenario(node)
            except Exception as e:  # compared below: both must fail alike
                out = (type(e), str(e).replace(node.address, "<store>"))
            results[kind] = (out, node.state(barriers), node.forward_p.ops, node.broadcast_p.ops)
        finally:
            node.close()
    assert results["native"] == results["python"]
    return results["native"][0], results["native"][1]


def _arrive(node: Node, slots: list[int], barrier: int, *, life: int = 0, first_rank: int = 0) -> None:
    for slot in slots:
        node.board.arrive(slot, barrier, WORLD, first_rank + slot, life)


# Seats per key: one per rank (no agents), a node over two keys (written together, pipelined), the
# node's (SLOTS), and a key shared with another node (WORLD).
PER_KEY = [1, 2, SLOTS, WORLD]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_key", PER_KEY)
def test_all_seats_taken_one_add_and_the_lowest_slot_leads(per_key: int) -> None:
    def scenario(node: Node) -> tuple[int, int]:
        for r in range(SLOTS):
            node.seat(r, "0")
        _arrive(node, list(range(SLOTS)), 1)
        n = int(node.relay.forward(node.forward_p)) * 10 + int(node.relay.forward(node.forward_p))
        return n, node.forward_p.ops

    (n, ops), state = both(scenario, per_key=per_key)
    assert n == SLOTS * 10  # the second forward finds nothing new
    # The seats per key (asked once), a compare_set per seat key (the node's 4 seats: 4, 2, 1 or 1), one add.
    assert ops == 1 + -(-SLOTS // per_key) + 1
    assert state["seats"][:SLOTS] == [b"1"] * SLOTS and state["arrivals"][1] == str(SLOTS).encode()
    assert state["leads"] == [1, -1, -1, -1] and state["forwarded"] == [1] * SLOTS and state["ready"][1] is None


@pytest.mark.timeout(60)
def test_barrier_zero_and_a_later_life_take_the_seats_the_protocol_names() -> None:
    def scenario(node: Node) -> int:
        _arrive(node, [0, 1], 0)  # barrier 0: nobody wrote the seats yet
        node.seat(6, seats.healthy(1, 3))  # a joined process (life 3) counted at 1
        node.board.arrive(2, 2, WORLD, 6, 3)
        return int(node.relay.forward(node.forward_p))

    n, state = both(scenario)
    assert n == 3 and state["seats"][0:2] == [b"0", b"0"] and state["seats"][6] == b"2@3"
    assert state["arrivals"][0] == b"2" and state["arrivals"][2] == b"1"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_key", PER_KEY)
def test_a_seat_counted_out_by_someone_else_first_is_refused(per_key: int) -> None:
    def scenario(node: Node) -> tuple[int, int]:
        for r in range(SLOTS):
            node.seat(r, "0")
        node.seat(2, seats.counted_out(1, "m2"))  # rank 2's monitor counted it out at barrier 1
        _arrive(node, list(range(SLOTS)), 1)
        return int(node.relay.forward(node.forward_p)), node.forward_p.ops

    (n, ops), state = both(scenario, per_key=per_key)
    # A key per seat: 4 compare_sets, one refused. A shared key: the first write expects rank 2's seat
    # at "0", the store answers the key as it is, and the second write leaves that seat as it found it.
    assert ops == 1 + {1: 4, 2: 2 + 1, SLOTS: 1 + 1, WORLD: 1 + 1}[per_key] + 1
    assert n == SLOTS - 1 and state["arrivals"][1] == b"3"
    assert state["seats"][2] == b"t1:m2" and state["refused"][2] == [False, True, False, False]
    assert state["forwarded"] == [1, 1, -1, 1]  # refused: not counted on the board, not looked at again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("per_key", PER_KEY)
def test_two_barriers_pending_at_once_are_forwarded_oldest_first(per_key: int) -> None:
    def scenario(node: Node) -> tuple[int, int]:
        node.seat(0, "0")
        node.seat(1, "0")
        node.seat(2, "1")
        node.seat(3, "1")
        _arrive(node, [0, 1], 1)
        _arrive(node, [2, 3], 2)
        return int(node.relay.forward(node.forward_p)), node.forward_p.ops

    (n, ops), state = both(scenario, per_key=per_key)
    # Keys of 4 or 8: barrier 1's write expects seats 2 and 3 as the relay last saw them (never:
    # unwritten), is answered with the key, sent again; barrier 2's then expects what that answer said.
    assert ops == 1 + {1: 4, 2: 2, SLOTS: 3, WORLD: 3}[per_key] + 2
    assert n == 4 and state["arrivals"][1:3] == [b"2", b"2"]
    assert state["leads"] == [1, -1, 2, -1] and state["forwarded"] == [1, 1, 2, 2]


@pytest.mark.timeout(60)
def test_the_batch_that_completes_the_count_sets_ready() -> None:
    def scenario(node: Node) -> int:
        node.p.counted.add(node.p.key(1, "arrivals"), WORLD - SLOTS)  # the other node arrived first
        for r in range(SLOTS):
            node.seat(r, "0")
        _arrive(node, list(range(SLOTS)), 1)
        return int(node.relay.forward(node.forward_p))

    n, state = both(scenario)
    assert n == SLOTS and state["arrivals"][1] == str(WORLD).encode() and state["ready"][1] == b"1"
    assert state["leads"] == [-1] * SLOTS  # not the barrier's first healthy arrivals


@pytest.mark.timeout(60)
def test_overflow_raises_barrier_overflow() -> None:
    def scenario(node: Node) -> int:
        node.p.counted.add(node.p.key(1, "arrivals"), WORLD - 2)
        for r in range(SLOTS):
            node.seat(r, "0")
        _arrive(node, list(range(SLOTS)), 1)
        return int(node.relay.forward(node.forward_p))

    out, state = both(scenario)
    assert out == (BarrierOverflow, f"barrier 1: {WORLD + 2} arrivals, expected {WORLD}")
    assert state["forwarded"] == [-1] * SLOTS and state["ready"][1] is None


def _decision(world: int = WORLD) -> str:
    return decide(Compose(ActivateAllRanks(), ShiftRanks()), Membership.all_active(world), set(), [], 1,
                  leader=0).to_json()


@pytest.mark.timeout(60)
def test_a_lost_mark_is_posted_then_the_decision_of_the_next_term() -> None:
    fault = FaultRecord(3, 1, "killed", "SIGKILL", "lost in the barrier", host="h", t_ns=1)
    mark = lost_mark(fault)
    decision = _decision()  # once: a decision holds its time

    def scenario(node: Node) -> tuple[bool, Any]:
        node.p.terms.write(1, 0, mark)
        result: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: result.update(go_on=node.relay.relay_decision(node.broadcast_p, 1, lambda: False)))
        thread.start()
        try:
            deadline = time.monotonic() + 10
            while node.board.read_decision() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            seen = node.board.read_decision()  # the mark, while the next term is still open
        finally:
            node.p.terms.write(1, 1, decision)
            thread.join(10)
        return result["go_on"], seen

    (go_on, seen), state = both(scenario)
    assert seen == (1, mark.encode()) and go_on is True
    assert state["decision"] == (1, decision.encode())


@pytest.mark.timeout(60)
def test_a_corrupted_lost_mark_is_refused_before_it_is_posted() -> None:
    def scenario(node: Node) -> bool:
        node.p.terms.write(1, 0, "lost:{not a record")
        return bool(node.relay.relay_decision(node.broadcast_p, 1, lambda: False))

    out, state = both(scenario)
    assert out[0] is InternalError and out[1].startswith("corrupted lost mark b'lost:{not a record'")
    assert state["decision"] is None


@pytest.mark.timeout(60)
def test_the_events_restart_and_complete() -> None:
    def scenario(node: Node) -> tuple[bool, int, bool]:
        node.p.request_restart(1)
        restart = node.relay.relay_event(node.broadcast_p, 1, lambda: False)
        after_restart = node.board.event()
        node.p.arrive_completed(2, 1)  # the last active rank completed iteration 2
        return restart, after_restart, node.relay.relay_event(node.broadcast_p, 2, lambda: False)

    (restart, after_restart, complete), state = both(scenario)
    assert restart is True and after_restart == 2 * 1 and complete is False and state["event"] == 2 * 2 + 1


@pytest.mark.timeout(60)
def test_an_event_of_another_value_is_an_internal_error() -> None:
    def scenario(node: Node) -> bool:
        node.p.counted.set(node.p.key(1, "event"), "bogus")
        return bool(node.relay.relay_event(node.broadcast_p, 1, lambda: False))

    out, state = both(scenario)
    assert out == (InternalError, f"iteration 1 event holds 'bogus', expected {RESTART!r} or {COMPLETE!r}")
    assert state["event"] == -1


@pytest.mark.timeout(60)
def test_a_wait_is_cancelled_between_chunks_and_the_connection_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_ops, "WAIT_CHUNK_S", 0.1)

    def scenario(node: Node) -> tuple[Any, int, bool]:
        asked = []

        def cancelled() -> bool:
            asked.append(1)
            return len(asked) >= 3

        start = time.monotonic()
        with pytest.raises(RestartTimeout, match=r"barrier 2: cancelled \(key .*2/decision\)"):
            node.relay.relay_decision(node.broadcast_p, 2, cancelled)
        took = time.monotonic() - start
        assert 0.25 < took < 5, took
        node.p.request_restart(2)
        return len(asked), node.board.event(), node.relay.relay_event(node.broadcast_p, 2, lambda: False)

    (asked, event, go_on), state = both(scenario)
    assert asked == 3 and event == -1 and go_on is True and state["event"] == 4


@pytest.mark.timeout(60)
def test_the_server_gone_fails_a_step_with_the_stores_address() -> None:
    # torch's TCPStore has no way to stop its server but dropping the master object: a node of its own.
    for kind in ("python", "native"):
        node = Node(kind)
        try:
            address = node.address
            node.board.arrive(0, 1, WORLD, 0, 0)
            assert node.forward_p.seat_table.per_key == 1  # asked at barrier 0 in a job, before the server went
            node.p = None  # type: ignore[assignment]  # the master's last reference goes below
            node.server = None  # type: ignore[assignment]
            time.sleep(0.3)
            with pytest.raises(StoreConnectionError, match=f"{address}") as info:
                node.relay.forward(node.forward_p)
            if kind == "native":  # the Python client's pipelined batch names no operation (left as it is)
                assert "compare_set_many('inprocess/0/seat/0')" in str(info.value), str(info.value)
            assert node.board.forwarded(0) == -1
        finally:
            node.board.unmap()
            for p in (node.forward_p, node.broadcast_p):
                p.store.close()


@pytest.mark.timeout(60)
def test_another_store_goes_through_node_relay_and_the_slots_state_carries_over() -> None:
    server = _server()
    board = _native.NodeBoard.create(SLOTS, DECISION_CAPACITY)
    python_p = RestartProtocol(TCPStoreClient(HOST, server.port, timeout=5, connect_timeout=5))
    native_p = RestartProtocol(_native.StoreConnection(HOST, server.port, timeout=5, connect_timeout=5))
    try:
        relay = NativeNodeRelay(board)
        RestartProtocol(server).seat_table.write({r: "0" for r in range(SLOTS)})
        # Each asks the call's seats per key once (an agent's does at barrier 0): one call, before the counts.
        assert python_p.seat_table.per_key == native_p.seat_table.per_key == 1
        python_p.counted.calls = native_p.counted.calls = 0
        _arrive_on(board, list(range(SLOTS)), 1)
        assert relay.forward(python_p) == SLOTS and python_p.ops == SLOTS + 1  # NodeRelay: seats, one add
        assert relay.forward(native_p) == 0 and native_p.ops == 0  # forwarded already: not counted twice
        _arrive_on(board, [0, 1], 2)
        assert relay.forward(native_p) == 2 and native_p.ops == 3
        assert relay.forward(python_p) == 0  # and back: the native relay's state carries over
        assert relay.forwarded == [2, 2, 1, 1] and relay.adds == 2
        assert server.add(python_p.key(1, "arrivals"), 0) == SLOTS and server.add(python_p.key(2, "arrivals"), 0) == 2
    finally:
        python_p.store.close()
        native_p.store.close()
        board.unmap()
        del server


def _arrive_on(board: Any, slots: list[int], barrier: int) -> None:
    for slot in slots:
        board.arrive(slot, barrier, WORLD, slot, 0)


@pytest.mark.timeout(60)
def test_two_nodes_share_a_seat_key_and_each_counts_its_ranks_once_per_barrier() -> None:
    """Nodes of 4 ranks, 8 seats per key: the two agents (one relay of each kind) write the same key
    at once at every barrier; every seat moves, every barrier counts 8."""
    server = _server()
    p = RestartProtocol(server, seats_per_key=WORLD)
    p.seat_table.write({r: "0" for r in range(WORLD)})
    boards = [_native.NodeBoard.create(SLOTS, DECISION_CAPACITY) for _ in range(2)]
    relays: list[Any] = [NodeRelay(boards[0]), NativeNodeRelay(boards[1])]
    forward = [RestartProtocol(TCPStoreClient(HOST, server.port, timeout=5, connect_timeout=5), seats_per_key=SLOTS),
               RestartProtocol(_native.StoreConnection(HOST, server.port, timeout=5, connect_timeout=5),
                               seats_per_key=SLOTS)]
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def agent(k: int) -> None:
        try:
            for b in range(1, 21):
                for slot in range(SLOTS):
                    boards[k].arrive(slot, b, WORLD, SLOTS * k + slot, 0)
                start.wait(10)
                assert relays[k].forward(forward[k]) == SLOTS
        except BaseException as e:
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=agent, args=(k,)) for k in range(2)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert [server.add(p.key(b, "arrivals"), 0) for b in range(1, 21)] == [WORLD] * 20
        assert p.seat_table.read_many(list(range(WORLD))) == {r: "20" for r in range(WORLD)}
        assert all(f.seat_table.per_key == WORLD for f in forward)  # both adopted the call's, not their proposal
        # Per barrier an agent writes the key once, and again for each time the other wrote in between.
        assert all(1 + 20 + 20 <= f.ops <= 1 + 20 + 3 * 20 for f in forward), [f.ops for f in forward]
    finally:
        for f in forward:
            f.store.close()
        for board in boards:
            board.unmap()
