"""Shard planning (inprocess.peer_state.planning): who sends which shard after a restart, and
what a restore says when some shard is gone. Pure functions of the table every rank holds."""

from __future__ import annotations

from inprocess.peer_state.planning import plan_shards, replicated_plan, routes, sharded_plan

NONE = (-1, -1)


def test_a_lost_shard_is_named_and_a_shard_held_at_an_older_step_is_not() -> None:
    """Two partners (ranks 1 and 2, distance 1: rank r keeps shard r+1's copy) killed right after
    commit 33: rank 0's copy of shard 1 is of step 32 (the exchange of 33 had not reached it);
    shard 2 and its only copy are gone. Only shard 2 is lost: shard 1 is held, at step 32."""
    table = [
        [(0, 33), (0, 32), (1, 32), (1, 31)],  # rank 0: its own shard, rank 1's copy one commit behind
        [NONE] * 4,  # the spares that took the dead ranks' places
        [NONE] * 4,
        [(3, 33), (3, 32), (0, 33), (0, 32)],  # rank 3 keeps rank 0's copy
    ]
    said = plan_shards(table, 4)
    assert isinstance(said, str)
    assert said.startswith("shard(s) 2 lost with their copies"), said
    assert "1," not in said and "shard(s) 1" not in said, said


def test_every_shard_held_but_at_no_common_step_names_the_steps_each_has() -> None:
    table = [[(0, 33), (0, 32), (1, 31), NONE], [NONE] * 4, [(2, 33), (2, 32), (0, 33), NONE]]
    said = plan_shards(table, 3)
    assert isinstance(said, str)
    assert "no step has every shard" in said and "shard 1 at step 31" in said, said


def test_the_newest_complete_step_and_its_sources() -> None:
    table = [[(0, 33), (0, 32), (1, 33), (1, 32)], [NONE] * 4, [(2, 33), (2, 32), (0, 33), (0, 32)]]
    assert plan_shards(table, 3) == (33, [0, 0, 2])
    assert plan_shards([[NONE] * 4] * 2, 2) == "no rank holds a committed shard (none committed yet, or every " \
                                               "holder lost)"


def test_replicated_the_newest_step_every_group_holds_and_the_routes_within_a_group() -> None:
    """Rows [group key, step, step] by global rank; 2 x 2 layout, data-parallel groups keyed 0 ({0, 2})
    and 1 ({1, 3}). Group 1 has no rank holding step 7: every group resumes at 6."""
    rows = [[0, 7, 6], [1, -1, -1], [0, 7, 6], [1, 6, 5]]
    assert replicated_plan(rows, [0, 2]) == (6, [])  # both hold 6: nothing to send
    assert replicated_plan(rows, [1, 3]) == (6, [(1, (0,))])  # group rank 1 (global 3) sends to group rank 0
    assert replicated_plan([[0, -1, -1], [1, 6, 5]], [0]) is None  # group 0 holds nothing: nobody resumes


def test_routes_share_the_receivers_among_the_holders() -> None:
    assert routes([0], [1, 2, 3]) == [(0, (1, 2, 3))]
    assert routes([0, 4], [1, 2, 3, 5, 6]) == [(0, (1, 3, 6)), (4, (2, 5))]
    assert routes([0, 1, 2], [3]) == [(0, (3,))]
    assert routes([0], []) == []


def test_sharded_groups_resume_at_a_step_every_group_holds_whole() -> None:
    """Rows [key, size, (shard, step) x 4]; group 0 (global 0, 2) holds every shard at 5 and 4, group 1
    (global 1, 3) at 4 only (its rank 0 lost its shard of 5; its copy is one commit behind)."""
    rows = [[0, 2, 0, 5, 0, 4, 1, 5, 1, 4], [1, 2, -1, -1, -1, -1, -1, -1, -1, -1],
            [0, 2, 1, 5, 1, 4, 0, 5, 0, 4], [1, 2, 1, 5, 1, 4, 0, 4, -1, -1]]
    assert sharded_plan(rows, [0, 2]) == (4, [0, 1])
    assert sharded_plan(rows, [1, 3]) == (4, [1, 1])  # group rank 1 holds shard 0's copy of step 4: it sends
    lost = [rows[0], [1, 2] + [-1] * 8, rows[2], [1, 2, 1, 5, 1, 4, -1, -1, -1, -1]]
    assert sharded_plan(lost, [1, 3]) == "shard(s) 0 lost with their copies (no rank holds them at any step)"
    assert sharded_plan(lost, [0, 2]).startswith("another group lacks a shard of every step this group holds")
