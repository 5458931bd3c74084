"""Rank assignment: the membership of the next iteration, decided by one leader.

Unlike ``nvidia_resiliency_ext.inprocess``, where each rank runs the assignment
on its own view, here the first healthy rank to arrive at the restart barrier
runs it once for the whole job and publishes the result, which every rank
reads (design principle 3). The built-in classes keep that library's names and
meaning, so configurations carry over.

The package, one concept per module:

* :mod:`.base`: :class:`RankAssignment`, its context and the gathered :class:`Topology`;
* :mod:`.renumbering`: :class:`ShiftRanks`, :class:`FillGaps`;
* :mod:`.activation`: :class:`ActivateAllRanks`, :class:`MaxActiveWorldSize`,
  :class:`ActiveWorldSizeDivisibleBy`;
* :mod:`.keys`: grouping keys (:class:`EnvKey`, :class:`HostnameKey`);
* :mod:`.layers`, :mod:`.tree`, :mod:`.tree_decision`: :class:`Tree` of :class:`Layer`;
* :mod:`.filter_count`: :class:`FilterCountGroupedByKey`;
* :mod:`.composition`: the rules for composing them, checked when the Wrapper is built;
* :mod:`.decision`: the leader's decision that the restart barrier publishes.
"""

from ..compose import Compose
from ..exception import RankDiscarded
from .activation import ActivateAllRanks, ActiveWorldSizeDivisibleBy, MaxActiveWorldSize
from .base import RankAssignment, RankAssignmentCtx, Topology, key_gathering_leaves
from .composition import check_composition, check_rank_assignment
from .decision import decide, run_assignment
from .filter_count import FilterCountGroupedByKey
from .keys import EnvKey, HostnameKey
from .layers import Layer, LayerFlag
from .renumbering import FillGaps, ShiftRanks
from .tree import Tree

__all__ = [
    "RankAssignment",
    "RankAssignmentCtx",
    "Topology",
    "RankDiscarded",
    "Compose",
    "ActivateAllRanks",
    "ShiftRanks",
    "FillGaps",
    "MaxActiveWorldSize",
    "ActiveWorldSizeDivisibleBy",
    "FilterCountGroupedByKey",
    "Layer",
    "LayerFlag",
    "Tree",
    "EnvKey",
    "HostnameKey",
    "check_composition",
    "check_rank_assignment",
    "key_gathering_leaves",
    "decide",
    "run_assignment",
]
