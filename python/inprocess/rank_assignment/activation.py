"""Activation assignments: who of the ranks in the job runs the function, and who is a spare."""

from __future__ import annotations

from typing import Optional

from ..control.membership import ACTIVE, TERMINATED
from .base import RankAssignment, RankAssignmentCtx, is_int


class ActivateAllRanks(RankAssignment):
    """Every rank still in the job becomes active, with ``active_rank = rank``."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        m = ctx.membership
        for r, mode in enumerate(m.mode):
            if mode != TERMINATED:
                m.mode[r] = ACTIVE
                m.active_rank[r] = m.rank[r]
        return ctx


class MaxActiveWorldSize(RankAssignment):
    """At most ``max_active_world_size`` active ranks; the highest become spares."""

    def __init__(self, max_active_world_size: Optional[int] = None):
        if max_active_world_size is not None and not (is_int(max_active_world_size) and max_active_world_size >= 1):
            raise ValueError(f"max_active_world_size={max_active_world_size!r}: expected a positive int or None")
        self.max_active_world_size = max_active_world_size

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        limit = self.max_active_world_size
        if limit is None:
            return ctx
        m = ctx.membership
        for r, mode in enumerate(m.mode):
            if mode == ACTIVE and m.active_rank[r] >= limit:
                m.deactivate(r)
        return ctx


class ActiveWorldSizeDivisibleBy(RankAssignment):
    """Keep the active world size a multiple of ``divisor``; the highest extra become spares."""

    def __init__(self, divisor: int = 1):
        if not (is_int(divisor) and divisor >= 1):
            raise ValueError(f"divisor={divisor!r}: expected a positive int")
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        m = ctx.membership
        keep = m.active_world_size - m.active_world_size % self.divisor
        for r, mode in enumerate(m.mode):
            if mode == ACTIVE and m.active_rank[r] >= keep:
                m.deactivate(r)
        return ctx
