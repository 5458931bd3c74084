"""The membership table: its invariants and its run-length encoding."""

from __future__ import annotations

import pytest

import inprocess
from inprocess.control.membership import ACTIVE, NONE, TERMINATED, Membership
from inprocess.rank_assignment import ActivateAllRanks, ShiftRanks, Topology, run_job_wide

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
