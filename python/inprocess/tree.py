"""Topology-aware rank assignment: :class:`Tree` of :class:`Layer` and :class:`FilterCountGroupedByKey`.

The names and parameters are those of ``nvidia_resiliency_ext.inprocess``;
the algorithm runs once per restart on the leader over the whole job's
:class:`~inprocess.control.membership.Membership` (design principle 3), so it is
written over plain lists and stays well under 100 ms at 16,384 ranks
(``benchmarks/rank_assignment_scale.py``).

Keys
----
Each layer groups ranks by a key. ``key_or_fn`` is either

* a ``str``: the key itself, the same on every rank (``"job"`` for the layer
  that spans the whole job). It is *not* the name of an environment
  variable; use :class:`EnvKey` for that;
* a callable ``fn(initial_rank, initial_world_size) -> str`` evaluated once on
  every rank at the initial barrier, e.g. :class:`EnvKey` (an environment
  variable such as ``SLURM_NODEID``), :class:`HostnameKey` (the host name), or
  ``lambda rank, world_size: str(rank // 8)``. An ``int`` result is turned
  into its decimal string; anything else is refused.

The keys are gathered once (``local_keys``) and read by the leader from
``ctx.topology``; the previous decision, not any rank's local view, is the
only other input.

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
available, see below).

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

import bisect
import enum
import heapq
import os
import socket
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

from .compose import leaves
from .control.membership import ACTIVE, INACTIVE, NONE, TERMINATED, Membership

if TYPE_CHECKING:
    from .rank_assignment import RankAssignmentCtx

__all__ = [
    "EnvKey",
    "FilterCountGroupedByKey",
    "HostnameKey",
    "Layer",
    "LayerFlag",
    "Tree",
    "check_composition",
]

KeyOrFn = Union[str, Callable[[int, int], Any]]


# -- keys -----------------------------------------------------------------------


class EnvKey:
    """Key function: the value of environment variable ``name`` on each rank.

    A rank without the variable uses ``default``; with ``default=None`` it
    raises ``ValueError`` naming the variable and the rank.
    """

    def __init__(self, name: str, default: Optional[str] = None):
        if not isinstance(name, str) or not name:
            raise ValueError(f"EnvKey name={name!r}: expected a non-empty str")
        if default is not None and not isinstance(default, str):
            raise ValueError(f"EnvKey default={default!r}: expected a str or None")
        self.name = name
        self.default = default

    def __call__(self, initial_rank: int, initial_world_size: int) -> str:
        value = os.environ.get(self.name, self.default)
        if value is None:
            raise ValueError(
                f"EnvKey: environment variable {self.name} is not set on initial rank {initial_rank} "
                f"and no default was given"
            )
        return value

    def __repr__(self) -> str:
        return f"EnvKey({self.name!r}, default={self.default!r})"


class HostnameKey:
    """Key function: the host name of each rank (``socket.gethostname()``)."""

    def __call__(self, initial_rank: int, initial_world_size: int) -> str:
        return socket.gethostname()

    def __repr__(self) -> str:
        return "HostnameKey()"


def _check_key_or_fn(key_or_fn: Any, name: str) -> None:
    if isinstance(key_or_fn, str):
        return
    if not callable(key_or_fn):
        raise ValueError(
            f"{name}={key_or_fn!r} ({type(key_or_fn).__name__}): expected a str (the same key on every rank) "
            f"or a callable (initial_rank, initial_world_size) -> str, e.g. EnvKey('SLURM_NODEID')"
        )


def _evaluate_key(key_or_fn: KeyOrFn, initial_rank: int, initial_world_size: int) -> str:
    if isinstance(key_or_fn, str):
        return key_or_fn
    value = key_or_fn(initial_rank, initial_world_size)
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(
        f"key_or_fn {key_or_fn!r} returned {value!r} ({type(value).__name__}) on initial rank {initial_rank}: "
        f"expected a str (or an int)"
    )


def _check_keys(keys: Sequence[Any], width: int, owner: Any, world_size: int) -> None:
    if len(keys) != world_size:
        raise ValueError(f"{owner!r}: keys of {len(keys)} ranks for a job of {world_size} ranks")
    for r, k in enumerate(keys):
        if not isinstance(k, tuple) or len(k) != width or not all(isinstance(x, str) for x in k):
            raise ValueError(f"{owner!r}: initial rank {r} has keys {k!r}, expected a tuple of {width} str")


def _topology_keys(ctx: "RankAssignmentCtx", owner: Any) -> list[tuple[str, ...]]:
    try:
        return ctx.topology.keys(owner)
    except KeyError:
        raise ValueError(
            f"{owner!r}: ctx.topology has no keys for it; they are gathered at the initial barrier "
            f"by inprocess.Wrapper from local_keys()"
        ) from None


def _positive_int(value: Any, name: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return value


# -- layers ---------------------------------------------------------------------


class LayerFlag(enum.Flag):
    """Per-layer policy of :class:`Tree`.

    ``RESERVE``: a lost active rank may be replaced by a spare from anywhere
    in its domain at this layer. ``BACKFILL``: when no spare is found, the
    highest active rank of its domain at this layer takes the lost number,
    moving the gap to the end of that domain.
    """

    RESERVE = enum.auto()
    BACKFILL = enum.auto()


class Layer:
    """One level of the topology tree of :class:`Tree`.

    Args:
        min_ranks: a domain of this layer with fewer healthy (active or
            spare) ranks is terminated whole.
        max_ranks: at most this many active ranks per domain of this layer;
            the rest are spares. ``None``: no bound.
        key_or_fn: the grouping key (see the module docstring).
        flag: ``LayerFlag.RESERVE``, ``LayerFlag.BACKFILL``, both (``|``) or None.
    """

    def __init__(
        self,
        min_ranks: int = 1,
        max_ranks: Optional[int] = None,
        key_or_fn: KeyOrFn = "",
        flag: Optional[LayerFlag] = None,
    ):
        self.min_ranks = _positive_int(min_ranks, "min_ranks")
        if max_ranks is not None:
            _positive_int(max_ranks, "max_ranks")
        self.max_ranks = max_ranks
        _check_key_or_fn(key_or_fn, "key_or_fn")
        self.key_or_fn = key_or_fn
        if flag is not None and not isinstance(flag, LayerFlag):
            raise ValueError(f"flag={flag!r} ({type(flag).__name__}): expected a LayerFlag or None")
        self.flag = flag

    def has(self, flag: LayerFlag) -> bool:
        return self.flag is not None and bool(self.flag & flag)

    def __repr__(self) -> str:
        return (
            f"Layer(min_ranks={self.min_ranks}, max_ranks={self.max_ranks}, "
            f"key_or_fn={self.key_or_fn!r}, flag={self.flag})"
        )


class _Structure:
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
        parent_col: Optional[list[int]] = None
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


# -- Tree ---------------------------------------------------------------------------


class Tree:
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
        self._structure: Optional[_Structure] = None

    def __repr__(self) -> str:
        return f"Tree(layers={list(self.layers)!r}, world_size_filter={self.world_size_filter!r})"

    def local_keys(self, initial_rank: int, initial_world_size: int) -> tuple[str, ...]:
        """This rank's key in every layer (runs on each rank at the initial barrier)."""
        return tuple(_evaluate_key(layer.key_or_fn, initial_rank, initial_world_size) for layer in self.layers)

    def structure(self, keys: list[tuple[str, ...]]) -> _Structure:
        """The tree for ``keys``; cached, since the keys are gathered once per job."""
        s = self._structure
        if s is None or s.keys is not keys:
            _check_keys(keys, len(self.layers), self, len(keys))
            s = self._structure = _Structure(keys, len(self.layers))
        return s

    def __call__(self, ctx: "RankAssignmentCtx") -> "RankAssignmentCtx":
        m = ctx.membership
        n = m.initial_world_size
        keys = _topology_keys(ctx, self)
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
                slots = _infer_slots(st, m, lost)
        newly = _decide(st, self.layers, m, slots, initial)
        if newly:
            ctx.terminated_ranks.update(newly)
        self._filter(m)
        _number_spares(st, m)
        return ctx

    def _slots_from_previous(self, previous: Membership, m: Membership) -> list[tuple[int, int]]:
        if not isinstance(previous, Membership) or previous.initial_world_size != m.initial_world_size:
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
        keep = f(active)
        if not isinstance(keep, int) or isinstance(keep, bool) or not 0 <= keep <= active:
            raise ValueError(
                f"world_size_filter {f!r} returned {keep!r} for an active world size of {active}: "
                f"expected an int in [0, {active}]"
            )
        mode, act = m.mode, m.active_rank
        for r in range(len(mode)):
            if mode[r] == ACTIVE and act[r] >= keep:
                mode[r] = INACTIVE
                act[r] = NONE


def _infer_slots(st: _Structure, m: Membership, lost: list[int]) -> list[tuple[int, int]]:
    """(number, lost initial rank) of each lost active rank, recovered without the previous table.

    Relies on Tree's numbering (rank == active_rank for active ranks, spares
    numbered above them in tree order): the lost ranks' numbers are the gaps
    of the ``rank`` column among ``W_prev`` = survivors + lost. Gaps above the
    surviving spares' lowest rank were spares; they are matched to lost
    ranks by tree order between the surviving spares around them (the latest
    such lost rank, as spares sit at the end of their domain). The other gaps
    are taken for active numbers, matched to the remaining lost ranks in tree
    order. Gaps between the highest surviving active number and the lowest
    surviving spare's rank could be either; taking them for active numbers
    keeps spares in use rather than shrinking the world.
    """
    if not lost:
        return []
    mode, rank, act = m.mode, m.rank, m.active_rank
    pos = st.pos
    n = len(mode)
    survivors_active = [r for r in range(n) if mode[r] == ACTIVE]
    spares = sorted((rank[r], r) for r in range(n) if mode[r] == INACTIVE)
    w_prev = n - mode.count(TERMINATED) + len(lost)
    max_active = max((act[r] for r in survivors_active), default=-1)
    convention = all(rank[r] == act[r] for r in survivors_active) and (not spares or spares[0][0] > max_active)
    if convention:
        held = [False] * w_prev
        for r in range(n):
            if mode[r] != TERMINATED and 0 <= rank[r] < w_prev:
                held[rank[r]] = True
        low_spare = spares[0][0] if spares else w_prev
        gaps = [v for v in range(w_prev) if not held[v]]
        active_gaps = [v for v in gaps if v < low_spare]
        spare_gaps = [v for v in gaps if v >= low_spare]
    else:
        held = [False] * (max_active + 1)
        for r in survivors_active:
            held[act[r]] = True
        active_gaps = [v for v in range(max_active + 1) if not held[v]]
        spare_gaps = []
    lost_pos = [pos[r] for r in lost]  # ascending: lost is in tree order
    taken = [False] * len(lost)
    spare_values = [v for v, _ in spares]
    for v in spare_gaps:
        i = bisect.bisect_left(spare_values, v)
        lo = pos[spares[i - 1][1]] if i > 0 else -1
        hi = pos[spares[i][1]] if i < len(spares) else n
        j = bisect.bisect_left(lost_pos, hi) - 1
        while j >= 0 and lost_pos[j] > lo and taken[j]:
            j -= 1
        if j >= 0 and lost_pos[j] > lo:
            taken[j] = True
    remaining = [r for r, t in zip(lost, taken) if not t]
    return list(zip(active_gaps, remaining))


def _decide(
    st: _Structure, layers: Sequence[Layer], m: Membership, slots: list[tuple[int, int]], initial: bool
) -> list[int]:
    """Steps 1-4 of :class:`Tree` on ``m`` in place; returns the ranks it terminated."""
    mode, rank, act = m.mode, m.rank, m.active_rank
    n = len(mode)
    dom = st.dom
    depth = len(layers)
    newly: list[int] = []

    # 1. min_ranks: deepest first, so a terminated domain lowers its ancestors' counts.
    for d in range(depth - 1, -1, -1):
        need = layers[d].min_ranks
        if need <= 1:
            continue
        col = dom[d]
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

    caps = [(dom[d], layers[d].max_ranks, [0] * st.n_dom[d]) for d in range(depth) if layers[d].max_ranks is not None]

    if initial:
        # Activate in tree order while every domain on the path has room.
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
        return newly

    for r in range(n):
        if mode[r] == ACTIVE:
            for col, _, count in caps:
                count[col[r]] += 1

    if slots:
        _fill(st, layers, m, slots, caps)

    # 4. Close the remaining gaps: renumber active ranks by their current number.
    top = max((act[r] for r in range(n) if mode[r] == ACTIVE), default=-1)
    holder = [NONE] * (top + 1)
    for r in range(n):
        if mode[r] == ACTIVE:
            holder[act[r]] = r
    a = 0
    for r in holder:
        if r != NONE:
            act[r] = a
            a += 1
    return newly


def _fill(
    st: _Structure,
    layers: Sequence[Layer],
    m: Membership,
    slots: list[tuple[int, int]],
    caps: list[tuple[list[int], int, list[int]]],
) -> None:
    """Steps 2-3 of :class:`Tree`: give each lost number to a spare, or backfill it."""
    mode, act = m.mode, m.active_rank
    n = len(mode)
    dom = st.dom
    depth = len(layers)
    reserve = [d for d in range(depth - 1, -1, -1) if layers[d].has(LayerFlag.RESERVE)]
    backfill = [d for d in range(depth - 1, -1, -1) if layers[d].has(LayerFlag.BACKFILL)]

    # Spares per RESERVE domain, in tree order, each list with a read pointer.
    # A spare that is used, or found without room, is skipped for good: the
    # active counts only grow while gaps are filled.
    spares: dict[tuple[int, int], list[int]] = {}
    if reserve:
        for r in st.order:
            if mode[r] == INACTIVE:
                for d in reserve:
                    spares.setdefault((d, dom[d][r]), []).append(r)
    pointer: dict[tuple[int, int], int] = {}
    usable = [True] * n

    # Active ranks per BACKFILL domain, highest number first.
    donors: dict[tuple[int, int], list[tuple[int, int]]] = {}
    if backfill:
        top = max((act[r] for r in range(n) if mode[r] == ACTIVE), default=-1)
        holder = [NONE] * (top + 1)
        for r in range(n):
            if mode[r] == ACTIVE:
                holder[act[r]] = r
        for v in range(top, -1, -1):
            r = holder[v]
            if r != NONE:
                for d in backfill:
                    donors.setdefault((d, dom[d][r]), []).append((v, r))
    donor_pointer: dict[tuple[int, int], int] = {}

    heap = list(slots)
    heapq.heapify(heap)
    while heap:
        gap, lost = heapq.heappop(heap)
        spare = _find_spare(dom, reserve, lost, spares, pointer, usable, caps)
        if spare != NONE:
            mode[spare] = ACTIVE
            act[spare] = gap
            for col, _, count in caps:
                count[col[spare]] += 1
            continue
        for d in backfill:
            key = (d, dom[d][lost])
            lst = donors.get(key)
            if not lst:
                continue
            p = donor_pointer.get(key, 0)
            while p < len(lst) and (mode[lst[p][1]] != ACTIVE or act[lst[p][1]] != lst[p][0]):
                p += 1  # moved or replaced since the list was made
            donor_pointer[key] = p
            if p < len(lst) and lst[p][0] > gap:
                value, donor = lst[p]
                donor_pointer[key] = p + 1
                act[donor] = gap
                heapq.heappush(heap, (value, donor))
                break


def _find_spare(
    dom: list[list[int]],
    reserve: list[int],
    lost: int,
    spares: dict[tuple[int, int], list[int]],
    pointer: dict[tuple[int, int], int],
    usable: list[bool],
    caps: list[tuple[list[int], int, list[int]]],
) -> int:
    for d in reserve:
        key = (d, dom[d][lost])
        lst = spares.get(key)
        if not lst:
            continue
        p = pointer.get(key, 0)
        found = NONE
        while p < len(lst):
            s = lst[p]
            p += 1
            if not usable[s]:
                continue
            usable[s] = False
            if all(count[col[s]] < cap for col, cap, count in caps):
                found = s
                break
        pointer[key] = p
        if found != NONE:
            return found
    return NONE


def _number_spares(st: _Structure, m: Membership) -> None:
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


# -- FilterCountGroupedByKey ------------------------------------------------------


class FilterCountGroupedByKey:
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
        _check_key_or_fn(key_or_fn, "key_or_fn")
        if not callable(condition):
            raise ValueError(f"condition={condition!r}: expected a callable (healthy_count) -> bool")
        self.key_or_fn = key_or_fn
        self.condition = condition
        self._groups: Optional[tuple[list[tuple[str, ...]], list[int], int]] = None

    def __repr__(self) -> str:
        return f"FilterCountGroupedByKey(key_or_fn={self.key_or_fn!r}, condition={self.condition!r})"

    def local_keys(self, initial_rank: int, initial_world_size: int) -> tuple[str, ...]:
        return (_evaluate_key(self.key_or_fn, initial_rank, initial_world_size),)

    def _group_of(self, keys: list[tuple[str, ...]]) -> tuple[list[int], int]:
        g = self._groups
        if g is None or g[0] is not keys:
            _check_keys(keys, 1, self, len(keys))
            ids: dict[str, int] = {}
            col = [ids.setdefault(k[0], len(ids)) for k in keys]
            g = self._groups = (keys, col, len(ids))
        return g[1], g[2]

    def __call__(self, ctx: "RankAssignmentCtx") -> "RankAssignmentCtx":
        m = ctx.membership
        keys = _topology_keys(ctx, self)
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


# -- composition ------------------------------------------------------------------


def check_composition(rank_assignment: Any) -> None:
    """Raise ``ValueError`` if ``rank_assignment`` combines these classes in a way that cannot work.

    Rules, in execution order (the last ``Compose`` argument runs first):
    at most one ``Tree``; only ``FilterCountGroupedByKey`` may run before
    it; ``ActivateAllRanks`` must not run after it; every
    ``FilterCountGroupedByKey`` must be followed by a renumbering
    assignment (``Tree``, ``ShiftRanks`` or ``FillGaps``). Custom
    assignments are not judged.
    """
    from .rank_assignment import (
        ActivateAllRanks,
        ActiveWorldSizeDivisibleBy,
        FillGaps,
        MaxActiveWorldSize,
        ShiftRanks,
    )

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


# rank_assignment re-exports this module's classes from its last line. Its
# base class is therefore imported here, after they exist, and they are
# registered as virtual subclasses: either module can be imported first.
from .rank_assignment import RankAssignment as _RankAssignment  # noqa: E402

_RankAssignment.register(Tree)
_RankAssignment.register(FilterCountGroupedByKey)
