"""The recovery plan (inprocess.control.recovery_plan): every rank's plan from real decisions.

The decisions come from the leader's own function (``rank_assignment.decide``) with the built-in
rank assignments, and go through the decision's JSON form as every rank reads it from the store.
"""

from __future__ import annotations

import pytest

from inprocess import Compose
from inprocess.control.membership import Membership
from inprocess.control.records import Decision
from inprocess.control.recovery_plan import (
    RELEASE_SCHEDULE,
    DecisionSummary,
    Moment,
    RecoveryPlan,
    Resource,
    StateSource,
    Transition,
    leaves,
    released_at,
    seated,
    transition,
)
from inprocess.exception import InternalError
from inprocess.rank_assignment import (
    ActivateAllRanks,
    ActiveWorldSizeDivisibleBy,
    JobAssignment,
    MaxActiveWorldSize,
    ShiftRanks,
    decide,
    initial_membership,
)
from inprocess.state import Mode

pytestmark = pytest.mark.timeout(30)

DEFAULT = Compose(ActivateAllRanks(), ShiftRanks())  # the Wrapper's default rank assignment
ONE_SPARE = Compose(MaxActiveWorldSize(3), ActivateAllRanks(), ShiftRanks())


def on_the_wire(d: Decision) -> Decision:
    """The decision as a rank other than the leader reads it."""
    return Decision.from_json(d.to_json().encode())


def decisions(ra: object, n: int, *lost: set[int]) -> list[Decision]:
    """The initial decision of ``n`` ranks, then one per restart losing each set of ``lost``."""
    out = [on_the_wire(decide(ra, initial_membership(n), set(), [], 0, 0))]
    for i, dead in enumerate(lost, start=1):
        out.append(on_the_wire(decide(ra, out[-1].membership, dead, [], i, 0)))
    return out


def plans(previous: Membership | None, d: Decision) -> list[RecoveryPlan]:
    return [RecoveryPlan.for_rank(previous, d, r) for r in range(d.membership.initial_world_size)]


def test_at_the_start_every_rank_activates_with_its_state_from_the_users_code() -> None:
    (d0,) = decisions(DEFAULT, 4)
    for r, p in enumerate(plans(None, d0)):
        assert p.transition is Transition.ACTIVATE
        assert p.new_mode == Mode.ACTIVE
        assert (p.old_rank, p.new_rank, p.old_active_rank, p.new_active_rank) == (None, r, None, r)
        assert (p.new_world_size, p.new_active_world_size) == (4, 4)
        assert p.state_source is StateSource.USER
        assert p.release == frozenset()  # nothing ran yet
        assert p.environment() == {"RANK": str(r), "WORLD_SIZE": "4"}
        assert p.active and not p.leaves and p.iteration == 0


def test_a_shift_ranks_shrink_renumbers_the_survivors_and_the_lost_rank_leaves() -> None:
    d0, d1 = decisions(DEFAULT, 4, {1})
    p = plans(d0.membership, d1)
    assert [x.transition for x in p] == [Transition.STAY_ACTIVE, Transition.LEAVE, Transition.STAY_ACTIVE,
                                         Transition.STAY_ACTIVE]
    assert [(x.old_rank, x.new_rank) for x in p] == [(0, 0), (1, None), (2, 1), (3, 2)]
    assert [(x.old_active_rank, x.new_active_rank) for x in p] == [(0, 0), (1, None), (2, 1), (3, 2)]
    for x in p:
        assert (x.new_world_size, x.new_active_world_size) == (3, 3)
        assert x.release == {Resource.NCCL_TEARDOWN}  # once the decision is known: NCCL's teardown
    assert [x.state_source for x in p] == [StateSource.MEMORY, None, StateSource.MEMORY, StateSource.MEMORY]
    assert p[3].environment() == {"RANK": "2", "WORLD_SIZE": "3"}
    assert p[1].leaves and not p[1].active and p[1].new_mode == Mode.TERMINATED


def test_a_spare_takes_over_and_gets_its_state_from_the_users_code() -> None:
    d0, d1 = decisions(ONE_SPARE, 4, {1})
    start = plans(None, d0)
    assert [x.transition for x in start] == [Transition.ACTIVATE] * 3 + [Transition.STAY_SPARE]
    spare = start[3]
    assert spare.state_source is None and not spare.active and spare.new_active_rank is None
    assert spare.environment() == {"RANK": None, "WORLD_SIZE": None}  # a spare has no rank in the running job
    p = plans(d0.membership, d1)
    assert [x.transition for x in p] == [Transition.STAY_ACTIVE, Transition.LEAVE, Transition.STAY_ACTIVE,
                                         Transition.ACTIVATE]
    assert (p[3].old_rank, p[3].new_mode, p[3].old_active_rank, p[3].new_active_rank) == (3, Mode.ACTIVE, None, 2)
    assert p[3].state_source is StateSource.USER and p[3].environment() == {"RANK": "2", "WORLD_SIZE": "3"}
    assert p[0].state_source is StateSource.MEMORY


def test_a_spare_stays_a_spare_and_an_active_rank_can_become_one() -> None:
    spare_kept = decisions(Compose(MaxActiveWorldSize(2), ActivateAllRanks(), ShiftRanks()), 4, {0})
    p = plans(spare_kept[0].membership, spare_kept[1])
    assert [x.transition for x in p] == [Transition.LEAVE, Transition.STAY_ACTIVE, Transition.ACTIVATE,
                                         Transition.STAY_SPARE]
    # Three left of four, an even active world wanted: the last one is made a spare.
    d0, d1 = decisions(Compose(ActiveWorldSizeDivisibleBy(2), ActivateAllRanks(), ShiftRanks()), 4, {1})
    p = plans(d0.membership, d1)
    assert [x.transition for x in p] == [Transition.STAY_ACTIVE, Transition.LEAVE, Transition.STAY_ACTIVE,
                                         Transition.DEACTIVATE]
    assert (p[3].new_rank, p[3].new_active_rank, p[3].state_source) == (2, None, None)
    assert p[3].environment() == {"RANK": None, "WORLD_SIZE": None}


def test_the_jobs_end_makes_every_rank_leave() -> None:
    class Boom(JobAssignment):
        def assign_job(self, ctx: object) -> object:
            raise RuntimeError("boom")

    d0 = decisions(DEFAULT, 4)[0]
    end = on_the_wire(decide(Compose(ActivateAllRanks(), ShiftRanks(), Boom()), d0.membership, {2}, [], 1, 0))
    assert end.abort is not None
    for x in plans(d0.membership, end):
        assert x.transition is Transition.LEAVE and x.leaves and not x.active
        assert x.ends_job == end.abort and "boom" in x.ends_job
        assert x.state_source is None
    summary = DecisionSummary.of(d0.membership, end)
    assert summary.left == [0, 1, 2, 3] and summary.ends_job == end.abort
    # A rank assignment that fails at the start: its table is still the initial one (modes INITIALIZED).
    start = on_the_wire(decide(Compose(ShiftRanks(), Boom()), initial_membership(2), set(), [], 0, 0))
    assert start.abort is not None and start.membership.mode == [int(Mode.INITIALIZED)] * 2
    for x in plans(None, start):
        assert x.transition is Transition.LEAVE and x.new_mode == Mode.INITIALIZED and x.ends_job == start.abort
    assert DecisionSummary.of(None, start).left == [0, 1]


def test_a_joiner_is_one_more_case_for_every_rank_and_for_itself() -> None:
    d0, d1 = decisions(DEFAULT, 4, {1})
    # As if this decision refilled seat 1 with a joiner (its second life): the decision names it.
    refilled = Membership(list(d0.membership.mode), list(d0.membership.rank), list(d0.membership.active_rank))
    d2 = on_the_wire(Decision(2, refilled, [], [], 0, 0, joined=[(1, 2)]))
    for previous in (d1.membership, None):  # a peer's plan, then the joiner's own (it knew no membership)
        p = RecoveryPlan.for_rank(previous, d2, 1)
        assert p.transition is Transition.JOIN and (p.old_rank, p.old_active_rank) == (None, None)
        assert (p.new_rank, p.new_active_rank, p.state_source) == (1, 1, StateSource.USER)
        assert p.release == frozenset()  # nothing of a failed iteration: the joiner ran none; a peer's is not it
    assert DecisionSummary.of(d1.membership, d2).joined == [1]
    # The joiner's own summary of the decision that admits it names its seat as every peer's does.
    mine = DecisionSummary.of(None, d2)
    assert (mine.joined, mine.started_active, mine.stayed_active + mine.stayed_spare) == ([1], 0, 3)
    without = on_the_wire(Decision(2, refilled, [], [], 0, 0))
    with pytest.raises(InternalError, match="without a join"):
        RecoveryPlan.for_rank(d1.membership, without, 1)  # a seat that left never comes back on its own


def test_the_leave_rule_and_the_seating_of_joiners() -> None:
    d0, d1 = decisions(DEFAULT, 4, {1})
    assert [leaves(d1, r) for r in range(4)] == [False, True, False, False]
    ended = on_the_wire(Decision(2, d1.membership, [], [], 0, 0, abort="the rank assignment failed"))
    assert all(leaves(ended, r) for r in range(4))  # the job ends: every rank leaves
    assert seated(d1.membership, []) is d1.membership
    back = seated(d1.membership, [(1, 2)])
    assert (back.mode[1], back.rank, back.world_size) == (int(Mode.INACTIVE), [0, 1, 2, 3], 4)
    assert d1.membership.mode[1] == int(Mode.TERMINATED)  # seated() copies


def test_the_release_schedule_is_the_plans_instruction() -> None:
    # The groups and the store client before the barrier; NCCL's teardown, started by the abort, once it is over.
    assert released_at(Moment.BEFORE_DECISION) == {Resource.PROCESS_GROUPS, Resource.ITERATION_STORE}
    assert released_at(Moment.AFTER_DECISION) == {Resource.NCCL_TEARDOWN}
    later = dict(RELEASE_SCHEDULE, **{})
    later[Resource.PROCESS_GROUPS] = Moment.AFTER_DECISION
    assert released_at(Moment.BEFORE_DECISION, later) == {Resource.ITERATION_STORE}
    d0, d1 = decisions(DEFAULT, 4, {1})
    for r in range(4):  # once the decision is known, every rank releases it, the one that leaves too
        assert RecoveryPlan.for_rank(d0.membership, d1, r, later).release == {Resource.PROCESS_GROUPS,
                                                                              Resource.NCCL_TEARDOWN}
    assert RecoveryPlan.for_rank(None, d0, 0, later).release == frozenset()  # nothing ran before the start


def test_a_plans_fields_say_what_the_rank_does() -> None:
    d0, d1 = decisions(ONE_SPARE, 4, {1})
    fields = RecoveryPlan.for_rank(d0.membership, d1, 3).fields()
    assert fields == {"transition": "activate", "rank": [3, 2], "active_rank": [None, 2], "state": "user",
                      "release": ["nccl_teardown"]}


def test_transitions_cover_every_pair_of_modes() -> None:
    olds = [Mode.INITIALIZED, Mode.ACTIVE, Mode.INACTIVE]
    expected = {
        (Mode.INITIALIZED, Mode.ACTIVE): Transition.ACTIVATE, (Mode.INITIALIZED, Mode.INACTIVE): Transition.STAY_SPARE,
        (Mode.ACTIVE, Mode.ACTIVE): Transition.STAY_ACTIVE, (Mode.ACTIVE, Mode.INACTIVE): Transition.DEACTIVATE,
        (Mode.INACTIVE, Mode.ACTIVE): Transition.ACTIVATE, (Mode.INACTIVE, Mode.INACTIVE): Transition.STAY_SPARE,
    }
    for old in olds:
        assert transition(old, Mode.TERMINATED) is Transition.LEAVE
        for new in (Mode.ACTIVE, Mode.INACTIVE):
            assert transition(old, new) is expected[(old, new)]
    assert transition(Mode.TERMINATED, Mode.TERMINATED) is Transition.LEAVE
    assert transition(Mode.TERMINATED, Mode.INACTIVE, joined=True) is Transition.JOIN


def test_the_summary_lists_who_leaves_who_stays_and_who_is_activated() -> None:
    d0, d1, d2 = decisions(ONE_SPARE, 6, {1}, {4})
    start = DecisionSummary.of(None, d0)
    assert (start.started_active, start.stayed_spare, start.activated, start.left) == (3, 3, [], [])
    s1 = DecisionSummary.of(d0.membership, d1)
    assert (s1.left, s1.activated, s1.deactivated, s1.joined) == ([1], [3], [], [])
    assert (s1.stayed_active, s1.stayed_spare, s1.world_size, s1.active_world_size) == (2, 2, 5, 3)
    s2 = DecisionSummary.of(d1.membership, d2)  # rank 1 left before: not counted again
    assert (s2.left, s2.stayed_active + s2.stayed_spare + len(s2.activated)) == ([4], 4)
    fields = s1.fields()
    assert fields["left"] == [1] and fields["n_left"] == 1 and fields["activated"] == [3]
    assert fields["ends_job"] is None


def test_the_summarys_fields_stay_short_at_scale() -> None:
    n = 16384
    d0 = on_the_wire(decide(DEFAULT, initial_membership(n), set(), [], 0, 0))
    lost = set(range(0, n, 2))
    d1 = on_the_wire(decide(DEFAULT, d0.membership, lost, [], 1, 0))
    fields = DecisionSummary.of(d0.membership, d1).fields()
    assert fields["n_left"] == n // 2 and len(fields["left"]) == 32
    assert fields["stayed_active"] == n // 2
    last = RecoveryPlan.for_rank(d0.membership, d1, n - 1)
    assert (last.old_rank, last.new_rank) == (n - 1, n // 2 - 1)


def test_a_rank_outside_the_membership_is_an_internal_error() -> None:
    (d0,) = decisions(DEFAULT, 4)
    with pytest.raises(InternalError, match="initial rank 4 is not in a membership of 4 ranks"):
        RecoveryPlan.for_rank(None, d0, 4)
    with pytest.raises(InternalError, match="initial world size changed from 3 to 4"):
        RecoveryPlan.for_rank(Membership.all_active(3), d0, 0)
