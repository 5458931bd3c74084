"""Rank assignment: who takes part in the next iteration, and with which rank.

Two kinds of hook, one decision per restart (design principle 3):

* **Per-rank**, as ``nvidia_resiliency_ext.inprocess`` defines it: a
  :class:`RankAssignment` subclass whose ``__call__(ctx)`` reads
  ``ctx.state`` (one rank's :class:`~inprocess.State`) and
  ``ctx.terminated_ranks`` (the ranks leaving, numbered by ``State.rank``) and
  returns the context with that rank's next state. The Wrapper runs it on
  inputs every rank agrees on (the previous decision, the ranks leaving): the
  leader for every rank, publishing the table the results form; then each
  rank for itself, checking its own row. An inconsistent table (two ranks
  with one rank, a gap, a rank missing) or a rank whose own result differs
  ends the job with an error naming the ranks; it never splits the job.
* **Job-wide**: a :class:`JobAssignment` subclass whose ``assign_job(ctx)``
  transforms the whole membership table (:class:`JobAssignmentCtx`) at once.
  The leader runs it once per restart, O(world size) in all. Every built-in
  assignment is job-wide, and is also callable per rank exactly as there
  (``ShiftRanks()(RankAssignmentCtx(State(), store, {1}))``), giving that
  rank's row of the same decision.

Write a per-rank hook to port one unchanged, or for logic that is easiest
stated for one rank; write a job-wide one when the job is large (the leader
runs a per-rank hook once per rank) or the logic needs the whole table.
``docs/rank_assignment.md`` compares the two.

The package, one concept per module: :mod:`.base` (the hooks and their
contexts), :mod:`.job` (job-wide steps and their per-rank view),
:mod:`.renumbering`, :mod:`.activation`, :mod:`.keys`, :mod:`.layers`,
:mod:`.tree` with :mod:`.tree_decision`, :mod:`.nodes` (NVRx's tree
nodes, for code that walks a tree itself), :mod:`.filter_count`,
:mod:`.composition` (the rules for composing them), :mod:`.agreed` (the
agreed inputs), :mod:`.consistency` (the checks of every decision),
:mod:`.decision` (the leader's decision and each rank's check),
:mod:`.store_gather` (per-rank calls outside the Wrapper) and :mod:`.runner`
(what the Wrapper calls).
"""

from ..compose import Compose
from ..exception import RankDiscarded
from .activation import ActivateAllRanks, ActiveWorldSizeDivisibleBy, MaxActiveWorldSize
from .agreed import initial_membership
from .base import JobAssignmentCtx, RankAssignment, RankAssignmentCtx, RankFilter, Topology, key_gathering_leaves
from .composition import check_composition, check_rank_assignment, uses_per_rank_hooks
from .consistency import InconsistentAssignment
from .decision import RankAssignmentMismatch, decide, run_job_wide
from .filter_count import FilterCountGroupedByKey
from .job import JobAssignment
from .keys import EnvKey, HostnameKey
from .layers import Layer, LayerFlag
from .nodes import Node, bounded_activate, propagate_terminations
from .renumbering import FillGaps, ShiftRanks
from .runner import AssignmentRunner
from .tree import Tree

__all__ = [
    "RankAssignment",
    "RankAssignmentCtx",
    "RankFilter",
    "JobAssignment",
    "JobAssignmentCtx",
    "Topology",
    "RankDiscarded",
    "RankAssignmentMismatch",
    "InconsistentAssignment",
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
    "Node",
    "bounded_activate",
    "propagate_terminations",
    "EnvKey",
    "HostnameKey",
    "AssignmentRunner",
    "check_composition",
    "check_rank_assignment",
    "uses_per_rank_hooks",
    "key_gathering_leaves",
    "initial_membership",
    "decide",
    "run_job_wide",
]
