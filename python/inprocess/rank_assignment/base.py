"""The two kinds of rank assignment and their contexts.

* :class:`RankAssignment` is the hook as ``nvidia_resiliency_ext.inprocess``
  defines it: ``__call__(ctx)`` with a :class:`RankAssignmentCtx` holding one
  rank's ``state``, a ``store`` and the ``terminated_ranks`` (numbered by
  ``rank``); it returns the context with that rank's next state.
* :class:`~inprocess.rank_assignment.job.JobAssignment` decides for the whole
  job at once: ``assign_job(ctx)`` with a :class:`JobAssignmentCtx` holding
  every rank's row of the membership table. Every built-in assignment is one,
  and each also keeps the per-rank ``__call__`` above.

Per-rank facts that an assignment needs (a node name, a rack) are gathered
once at the initial barrier from ``local_keys(state)`` and reach the job-wide
form as :class:`Topology`.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import Any, TypeGuard, TypeVar

from ..compose import leaves
from ..control.membership import Membership
from ..state import State


@dataclasses.dataclass
class RankAssignmentCtx:
    """Inputs and outputs of a per-rank :class:`RankAssignment` (as there).

    ``state``: the rank's state; ``store``: a distributed store;
    ``terminated_ranks``: the ranks (numbered by ``State.rank``) that leave at
    this restart. An assignment returns the context with the rank's next
    ``state``; a renumbering one empties ``terminated_ranks``.
    """

    state: State
    store: Any
    terminated_ranks: set[int]


class RankAssignment(abc.ABC):
    """Base class of the ``rank_assignment`` hook: one rank's next state from its current one."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError


class RankFilter(RankAssignment):
    """Base class of the assignments that choose who is active and who is a spare (as in NVRx),
    without renumbering: in ``Compose`` they come after (run before, being listed first) the
    steps that change ranks or the world size. ``ActivateAllRanks``, ``MaxActiveWorldSize``
    and ``ActiveWorldSizeDivisibleBy`` are ones; a subclass of your own is a per-rank hook."""

    @abc.abstractmethod
    def __call__(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        raise NotImplementedError


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
    def empty(cls) -> Topology:
        return cls((), ())

    @classmethod
    def from_table(cls, owners: Sequence[Any], table: Sequence[Sequence[Sequence[str]]]) -> Topology:
        """From what every rank published: ``table[initial_rank][owner_index]`` is a list of keys."""
        return cls(owners, [[tuple(row[j]) for row in table] for j in range(len(owners))])

    def keys(self, owner: Any) -> list[tuple[str, ...]]:
        try:
            return self._columns[self._column_of[id(owner)]]
        except KeyError:
            raise KeyError(f"{owner!r} gathered no keys: it defines no local_keys()") from None


@dataclasses.dataclass
class JobAssignmentCtx:
    """What a job-wide assignment reads and transforms: the next membership of the whole job.

    ``membership`` holds every initial rank's row (mode, rank, active rank) as
    the previous steps left it; at the first decision every row is
    ``INITIALIZED`` with ``rank`` equal to the initial rank.
    ``terminated_ranks`` are the initial ranks leaving at this restart whose
    rows are still in the table: a renumbering step (``ShiftRanks``,
    ``FillGaps``, ``Tree``) terminates them and closes their gaps.
    ``active_world_size`` is the active world size every rank's state carries
    (None before the first activation); activation steps set it.
    ``previous`` is the decision of the iteration that ended, untouched.
    """

    membership: Membership
    terminated_ranks: set[int]
    active_world_size: int | None
    iteration: int
    topology: Topology = dataclasses.field(default_factory=Topology.empty)
    previous: Membership | None = None


StateT = TypeVar("StateT")


def replace_state(state: StateT, **changes: Any) -> StateT:
    """``dataclasses.replace(state, **changes)``: a new state, the input untouched.

    A plain :class:`State` is copied field by field without running its
    ``__init__`` again (the leader builds one per rank and per step), any other
    dataclass (a ``FrozenState``, a subclass) through ``dataclasses.replace``.
    """
    if type(state) is State:
        new = State.__new__(State)
        new.__dict__.update(state.__dict__)
        new.__dict__.update(changes)
        return new  # type: ignore[return-value]
    return dataclasses.replace(state, **changes)  # type: ignore[type-var]


def key_gathering_leaves(rank_assignment: Any) -> list[Any]:
    """The members of ``rank_assignment`` that need per-rank keys, in execution order."""
    return [leaf for leaf in leaves(rank_assignment) if getattr(leaf, "local_keys", None) is not None]


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (configuration values are checked with it)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: object, name: str, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``; else ``ValueError`` naming it."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return value
