"""Group filtering: :class:`FilterCountGroupedByKey` terminates every rank of a group that fails a count."""

from __future__ import annotations

from typing import Callable, Optional

from ..control.membership import TERMINATED
from .base import RankAssignment, RankAssignmentCtx
from .keys import KeyOrFn, check_key_or_fn, check_keys, evaluate_key, topology_keys


class FilterCountGroupedByKey(RankAssignment):
    """Terminate every rank of a group whose healthy count fails ``condition``.

    Ranks are grouped by ``key_or_fn`` (see the module docstring);
    ``condition(count) -> bool`` is evaluated once per group that still has
    healthy (active or spare) ranks, with their count, groups in order of
    their lowest initial rank. E.g. drop a whole node as soon as one of its
    8 ranks is lost: ``FilterCountGroupedByKey(EnvKey("SLURM_NODEID"),
    lambda count: count == 8)``.

    It only terminates ranks: run a renumbering assignment after it, i.e.
    place it after ``Tree`` (or ``ShiftRanks``/``FillGaps``) in ``Compose``.
    """

    def __init__(self, key_or_fn: KeyOrFn, condition: Callable[[int], bool]):
        check_key_or_fn(key_or_fn, "key_or_fn")
        if not callable(condition):
            raise ValueError(f"condition={condition!r}: expected a callable (healthy_count) -> bool")
        self.key_or_fn = key_or_fn
        self.condition = condition
        self._groups: Optional[tuple[list[tuple[str, ...]], list[int], int]] = None

    def __repr__(self) -> str:
        return f"FilterCountGroupedByKey(key_or_fn={self.key_or_fn!r}, condition={self.condition!r})"

    def local_keys(self, initial_rank: int, initial_world_size: int) -> tuple[str, ...]:
        return (evaluate_key(self.key_or_fn, initial_rank, initial_world_size),)

    def _group_of(self, keys: list[tuple[str, ...]]) -> tuple[list[int], int]:
        g = self._groups
        if g is None or g[0] is not keys:
            check_keys(keys, 1, self, len(keys))
            ids: dict[str, int] = {}
            col = [ids.setdefault(k[0], len(ids)) for k in keys]
            g = self._groups = (keys, col, len(ids))
        return g[1], g[2]

    def __call__(self, ctx: "RankAssignmentCtx") -> "RankAssignmentCtx":
        m = ctx.membership
        keys = topology_keys(ctx, self)
        if len(keys) != m.initial_world_size:
            raise ValueError(f"{self!r}: keys of {len(keys)} ranks for a job of {m.initial_world_size} ranks")
        group, n_groups = self._group_of(keys)
        mode = m.mode
        healthy = [0] * n_groups
        for r in range(len(mode)):
            if mode[r] != TERMINATED:
                healthy[group[r]] += 1
        drop = [count > 0 and not bool(self.condition(count)) for count in healthy]
        gone = [r for r in range(len(mode)) if mode[r] != TERMINATED and drop[group[r]]]
        if gone:
            m.terminate(gone)
            ctx.terminated_ranks.update(gone)
        return ctx
