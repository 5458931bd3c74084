"""Is a decided membership one job? The checks every decision passes before it is published.

A table that fails them ends the job on every rank (the decision carries the
error, naming the ranks), so that no two ranks ever run with different views
of who is who: two ranks with one rank, a gap in the numbering, a rank
missing, a lost rank still in the job, a rank that was never activated.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from ..state import Mode


class InconsistentAssignment(ValueError):
    """The rank assignment produced a membership that is not one job; the message names the ranks."""


def _ranks(ranks: Iterable[int], limit: int = 16) -> str:
    shown = sorted(ranks)
    text = ", ".join(str(r) for r in shown[:limit])
    return text + (f", ... ({len(shown)} in all)" if len(shown) > limit else "")


def check_membership(
    m: Membership,
    active_world_size: int | None,
    previous: Membership,
    lost: set[int],
    still_leaving: Iterable[int] = (),
) -> None:
    """Raise :class:`InconsistentAssignment` unless ``m`` is a consistent next membership.

    ``lost``: initial ranks reported lost at this restart; ``still_leaving``:
    initial ranks marked as leaving that no step removed.
    """
    pending = set(still_leaving)
    if pending:
        raise InconsistentAssignment(
            f"initial ranks {_ranks(pending)} are leaving but still hold their ranks: expected ShiftRanks, FillGaps "
            f"or Tree to remove them after the step that marked them"
        )
    mode, previous_mode = m.mode, previous.mode
    alive = [r for r in range(len(mode)) if mode[r] != TERMINATED]
    back = [r for r in alive if previous_mode[r] == TERMINATED]
    if back:
        raise InconsistentAssignment(f"initial ranks {_ranks(back)} were terminated before and came back")
    kept = [r for r in lost if mode[r] != TERMINATED]
    if kept:
        raise InconsistentAssignment(f"initial ranks {_ranks(kept)} were lost but are still in the job")
    unassigned = [r for r in alive if mode[r] != ACTIVE and mode[r] != INACTIVE]
    if unassigned:
        names = sorted({Mode(mode[r]).name for r in unassigned})
        raise InconsistentAssignment(
            f"initial ranks {_ranks(unassigned)} are {'/'.join(names)}: nothing made them active or spare; expected "
            f"ActivateAllRanks, MaxActiveWorldSize, ActiveWorldSizeDivisibleBy or Tree in the rank assignment"
        )
    _check_numbering(m, alive)
    count = sum(1 for r in alive if mode[r] == ACTIVE)
    if active_world_size != count:
        raise InconsistentAssignment(
            f"the ranks' active_world_size is {active_world_size} but {count} ranks are active: expected an "
            f"activation step (ActivateAllRanks, MaxActiveWorldSize, ActiveWorldSizeDivisibleBy) after the last "
            f"renumbering one"
        )


def _check_numbering(m: Membership, alive: list[int]) -> None:
    mode, rank, act = m.mode, m.rank, m.active_rank
    inactive_with_rank = [r for r in alive if mode[r] == INACTIVE and act[r] != NONE]
    if inactive_with_rank:
        r = inactive_with_rank[0]
        raise InconsistentAssignment(
            f"spare initial ranks {_ranks(inactive_with_rank)} hold an active rank (initial rank {r}: "
            f"active_rank={act[r]})"
        )
    active = [r for r in alive if mode[r] == ACTIVE]
    for name, column, holders in (("rank", rank, alive), ("active_rank", act, active)):
        # The common case in one sort; the search for the ranks to name only when it fails.
        if sorted(column[r] for r in holders) != list(range(len(holders))):
            _name_the_clash(name, [(r, column[r]) for r in holders])


def _name_the_clash(name: str, held: list[tuple[int, int]]) -> None:
    """(initial rank, number) pairs whose numbers are not 0..len-1, each once: raise naming the ranks."""
    size = len(held)
    holder: dict[int, int] = {}
    for r, value in held:
        if not 0 <= value < size:
            shown = "None" if value == NONE else value
            raise InconsistentAssignment(
                f"initial rank {r} has {name}={shown}, outside 0..{size - 1} ({size} ranks hold a {name})"
            )
        other = holder.setdefault(value, r)
        if other != r:
            raise InconsistentAssignment(f"initial ranks {other} and {r} both have {name}={value}")
    raise InconsistentAssignment(f"the {name} numbers are not 0..{size - 1}")


def check_agreement(m: Membership, states: dict[int, tuple[int, int | None]]) -> None:
    """Per-rank results: every rank's (world_size, active_world_size) must be the table's."""
    expected = (m.world_size, m.active_world_size)
    wrong = {r: sizes for r, sizes in states.items() if sizes != expected}
    if wrong:
        r, (ws, aws) = min(wrong.items())
        raise InconsistentAssignment(
            f"initial ranks {_ranks(wrong)} disagree on the job's size: initial rank {r} has world_size={ws}, "
            f"active_world_size={aws}, but {expected[0]} ranks remain and {expected[1]} are active"
        )
