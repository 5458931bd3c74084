"""Single-process units: membership encoding, the protocol over a real TCPStore,
CallWrapper injection, the heartbeat page."""

from __future__ import annotations

import datetime
import os
import socket
import stat
import threading
import time

import pytest
import torch
import torch.distributed as dist

import inprocess
from inprocess import _native
from inprocess.control.membership import ACTIVE, NONE, TERMINATED, Membership
from inprocess.control.protocol import COMPLETE, RESTART, FaultRecord, RestartProtocol
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, Topology, decide, run_job_wide

pytestmark = pytest.mark.timeout(30)


# -- membership -------------------------------------------------------------


def test_membership_round_trips_through_runs_and_stays_compact():
    m = Membership.all_active(16384)
    assert m.encode() == [[0, 16384, ACTIVE, 0, 0]]
    m2, _ = run_job_wide(Compose_shift(), m, {5, 900, 16000}, 1, Topology.empty())
    runs = m2.encode()
    assert len(runs) <= 2 * 3 + 1  # O(changes), not O(world size)
    assert Membership.decode(runs, 16384) == m2
    assert m2.world_size == 16381 and m2.active_world_size == 16381


def Compose_shift():
    return inprocess.Compose(ActivateAllRanks(), ShiftRanks())


def test_membership_validate_catches_duplicates_and_resurrection():
    m = Membership([ACTIVE, ACTIVE], [0, 0], [0, 1])
    with pytest.raises(inprocess.InternalError, match="rank 0: out of range or taken twice"):
        m.validate()
    prev = Membership([TERMINATED, ACTIVE], [NONE, 0], [NONE, 0])
    back = Membership([ACTIVE, ACTIVE], [0, 1], [0, 1])
    with pytest.raises(inprocess.InternalError, match="was terminated and came back"):
        back.validate(prev)


# -- the protocol over a real TCPStore -----------------------------------------


@pytest.fixture
def tcp_store():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)
    yield server


def test_barrier_leader_decides_once_for_everyone(tcp_store):
    n = 8
    decisions = [None] * n
    clients = [tcp_store.clone() for _ in range(n)]
    errors = []

    def rank(r):
        try:
            p = RestartProtocol(clients[r], call=7)
            d = p.barrier(
                0, r, n, terminated=r == 5, timeout=10,
                decide=lambda dead, faults, leader: decide(Compose_shift(), Membership.all_active(n), dead, faults, 0,
                                                           leader),
            )
            decisions[r] = d
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors, errors
    assert decisions[5] is None or decisions[5].leader == 5  # the terminated rank does not wait
    live = [d for r, d in enumerate(decisions) if r != 5]
    assert all(d is not None for d in live)
    assert len({d.to_json() for d in live}) == 1  # one decision, read by all
    assert live[0].terminated == [5] and live[0].membership.world_size == 7


def test_event_first_writer_wins_and_wakes_waiters(tcp_store):
    p = RestartProtocol(tcp_store.clone())
    waiter = RestartProtocol(tcp_store.clone())
    seen = []
    t = threading.Thread(target=lambda: seen.append((waiter.wait_event(0, 10), time.monotonic())))
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    assert p.report_fault(FaultRecord(3, 0, "exception", "RuntimeError", "x")) is True
    t.join(5)
    assert seen and seen[0][0] == RESTART
    assert seen[0][1] - start < 0.5  # woken by the store, not by a poll interval
    p.arrive_completed(0, 1)  # too late: the restart won
    assert waiter.wait_event(0, 1) == RESTART
    assert p.read_faults(0)[0].rank == 3
    q = RestartProtocol(tcp_store.clone(), call=1)
    q.arrive_completed(0, 1)
    assert q.wait_event(0, 1) == COMPLETE


def test_concurrent_faults_are_all_in_the_one_decision(tcp_store):
    """Faults recorded by several ranks before the barrier completes are all
    read by the leader and published together, whatever their order."""
    n = 6
    clients = [RestartProtocol(tcp_store.clone(), call=3) for _ in range(n)]
    for r in range(n):  # as barrier 0 left them: every rank counted in there
        clients[r].take_seat(0, r)
    for r in (4, 1, 2):  # three ranks fail in iteration 0, in this order
        clients[r].report_fault(FaultRecord(r, 0, "exception", "RuntimeError", f"fault {r}"))
    out = [None] * n
    threads = [
        threading.Thread(target=lambda r=r: out.__setitem__(r, clients[r].barrier(
            1, r, n, timeout=10,
            decide=lambda dead, faults, leader: decide(Compose_shift(), Membership.all_active(n), dead, faults, 1, leader),
        )))
        for r in range(n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert all(d is not None for d in out)
    assert len({d.to_json() for d in out}) == 1
    assert sorted(f.rank for f in out[0].faults) == [1, 2, 4] and out[0].n_faults == 3


def test_wait_times_out_with_the_engines_timeout_error(tcp_store):
    p = RestartProtocol(tcp_store.clone())
    with pytest.raises(inprocess.TimeoutError, match="barrier 4"):
        p.wait_decision(4, 0.2)


# -- the wrapper, without processes ---------------------------------------------

# Short, and ordered as Wrapper requires (hard + grace < barrier).
SINGLE_RANK_TIMEOUTS = dict(
    soft_timeout=datetime.timedelta(seconds=5),
    hard_timeout=datetime.timedelta(seconds=10),
    barrier_timeout=datetime.timedelta(seconds=20),
)


def test_disabled_wrapper_returns_the_function_untouched():
    def f(x):
        return x

    assert inprocess.Wrapper(enabled=False)(f) is f


def test_call_wrapper_parameter_is_found_by_annotation():
    from typing import Optional as Opt

    from inprocess.wrap import _call_wrapper_parameter

    def a(x, cw: inprocess.CallWrapper):
        pass

    def b(cw: Opt[inprocess.CallWrapper] = None):
        pass

    def c(*args, **kwargs):
        pass

    assert _call_wrapper_parameter(a) == "cw"
    assert _call_wrapper_parameter(b) == "cw"
    assert _call_wrapper_parameter(c) is None  # then inprocess.current_call() is the way in


def test_refuses_to_start_when_a_process_group_exists(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match=r"not torch\.distributed\.is_initialized\(\)"):
            inprocess.Wrapper()(lambda: None)()
    finally:
        dist.destroy_process_group()


def test_single_rank_job_runs_with_current_call(monkeypatch):
    from inprocess.launch import free_port

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    calls = []

    @inprocess.Wrapper(
        **SINGLE_RANK_TIMEOUTS,
    )
    def train(*args, **kwargs):
        cw = inprocess.current_call()
        calls.append(cw.iteration)
        cw.ping()
        if cw.iteration == 0:
            raise ValueError("first attempt fails")
        return "done"

    assert train() == "done"
    assert calls == [0, 1]
    assert inprocess.current_call() is None
    assert os.environ["RANK"] == "0"


# -- the heartbeat page -------------------------------------------------------


def test_heartbeat_page_is_private_and_nameless():
    before = set(os.listdir("/dev/shm"))
    hb = _native.HeartbeatPage.create()
    try:
        mode = os.fstat(hb.fd).st_mode
        assert stat.S_IMODE(mode) == 0o600
        assert set(os.listdir("/dev/shm")) == before  # memfd: nothing to leak
        snap = hb.snapshot()
        assert not snap.flags & _native.FLAG_MANUAL_ARMED
        hb.ping()
        assert hb.snapshot().flags & _native.FLAG_MANUAL_ARMED
        assert hb.snapshot().manual_progress_ns >= snap.manual_progress_ns
        hb.begin_iteration(3, 7)
        s = hb.snapshot()
        assert (s.iteration, s.world_size) == (3, 7) and not s.flags & _native.FLAG_MANUAL_ARMED
        other = _native.HeartbeatPage.attach(hb.fd)
        hb.set_phase(_native.Phase.RUNNING)
        assert other.snapshot().phase == _native.Phase.RUNNING
        other.close()
    finally:
        hb.close()
    assert hb.closed


def test_attach_refuses_a_descriptor_that_is_not_a_page(tmp_path):
    f = tmp_path / "x"
    f.write_bytes(b"\0" * 4096)
    with open(f, "rb+") as fh:
        with pytest.raises(ValueError, match="holds no inprocess heartbeat page"):
            _native.HeartbeatPage.attach(fh.fileno())


@pytest.mark.parametrize("use_libuv", [True, False])
def test_event_wakes_waiters_on_both_server_backends(use_libuv):
    # torch 2.13's legacy server wakes no waiter on compare_set alone.
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10),
                           wait_for_workers=False, use_libuv=use_libuv)
    waiter = RestartProtocol(server.clone())
    woke = []
    t = threading.Thread(target=lambda: woke.append((waiter.wait_event(2, 10), time.monotonic())))
    t.start()
    time.sleep(0.2)
    start = time.monotonic()
    RestartProtocol(server.clone()).request_restart(2)
    t.join(12)
    assert woke and woke[0][0] == RESTART
    assert woke[0][1] - start < 1.0, f"woken after {woke[0][1] - start:.2f}s"


def test_single_host_job_on_a_file_store(monkeypatch, tmp_path):
    """store_factory=inprocess.store.FileStore: the single-host store, no TCP server."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    calls = []

    @inprocess.Wrapper(
        store_factory=inprocess.store.FileStore,
        store_kwargs={"file_name": str(tmp_path / "store")},
        **SINGLE_RANK_TIMEOUTS,
    )
    def train(call_wrapper: inprocess.CallWrapper = None):
        calls.append(call_wrapper.iteration)
        dist.init_process_group("gloo", store=call_wrapper.store, rank=0, world_size=1)
        dist.all_reduce(torch.ones(2))
        if call_wrapper.iteration < 2:
            raise ValueError("fails twice")
        dist.destroy_process_group()
        return call_wrapper.iteration

    assert train() == 2
    assert calls == [0, 1, 2]
    assert not dist.is_initialized()


def test_a_socket_accepted_by_an_older_listener_is_not_the_new_groups():
    """A TCPStore server living in the process accepts clients at any time: a
    connection it accepts while a process group is built belongs to the store."""
    from inprocess.engine import sockets

    store_server = socket.socket()
    store_server.bind(("127.0.0.1", 0))
    store_server.listen()
    before = sockets.socket_fds()
    client = socket.create_connection(store_server.getsockname())  # a peer's store client
    accepted, _ = store_server.accept()  # what the server thread does meanwhile
    group_listener = socket.socket()  # the new group's own listener and pair
    group_listener.bind(("127.0.0.1", 0))
    group_listener.listen()
    pair = socket.create_connection(group_listener.getsockname())
    pair_accepted, _ = group_listener.accept()
    try:
        new = sockets.new_since(before)
        assert {client.fileno(), accepted.fileno(), group_listener.fileno(), pair.fileno(),
                pair_accepted.fileno()} <= set(new)
        assert set(sockets.accepted_by_older_listeners(new, before)) == {accepted.fileno()}
    finally:
        for s in (store_server, client, accepted, group_listener, pair, pair_accepted):
            s.close()


def test_causes_come_first_and_consequences_are_marked():
    from inprocess.control.protocol import FaultRecord
    from inprocess.engine.restart_record import RestartRecord

    gloo = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4503"
    killed = FaultRecord(0, 2, "killed", "SIGKILL", "rank process 11 died in iteration 2")
    peer_error = FaultRecord(1, 2, "exception", "RuntimeError", gloo)
    own_bug = FaultRecord(3, 2, "exception", "ValueError", "bad batch")
    late = FaultRecord(2, 2, "after_restart", "RuntimeError", "interrupted")
    # The peer's gloo error was recorded first: it is still not a cause.
    record = RestartRecord(2, [peer_error, late, killed, own_bug], 4, [0], detected_ns=1_000_000,
                           aborted_ns=2_000_000, finalized_ns=3_000_000, health_checked_ns=4_000_000,
                           decided_ns=9_000_000, activated=[5])
    assert record.causes == [killed, own_bug]
    assert record.consequences == [peer_error, late]
    # Without a death, a communication error is a cause.
    assert RestartRecord(2, [peer_error], 1, []).causes == [peer_error]
    text = record.summary(active_world_size=3, world_size=4)
    assert text.startswith("restart after iteration 2: cause: rank 0 killed: SIGKILL: rank process 11 died")
    assert "consequences (not causes): rank 1 RuntimeError; rank 2 RuntimeError" in text
    assert "excluded: [0]; spares activated: [5]; now 3 active of 4" in text
    assert text.endswith("(slowest phase: barrier, 5 ms)")
