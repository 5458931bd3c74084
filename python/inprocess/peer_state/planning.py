"""Who keeps whose copy, and who sends which shard: pure functions of tables every rank holds alike."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

Held = list[tuple[int, int]]  # a rank's (shard, step) pairs: its own snapshots, then its copies; (-1, -1): none


def node_key() -> str:
    """This process's node, as the launchers say it: torchrun's and inprocess.launch's
    ``GROUP_RANK``, else SLURM's ``SLURM_NODEID``, else the host name."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(name, "") != "":
            return f"{name}={os.environ[name]}"
    return f"host={socket.gethostname()}"


def partners(nodes: list[int], distance: int | None = None) -> list[int]:
    """The partner of each rank (whose shard it keeps a copy of), from each rank's node.

    Ranks are ordered by node, then rank; each rank's partner is the rank `distance`
    places ahead in that order (default: the size of the largest node), so that no
    rank keeps the copy of a rank of its own node while no node holds more than half
    of the ranks (one node: neighbours). A permutation: every rank keeps one copy."""
    world = len(nodes)
    order = sorted(range(world), key=lambda r: (nodes[r], r))
    if distance is None:
        largest = max(nodes.count(n) for n in set(nodes))
        distance = largest if largest < world else 1
    position = {r: i for i, r in enumerate(order)}
    return [order[(position[r] + distance) % world] for r in range(world)]


Route = tuple[int, tuple[int, ...]]  # a source and the ranks it sends one snapshot to


def routes(holders: Sequence[int], receivers: Sequence[int]) -> list[Route]:
    """Each holder sends to an equal share of the receivers (in turn: the first holder the 1st,
    (h+1)-th, ... receiver), so that no holder serves more than its share; a holder without
    receivers has no route."""
    if receivers and not holders:
        raise ValueError(f"peer state: receivers {list(receivers)} and no holder")
    shares = [(holder, tuple(receivers[i::len(holders)])) for i, holder in enumerate(holders)]
    return [(holder, share) for holder, share in shares if share]


def replicated_plan(rows: Sequence[Sequence[int]], members: Sequence[int]) -> tuple[int, list[Route]] | None:
    """ReplicatedState's restore, from every rank's row ``[group key, step held, step held]``
    (-1: none) by global rank: the newest step that every group has a holder of (None: none),
    and the routes within the group of `members` (its global ranks by group rank), in group ranks."""
    held: dict[int, set[int]] = {}
    for key, *steps in rows:
        held.setdefault(key, set()).update(step for step in steps if step >= 0)
    common = set.intersection(*held.values()) if held else set()
    if not common:
        return None
    step = max(common)
    holders = [i for i, g in enumerate(members) if step in rows[g][1:]]
    receivers = [i for i, g in enumerate(members) if step not in rows[g][1:]]
    return step, routes(holders, receivers)


def held_table(rows: Sequence[Sequence[int]]) -> list[Held]:
    """Every rank's row of flattened (shard, step) pairs, as pairs."""
    return [[(row[i], row[i + 1]) for i in range(0, len(row), 2)] for row in rows]


def complete_steps(table: Sequence[Held], world: int) -> set[int]:
    """The steps at which every shard 0..world-1 is held by some rank."""
    steps = {step for row in table for _, step in row if step >= 0}
    return {step for step in steps if all(any((shard, step) in row for row in table) for shard in range(world))}


def sources_at(table: Sequence[Held], world: int, step: int) -> list[int]:
    """Who sends each shard of `step`: its own rank where it holds it, else the lowest holder."""
    sources = []
    for shard in range(world):
        holders = [r for r, row in enumerate(table) if (shard, step) in row]
        sources.append(shard if shard in holders else holders[0])
    return sources


def plan_shards(table: Sequence[Held], world: int) -> tuple[int, list[int]] | str:
    """The newest step at which every shard 0..world-1 is held, and who sends each
    (the shard's own rank where it holds it); else why not, in one line."""
    steps = complete_steps(table, world)
    if not steps:
        return why_no_step(table, world)
    step = max(steps)
    return step, sources_at(table, world, step)


def sharded_plan(rows: Sequence[Sequence[int]], members: Sequence[int]) -> tuple[int, list[int]] | str:
    """ShardedState's restore, from every rank's row ``[group key, group size, (shard, step) x 4]``
    by global rank: the newest step at which every group holds every one of its shards, and who
    sends each shard of the group of `members` (group ranks); else why not, in one line."""
    groups: dict[int, list[Held]] = {}
    sizes: dict[int, int] = {}
    for key, size, *pairs in rows:
        groups.setdefault(key, []).extend(held_table([pairs]))
        sizes[key] = size
    # a group's table in group-rank order: `members` for this rank's group; the others' order does not
    # change which steps are complete
    mine = held_table([rows[g][2:] for g in members])
    common = set.intersection(*(complete_steps(table, sizes[k]) for k, table in groups.items()))
    if not common:
        complete = complete_steps(mine, len(members))
        if not complete:
            return why_no_step(mine, len(members))
        return (f"another group lacks a shard of every step this group holds whole "
                f"({', '.join(map(str, sorted(complete, reverse=True)))})")
    step = max(common)
    return step, sources_at(mine, len(members), step)


def why_no_step(table: Sequence[Held], world: int) -> str:
    """The shards held at no step (lost with their copies), else each shard's steps."""
    if all(step < 0 for row in table for _, step in row):
        return "no rank holds a committed shard (none committed yet, or every holder lost)"
    steps_of = {shard: sorted({step for row in table for s, step in row if s == shard and step >= 0}, reverse=True)
                for shard in range(world)}
    lost = [shard for shard, steps in steps_of.items() if not steps]
    if lost:
        return f"shard(s) {', '.join(map(str, lost))} lost with their copies (no rank holds them at any step)"
    held = [f"shard {shard} at step {', '.join(map(str, steps))}" for shard, steps in steps_of.items()]
    return f"no step has every shard ({'; '.join(held[:8])}{'; ...' if len(held) > 8 else ''})"
