"""The rules for composing rank assignments, in one place.

Composition (``Compose(a, b)(x) == a(b(x))``: the *last* argument runs first)
-----------------------------------------------------------------------------
``Tree`` decides activation and numbering for the whole job, so it must see
the table as the previous decision left it:

* ``FilterCountGroupedByKey`` goes *after* ``Tree`` in ``Compose`` (it runs
  first): it only terminates ranks, and ``Tree`` then replaces them from
  spares. ``Compose(Tree(...), FilterCountGroupedByKey(...))``. Without a
  ``Tree``, follow it with a renumbering assignment:
  ``Compose(ShiftRanks(), FilterCountGroupedByKey(...))``.
* ``MaxActiveWorldSize``, ``ActiveWorldSizeDivisibleBy`` go *before* ``Tree``
  (they run after it) and deactivate its highest active ranks, which become
  spares for later restarts. ``Compose(ActiveWorldSizeDivisibleBy(8),
  Tree(...))`` runs the same ranks with the same numbers as
  ``Tree(..., world_size_filter=lambda n: n - n % 8)``; only the spares'
  ``rank`` numbers differ (the filter numbers them in tree order).
* ``ShiftRanks`` and ``FillGaps`` after ``Tree`` change nothing (it leaves no
  gap); run before it they would close the gaps that spares must fill.
* ``ActivateAllRanks`` after ``Tree`` would activate every spare; before it,
  it would make the previous decision unreadable. check_composition refuses both.

:func:`check_composition` states these rules and raises ``ValueError`` for a
composition that breaks them; ``Tree`` also refuses, at decision time, a
table that something changed before it ran (when the previous table is
available, see :mod:`inprocess.rank_assignment.tree`).
"""

from __future__ import annotations

from typing import Any

from ..compose import leaves
from .activation import ActivateAllRanks, ActiveWorldSizeDivisibleBy, MaxActiveWorldSize
from .base import RankAssignment
from .filter_count import FilterCountGroupedByKey
from .renumbering import FillGaps, ShiftRanks
from .tree import Tree


def check_rank_assignment(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a usable ``rank_assignment`` for the Wrapper."""
    for leaf in leaves(value):
        if not isinstance(leaf, RankAssignment):
            raise ValueError(
                f"rank_assignment contains {leaf!r} ({type(leaf).__name__}): expected "
                f"inprocess.rank_assignment.RankAssignment instances (optionally inside Compose)"
            )
    if value is None:
        raise ValueError("rank_assignment=None: expected a RankAssignment, e.g. ShiftRanks()")
    check_composition(value)


def check_composition(rank_assignment: Any) -> None:
    """Raise ``ValueError`` if ``rank_assignment`` combines these classes in a way that cannot work.

    Rules, in execution order (the last ``Compose`` argument runs first):
    at most one ``Tree``; only ``FilterCountGroupedByKey`` may run before
    it; ``ActivateAllRanks`` must not run after it; every
    ``FilterCountGroupedByKey`` must be followed by a renumbering
    assignment (``Tree``, ``ShiftRanks`` or ``FillGaps``). Custom
    assignments are not judged.
    """
    order = list(leaves(rank_assignment))
    trees = [i for i, leaf in enumerate(order) if isinstance(leaf, Tree)]
    if len(trees) > 1:
        raise ValueError(f"{rank_assignment!r} holds {len(trees)} Tree instances: expected at most one")
    known_changers = (ActivateAllRanks, ActiveWorldSizeDivisibleBy, FillGaps, MaxActiveWorldSize, ShiftRanks)
    if trees:
        t = trees[0]
        for leaf in order[:t]:
            if isinstance(leaf, known_changers):
                raise ValueError(
                    f"{type(leaf).__name__} runs before Tree in {rank_assignment!r}: expected Tree to run first (after "
                    f"FilterCountGroupedByKey only), i.e. place {type(leaf).__name__} before Tree in Compose(...)"
                )
        for leaf in order[t + 1 :]:
            if isinstance(leaf, ActivateAllRanks):
                raise ValueError(
                    f"ActivateAllRanks runs after Tree in {rank_assignment!r}: it would activate every spare "
                    f"that Tree keeps; expected no ActivateAllRanks with Tree"
                )
    renumbering = (Tree, ShiftRanks, FillGaps)
    for i, leaf in enumerate(order):
        if isinstance(leaf, FilterCountGroupedByKey) and not any(isinstance(x, renumbering) for x in order[i + 1 :]):
            raise ValueError(
                f"{leaf!r} runs last in {rank_assignment!r}: it leaves gaps in the numbering; expected Tree, "
                f"ShiftRanks or FillGaps to run after it (place it after them in Compose(...))"
            )
