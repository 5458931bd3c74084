"""Seats count every rank exactly once, also when two monitors declare the same rank lost at once."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from inprocess.control import seat_table
from inprocess.control.counting_out import count_out
from inprocess.control.membership import Membership
from inprocess.control.protocol import Decision, FaultRecord, RestartProtocol

TIMEOUT = datetime.timedelta(seconds=10)


class RaceOnSeat:
    """A store connection that runs ``race()`` right after its first ``compare_set`` of a seat
    returns (a read of it, or with ``claims_only`` a claim, "t..."), so that another party acts
    in between."""

    def __init__(self, store: Any, race: Callable[[], None], *, claims_only: bool = False):
        self._store = store
        self._race: Callable[[], None] | None = race
        self._claims_only = claims_only

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        value = bytes(self._store.compare_set(key, expected, desired))
        desired_text = desired.decode() if isinstance(desired, bytes) else desired
        claim = desired_text.startswith("t")
        if self._race is not None and "/seat/" in key and (claim or not self._claims_only):
            race, self._race = self._race, None
            race()
        return value

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("second", ["monitor", "the rank itself"])
def test_two_claimants_of_one_seat_count_it_once(second: str) -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False)

    def client() -> dist.TCPStore:
        return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)

    n, lost = 4, 2
    seeded = seat_table.seeded("inprocess/0/", 1, {r: "0" for r in range(n)})
    server.multi_set(list(seeded), list(seeded.values()))
    assert server.check(list(seeded))  # answered: the server holds them
    # As barrier 0 left them: decided (a rank lost before that decision is counted out of
    # barrier 0 itself: tests/test_takeover.py).
    RestartProtocol(server).publish_decision(Decision(0, Membership.all_active(n), [], [], 0, leader=0))

    def fault(iteration: int) -> FaultRecord:
        return FaultRecord(lost, iteration, "unresponsive", "HeartbeatTimeout", "test")

    other = RestartProtocol(client())

    def second_claimant() -> None:
        if second == "monitor":  # the monitor of rank 3 declares rank 2 lost, start to end
            assert count_out(other, lost, fault, lambda b: n, timeout=10, who="m3") == 1
        else:  # rank 2 itself leaves, counting itself out of barrier 1
            assert other.barrier(1, lost, n, terminated=True, timeout=10) is None

    # The monitor of rank 0 reads the seat ("0"); before it claims it, the other claimant wins.
    first = RestartProtocol(RaceOnSeat(client(), second_claimant))
    assert count_out(first, lost, fault, lambda b: n, timeout=10, who="m0") is None
    arrivals = server.add(first.key(1, "arrivals"), 0)
    assert (arrivals & 0xFFFFFFFF, arrivals >> 32) == (0, 1), "rank 2 was counted out more than once"
    assert RestartProtocol(server).read_seat(lost) == ("t1:m3" if second == "monitor" else "t1:self")
