"""Seats kept several to a store key (control/seat_table.py), against torch's TCPStore and HashStore.

Each seat must behave as the key of its own it was before: a compare_set of one seat is
refused only by a change of that seat, never by the other seats of its key or by what
this process saw of the key before.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist

from inprocess.control import seat_table, seats
from inprocess.control.protocol import RestartProtocol
from inprocess.control.seat_table import SeatTable
from inprocess.control.store_ops import CountingStore
from inprocess.exception import InternalError

PREFIX = "inprocess/0/"


@pytest.fixture(params=["tcp", "hash"])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "tcp":
        server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10),
                               wait_for_workers=False)
        yield server
        del server
    else:
        yield dist.HashStore()


def table(store: Any, proposal: int = 8) -> SeatTable:
    return SeatTable(CountingStore(store), PREFIX, proposal)


@pytest.mark.timeout(30)
def test_the_first_proposal_is_the_calls_and_the_others_adopt_it(store: Any) -> None:
    first, second = table(store, 8), table(store, 4)
    assert first.per_key == 8 and second.per_key == 8  # asked once each: one call
    assert first.counted.calls == second.counted.calls == 1
    assert first.per_key == 8 and first.counted.calls == 1  # known from then on
    # Another call has its own.
    assert SeatTable(CountingStore(store), "inprocess/1/", 2).per_key == 2
    assert RestartProtocol(store, 0).seat_key(11) == f"{PREFIX}seat/1"  # a protocol without a proposal adopts 8


@pytest.mark.timeout(30)
def test_a_per_key_value_not_written_by_the_library_is_named(store: Any) -> None:
    store.set(seat_table.per_key_key(PREFIX), "eight")
    with pytest.raises(InternalError, match="seat/per_key holds 'eight': expected an integer in 1..256"):
        assert table(store).per_key
    store.set(seat_table.per_key_key("inprocess/2/"), "0")
    with pytest.raises(InternalError, match="seat/per_key 0: expected an integer in 1..256"):
        assert SeatTable(CountingStore(store), "inprocess/2/").per_key
    with pytest.raises(InternalError, match="seats per key proposed 300"):
        table(store, 300)


@pytest.mark.timeout(30)
def test_one_seat_moves_while_the_others_of_its_key_stay(store: Any) -> None:
    t = table(store)
    assert t.compare_set(3, "", "0") == "0"  # barrier 0: nothing written, the key is created
    assert store.get(f"{PREFIX}seat/0") == b",,,0,,,,"
    assert t.read(3) == "0" and t.read(4) is None
    assert t.compare_set(3, "0", "1") == "1"
    assert t.compare_set(3, "0", "1") == "1"  # already there: answered as a key of its own would
    assert t.compare_set(3, "5", "6") == "1"  # elsewhere: refused, with what the seat holds
    assert t.read(3) == "1" and t.read_many([3, 4, 9]) == {3: "1", 4: None, 9: None}


@pytest.mark.timeout(30)
def test_a_missing_key_refuses_a_move_that_expects_a_value_and_creates_nothing(store: Any) -> None:
    t = table(store)
    assert t.compare_set(10, "0", "1") == ""  # the rank never arrived: nothing is created
    assert t.read(10) is None
    assert t.compare_set_many([(8, "0", "1"), (9, "", "0")]) == ["", "0"]
    assert t.read_many([8, 9]) == {8: None, 9: "0"}


@pytest.mark.timeout(30)
def test_a_stale_view_of_the_key_never_refuses_a_move(store: Any) -> None:
    """What this table saw of the key (a seat counted out) is older than the store (a joiner
    admitted into it since): the move that expects the store's value goes through."""
    mine, leader = table(store), table(store)
    mine.write({r: "4" for r in range(8)})
    assert mine.compare_set(2, "4", seats.counted_out(5, "m2")) == "t5:m2"  # this table saw rank 2 counted out
    assert leader.compare_set(2, "t5:m2", seats.healthy(5, 1)) == "5@1"  # a leader admitted a joiner into it
    assert leader.compare_set(1, "4", "5") == "5"  # and another seat of the key moved too
    assert mine.compare_set(2, "5@1", "6@1") == "6@1"
    assert mine.read_many(list(range(8))) == {0: "4", 1: "5", 2: "6@1", 3: "4", 4: "4", 5: "4", 6: "4", 7: "4"}


@pytest.mark.timeout(30)
def test_many_seats_of_many_keys_in_one_call_one_compare_set_per_key(store: Any) -> None:
    t = table(store)
    t.write({r: "0" for r in range(24)})
    t.compare_set(10, "0", "t1:m10")  # counted out meanwhile
    other = table(store)
    calls = other.counted.calls
    moves = [(r, "0", "1") for r in range(24)]
    assert other.compare_set_many(moves) == ["1"] * 10 + ["t1:m10"] + ["1"] * 13
    # One per key, plus one more for the key whose seat 10 was not where the write expected it, and
    # the call's seats per key.
    assert other.counted.calls - calls == 3 + 1 + 1
    with pytest.raises(InternalError, match="name a seat twice"):
        other.compare_set_many([(1, "1", "2"), (1, "1", "2")])


@pytest.mark.timeout(30)
def test_a_seat_value_with_the_separator_is_refused(store: Any) -> None:
    with pytest.raises(InternalError, match="holds ','"):
        table(store).compare_set(0, "", "t0:m,1")
    store.set(f"{PREFIX}seat/0", "0,0")
    with pytest.raises(InternalError, match=r"seat key inprocess/0/seat/0 holds '0,0': expected 8 seat values"):
        table(store).read(0)


@pytest.mark.timeout(60)
def test_eight_processes_move_their_own_seats_of_one_key_at_once_each_counted_once() -> None:
    """Eight ranks arrive at 30 barriers at once on one key, each on its own connection (ranks
    whose agent is gone), while the monitor of rank 5 claims its seat at barrier 17 against rank
    5's own arrival: every move lands, and exactly one of the two claims of barrier 17 wins. As
    in the protocol, nobody arrives at barrier b+1 before everybody arrived at b."""
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10), wait_for_workers=False)

    def client() -> SeatTable:
        return table(dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=10)))

    tables = [client() for _ in range(9)]
    start = threading.Barrier(9)
    decided = threading.Barrier(8)  # barrier b's decision: every rank arrived (rank 5 counted out or not)
    results: dict[str, Any] = {}

    def rank(r: int) -> None:
        start.wait()
        out = None
        for b in range(30):
            if out is None:
                answer = tables[r].compare_set(r, seats.before_barrier(b), seats.healthy(b))
                if answer != seats.healthy(b):
                    out = (b, answer)
            decided.wait(20)
        results[f"rank {r}"] = out or "all"

    def monitor() -> None:
        start.wait()
        for _ in range(100_000):  # claims barrier 17 when rank 5's seat says it has not arrived there
            if tables[8].read(5) == "16":
                results["monitor"] = tables[8].compare_set(5, "16", seats.counted_out(17, "m5"))
                return
        results["monitor"] = "never saw 16"

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(8)] + [threading.Thread(target=monitor)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not any(t.is_alive() for t in threads)
    assert all(results[f"rank {r}"] == "all" for r in range(8) if r != 5), results
    final = table(server).read_many(list(range(8)))
    assert all(final[r] == "29" for r in range(8) if r != 5), final
    if results["monitor"] == "t17:m5":  # the monitor won barrier 17: rank 5 was refused there
        assert results["rank 5"] == (17, "t17:m5") and final[5] == "t17:m5", (results, final)
    else:  # rank 5 arrived first (or the monitor never read 16 between two of its moves)
        assert results["rank 5"] == "all" and final[5] == "29", (results, final)
