"""Who keeps whose copy, and who sends which shard: pure functions of tables every rank holds alike."""

from __future__ import annotations

import os
import socket
from typing import List, Optional, Sequence, Tuple, Union

Held = List[Tuple[int, int]]  # a rank's (shard, step) pairs: its own snapshots, then its copies; (-1, -1): none


def node_key() -> str:
    """This process's node, as the launchers say it: torchrun's and inprocess.launch's
    ``GROUP_RANK``, else SLURM's ``SLURM_NODEID``, else the host name."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(name, "") != "":
            return f"{name}={os.environ[name]}"
    return f"host={socket.gethostname()}"


def partners(nodes: List[int], distance: Optional[int] = None) -> List[int]:
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


def held_table(rows: Sequence[Sequence[int]]) -> List[Held]:
    """Every rank's row of flattened (shard, step) pairs, as pairs."""
    return [[(row[i], row[i + 1]) for i in range(0, len(row), 2)] for row in rows]


def plan_shards(table: Sequence[Held], world: int) -> Union[Tuple[int, List[int]], str]:
    """The newest step at which every shard 0..world-1 is held, and who sends each
    (the shard's own rank where it holds it); else why not, in one line."""
    steps = sorted({step for row in table for shard, step in row if step >= 0}, reverse=True)
    if not steps:
        return "no rank holds a committed shard (none committed yet, or every holder lost)"
    for step in steps:
        sources = []
        for shard in range(world):
            holders = [r for r, row in enumerate(table) if (shard, step) in row]
            if not holders:
                break
            sources.append(shard if shard in holders else holders[0])
        else:
            return step, sources
    return _why_no_step(table, world)


def _why_no_step(table: Sequence[Held], world: int) -> str:
    """The shards held at no step (lost with their copies), else each shard's steps."""
    steps_of = {shard: sorted({step for row in table for s, step in row if s == shard and step >= 0}, reverse=True)
                for shard in range(world)}
    lost = [shard for shard, steps in steps_of.items() if not steps]
    if lost:
        return f"shard(s) {', '.join(map(str, lost))} lost with their copies (no rank holds them at any step)"
    held = [f"shard {shard} at step {', '.join(map(str, steps))}" for shard, steps in steps_of.items()]
    return f"no step has every shard ({'; '.join(held[:8])}{'; ...' if len(held) > 8 else ''})"
