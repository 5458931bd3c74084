"""Renumbering assignments: :class:`ShiftRanks` and :class:`FillGaps` close the gaps of lost ranks."""

from __future__ import annotations

from ..control.membership import ACTIVE, NONE, TERMINATED, Membership
from .base import RankAssignment, RankAssignmentCtx


def _renumber(membership: Membership, order: list[int], column: list[int]) -> None:
    for new, r in enumerate(order):
        column[r] = new


class ShiftRanks(RankAssignment):
    """Close the gaps left by terminated ranks by shifting later ranks down.

    Relative order is kept; every rank after the first gap is renumbered. Both
    numberings shift: ``rank`` among ranks in the job and ``active_rank``
    among active ranks.
    """

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        m = ctx.membership
        alive = [r for r, mode in enumerate(m.mode) if mode != TERMINATED and m.rank[r] != NONE]
        alive.sort(key=m.rank.__getitem__)
        # Ranks that never had a rank (a corrupted table) would be lost here: validate() catches that.
        _renumber(m, alive, m.rank)
        active = [r for r, mode in enumerate(m.mode) if mode == ACTIVE]
        active.sort(key=lambda r: (m.active_rank[r] == NONE, m.active_rank[r], m.rank[r]))
        _renumber(m, active, m.active_rank)
        return ctx


class FillGaps(RankAssignment):
    """Fill each gap with one of the highest ranks; all other ranks keep theirs.

    With W ranks left, every rank below W keeps its number; the ranks at or
    above W move, lowest first, into the gaps below W, lowest gap first. The
    same rule applies to ``active_rank`` among active ranks.
    """

    @staticmethod
    def _fill(members: list[int], column: list[int]) -> None:
        count = len(members)
        taken = [False] * count
        movers = []
        for r in members:
            c = column[r]
            if c != NONE and 0 <= c < count and not taken[c]:
                taken[c] = True
            else:
                movers.append(r)
        movers.sort(key=lambda r: (column[r] == NONE, column[r]))
        gaps = (i for i, t in enumerate(taken) if not t)
        for r, gap in zip(movers, gaps, strict=True):  # as many movers as free places
            column[r] = gap

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        m = ctx.membership
        self._fill([r for r, mode in enumerate(m.mode) if mode != TERMINATED], m.rank)
        self._fill([r for r, mode in enumerate(m.mode) if mode == ACTIVE], m.active_rank)
        return ctx
