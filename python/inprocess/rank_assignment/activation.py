"""Activation assignments: who of the ranks in the job runs the function, and who is a spare.

As there, each sets the mode, ``active_rank`` and ``active_world_size`` from
``rank`` and ``world_size``: the ranks numbered below the active world size
are active with ``active_rank = rank``, the others are spares. They run after
the renumbering step (they come first in ``Compose``). ``MaxActiveWorldSize``
and ``ActiveWorldSizeDivisibleBy`` start from the previous active world size,
so a spare takes the place of an active rank that left as long as the job
still has enough ranks.
"""

from __future__ import annotations

from ..control.membership import ACTIVE, INACTIVE, NONE, TERMINATED
from ..state import Mode, State
from .base import JobAssignmentCtx, RankAssignmentCtx, RankFilter, is_int, replace_state
from .job import JobAssignment


def _activate_below(ctx: JobAssignmentCtx, active_world_size: int) -> JobAssignmentCtx:
    m = ctx.membership
    for r, mode in enumerate(m.mode):
        if mode == TERMINATED:
            continue
        if m.rank[r] < active_world_size:
            m.mode[r] = ACTIVE
            m.active_rank[r] = m.rank[r]
        else:
            m.mode[r] = INACTIVE
            m.active_rank[r] = NONE
    ctx.active_world_size = active_world_size
    return ctx


def _state_below(state: State, active_world_size: int) -> State:
    active = state.rank < active_world_size
    return replace_state(
        state,
        mode=Mode.ACTIVE if active else Mode.INACTIVE,
        active_rank=state.rank if active else None,
        active_world_size=active_world_size,
    )


def _bounded(previous: int | None, world_size: int) -> int:
    """The previous active world size, never above the world size; the world size before the first."""
    return world_size if previous is None else min(previous, world_size)


class ActivateAllRanks(JobAssignment, RankFilter):
    """Every rank still in the job becomes active, with ``active_rank = rank``."""

    def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx:
        return _activate_below(ctx, ctx.membership.world_size)

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        ctx.state = _state_below(ctx.state, ctx.state.world_size)
        return ctx


class _ActiveSize(JobAssignment, RankFilter):
    """The ranks below an active world size are active, the others spares; the size is the
    subclass's (:meth:`_size`, from the previous active world size and the world size)."""

    def _size(self, previous: int | None, world_size: int) -> int:
        raise NotImplementedError

    def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx:
        return _activate_below(ctx, self._size(ctx.active_world_size, ctx.membership.world_size))

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        state = ctx.state
        ctx.state = _state_below(state, self._size(state.active_world_size, state.world_size))
        return ctx


class MaxActiveWorldSize(_ActiveSize):
    """At most ``max_active_world_size`` active ranks (no limit if None).

    The active world size is the previous one (the world size before the
    first decision), at most the world size and at most the limit.
    """

    def __init__(self, max_active_world_size: int | None = None):
        if max_active_world_size is not None and not (is_int(max_active_world_size) and max_active_world_size >= 1):
            raise ValueError(f"max_active_world_size={max_active_world_size!r}: expected a positive int or None")
        self.max_active_world_size = max_active_world_size

    def __repr__(self) -> str:
        return f"MaxActiveWorldSize({self.max_active_world_size!r})"

    def _size(self, previous: int | None, world_size: int) -> int:
        size = _bounded(previous, world_size)
        return size if self.max_active_world_size is None else min(size, self.max_active_world_size)


class ActiveWorldSizeDivisibleBy(_ActiveSize):
    """The active world size rounded down to a multiple of ``divisor``.

    It starts from the previous active world size (the world size before the
    first decision), at most the world size.
    """

    def __init__(self, divisor: int = 1):
        if not (is_int(divisor) and divisor >= 1):
            raise ValueError(f"divisor={divisor!r}: expected a positive int")
        self.divisor = divisor

    def __repr__(self) -> str:
        return f"ActiveWorldSizeDivisibleBy({self.divisor!r})"

    def _size(self, previous: int | None, world_size: int) -> int:
        size = _bounded(previous, world_size)
        return size - size % self.divisor
