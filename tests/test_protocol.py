"""The restart protocol over a real TCPStore, in one process: barriers, events, faults, timeouts."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

import inprocess
from inprocess.control.membership import Membership
from inprocess.control.protocol import COMPLETE, RESTART, FaultRecord, RestartProtocol
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, decide

pytestmark = pytest.mark.timeout(30)


def Compose_shift():
    return inprocess.Compose(ActivateAllRanks(), ShiftRanks())


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
            decide=lambda dead, faults, leader: decide(Compose_shift(), Membership.all_active(n), dead, faults, 1,
                                                       leader),
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
