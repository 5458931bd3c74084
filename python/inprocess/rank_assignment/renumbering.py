"""Renumbering assignments: :class:`ShiftRanks` and :class:`FillGaps` remove the ranks that
leave and close the gaps in ``rank``.

As there, they renumber ``rank`` and ``world_size`` only: ``active_rank``,
``active_world_size`` and the mode are left for an activation step
(``ActivateAllRanks``, ``MaxActiveWorldSize``, ``ActiveWorldSizeDivisibleBy``)
to set from the new ranks, which therefore runs after them (it comes first in
``Compose``). A rank that is itself in ``terminated_ranks`` is discarded
(:class:`~inprocess.exception.RankDiscarded`).
"""

from __future__ import annotations

import bisect

from ..control.membership import TERMINATED, Membership
from ..exception import RankDiscarded
from .base import JobAssignmentCtx, RankAssignmentCtx, replace_state
from .job import JobAssignment


def _leaving(ctx: RankAssignmentCtx) -> list[int]:
    """The ranks that leave, in order; RankDiscarded when this rank is one of them."""
    if ctx.state.rank in ctx.terminated_ranks:
        raise RankDiscarded(
            f"rank {ctx.state.rank} (initial rank {ctx.state.initial_rank}) is among the "
            f"{len(ctx.terminated_ranks)} terminated_ranks"
        )
    return _sorted(ctx.terminated_ranks)


def _renumbered(ctx: RankAssignmentCtx, rank: int, world_size: int) -> RankAssignmentCtx:
    """`ctx` with this rank's new number and world size, the leaving ranks gone."""
    ctx.state = replace_state(ctx.state, rank=rank, world_size=world_size)
    ctx.terminated_ranks = set()
    return ctx


_last_sorted: tuple[frozenset[int], list[int]] = (frozenset(), [])


def _sorted(ranks: set[int]) -> list[int]:
    """``sorted(ranks)``, kept for the next call: the leader passes every rank the same set."""
    global _last_sorted
    key = frozenset(ranks)
    last = _last_sorted
    if last[0] == key:
        return last[1]
    ordered = sorted(key)
    _last_sorted = (key, ordered)
    return ordered


def _remove_leaving(ctx: JobAssignmentCtx) -> Membership:
    m = ctx.membership
    m.terminate(ctx.terminated_ranks)
    ctx.terminated_ranks = set()
    return m


class ShiftRanks(JobAssignment):
    """Close the gaps left by the ranks that leave by shifting every later rank down.

    Relative order is kept; every rank after the first gap is renumbered::

        ranks 0 X 2 3 X X 6 7  ->  0 2 3 6 7   (2->1, 3->2, 6->3, 7->4)
    """

    def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx:
        m = _remove_leaving(ctx)
        alive = [r for r, mode in enumerate(m.mode) if mode != TERMINATED]
        alive.sort(key=m.rank.__getitem__)
        for new, r in enumerate(alive):
            m.rank[r] = new
        return ctx

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        leaving = _leaving(ctx)
        state = ctx.state
        return _renumbered(ctx, state.rank - bisect.bisect_left(leaving, state.rank), state.world_size - len(leaving))


class FillGaps(JobAssignment):
    """Fill each gap with one of the highest ranks; every other rank keeps its number.

    With W ranks left, every rank below W keeps its number; the ranks at or
    above W move, lowest first, into the gaps below W, lowest gap first::

        ranks 0 X 2 3 X X 6 7  ->  0 6 2 3 7   (6->1, 7->4)

    This is the documented behaviour there; its code moves a rank past the
    new world size when a rank at or above W leaves too (here it never does).
    """

    def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx:
        m = _remove_leaving(ctx)
        alive = [r for r, mode in enumerate(m.mode) if mode != TERMINATED]
        w = len(alive)
        held = [False] * w
        for r in alive:
            if m.rank[r] < w:
                held[m.rank[r]] = True
        movers = sorted((r for r in alive if m.rank[r] >= w), key=m.rank.__getitem__)
        gaps = [v for v in range(w) if not held[v]]
        for r, gap in zip(movers, gaps, strict=True):  # as many movers as gaps
            m.rank[r] = gap
        return ctx

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        leaving = _leaving(ctx)
        state = ctx.state
        w = state.world_size - len(leaving)
        rank = state.rank
        if rank >= w:
            # Movers are the remaining ranks at or above w, lowest first; gaps the leaving ranks below w.
            below = bisect.bisect_left(leaving, w)
            mover_index = (rank - w) - (bisect.bisect_left(leaving, rank) - below)
            rank = leaving[mover_index]
        return _renumbered(ctx, rank, w)
