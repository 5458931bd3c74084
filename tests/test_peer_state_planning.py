"""Shard planning (inprocess.peer_state.planning): who sends which shard after a restart, and
what a restore says when some shard is gone. Pure functions of the table every rank holds."""

from __future__ import annotations

from inprocess.peer_state.planning import plan_shards

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
