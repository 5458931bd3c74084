"""The rules for composing rank assignments, in one place.

``Compose(a, b)(x) == a(b(x))``: the *last* argument runs first. The rules,
checked when the Wrapper is built (:func:`check_composition`):

* **A renumbering step removes the ranks that leave.** ``ShiftRanks``,
  ``FillGaps`` or ``Tree`` must be in the composition.
* **An activation step runs after the last renumbering one.** ``ShiftRanks``
  and ``FillGaps`` renumber ``rank`` only, as there; ``ActivateAllRanks``,
  ``MaxActiveWorldSize`` or ``ActiveWorldSizeDivisibleBy`` then set who is
  active from the new ranks: ``Compose(ActivateAllRanks(), ShiftRanks())``
  (the default). ``Tree`` does both.
* **``FilterCountGroupedByKey`` runs before a renumbering step** (it only marks
  ranks as leaving): ``Compose(ActivateAllRanks(), ShiftRanks(),
  FilterCountGroupedByKey(...))``, ``Compose(Tree(...),
  FilterCountGroupedByKey(...))``.
* **``Tree`` runs first**, after ``FilterCountGroupedByKey`` only, at most
  once: it decides from the table as the previous decision left it, and
  refuses at decision time a table that something changed before it.
  ``MaxActiveWorldSize``/``ActiveWorldSizeDivisibleBy`` after it deactivate
  its highest active ranks, which become spares (``Compose(
  ActiveWorldSizeDivisibleBy(8), Tree(...))`` runs the same ranks with the
  same numbers as ``Tree(..., world_size_filter=lambda n: n - n % 8)``;
  only the spares' ``rank`` numbers differ). ``ShiftRanks``/``FillGaps``
  after it change nothing; ``ActivateAllRanks`` after it would activate every
  spare and is refused.

A composition with a custom per-rank hook is judged on its built-in members
only where their order alone decides (``Tree`` first, filters before a
renumbering step); whether the hook activates and renumbers ranks is checked
on its results, at every decision.
"""

from __future__ import annotations

from typing import Any

from ..compose import leaves
from .activation import ActivateAllRanks, ActiveWorldSizeDivisibleBy, MaxActiveWorldSize
from .base import RankAssignment
from .filter_count import FilterCountGroupedByKey
from .job import is_job_wide
from .renumbering import FillGaps, ShiftRanks
from .tree import Tree

_BUILT_IN = (
    ActivateAllRanks, ActiveWorldSizeDivisibleBy, FillGaps, FilterCountGroupedByKey, MaxActiveWorldSize,
    ShiftRanks, Tree,
)
_RENUMBERING = (Tree, ShiftRanks, FillGaps)
_ACTIVATION = (Tree, ActivateAllRanks, MaxActiveWorldSize, ActiveWorldSizeDivisibleBy)


def check_rank_assignment(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a usable ``rank_assignment`` for the Wrapper."""
    if value is None:
        raise ValueError("rank_assignment=None: expected a RankAssignment, e.g. ShiftRanks()")
    for leaf in leaves(value):
        if not isinstance(leaf, RankAssignment):
            raise ValueError(
                f"rank_assignment contains {leaf!r} ({type(leaf).__name__}): expected "
                f"inprocess.rank_assignment.RankAssignment instances (optionally inside Compose)"
            )
    check_composition(value)


def uses_per_rank_hooks(rank_assignment: Any) -> bool:
    """True if a member is a per-rank hook: the Wrapper then runs the composition per rank."""
    return not all(is_job_wide(leaf) for leaf in leaves(rank_assignment))


def check_composition(rank_assignment: Any) -> None:
    """Raise ``ValueError`` if ``rank_assignment`` combines the built-in assignments in a way
    that cannot work (the rules are in the module docstring)."""
    order = list(leaves(rank_assignment))
    _check_tree(rank_assignment, order)
    for i, leaf in enumerate(order):
        if isinstance(leaf, FilterCountGroupedByKey) and not any(isinstance(x, _RENUMBERING) for x in order[i + 1 :]):
            raise ValueError(
                f"{leaf!r} runs last in {rank_assignment!r}: it only marks ranks as leaving; expected Tree, "
                f"ShiftRanks or FillGaps to run after it (place it after them in Compose(...))"
            )
    if all(isinstance(leaf, _BUILT_IN) and is_job_wide(leaf) for leaf in order):
        _check_complete(rank_assignment, order)


def _check_tree(rank_assignment: Any, order: list[Any]) -> None:
    trees = [i for i, leaf in enumerate(order) if isinstance(leaf, Tree)]
    if len(trees) > 1:
        raise ValueError(f"{rank_assignment!r} holds {len(trees)} Tree instances: expected at most one")
    if not trees:
        return
    t = trees[0]
    for leaf in order[:t]:
        if isinstance(leaf, _BUILT_IN) and not isinstance(leaf, FilterCountGroupedByKey):
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


def _check_complete(rank_assignment: Any, order: list[Any]) -> None:
    """Built-in members only: some step removes the ranks that leave, and an activation step follows it."""
    renumbering = [i for i, leaf in enumerate(order) if isinstance(leaf, _RENUMBERING)]
    if not renumbering:
        raise ValueError(
            f"{rank_assignment!r} never removes the ranks that leave: expected ShiftRanks, FillGaps or Tree in it, "
            f"e.g. Compose(ActivateAllRanks(), ShiftRanks())"
        )
    last = renumbering[-1]
    if not any(isinstance(leaf, _ACTIVATION) for leaf in order[last:]):
        name = type(order[last]).__name__
        raise ValueError(
            f"{name} runs after every activation step in {rank_assignment!r}: it renumbers ranks but leaves who "
            f"is active as it was; expected ActivateAllRanks, MaxActiveWorldSize or ActiveWorldSizeDivisibleBy "
            f"to run after it (place it before {name} in Compose(...)), e.g. Compose(ActivateAllRanks(), {name}())"
        )
