"""Topology-aware rank assignment: :class:`Tree` of :class:`Layer`.

The names and parameters are those of ``nvidia_resiliency_ext.inprocess``;
the algorithm runs once per restart on the leader over the whole job's
:class:`~inprocess.control.membership.Membership` (design principle 3), so it is
written over plain lists and stays well under 100 ms at 16,384 ranks
(``benchmarks/rank_assignment_scale.py``).

The rules for composing it with other assignments are in
:mod:`inprocess.rank_assignment.composition`; its keys in
:mod:`inprocess.rank_assignment.keys`.

Called per rank, as there (``Tree(...)(RankAssignmentCtx(state, store,
terminated_ranks))``), it gives that rank's row of the same decision: inside
the Wrapper from the agreed inputs; outside it, the first call gathers every
rank's state and keys through ``ctx.store`` and later calls continue from the
table the instance keeps, as there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from ..exception import RankDiscarded
from ..state import FrozenState, State
from .agreed import describe_row, row_of, table_row
from .base import JobAssignmentCtx, RankAssignmentCtx, Topology, is_int
from .job import JobAssignment, rank_view
from .keys import check_keys, evaluate_key, topology_keys
from .layers import Layer
from .store_gather import StoreNamespace, exchange
from .tree_decision import Structure, decide_tree, number_spares


@dataclasses.dataclass
class _Kept:
    """What a Tree called per rank outside the Wrapper keeps between calls (as there)."""

    table: Membership
    active_world_size: int | None
    topology: Topology
    calls: int = 0


class Tree(JobAssignment):
    """Topology-aware activation and numbering, with spares (hot reserve ranks).

    ``layers[0]`` is the top of the tree (usually one domain for the whole
    job: ``Layer(key_or_fn="job", ...)``); each further layer splits every
    domain of the layer above by its own key (rack, node, NVLink domain).

    At iteration 0 every healthy rank is visited in tree order and activated
    unless a domain on its path already holds ``max_ranks`` active ranks; it
    is then a spare. Active ranks are numbered in tree order. At every
    decision, in this order:

    1. A domain with fewer healthy ranks than its layer's ``min_ranks`` is
       terminated whole (deepest layers first, so the loss propagates up).
    2. Each number held by a lost active rank, lowest first, is given to a
       spare from its nearest ``RESERVE`` domain (deepest first; the first
       spare in tree order whose domains all stay within ``max_ranks``). The
       spare takes exactly that ``active_rank`` and ``rank``.
    3. Without a spare, its nearest ``BACKFILL`` domain gives its highest
       active rank above the gap, which moves into the gap; the gap moves
       to that rank's old number and is handled the same way.
    4. Remaining gaps are closed by shifting the active ranks above them.
    5. ``world_size_filter(A) -> m`` (``0 <= m <= A``) deactivates the active
       ranks numbered ``m`` and above; they become spares.

    Numbering: an active rank's ``rank`` equals its ``active_rank``; spares
    take the ranks above, in tree order. The same inputs give the same
    table; nothing depends on set or dict iteration order.
    """

    def __init__(self, layers: Sequence[Layer], world_size_filter: Callable[[int], int] | None = None):
        if isinstance(layers, Layer) or not isinstance(layers, (list, tuple)) or not layers:
            raise ValueError(f"layers={layers!r}: expected a non-empty list of Layer, top layer first")
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise ValueError(f"layers[{i}]={layer!r} ({type(layer).__name__}): expected a Layer")
        if world_size_filter is not None and not callable(world_size_filter):
            raise ValueError(
                f"world_size_filter={world_size_filter!r}: expected None or a callable (active_world_size) -> int"
            )
        self.layers = tuple(layers)
        self.world_size_filter = world_size_filter
        self._structure: Structure | None = None
        self._namespace = StoreNamespace(self)
        self._alone: _Kept | None = None

    def __repr__(self) -> str:
        return f"Tree(layers={list(self.layers)!r}, world_size_filter={self.world_size_filter!r})"

    def local_keys(self, state: State | FrozenState) -> tuple[str, ...]:
        """This rank's key in every layer (runs on each rank at the initial barrier)."""
        return tuple(evaluate_key(layer.key_or_fn, state) for layer in self.layers)

    def structure(self, keys: list[tuple[str, ...]]) -> Structure:
        """The tree for ``keys``; cached, since the keys are gathered once per job."""
        s = self._structure
        if s is None or s.keys is not keys:
            check_keys(keys, len(self.layers), self, len(keys))
            s = self._structure = Structure(keys, len(self.layers))
        return s

    def assign_job(self, ctx: JobAssignmentCtx) -> JobAssignmentCtx:
        m = ctx.membership
        st = self.structure(topology_keys(ctx, self))
        initial = ctx.iteration == 0
        if ctx.previous is not None:
            self._check_unchanged(ctx.previous, m)
        # The rows of the ranks leaving are still in the table: the numbers to refill are theirs.
        leaving = sorted(ctx.terminated_ranks, key=st.pos.__getitem__)
        slots = [] if initial else [(m.active_rank[r], r) for r in leaving if m.mode[r] == ACTIVE]
        m.terminate(leaving)
        ctx.terminated_ranks = set()
        decide_tree(st, self.layers, m, slots, initial)
        self._filter(m)
        number_spares(st, m)
        ctx.active_world_size = m.active_world_size
        return ctx

    def _call_through_store(self, ctx: RankAssignmentCtx) -> RankAssignmentCtx:
        """Outside the Wrapper, as there: the first call gathers every rank's state and keys
        through ``ctx.store``; every call then decides for the whole job from the table this
        instance keeps, and returns this rank's row."""
        state = ctx.state
        if self._alone is None:
            namespace = self._namespace.next_call()
            if state.rank in ctx.terminated_ranks:
                raise RankDiscarded(f"rank {state.rank} is among terminated_ranks={sorted(ctx.terminated_ranks)}")
            staying = [r for r in range(state.world_size) if r not in ctx.terminated_ranks]
            mine = {
                "i": state.initial_rank, "mode": int(state.mode), "rank": state.rank,
                "act": state.active_rank, "keys": list(self.local_keys(state)),
            }
            table, keys = self._table_of(exchange(ctx.store, namespace, state.rank, mine, staying),
                                         state.initial_world_size)
            self._alone = _Kept(table, state.active_world_size, Topology([self], [keys]))
            leaving: set[int] = set()  # they sent nothing: their rows are not in the table
        else:
            kept = self._alone.table
            arrived = row_of(state)
            expected = table_row(kept, self._alone.active_world_size, state.initial_rank)
            if arrived != expected:
                raise ValueError(
                    f"{self!r} called per rank decides from the table it kept from its last call (as there), but "
                    f"initial rank {state.initial_rank} arrives as {describe_row(arrived)} instead of "
                    f"{describe_row(expected)}: something changed the rank's state after Tree; compose Tree "
                    f"with other assignments only inside inprocess.Wrapper, or call assign_job() on the whole job"
                )
            by_rank = {kept.rank[r]: r for r in range(len(kept.mode)) if kept.mode[r] != TERMINATED}
            leaving = {by_rank[rank] for rank in ctx.terminated_ranks}
        kept_state = self._alone
        job = JobAssignmentCtx(
            kept_state.table.copy(), leaving, kept_state.active_world_size, kept_state.calls, kept_state.topology,
            kept_state.table,
        )
        self.assign_job(job)
        kept_state.table, kept_state.active_world_size = job.membership, job.active_world_size
        kept_state.calls += 1
        return rank_view(job, ctx)

    def _table_of(self, everyone: dict[int, Any], n: int) -> tuple[Membership, list[tuple[str, ...]]]:
        table = Membership([TERMINATED] * n, [NONE] * n, [NONE] * n)
        # Ranks that sent nothing are terminated: their keys never count.
        keys = [("",) * len(self.layers)] * n
        for v in everyone.values():
            i = int(v["i"])
            table.mode[i], table.rank[i] = int(v["mode"]), int(v["rank"])
            table.active_rank[i] = NONE if v["act"] is None else int(v["act"])
            keys[i] = tuple(str(k) for k in v["keys"])
        return table, keys

    def _check_unchanged(self, previous: Membership, m: Membership) -> None:
        pm, pr, pa = previous.mode, previous.rank, previous.active_rank
        mode, rank, act = m.mode, m.rank, m.active_rank
        for r in range(len(mode)):
            if (mode[r], rank[r], act[r]) != (pm[r], pr[r], pa[r]):
                raise ValueError(
                    f"Tree: initial rank {r} changed from (mode={pm[r]}, rank={pr[r]}, active_rank={pa[r]}) to "
                    f"(mode={mode[r]}, rank={rank[r]}, active_rank={act[r]}) before Tree ran: expected Tree to "
                    f"run first, after FilterCountGroupedByKey only (it is the last argument of Compose)"
                )

    def _filter(self, m: Membership) -> None:
        f = self.world_size_filter
        if f is None:
            return
        active = m.active_world_size
        keep: object = f(active)
        if not is_int(keep) or not 0 <= keep <= active:
            raise ValueError(
                f"world_size_filter {f!r} returned {keep!r} for an active world size of {active}: "
                f"expected an int in [0, {active}]"
            )
        mode, act = m.mode, m.active_rank
        for r in range(len(mode)):
            if mode[r] == ACTIVE and act[r] >= keep:
                mode[r] = INACTIVE
                act[r] = NONE
