"""The decision of :class:`~inprocess.rank_assignment.Tree` over plain lists: the topology
tree of initial ranks, and steps 1-4 of the algorithm (terminate, replace, backfill, shift).

Written over the columns of the membership table so that it stays well under
100 ms at 16,384 ranks (``benchmarks/rank_assignment_scale.py``).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

from ..control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership
from .layers import Layer, LayerFlag


class Structure:
    """The topology tree over initial ranks, built once per set of keys.

    ``dom[d][r]`` is the domain id of initial rank ``r`` at depth ``d``; ids
    are numbered per depth in order of first appearance, scanning initial
    ranks upward, so the tree is the same whatever order dicts iterate in.
    ``order`` lists initial ranks depth-first (children in order of first
    appearance, ranks of a leaf domain by initial rank); ``pos`` inverts it.
    """

    __slots__ = ("keys", "dom", "n_dom", "order", "pos")

    def __init__(self, keys: list[tuple[str, ...]], depth: int):
        n = len(keys)
        self.keys = keys  # held so that the cache's identity check cannot be fooled by id reuse
        dom: list[list[int]] = []
        parent_col: list[int] | None = None
        for d in range(depth):
            ids: dict[Any, int] = {}
            col = [0] * n
            for r in range(n):
                key: Any = keys[r][d] if parent_col is None else (parent_col[r], keys[r][d])
                i = ids.get(key)
                if i is None:
                    i = ids[key] = len(ids)
                col[r] = i
            dom.append(col)
            parent_col = col
        self.dom = dom
        self.n_dom = [max(col, default=-1) + 1 for col in dom]
        # Depth-first order: sort the leaf domains by their path, then list members.
        leaf = dom[-1]
        path_of_leaf: list[Any] = [None] * self.n_dom[-1]
        members: list[list[int]] = [[] for _ in range(self.n_dom[-1])]
        for r in range(n):
            if path_of_leaf[leaf[r]] is None:
                path_of_leaf[leaf[r]] = tuple(col[r] for col in dom)
            members[leaf[r]].append(r)
        order: list[int] = []
        for lf in sorted(range(self.n_dom[-1]), key=path_of_leaf.__getitem__):
            order.extend(members[lf])
        self.order = order
        pos = [0] * n
        for i, r in enumerate(order):
            pos[r] = i
        self.pos = pos


Caps = list[tuple[list[int], int, list[int]]]  # per capped layer: domain column, max_ranks, active count per domain


def decide_tree(
    st: Structure, layers: Sequence[Layer], m: Membership, slots: list[tuple[int, int]], initial: bool
) -> list[int]:
    """Steps 1-4 of :class:`Tree` on ``m`` in place; returns the ranks it terminated."""
    newly = _terminate_undersized(st, layers, m, slots, initial)
    caps: Caps = [
        (st.dom[d], cap, [0] * st.n_dom[d])
        for d, cap in enumerate(layer.max_ranks for layer in layers)
        if cap is not None
    ]
    if initial:
        _activate_in_tree_order(st, m, caps)
        return newly
    mode = m.mode
    for r in range(len(mode)):
        if mode[r] == ACTIVE:
            for col, _, count in caps:
                count[col[r]] += 1
    if slots:
        _fill(st, layers, m, slots, caps)
    _close_gaps(m)
    return newly


def _terminate_undersized(
    st: Structure, layers: Sequence[Layer], m: Membership, slots: list[tuple[int, int]], initial: bool
) -> list[int]:
    """Step 1, min_ranks: deepest layer first, so a terminated domain lowers its ancestors' counts.

    The number of every active rank it terminates becomes a slot to fill."""
    mode, rank, act = m.mode, m.rank, m.active_rank
    n = len(mode)
    newly: list[int] = []
    for d in range(len(layers) - 1, -1, -1):
        need = layers[d].min_ranks
        if need <= 1:
            continue
        col = st.dom[d]
        healthy = [0] * st.n_dom[d]
        for r in range(n):
            if mode[r] != TERMINATED:
                healthy[col[r]] += 1
        for r in range(n):
            if mode[r] != TERMINATED and healthy[col[r]] < need:
                if mode[r] == ACTIVE and not initial:
                    slots.append((act[r], r))
                mode[r] = TERMINATED
                rank[r] = NONE
                act[r] = NONE
                newly.append(r)
    return newly


def _activate_in_tree_order(st: Structure, m: Membership, caps: Caps) -> None:
    """Iteration 0: activate in tree order while every domain on the path has room."""
    mode, act = m.mode, m.active_rank
    a = 0
    for r in st.order:
        if mode[r] == TERMINATED:
            continue
        if all(count[col[r]] < cap for col, cap, count in caps):
            for col, _, count in caps:
                count[col[r]] += 1
            mode[r] = ACTIVE
            act[r] = a
            a += 1
        else:
            mode[r] = INACTIVE
            act[r] = NONE


def _active_holders(m: Membership) -> list[int]:
    """``holders[v]`` is the initial rank holding active number v, or NONE."""
    mode, act = m.mode, m.active_rank
    top = max((act[r] for r in range(len(mode)) if mode[r] == ACTIVE), default=-1)
    holder = [NONE] * (top + 1)
    for r in range(len(mode)):
        if mode[r] == ACTIVE:
            holder[act[r]] = r
    return holder


def _close_gaps(m: Membership) -> None:
    """Step 4: renumber the active ranks by their current number, closing the remaining gaps."""
    act = m.active_rank
    a = 0
    for r in _active_holders(m):
        if r != NONE:
            act[r] = a
            a += 1


class _SparePool:
    """Spares per RESERVE domain, in tree order, each list with a read pointer.

    A spare that is used, or found without room, is skipped for good: the
    active counts only grow while gaps are filled.
    """

    def __init__(self, st: Structure, reserve: list[int], m: Membership):
        self.dom = st.dom
        self.reserve = reserve
        self.spares: dict[tuple[int, int], list[int]] = {}
        if reserve:
            for r in st.order:
                if m.mode[r] == INACTIVE:
                    for d in reserve:
                        self.spares.setdefault((d, st.dom[d][r]), []).append(r)
        self.pointer: dict[tuple[int, int], int] = {}
        self.usable = [True] * len(m.mode)

    def take(self, lost: int, caps: Caps) -> int:
        """The spare nearest to ``lost`` that every capped domain on its path has room for, or NONE."""
        for d in self.reserve:
            key = (d, self.dom[d][lost])
            lst = self.spares.get(key)
            if not lst:
                continue
            p = self.pointer.get(key, 0)
            found = NONE
            while p < len(lst):
                s = lst[p]
                p += 1
                if not self.usable[s]:
                    continue
                self.usable[s] = False
                if all(count[col[s]] < cap for col, cap, count in caps):
                    found = s
                    break
            self.pointer[key] = p
            if found != NONE:
                return found
        return NONE


class _DonorPool:
    """Active ranks per BACKFILL domain, highest number first, each list with a read pointer."""

    def __init__(self, st: Structure, backfill: list[int], m: Membership):
        self.dom = st.dom
        self.backfill = backfill
        self.m = m
        self.donors: dict[tuple[int, int], list[tuple[int, int]]] = {}
        if backfill:
            holder = _active_holders(m)
            for v in range(len(holder) - 1, -1, -1):
                r = holder[v]
                if r != NONE:
                    for d in backfill:
                        self.donors.setdefault((d, st.dom[d][r]), []).append((v, r))
        self.pointer: dict[tuple[int, int], int] = {}

    def take(self, lost: int, gap: int) -> tuple[int, int] | None:
        """(its number, initial rank) of the highest active rank above ``gap`` in the nearest
        BACKFILL domain of ``lost``, or None."""
        mode, act = self.m.mode, self.m.active_rank
        for d in self.backfill:
            key = (d, self.dom[d][lost])
            lst = self.donors.get(key)
            if not lst:
                continue
            p = self.pointer.get(key, 0)
            while p < len(lst) and (mode[lst[p][1]] != ACTIVE or act[lst[p][1]] != lst[p][0]):
                p += 1  # moved or replaced since the list was made
            self.pointer[key] = p
            if p < len(lst) and lst[p][0] > gap:
                self.pointer[key] = p + 1
                return lst[p]
        return None


def _fill(st: Structure, layers: Sequence[Layer], m: Membership, slots: list[tuple[int, int]], caps: Caps) -> None:
    """Steps 2-3 of :class:`Tree`: give each lost number to a spare, or backfill it."""
    depth = len(layers)
    spares = _SparePool(st, [d for d in range(depth - 1, -1, -1) if layers[d].has(LayerFlag.RESERVE)], m)
    donors = _DonorPool(st, [d for d in range(depth - 1, -1, -1) if layers[d].has(LayerFlag.BACKFILL)], m)
    mode, act = m.mode, m.active_rank
    heap = list(slots)
    heapq.heapify(heap)
    while heap:
        gap, lost = heapq.heappop(heap)
        spare = spares.take(lost, caps)
        if spare != NONE:
            mode[spare] = ACTIVE
            act[spare] = gap
            for col, _, count in caps:
                count[col[spare]] += 1
            continue
        donor = donors.take(lost, gap)
        if donor is not None:
            value, r = donor
            act[r] = gap
            # The donor's old number is a gap now, handled the same way.
            heapq.heappush(heap, (value, r))


def number_spares(st: Structure, m: Membership) -> None:
    """rank = active_rank for active ranks; spares numbered above them in tree order."""
    mode, rank, act = m.mode, m.rank, m.active_rank
    for r in range(len(mode)):
        if mode[r] == ACTIVE:
            rank[r] = act[r]
    w = m.active_world_size
    for r in st.order:
        if mode[r] == INACTIVE:
            rank[r] = w
            w += 1
