"""Job-wide rank assignment: one step over the whole membership table.

A :class:`JobAssignment` implements ``assign_job(ctx)`` over a
:class:`~inprocess.rank_assignment.base.JobAssignmentCtx`. The leader runs a
composition of job-wide steps once per restart, O(world size) in all, and
publishes the table. It is also a :class:`RankAssignment`: called per rank
(``assignment(RankAssignmentCtx(state, store, terminated_ranks))``) it gives
that rank's row of the same decision. The built-in assignments compute that
row from the rank's own state where they can, as there; inside the Wrapper's
evaluation of a per-rank composition, :func:`job_step_for_rank` reads it from
the job-wide step on the agreed inputs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from ..control.membership import NONE, TERMINATED
from ..exception import RankDiscarded
from ..state import FrozenState, Mode
from .agreed import current as current_agreed
from .agreed import describe_row, row_of
from .base import JobAssignmentCtx, RankAssignment, RankAssignmentCtx, replace_state


class JobAssignment(RankAssignment):
    """A rank assignment that decides for the whole job at once (see the module docstring).

    Subclasses implement :meth:`assign_job`. One that groups ranks by a
    per-rank fact also defines ``local_keys(state) -> tuple[str, ...]``: it
    runs on every rank at the initial barrier, and the leader reads the
    results from ``ctx.topology``.
    """

    local_keys: Callable[[FrozenState], tuple[str, ...]] | None = None

    @abc.abstractmethod
    def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx | None:
        """Transform ``ctx`` (in place, or return a new one)."""
        raise NotImplementedError

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        if current_agreed() is None:
            return self._call_through_store(ctx)
        return job_step_for_rank(self, ctx)

    def _call_through_store(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """Called per rank outside the Wrapper (no agreed inputs): an assignment that can gather what
        it needs through ``ctx.store`` overrides this; by default a TypeError that says so."""
        return job_step_for_rank(self, ctx)


def job_step_for_rank(assignment: JobAssignment, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
    """``assignment``'s job-wide step on the agreed inputs, seen from the rank of ``ctx``.

    The step reads the whole previous decision, so the rank's state must still
    be as that decision left it: a composition that changes states before it
    is refused with the rank and the change.
    """
    inputs = current_agreed()
    if inputs is None:
        raise TypeError(
            f"{assignment!r} decides for the whole job: called per rank it needs the agreed inputs of a "
            f"decision, which inprocess.Wrapper provides; outside it, call assign_job() on a JobAssignmentCtx"
        )
    i = ctx.state.initial_rank
    arrived = row_of(ctx.state)
    expected = inputs.row(i)
    if arrived != expected:
        raise ValueError(
            f"{assignment!r} decides on the table as the previous decision left it, but initial rank {i} arrives "
            f"as {describe_row(arrived)} instead of {describe_row(expected)}: something ran before "
            f"it and changed the rank's state; place it so that it runs first (last in Compose)"
        )
    result = inputs.job_result(assignment, inputs.initial_ranks(ctx.terminated_ranks))
    return rank_view(result.ctx, ctx, result.world_size, result.leaving_ranks)


def rank_view(
    result: JobAssignmentCtx,
    ctx: RankAssignmentCtx,
    world_size: int | None = None,
    leaving_ranks: frozenset[int] | None = None,
) -> RankAssignmentCtx:
    """The rank of ``ctx`` in a job-wide result: its next state, and the ranks still leaving.

    Raises :class:`RankDiscarded` if the result terminated the rank, as the
    per-rank assignments there do.
    """
    m = result.membership
    i = ctx.state.initial_rank
    if m.mode[i] == TERMINATED:
        raise RankDiscarded(f"initial rank {i} (rank {ctx.state.rank}) was terminated by the rank assignment")
    ctx.state = replace_state(
        ctx.state,
        rank=m.rank[i],
        world_size=m.world_size if world_size is None else world_size,
        active_rank=None if m.active_rank[i] == NONE else m.active_rank[i],
        active_world_size=result.active_world_size,
        mode=Mode(m.mode[i]),
    )
    if leaving_ranks is None:
        leaving_ranks = frozenset(m.rank[r] for r in result.terminated_ranks)
    ctx.terminated_ranks = set(leaving_ranks)
    return ctx


def is_job_wide(leaf: Any) -> bool:
    """True for a job-wide step: a :class:`JobAssignment` whose ``__call__`` is not overridden below
    the class that implements ``assign_job`` (a subclass that overrides it is a per-rank hook)."""
    if not isinstance(leaf, JobAssignment):
        return False
    mro = type(leaf).__mro__
    call_owner = next(c for c in mro if "__call__" in c.__dict__)
    assign_owner = next(c for c in mro if "assign_job" in c.__dict__)
    return not (call_owner is not assign_owner and issubclass(call_owner, assign_owner))
