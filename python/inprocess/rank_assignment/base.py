"""The base of every rank assignment: the hook, its context, and the keys gathered for it.

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
from typing import Any, Callable, Optional, Sequence, TypeGuard

from ..compose import leaves
from ..control.membership import Membership


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


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (configuration values are checked with it)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(value: object, name: str, minimum: int = 1) -> int:
    """``value`` if it is an int >= ``minimum``; else ``ValueError`` naming it."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return value
