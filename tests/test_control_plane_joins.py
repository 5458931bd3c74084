"""The control-plane simulator with joiners (``--joiners K``, benchmarks/control_plane/joins.py), small.

The simulator runs the library's own join protocol: simulated joiners
announce themselves and wait with ``JoinKeys`` (as ``inprocess/engine/join.py``
does), the leader of the restart runs ``joining.admit`` and
``Membership.with_joined`` before the rank assignment (as
``CallWrapper._decide`` does), and every rank and joiner is checked to hold
the same decision and its expected row (the simulator raises otherwise).
Here at N = 64 with 4 joiners, in both modes, in a few seconds each.
"""

from __future__ import annotations

import psutil
import pytest
from benchmarks.control_plane import SimConfig, pick_faulty, simulate
from benchmarks.control_plane.joins import JoinPlan

from inprocess.control.membership import ACTIVE, TERMINATED


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("ranks_per_node", "layout"), [(8, "nodes"), (0, "nodes"), (8, "spread")],
                         ids=["node", "direct", "node-spread"])
def test_joiners_are_admitted_into_the_seats_lost_in_the_restart_before(ranks_per_node: int, layout: str) -> None:
    before = _children()
    n, k = 64, 4
    cfg = SimConfig(procs=2, groups=2, restarts=6, joiners=k, joiner_layout=layout, decode="every-rank",
                    check_membership=True, settle_s=0.1, steady_s=0.2, heartbeat_rounds=0, timeout_s=60.0,
                    ranks_per_node=ranks_per_node)
    result = simulate(n, cfg)
    assert _children() - before == set()  # every process the simulator started is gone

    restarts = result["per_restart"]
    assert [r["phase"] for r in restarts] == ["lose", "admit", "plain"] * 2
    plan = JoinPlan(n, k, cfg.restarts, pick_faulty(n, cfg.restarts), layout)
    per_key = ranks_per_node or 1  # node mode: a seat key per node (control/seat_table.py)
    leaders_asked: list[int] = []
    for j, r in enumerate(restarts):
        faults = j + 1
        assert len(r["decisions"]) == 1, r  # one decision, byte for byte, on every rank and joiner
        if r["phase"] == "lose":
            assert r["ranks"] == n - faults - k and r["joiners"] == 0, r
        elif r["phase"] == "admit":
            # The ranks of the restart hold the decision, and so does every joiner, admitted at barrier j+1
            # with a row of its own in it (checked by the simulator against ActivateAllRanks + ShiftRanks).
            assert r["ranks"] == n - faults - k and r["joiners"] == k, r
            assert 0 < r["joiner_admitted_median_ms"] <= r["joiner_decided_max_ms"], r
            # A joiner's store calls: the call's seats per key and its seat (control/seat_table.py), `running`
            # twice, its record (pending), its announcement and the announced counter (a grow's look reads
            # it: engine/grow.py), its outcome, the decision.
            assert r["joiner_ops_median"] == r["joiner_ops_max"] == 9, r
            # The leader's admit: the lines and the mark, one check and one multi_get of the k records and
            # seat keys, a connection of its own for the k outcomes' compare_sets (pipelined), the told values
            # (one multi_set) and the resolved counter, a compare_set per seat key (pipelined), the mark.
            # With node agents the leader may be the first of its process to touch a seat: then it asks
            # the call's seats per key first (one call; a rank that took its seat itself knew it).
            keys = len({seat // per_key for seat in plan.admitted_in(j)})
            asked = r["admit_calls"] - (k + keys + 8)
            assert asked in ((0, 1) if ranks_per_node else (0,)), (r, keys)
            leaders_asked.append(asked)
        else:
            # The world is back: the joiners of the restart before arrive as the ranks of their seats.
            assert r["ranks"] == n - faults and r["joiners"] == 0, r
            # Its leader reads the lines and the mark only: the mark says the admitted lines need no look.
            assert r["admit_calls"] == 2, r
        if r["phase"] == "lose" and j > 0:
            assert r["admit_calls"] == 2, r  # nothing pending: the lines and the mark
    # "nodes": the 4 seats of one node, one key; "spread": one key each; without agents a key per seat.
    assert keys == (1 if layout == "nodes" and ranks_per_node else k)
    assert leaders_asked[0] == (1 if ranks_per_node else 0)  # a rank in node mode has never touched a seat
    phases = result["phases"]
    lose, admit = phases["lose"], phases["admit"]
    assert admit["restarts"] == 2 and admit["joiners"] == k
    # The leader's admission costs it 2k + 8 calls in about 8 round trips; no other rank pays anything:
    # every other rank still makes its one seat call (with node agents none: its agent takes the seat).
    assert admit["ops_leader"] - lose["ops_leader"] >= 2 * k, phases
    if ranks_per_node:
        assert admit["ops_per_rank_median"] == 0, phases


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks_per_node", [8, 0], ids=["node", "direct"])
def test_a_group_whose_ranks_are_all_lost_runs_again_when_their_joiners_come_back(ranks_per_node: int) -> None:
    """One node per group and 8 joiners: the lost ranks are a whole node, so a group has no rank in
    the restart that admits their joiners. It must wait for the restart after, in which the joiners
    arrive as its ranks (its thread used to end: that restart never finished, at N = 256 by default)."""
    n, k = 64, 8
    cfg = SimConfig(procs=2, groups=4, restarts=3, joiners=k, decode="every-rank", settle_s=0.1, steady_s=0.2,
                    heartbeat_rounds=0, timeout_s=30.0, ranks_per_node=ranks_per_node)
    restarts = simulate(n, cfg)["per_restart"]
    assert [(r["phase"], r["ranks"], r["joiners"]) for r in restarts] == [
        ("lose", n - 1 - k, 0), ("admit", n - 2 - k, k), ("plain", n - 3, 0)], restarts


def test_join_plan_blocks_avoid_the_faulty_ranks() -> None:
    faulty = pick_faulty(16, 3)  # [9, 0, 7]: both node-aligned blocks of 8 hold one
    plan = JoinPlan(16, 2, 3, faulty)
    assert len(plan.lost[0]) == 2 and not set(plan.lost[0]) & set(faulty)
    assert plan.lost[0][1] == plan.lost[0][0] + 1  # consecutive ranks
    with pytest.raises(ValueError, match="no 8 consecutive ranks"):
        JoinPlan(16, 8, 6, pick_faulty(16, 6))


def test_join_plan_rows_follow_shift_ranks_with_joiners_in_their_seats_place() -> None:
    n, k = 16, 2
    faulty = pick_faulty(n, 3)
    plan = JoinPlan(n, k, 3, faulty)
    lost = plan.lost_in(0)
    assert len(lost) == k and not set(lost) & set(faulty) and plan.admitted_in(1) == lost
    assert plan.phase(2) == "plain" and plan.lost_in(1) == plan.admitted_in(2) == []
    assert plan.away(lost[0], 0) and plan.away(lost[0], 1) and not plan.away(lost[0], 2)
    rows0 = plan.rows(0)
    assert all(rows0[r] == (TERMINATED, -1, -1) for r in [faulty[0], *lost])
    rows1 = plan.rows(1)
    # Each joiner comes back where its seat stands: the ranks are in seat order again, as before the loss,
    # with only the two faulty ranks missing.
    alive = [r for r in range(n) if r not in faulty[:2]]
    assert [rows1[r] for r in alive] == [(ACTIVE, i, i) for i in range(n - 2)]
    assert rows1[faulty[0]] == rows1[faulty[1]] == (TERMINATED, -1, -1)
