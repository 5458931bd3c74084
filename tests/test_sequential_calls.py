"""Wrapped calls in a row in one job: call N+1 never meets call N's store server going away."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def test_twenty_calls_in_a_row(job):
    calls, world_size = 20, 4
    res = job({"calls": calls}, world_size=world_size, worker="sequential_worker.py", timeout=200.0)
    failed = {r: res.rank(r).get("exception") for r in range(world_size) if res.returncodes[r] != 0}
    assert not failed, f"{failed}\n{res.describe()}"  # every rank's own exception: the first may be a consequence
    for rank in range(world_size):
        log = res.rank(rank)
        # Every call ran its allreduce across all ranks: sum over r of (call + r).
        expected = [float(world_size * c + sum(range(world_size))) for c in range(calls)]
        assert [c["sum"] for c in log["calls"]] == expected
