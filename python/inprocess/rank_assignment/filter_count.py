"""Group filtering: :class:`FilterCountGroupedByKey` terminates every rank of a group that fails a count."""

from __future__ import annotations

import datetime
from collections.abc import Callable

from ..control.membership import TERMINATED
from ..state import FrozenState, State
from .base import JobAssignmentCtx, RankAssignmentCtx
from .job import JobAssignment
from .keys import KeyOrFn, check_key_or_fn, check_keys, evaluate_key, topology_keys
from .store_gather import StoreNamespace, exchange


class FilterCountGroupedByKey(JobAssignment):
    """Terminate every rank of a group whose count of remaining ranks fails ``condition``.

    Ranks are grouped by ``key_or_fn``: this rank's key (any hashable value,
    such as ``state.rank // 8`` computed on each rank) or a callable
    (state) -> key (:mod:`inprocess.rank_assignment.keys`);
    ``condition(count) -> bool`` is evaluated once per group that still has
    ranks not leaving, with their count, groups in order of their lowest
    initial rank. E.g. drop a whole node as soon as one of its 8 ranks is
    lost: ``FilterCountGroupedByKey(EnvKey("SLURM_NODEID"), lambda count: count == 8)``.

    It only adds ranks to ``terminated_ranks``: a renumbering step must run
    after it (place it after ``Tree``, ``ShiftRanks`` or ``FillGaps`` in
    ``Compose``). ``timeout`` bounds the key exchange of a per-rank call made
    outside the Wrapper.
    """

    def __init__(
        self,
        key_or_fn: KeyOrFn,
        condition: Callable[[int], bool],
        timeout: datetime.timedelta = datetime.timedelta(seconds=60),
    ):
        check_key_or_fn(key_or_fn, "key_or_fn")
        if not callable(condition):
            raise ValueError(f"condition={condition!r}: expected a callable (count) -> bool")
        if not isinstance(timeout, datetime.timedelta):
            raise ValueError(f"timeout={timeout!r}: expected a datetime.timedelta")
        self.key_or_fn = key_or_fn
        self.condition = condition
        self.timeout = timeout
        self._groups: tuple[list[tuple[str, ...]], list[int], int] | None = None
        self._namespace = StoreNamespace(self)
        self._own_key: str | None = None

    def __repr__(self) -> str:
        return f"FilterCountGroupedByKey(key_or_fn={self.key_or_fn!r}, condition={self.condition!r})"

    def local_keys(self, state: State | FrozenState) -> tuple[str, ...]:
        return (evaluate_key(self.key_or_fn, state),)

    def _group_of(self, keys: list[tuple[str, ...]]) -> tuple[list[int], int]:
        g = self._groups
        if g is None or g[0] is not keys:
            check_keys(keys, 1, self, len(keys))
            ids: dict[str, int] = {}
            col = [ids.setdefault(k[0], len(ids)) for k in keys]
            g = self._groups = (keys, col, len(ids))
        return g[1], g[2]

    def _failing(self, counts: list[int]) -> list[bool]:
        return [count > 0 and not bool(self.condition(count)) for count in counts]

    def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx:
        m = ctx.membership
        group, n_groups = self._group_of(topology_keys(ctx, self))
        leaving = ctx.terminated_ranks
        staying = [r for r in range(len(m.mode)) if m.mode[r] != TERMINATED and r not in leaving]
        counts = [0] * n_groups
        for r in staying:
            counts[group[r]] += 1
        failing = self._failing(counts)
        ctx.terminated_ranks = leaving | {r for r in staying if failing[group[r]]}
        return ctx

    def _call_through_store(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """As there: the ranks not leaving exchange their keys through ``ctx.store`` and count."""
        state = ctx.state
        if self._own_key is None:
            # Evaluated once, as at the Wrapper's initial barrier.
            self._own_key = evaluate_key(self.key_or_fn, state)
        leaving = set(ctx.terminated_ranks)
        namespace = self._namespace.next_call()
        if state.rank in leaving:
            return ctx
        staying = [r for r in range(state.world_size) if r not in leaving]
        keys = exchange(ctx.store, namespace, state.rank, self._own_key, staying, self.timeout)
        ids: dict[str, int] = {}
        group = {r: ids.setdefault(k, len(ids)) for r, k in sorted(keys.items())}
        counts = [0] * len(ids)
        for g in group.values():
            counts[g] += 1
        failing = self._failing(counts)
        ctx.terminated_ranks = leaving | {r for r, g in group.items() if failing[g]}
        return ctx
