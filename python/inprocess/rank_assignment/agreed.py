"""The agreed inputs of one decision, and the per-rank view of the membership table.

Per-rank hooks run on inputs every rank agrees on: the previous decision
(every rank read the same one) and the set of ranks leaving at this restart.
:class:`AgreedInputs` holds them while the hook runs, on the leader for every
rank and on each rank for itself; a job-wide step inside a per-rank
composition (``Tree``, ``FilterCountGroupedByKey``) reads the whole job from
it instead of gathering it through the store.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from ..control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from ..state import Mode, State
from .base import JobAssignmentCtx, Topology


class JobStep(Protocol):
    """What the agreed inputs run of a :class:`~inprocess.rank_assignment.job.JobAssignment`: its job-wide step."""

    def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx | None: ...

_current: contextvars.ContextVar[AgreedInputs | None] = contextvars.ContextVar(
    "inprocess_rank_assignment_agreed", default=None
)


def initial_membership(initial_world_size: int) -> Membership:
    """The table before the first decision: every rank INITIALIZED, holding its initial rank."""
    n = initial_world_size
    return Membership([int(Mode.INITIALIZED)] * n, list(range(n)), [NONE] * n)


def assigned_active_world_size(m: Membership) -> int | None:
    """The active world size every rank's state carries after decision ``m``; None before the first."""
    if not any(mode in (ACTIVE, INACTIVE) for mode in m.mode):
        return None
    return m.active_world_size


def state_of(m: Membership, active_world_size: int | None, initial_rank: int, iteration: int,
             fn_exception: BaseException | None = None, world_size: int | None = None) -> State:
    """Initial rank ``initial_rank``'s :class:`State` as the table ``m`` describes it
    (``world_size``: ``m.world_size``, when the caller has counted it already)."""
    r = initial_rank
    return State(
        rank=m.rank[r],
        world_size=m.world_size if world_size is None else world_size,
        active_rank=None if m.active_rank[r] == NONE else m.active_rank[r],
        active_world_size=active_world_size,
        initial_rank=r,
        initial_world_size=m.initial_world_size,
        iteration=iteration,
        mode=Mode(m.mode[r]),
        fn_exception=fn_exception,
    )


def row_of(state: Any) -> tuple[int, int, int, int, int | None]:
    """(mode, rank, active rank, world size, active world size) of a state, comparable with a table row."""
    return (
        int(state.mode),
        NONE if state.rank is None else int(state.rank),
        NONE if state.active_rank is None else int(state.active_rank),
        int(state.world_size),
        None if state.active_world_size is None else int(state.active_world_size),
    )


def table_row(m: Membership, active_world_size: int | None, initial_rank: int,
              world_size: int | None = None) -> tuple[int, int, int, int, int | None]:
    r = initial_rank
    return (m.mode[r], m.rank[r], m.active_rank[r], m.world_size if world_size is None else world_size,
            active_world_size)


def describe_row(row: tuple[int, int, int, int, int | None]) -> str:
    mode, rank, act, ws, aws = row
    if mode == TERMINATED:
        return "TERMINATED"
    shown_act = "None" if act == NONE else act
    return f"{Mode(mode).name} rank={rank}/{ws} active_rank={shown_act}/{aws}"


@dataclasses.dataclass(frozen=True)
class JobResult:
    """A job-wide step's result on the agreed inputs, with what every rank reads of it computed once."""

    ctx: JobAssignmentCtx
    world_size: int
    leaving_ranks: frozenset[int]  # the ranks (numbered by rank) still leaving after the step


class AgreedInputs:
    """The previous decision and the topology, the same on every rank, for one decision.

    ``iteration`` is the decision's (0: the first); ``hook_iteration`` the
    iteration number a per-rank hook sees in ``ctx.state`` (the one that
    ended, as there).
    """

    def __init__(
        self,
        previous: Membership,
        iteration: int,
        hook_iteration: int,
        topology: Callable[[], Topology],
    ):
        self.previous = previous
        self.world_size = previous.world_size  # counted once: every rank's state carries it
        self.active_world_size = assigned_active_world_size(previous)
        self.iteration = iteration
        self.hook_iteration = hook_iteration
        self._topology_source = topology
        self._topology: Topology | None = None
        self._initial_of_rank: dict[int, int] | None = None
        self._initial_of_set: dict[frozenset[int], frozenset[int]] = {}
        self._results: dict[tuple[int, frozenset[int]], JobResult] = {}

    @contextlib.contextmanager
    def active(self) -> Iterator[AgreedInputs]:
        """Per-rank hooks called inside the block read these inputs (see :func:`current`)."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            self._topology = self._topology_source()
        return self._topology

    def state_of(self, initial_rank: int, fn_exception: BaseException | None = None) -> State:
        return state_of(self.previous, self.active_world_size, initial_rank, self.hook_iteration, fn_exception,
                        self.world_size)

    def row(self, initial_rank: int) -> tuple[int, int, int, int, int | None]:
        """The rank's row in the previous decision, as :func:`row_of` gives it for a state."""
        return table_row(self.previous, self.active_world_size, initial_rank, self.world_size)

    def initial_ranks(self, ranks: set[int]) -> set[int]:
        """The initial ranks that held ``ranks`` (numbered by ``State.rank``) in the previous decision."""
        if self._initial_of_rank is None:
            p = self.previous
            self._initial_of_rank = {p.rank[r]: r for r in range(p.initial_world_size) if p.mode[r] != TERMINATED}
        # Every rank the leader evaluates passes the same set: convert it once.
        key = frozenset(ranks)
        known = self._initial_of_set.get(key)
        if known is not None:
            return set(known)
        try:
            found = {self._initial_of_rank[rank] for rank in ranks}
            self._initial_of_set[key] = frozenset(found)
            return found
        except KeyError as e:
            raise ValueError(
                f"terminated_ranks={sorted(ranks)} names rank {e.args[0]}, which no rank held in the previous "
                f"decision (ranks 0..{len(self._initial_of_rank) - 1})"
            ) from None

    def job_result(self, assignment: JobStep, leaving: set[int]) -> JobResult:
        """``assignment``'s job-wide step on the previous decision with ``leaving`` (initial ranks) pending.

        Computed once per (assignment, leaving) and shared by every rank the
        leader evaluates: a step over the whole table is O(world size).
        """
        key = (id(assignment), frozenset(leaving))
        result = self._results.get(key)
        if result is None:
            ctx = JobAssignmentCtx(
                self.previous.copy(), set(leaving), self.active_world_size, self.iteration, self.topology,
                self.previous,
            )
            done = assignment.assign_job(ctx) or ctx
            m = done.membership
            result = self._results[key] = JobResult(
                done, m.world_size, frozenset(m.rank[r] for r in done.terminated_ranks)
            )
        return result


def current() -> AgreedInputs | None:
    """The agreed inputs of the decision being made in this thread, or None outside one."""
    return _current.get()
