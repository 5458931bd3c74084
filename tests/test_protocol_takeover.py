"""The leader's death while it decides, over a real TCPStore: another rank takes the lead over.

Each test sets the store as barrier 1 left it (its decision out, every seat at "1"), then plays
barrier 2: a leader that arrives and never publishes stands for a leader killed while it
decides, and the monitor of a dead rank is a RestartProtocol over the torch-free client that
monitor processes use, calling ``count_out`` as the monitor does. Waiting ranks are threads,
each with its own connection. inprocess.control.leadership says what must happen.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from inprocess.compose import Compose
from inprocess.control import seat_table
from inprocess.control.counting_out import count_out
from inprocess.control.leadership import LOST_MARK, lost_mark, parse_lost_mark
from inprocess.control.membership import Membership
from inprocess.control.protocol import TERMINATED_UNIT, Decision, FaultRecord, RestartProtocol
from inprocess.control.tcpstore_client import TCPStoreClient
from inprocess.exception import InternalError
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, decide
from test_seats import RaceOnSeat

pytestmark = pytest.mark.timeout(60)

TIMEOUT = datetime.timedelta(seconds=10)
BARRIER = 2


class Died(BaseException):
    """A rank "killed" inside its decide function: its thread leaves without publishing."""


class Job:
    """A store as barrier 1 left it for ``n`` ranks, and the parts of barrier 2."""

    def __init__(self, n: int, use_libuv: bool = True):
        self.n = n
        self.server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False,
                                    use_libuv=use_libuv)
        self.use_libuv = use_libuv
        p = self.protocol()
        p.publish_decision(Decision(BARRIER - 1, Membership.all_active(n), [], [], 0, leader=0))
        seeded = seat_table.seeded(p.prefix, 1, {r: str(BARRIER - 1) for r in range(n)})
        self.server.multi_set(list(seeded), list(seeded.values()))
        assert self.server.check(list(seeded))  # answered: the server holds them
        self.decided: list[tuple[int, int]] = []  # (leader, term) of every decide call
        self.lock = threading.Lock()
        self.results: dict[int, Any] = {}

    def client(self) -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", self.server.port, is_master=False, timeout=TIMEOUT, use_libuv=self.use_libuv)

    def protocol(self, store: Any = None) -> RestartProtocol:
        return RestartProtocol(self.client() if store is None else store)

    def decide_fn(self, p: RestartProtocol, before: Callable[[int, int], None] | None = None,
                  barrier: int = BARRIER, previous: Membership | None = None) -> Any:
        def run(dead: set[int], faults: list[FaultRecord], leader: int) -> Decision:
            with self.lock:
                self.decided.append((leader, p.lead_term))
            if before is not None:
                before(leader, p.lead_term)
            table = Membership.all_active(self.n) if previous is None else previous
            return decide(Compose(ActivateAllRanks(), ShiftRanks()), table, dead, faults, barrier, leader)

        return run

    def waiter(self, rank: int, before: Callable[[int, int], None] | None = None,
               p: RestartProtocol | None = None, barrier: int = BARRIER,
               previous: Membership | None = None) -> threading.Thread:
        """Rank ``rank`` arrives at ``barrier`` (after ``previous``: every rank active if None) and
        waits for (or takes) its decision, in a thread."""
        p = self.protocol() if p is None else p
        decide_fn = self.decide_fn(p, before, barrier, previous)
        expected = self.n if previous is None else previous.world_size

        def body() -> None:
            try:
                self.results[rank] = p.barrier(barrier, rank, expected, decide=decide_fn, timeout=15)
            except BaseException as e:  # the test reads it
                self.results[rank] = e

        thread = threading.Thread(target=body, name=f"rank-{rank}")
        thread.start()
        return thread

    def count_out(self, rank: int, store: Any = None) -> int | None:
        """What the monitor of ``rank`` does when it sees the rank dead."""
        monitor = RestartProtocol(TCPStoreClient("127.0.0.1", self.server.port, timeout=10) if store is None
                                  else store)

        def fault(iteration: int) -> FaultRecord:
            return FaultRecord(rank, iteration, "killed", "SIGKILL", f"rank {rank} died in the barrier")

        return count_out(monitor, rank, fault, lambda b: self.n, timeout=10, who=f"m{rank}")

    def arrivals(self, barrier: int) -> int:
        return int(self.server.add(self.protocol(self.server).key(barrier, "arrivals"), 0))

    def wait_arrivals(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while self.arrivals(BARRIER) & (TERMINATED_UNIT - 1) < count:  # test harness: waits for the threads
            assert time.monotonic() < deadline, self.arrivals(BARRIER)
            time.sleep(0.01)

    def value(self, name: str) -> bytes | None:
        """The barrier's key ``name`` ("lead.<t>" and "decision.<t>": a term's, control/keys.py)."""
        keys = self.protocol(self.server).keys
        kind, _, term = name.partition(".")
        if kind == "lead":
            key = keys.term_claim(BARRIER, int(term))
        elif kind == "decision" and term:
            key = keys.term_outcome(BARRIER, int(term))
        else:
            key = keys.iteration(BARRIER, name)
        return bytes(self.server.get(key)) if self.server.check([key]) else None

    def one_decision(self, ranks: list[int]) -> Decision:
        """Every rank of ``ranks`` got the same decision: it."""
        for r in ranks:
            assert isinstance(self.results.get(r), Decision), (r, self.results)
        decisions = {self.results[r].to_json() for r in ranks}
        assert len(decisions) == 1, decisions
        return self.results[ranks[0]]  # type: ignore[no-any-return]


def join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(20)
        assert not t.is_alive(), f"{t.name} still waits"


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "legacy"])
@pytest.mark.parametrize("others", ["arrived before the death", "arrive after it"])
def test_a_leader_lost_before_its_decision_is_excluded_by_that_barriers_decision(use_libuv: bool,
                                                                                  others: str) -> None:
    job = Job(4, use_libuv)
    assert job.protocol().arrive(BARRIER, 1, 4) == (1, 0, False)  # rank 1 arrives first: it leads, then dies
    threads = []
    if others == "arrived before the death":
        threads = [job.waiter(r) for r in (0, 2, 3)]
        job.wait_arrivals(4)
    marked = time.monotonic()
    assert job.count_out(1) == BARRIER  # counted out at barrier 2 itself: no iteration wasted
    if others == "arrive after it":  # the last of them completes the count: the new leader waits for it
        threads = [job.waiter(r) for r in (0, 2, 3)]
    join(threads)
    took = time.monotonic() - marked
    d = job.one_decision([0, 2, 3])
    assert (d.iteration, d.term, d.terminated, d.membership.world_size) == (BARRIER, 1, [1], 3)
    assert [(f.rank, f.kind, f.type) for f in d.faults] == [(1, "killed", "SIGKILL")]  # the summary names it
    assert [term for _, term in job.decided] == [1]  # one decision computed: nobody decided twice
    assert d.leader == job.decided[0][0] != 1
    assert parse_lost_mark(job.value("decision") or b"") == d.faults[0]  # term 0 ended with the mark
    assert job.value("lead.1") == str(d.leader).encode()
    assert job.protocol(job.server).read_seat(1) == "t2:m1"
    # Woken by the mark (a blocking get on the key it creates), not by a poll interval.
    assert took < 2.0, f"{took:.2f}s from the mark to every rank's decision"


def test_a_second_leader_lost_too_hands_the_lead_on_again() -> None:
    job = Job(5)
    assert job.protocol().arrive(BARRIER, 1, 5) == (1, 0, False)  # the first leader, lost
    first_takeover: list[int] = []

    def die_once(leader: int, term: int) -> None:
        with job.lock:
            if first_takeover:
                return
            first_takeover.append(leader)
        raise Died(f"rank {leader} killed while it decided term {term}")

    threads = [job.waiter(r, before=die_once) for r in (0, 2, 3, 4)]
    job.wait_arrivals(5)
    assert job.count_out(1) == BARRIER
    deadline = time.monotonic() + 10
    while not first_takeover or first_takeover[0] not in job.results:  # until the second leader "died"
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = first_takeover[0]
    assert isinstance(job.results.pop(second), Died)
    assert job.count_out(second) == BARRIER  # its monitor ends term 1 the same way
    join(threads)
    survivors = [r for r in (0, 2, 3, 4) if r != second]
    d = job.one_decision(survivors)
    assert d.term == 2 and sorted(d.terminated) == sorted([1, second]) and d.membership.world_size == 3
    assert [f.rank for f in d.faults] == [1, second]
    assert [term for _, term in job.decided] == [1, 2]
    assert d.leader in survivors


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_a_lost_mark_is_read_strictly(tail: bytes) -> None:
    """A mark read back from the store is a fault record, or a clear error: never anything else."""
    try:
        record = parse_lost_mark(LOST_MARK + tail)
    except InternalError as e:
        assert "corrupted lost mark" in str(e)
    else:
        assert record is not None and parse_lost_mark(lost_mark(record).encode()) == record


def test_a_mark_and_a_decision_are_told_apart() -> None:
    record = FaultRecord(3, 1, "killed", "SIGKILL", "gone", "host", 7)
    assert parse_lost_mark(lost_mark(record).encode()) == record
    decision = Decision(2, Membership.all_active(4), [], [record], 1, leader=0, term=3)
    assert parse_lost_mark(decision.to_json().encode()) is None
    assert Decision.from_json(decision.to_json().encode()).term == 3
    assert '"term"' not in Decision(2, Membership.all_active(4), [], [], 0, leader=0).to_json()  # unchanged
    with pytest.raises(InternalError, match="corrupted decision record"):
        Decision.from_json(decision.to_json().replace('"term":3', '"term":5').encode())  # more terms than ranks


class GateClaims:
    """A connection whose claim of the lead waits until ``parties`` claims are ready: they race."""

    def __init__(self, store: Any, gate: threading.Barrier):
        self._store = store
        self._gate = gate

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        if "/lead." in key:
            self._gate.wait(10)
        return bytes(self._store.compare_set(key, expected, desired))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_waiters_racing_for_the_lead_make_one_decision() -> None:
    n = 8
    job = Job(n)
    assert job.protocol().arrive(BARRIER, 0, n) == (1, 0, False)
    gate = threading.Barrier(n - 1)
    threads = [job.waiter(r, p=job.protocol(GateClaims(job.client(), gate))) for r in range(1, n)]
    job.wait_arrivals(n)
    assert job.count_out(0) == BARRIER
    join(threads)
    d = job.one_decision(list(range(1, n)))
    assert len(job.decided) == 1 and d.term == 1 and d.terminated == [0]  # 7 claims, one winner, one decision
    assert job.value("lead.1") == str(d.leader).encode()


def test_a_rank_lost_inside_the_barrier_ends_a_live_leaders_term_in_doubt() -> None:
    """Rank 2 (not the leader) dies after its arrival: its monitor cannot tell, so it ends
    term 0 anyway. The live leader's publish then finds the mark; it follows the next term
    like any rank, and the only decision out excludes rank 2."""
    job = Job(4)
    release = threading.Event()

    def hold_term_0(leader: int, term: int) -> None:
        if term == 0:
            release.wait(10)

    leader = job.waiter(0, before=hold_term_0)
    job.wait_arrivals(1)  # rank 0 first: it leads, and holds in its decide
    job.protocol().arrive(BARRIER, 2, 4)  # rank 2 arrives, then dies
    threads = [job.waiter(r) for r in (1, 3)]
    job.wait_arrivals(4)
    assert job.count_out(2) == BARRIER
    release.set()
    join([leader] + threads)
    d = job.one_decision([0, 1, 3])
    assert d.term == 1 and d.terminated == [2] and d.membership.world_size == 3
    assert sorted(term for _, term in job.decided) == [0, 1]  # the leader's term-0 decision never came out
    assert parse_lost_mark(job.value("decision") or b"") is not None


def test_a_decision_out_before_the_mark_counts_the_lost_rank_out_of_the_next_barrier() -> None:
    job = Job(4)
    leader = job.protocol()
    assert leader.arrive(BARRIER, 0, 4) == (1, 0, False)
    for r in (1, 2, 3):
        job.protocol().arrive(BARRIER, r, 4)  # rank 2 among them: it arrives, then dies
    decision = decide(Compose(ActivateAllRanks(), ShiftRanks()), Membership.all_active(4), set(), [], BARRIER, 0)

    def leader_publishes() -> None:
        assert leader.publish_decision(decision)

    monitor = RaceOnSeat(job.client(), leader_publishes, claims_only=True)  # before its mark
    assert job.count_out(2, store=monitor) == BARRIER + 1  # as for a rank lost after the decision
    assert job.value("decision") == decision.to_json().encode()  # no mark, no second term
    assert job.value("decision.1") is None
    assert job.arrivals(BARRIER + 1) == TERMINATED_UNIT
    p = job.protocol(job.server)
    assert [(f.rank, f.iteration) for f in p.read_faults(BARRIER)] == [(2, BARRIER)]
    assert job.server.get(p.key(BARRIER, "event")) == b"restart"


def test_two_declarers_of_one_lost_leader_mark_it_once() -> None:
    job = Job(4)
    job.protocol().arrive(BARRIER, 1, 4)
    # The monitor of rank 3 (rank 1 went silent) reads rank 1's seat; before it claims it, rank
    # 1's own monitor counts it out start to end.
    peer = RaceOnSeat(job.client(), lambda: job.count_out(1))
    monitor = RestartProtocol(peer)
    fault = FaultRecord(1, 1, "unresponsive", "HeartbeatTimeout", "silent")
    assert count_out(monitor, 1, lambda i: fault, lambda b: 4, timeout=10, who="m3") is None
    assert monitor.read_seat(1) == "t2:m1"
    assert parse_lost_mark(job.value("decision") or b"") is not None
    assert job.value("decision.1") is None  # one mark: term 1 is still open for a taker


def test_the_last_healthy_arrival_lost_ends_the_jobs_keys() -> None:
    """Every rank that arrived healthy is lost before anyone decided: nobody is left to take the
    lead, so the mark that shows it ends the call's keys and sets ``done`` (the store host exits)."""
    job = Job(2)
    job.protocol().arrive(BARRIER, 0, 2)
    job.protocol().arrive(BARRIER, 1, 2)
    assert job.count_out(0) == BARRIER
    p = job.protocol(job.server)
    assert not job.server.check([p.keys.done()])  # rank 1 may still take the lead
    assert job.count_out(1) == BARRIER
    assert job.server.check([p.keys.done()])
    left = [k for k in job.server.list_keys() if k.startswith(p.prefix) and "/seat/" not in k]
    assert left == [p.keys.done()], left


@pytest.mark.parametrize("deleter", ["saw the takeover", "a fresh connection"])
def test_the_takeovers_keys_go_with_the_iteration(deleter: str) -> None:
    """Barrier 3's leader deletes iteration 2's keys, the takeover's included: knowing from
    barrier 2's decision in which term it came out, or (a connection that did not see it)
    deleting terms until one is missing."""
    job = Job(4)
    job.protocol().arrive(BARRIER, 1, 4)
    protocols = {r: job.protocol() for r in (0, 2, 3)}
    threads = [job.waiter(r, p=protocols[r]) for r in (0, 2, 3)]
    job.wait_arrivals(4)
    job.count_out(1)
    join(threads)
    p = job.protocol(job.server)
    assert job.value("decision.1") is not None and job.value("lead.1") is not None
    previous = job.one_decision([0, 2, 3]).membership
    job.results.clear()
    again = protocols if deleter == "saw the takeover" else {r: job.protocol() for r in (0, 2, 3)}
    threads = [job.waiter(r, p=again[r], barrier=BARRIER + 1, previous=previous) for r in (0, 2, 3)]
    join(threads)
    assert all(isinstance(job.results[r], Decision) for r in (0, 2, 3)), job.results
    assert [k for k in job.server.list_keys() if k.startswith(f"{p.prefix}{BARRIER}/")] == []


def test_without_a_fault_the_leader_sends_one_request_more_and_the_others_none() -> None:
    """The leader's publish is a compare_set and an empty append (the wake-up torch's legacy
    server needs) where it was one set: 19 calls (with the deletes of the storm brake's progress
    counter, engine/storm.py, and of a grow's two keys, engine/grow.py) instead of 16. A waiting rank still makes 3
    (its seat, its add, one blocking get: 4 requests), and no takeover key is written."""
    job = Job(4)
    protocols = [job.protocol() for _ in range(4)]
    for p in protocols:  # as in a job: each rank read barrier 1's decision, so its terms are known,
        p.wait_decision(BARRIER - 1, 5)
        assert p.seat_table.per_key == 1  # and took its seat before, so its call's seats per key are too
    before = [(p.ops, p.requests) for p in protocols]
    threads = [job.waiter(0, p=protocols[0])]
    job.wait_arrivals(1)  # rank 0 leads
    threads += [job.waiter(r, p=protocols[r]) for r in (1, 2, 3)]
    join(threads)
    d = job.one_decision([0, 1, 2, 3])
    assert d.term == 0 and job.value("decision.1") is None and job.value("lead.1") is None
    spent = [(p.ops - ops, p.requests - requests) for p, (ops, requests) in zip(protocols, before, strict=True)]
    # The leader: seat, add, wait for ready, count, faults, compare_set + append, 12 deletes.
    # The others: seat, add, blocking get; the one whose add completed the count also sets ``ready``.
    assert spent[0] == (19, 19) and sorted(spent[1:]) == [(3, 4), (3, 4), (4, 5)], spent


# -- a term's outcome read while it is missing ------------------------------------------------------
# torch's libuv server answers a compare_set of a missing key by waking that key's waiters, whose get
# then returns b"" (control/store_ops.py, peek). A monitor that completes a short count reads the terms
# of a barrier whose ranks wait for the next term (control/short_count.py): seen as "corrupted decision
# record b''" on every survivor when a monitor counted a frozen rank out of a barrier.


def _mark_term_0_lost(p: RestartProtocol) -> None:
    p.terms.write(BARRIER, 0, lost_mark(FaultRecord(1, BARRIER - 1, "killed", "SIGKILL", "lost while deciding")))


def _waiting(read: Callable[[], bytes]) -> tuple[threading.Thread, dict[str, Any]]:
    got: dict[str, Any] = {}

    def body() -> None:
        try:
            got["raw"] = read()
        except BaseException as e:  # the test reads it
            got["raw"] = e

    thread = threading.Thread(target=body, name="waiting for term 1")
    thread.start()
    time.sleep(0.5)  # its get waits on the server
    return thread, got


def test_the_short_count_reads_no_missing_term_that_ranks_wait_for() -> None:
    from inprocess.control.short_count import lost_ranks

    job = Job(4)
    _mark_term_0_lost(job.protocol())
    waiter = job.protocol()
    thread, got = _waiting(lambda: waiter.counted.get_blocking(waiter.terms.outcome_key(BARRIER, 1), 10, "term 1"))
    monitor = RestartProtocol(TCPStoreClient("127.0.0.1", job.server.port, timeout=10))
    assert lost_ranks(monitor, BARRIER) == ({1}, False)
    time.sleep(0.3)
    assert "raw" not in got, got  # still waiting: nothing woke it
    job.protocol().terms.write(BARRIER, 1, "the decision of term 1")
    thread.join(10)
    assert got["raw"] == b"the decision of term 1", got


def test_a_terms_reader_woken_early_waits_again() -> None:
    from inprocess.control.store_ops import Deadline

    job = Job(4)
    _mark_term_0_lost(job.protocol())
    waiter = job.protocol()
    thread, got = _waiting(lambda: waiter.terms.wait(BARRIER, 1, Deadline(10)))
    peeker = job.protocol()
    assert peeker.counted.peek(peeker.terms.outcome_key(BARRIER, 1)) is None  # wakes the waiter's get with b""
    time.sleep(0.3)
    job.protocol().terms.write(BARRIER, 1, "the decision of term 1")
    thread.join(10)
    assert got["raw"] == b"the decision of term 1", got
