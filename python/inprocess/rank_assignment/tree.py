"""Topology-aware rank assignment: :class:`Tree` of :class:`Layer`.

The names and parameters are those of ``nvidia_resiliency_ext.inprocess``;
the algorithm runs once per restart on the leader over the whole job's
:class:`~inprocess.control.membership.Membership` (design principle 3), so it is
written over plain lists and stays well under 100 ms at 16,384 ranks
(``benchmarks/rank_assignment_scale.py``).

The rules for composing it with other assignments are in
:mod:`inprocess.rank_assignment.composition`; its keys in
:mod:`inprocess.rank_assignment.keys`.

The previous decision
---------------------
Replacing a lost rank with the *exact* rank it held needs the previous
table, but ``RankAssignmentCtx.membership`` arrives with lost ranks already
erased. When the context carries ``previous`` (the table of the previous
iteration before this restart's terminations) ``Tree`` uses it and is exact.
Without it ``Tree`` recovers the lost ranks' numbers from its own numbering
convention (an active rank's ``rank`` equals its ``active_rank``; spares follow,
in tree order). That is exact when the ranks lost in a restart share a
leaf domain (a node), unless the lowest-numbered spare is among them: its
number cannot be told from the highest active rank's, so it is taken for an
active rank's and refilled if ``max_ranks`` allows (never past it). When
several domains lose ranks at once, the lost numbers are matched to the lost
ranks in tree order, a best guess. ``tests/test_tree.py`` checks both paths
against each other.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

from ..control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from .base import RankAssignment, RankAssignmentCtx, is_int
from .keys import check_keys, evaluate_key, topology_keys
from .layers import Layer
from .tree_decision import Structure, decide_tree, infer_slots, number_spares


class Tree(RankAssignment):
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

    def __init__(self, layers: Sequence[Layer], world_size_filter: Optional[Callable[[int], int]] = None):
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
        self._structure: Optional[Structure] = None

    def __repr__(self) -> str:
        return f"Tree(layers={list(self.layers)!r}, world_size_filter={self.world_size_filter!r})"

    def local_keys(self, initial_rank: int, initial_world_size: int) -> tuple[str, ...]:
        """This rank's key in every layer (runs on each rank at the initial barrier)."""
        return tuple(evaluate_key(layer.key_or_fn, initial_rank, initial_world_size) for layer in self.layers)

    def structure(self, keys: list[tuple[str, ...]]) -> Structure:
        """The tree for ``keys``; cached, since the keys are gathered once per job."""
        s = self._structure
        if s is None or s.keys is not keys:
            check_keys(keys, len(self.layers), self, len(keys))
            s = self._structure = Structure(keys, len(self.layers))
        return s

    def __call__(self, ctx: "RankAssignmentCtx") -> "RankAssignmentCtx":
        m = ctx.membership
        n = m.initial_world_size
        keys = topology_keys(ctx, self)
        if len(keys) != n:
            raise ValueError(f"{self!r}: keys of {len(keys)} ranks for a job of {n} ranks")
        st = self.structure(keys)
        initial = ctx.iteration == 0
        slots: list[tuple[int, int]] = []
        if not initial:
            previous = getattr(ctx, "previous", None)
            if previous is not None:
                slots = self._slots_from_previous(previous, m)
            else:
                lost = sorted((r for r in ctx.terminated_ranks if m.mode[r] == TERMINATED), key=st.pos.__getitem__)
                slots = infer_slots(st, m, lost)
        newly = decide_tree(st, self.layers, m, slots, initial)
        if newly:
            ctx.terminated_ranks.update(newly)
        self._filter(m)
        number_spares(st, m)
        return ctx

    def _slots_from_previous(self, previous: Membership, m: Membership) -> list[tuple[int, int]]:
        if not isinstance(previous, Membership) or previous.initial_world_size != m.initial_world_size:  # type: ignore[redundant-expr]
            raise ValueError(f"ctx.previous={previous!r}: expected the Membership of the previous iteration")
        slots = []
        pm, pr, pa = previous.mode, previous.rank, previous.active_rank
        mode, rank, act = m.mode, m.rank, m.active_rank
        for r in range(len(mode)):
            if mode[r] == TERMINATED:
                if pm[r] == ACTIVE:
                    slots.append((pa[r], r))
            elif mode[r] != pm[r] or rank[r] != pr[r] or act[r] != pa[r]:
                raise ValueError(
                    f"Tree: initial rank {r} changed from (mode={pm[r]}, rank={pr[r]}, active_rank={pa[r]}) to "
                    f"(mode={mode[r]}, rank={rank[r]}, active_rank={act[r]}) before Tree ran: expected Tree to "
                    f"run first, after FilterCountGroupedByKey only (it is the last argument of Compose)"
                )
        return slots

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
