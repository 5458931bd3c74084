"""NVRx's topology-tree nodes: :class:`Node`, :func:`bounded_activate`, :func:`propagate_terminations`.

NVRx's ``Tree`` is built from these objects, one per domain and one leaf per
rank, and its module exports them. They are here with NVRx's attributes,
methods and rules, for code that builds or walks such a tree itself (a custom
per-rank assignment, a test of a topology). :class:`~inprocess.rank_assignment.Tree`
does not use them: it decides once for the whole job over plain lists
(:mod:`.tree_decision`), with the same rules.

A leaf holds a rank's mutable :class:`~inprocess.State`; an inner node holds
its :class:`~inprocess.rank_assignment.Layer` and no state. Each inner node
keeps ``inactive_nodes``, the spares below it by initial rank, so a lost rank's
replacement is found by walking up from it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ..state import Mode, State
from .layers import Layer, LayerFlag

log = logging.getLogger("inprocess")


class Node:
    """One node of a topology tree: a domain of ``layer`` (inner node) or a rank holding ``state`` (leaf).

    ``name`` is the domain's grouping key (a leaf's: its initial rank);
    ``children`` maps the children's names to them; ``active_count`` is the
    number of active ranks below, counted by :func:`bounded_activate`;
    ``backfill_domain`` is set on a leaf by :meth:`assign_backfill_domain`.
    """

    def __init__(self, parent: Node | None, name: Any, layer: Layer | None, state: State | None):
        self.parent = parent
        self.name = name
        self.layer = layer
        self.state = state
        self.active_count = 0
        self.children: dict[Any, Node] = {}
        self.inactive_nodes: dict[int, Node] = {}
        self.backfill_domain: Node | None = None

    def add_child(self, name: Any, layer: Layer | None, state: State | None) -> Node:
        """A new child named ``name`` (replacing one of that name), returned."""
        child = Node(self, name, layer, state)
        self.children[name] = child
        return child

    def is_leaf(self) -> bool:
        return not self.children

    def iter_leaves(self) -> Iterator[Node]:
        """The leaves below (this node itself if it is one), in insertion order, depth first."""
        if self.is_leaf():
            yield self
            return
        for child in self.children.values():
            yield from child.iter_leaves()

    def ancestors(self) -> Iterator[Node]:
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def deactivate(self) -> None:
        """This leaf's rank becomes a spare: known as such to every domain above it."""
        state = self._leaf_state("deactivate")
        state.mode = Mode.INACTIVE
        state.active_rank = None
        for domain in self.ancestors():
            domain.inactive_nodes[state.initial_rank] = self

    def terminate(self) -> None:
        """This leaf's rank leaves the job: no longer a spare of any domain."""
        state = self._leaf_state("terminate")
        state.mode = Mode.TERMINATED
        self._leave_the_spares(state.initial_rank)

    def activate(self, active_rank: int) -> None:
        """This leaf's rank becomes active with ``active_rank``: no longer a spare of any domain."""
        state = self._leaf_state("activate")
        state.active_rank = active_rank
        state.mode = Mode.ACTIVE
        self._leave_the_spares(state.initial_rank)

    def assign_backfill_domain(self) -> None:
        """The highest domain above this leaf reached through ``BACKFILL`` layers only (None if its parent's
        layer is not one): where a gap this rank leaves may be filled from."""
        if not self.is_leaf():
            raise ValueError(f"{self!r}: assign_backfill_domain() is for a leaf (a rank), this node has children")
        domain = None
        node = self.parent
        while node is not None and node.layer is not None and node.layer.flag and node.layer.flag & LayerFlag.BACKFILL:
            domain = node
            node = node.parent
        self.backfill_domain = domain

    def _leave_the_spares(self, initial_rank: int) -> None:
        for domain in self.ancestors():
            domain.inactive_nodes.pop(initial_rank, None)

    def _leaf_state(self, what: str) -> State:
        if self.state is None:
            raise ValueError(f"{self!r}: {what}() needs a leaf holding a rank's state, this node holds none")
        return self.state

    def __repr__(self) -> str:
        return f"Node(name={self.name!r})"


def bounded_activate(
    node: Node, counter: int, path: list[Node] | None = None, current_state: Any = None
) -> int:
    """Activate the leaves below ``node`` in depth-first order, numbering them from ``counter``,
    as long as every domain on the way (``path``, then each node passed) has fewer than its
    layer's ``max_ranks`` active ranks; the other leaves become spares. Returns the next number
    (the active world size when called on the root with 0). ``current_state``: the calling rank's
    state; its own activation or deactivation is logged at INFO."""
    path = [] if path is None else path
    if node.is_leaf():
        leaf_state = node._leaf_state("bounded_activate")
        room = all(d.layer is None or d.layer.max_ranks is None or d.active_count < d.layer.max_ranks for d in path)
        mine = current_state is not None and current_state.initial_rank == leaf_state.initial_rank
        if room:
            if mine:
                log.info("rank assignment: initial rank %d activated as active rank %d",
                         leaf_state.initial_rank, counter)
            node.activate(counter)
            counter += 1
            for domain in path:
                domain.active_count += 1
        else:
            if mine:
                log.info("rank assignment: initial rank %d is a spare (a domain above holds max_ranks active ranks)",
                         leaf_state.initial_rank)
            node.deactivate()
    path.append(node)
    for child in node.children.values():
        counter = bounded_activate(child, counter, path, current_state)
    path.pop()
    return counter


def propagate_terminations(node: Node, terminated_ranks: set[int]) -> set[int]:
    """``terminated_ranks`` (numbered by ``State.rank``) grown by every domain below ``node``
    left with fewer healthy ranks than its layer's ``min_ranks``: all its ranks are added.
    Deepest domains first, so a domain's loss counts against the domains above. The set is
    updated in place and returned."""
    for child in node.children.values():
        terminated_ranks = propagate_terminations(child, terminated_ranks)
    if node.is_leaf() or node.layer is None:
        return terminated_ranks
    alive = [leaf.state for leaf in node.iter_leaves() if leaf.state is not None and leaf.state.mode != Mode.TERMINATED]
    healthy = sum(1 for s in alive if s.rank not in terminated_ranks)
    if healthy < node.layer.min_ranks:
        terminated_ranks.update(s.rank for s in alive)
    return terminated_ranks
