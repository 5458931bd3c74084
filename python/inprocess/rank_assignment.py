"""Rank assignment: the membership of the next iteration, decided by one leader.

Unlike ``nvidia_resiliency_ext.inprocess``, where each rank runs the assignment
on its own view, here the last rank to arrive at the restart barrier runs it
once for the whole job and publishes the result, which every rank reads
(design principle 3). A :class:`RankAssignment` therefore maps a whole
:class:`~inprocess.control.membership.Membership` to the next one. The built-in
classes keep that library's names and meaning, so configurations carry over;
a custom subclass must be ported to the whole-table interface.

Per-rank facts that an assignment needs (a node name, a rack) are gathered
once at the initial barrier from :meth:`RankAssignment.local_keys` and handed
to the leader in :attr:`RankAssignmentCtx.topology`.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

from .compose import Compose, leaves
from .control.membership import ACTIVE, NONE, TERMINATED, Membership
from .exception import RankDiscarded

__all__ = [
    "RankAssignment",
    "RankAssignmentCtx",
    "Topology",
    "RankDiscarded",
    "ActivateAllRanks",
    "ShiftRanks",
    "FillGaps",
    "MaxActiveWorldSize",
    "ActiveWorldSizeDivisibleBy",
    "FilterCountGroupedByKey",
    "Layer",
    "LayerFlag",
    "Tree",
]


class Topology:
    """Per-rank keys gathered at the initial barrier, one column per owner.

    ``keys(owner)[initial_rank]`` is the tuple that ``owner.local_keys``
    returned on that rank. Owners are identified by their position among the
    key-gathering leaves of the rank assignment, which is the same on every
    rank because every rank builds the same ``Wrapper``.
    """

    def __init__(self, owners: Sequence[Any], columns: Sequence[list[tuple[str, ...]]]):
        self._column_of = {id(o): i for i, o in enumerate(owners)}
        self._columns = list(columns)

    @classmethod
    def empty(cls) -> "Topology":
        return cls((), ())

    def keys(self, owner: Any) -> list[tuple[str, ...]]:
        try:
            return self._columns[self._column_of[id(owner)]]
        except KeyError:
            raise KeyError(f"{owner!r} gathered no keys: it defines no local_keys()") from None


@dataclasses.dataclass
class RankAssignmentCtx:
    """What a :class:`RankAssignment` reads and transforms.

    ``membership`` starts as the previous iteration's table with
    ``terminated_ranks`` (initial ranks lost in this restart) already marked
    TERMINATED. An assignment may terminate more ranks (it adds them to
    ``terminated_ranks``), deactivate or activate ranks and renumber them.
    """

    membership: Membership
    terminated_ranks: set[int]
    iteration: int
    topology: Topology = dataclasses.field(default_factory=Topology.empty)
    # The table of the iteration that ended, untouched (read-only): who held
    # which rank before this restart.
    previous: Optional[Membership] = None


class RankAssignment(abc.ABC):
    """Base class of the ``rank_assignment`` hook."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError

    # Subclasses that group ranks by a per-rank fact override this; it runs on
    # every rank at the initial barrier with (initial_rank, initial_world_size).
    local_keys: Optional[Callable[[int, int], tuple[str, ...]]] = None


def key_gathering_leaves(rank_assignment: Any) -> list[Any]:
    return [leaf for leaf in leaves(rank_assignment) if getattr(leaf, "local_keys", None) is not None]


def check_rank_assignment(value: Any) -> None:
    for leaf in leaves(value):
        if not isinstance(leaf, RankAssignment):
            raise ValueError(
                f"rank_assignment contains {leaf!r} ({type(leaf).__name__}): expected "
                f"inprocess.rank_assignment.RankAssignment instances (optionally inside Compose)"
            )
    if value is None:
        raise ValueError("rank_assignment=None: expected a RankAssignment, e.g. ShiftRanks()")
    from .tree import check_composition

    check_composition(value)


def _renumber(membership: Membership, order: list[int], column: list[int]) -> None:
    for new, r in enumerate(order):
        column[r] = new


class ActivateAllRanks(RankAssignment):
    """Every rank still in the job becomes active, with ``active_rank = rank``."""

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        m = ctx.membership
        for r, mode in enumerate(m.mode):
            if mode != TERMINATED:
                m.mode[r] = ACTIVE
                m.active_rank[r] = m.rank[r]
        return ctx


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
        for r, gap in zip(movers, gaps):
            column[r] = gap

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        m = ctx.membership
        self._fill([r for r, mode in enumerate(m.mode) if mode != TERMINATED], m.rank)
        self._fill([r for r, mode in enumerate(m.mode) if mode == ACTIVE], m.active_rank)
        return ctx


class MaxActiveWorldSize(RankAssignment):
    """At most ``max_active_world_size`` active ranks; the highest become spares."""

    def __init__(self, max_active_world_size: Optional[int] = None):
        if max_active_world_size is not None and (
            not isinstance(max_active_world_size, int) or isinstance(max_active_world_size, bool)
            or max_active_world_size < 1
        ):
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
        if not isinstance(divisor, int) or isinstance(divisor, bool) or divisor < 1:
            raise ValueError(f"divisor={divisor!r}: expected a positive int")
        self.divisor = divisor

    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        m = ctx.membership
        keep = m.active_world_size - m.active_world_size % self.divisor
        for r, mode in enumerate(m.mode):
            if mode == ACTIVE and m.active_rank[r] >= keep:
                m.deactivate(r)
        return ctx


def run_assignment(
    rank_assignment: Union[RankAssignment, Compose],
    previous: Membership,
    terminated: set[int],
    iteration: int,
    topology: Topology,
) -> tuple[Membership, set[int]]:
    """Apply the hook to a copy of ``previous`` and check the result.

    Returns the new table and every rank terminated in this restart (those
    reported plus those the assignment terminated itself).
    """
    membership = previous.copy()
    membership.terminate(terminated)
    ctx = RankAssignmentCtx(membership, set(terminated), iteration, topology, previous)
    out = rank_assignment(ctx)
    if out is not None:
        ctx = out
    newly = {r for r, mode in enumerate(ctx.membership.mode) if mode == TERMINATED and previous.mode[r] != TERMINATED}
    ctx.membership.validate(previous, newly)
    return ctx.membership, newly


from .tree import FilterCountGroupedByKey, Layer, LayerFlag, Tree  # noqa: E402
