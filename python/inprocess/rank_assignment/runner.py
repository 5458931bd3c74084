"""What the Wrapper needs of its rank assignment, behind one object: :class:`AssignmentRunner`.

* :meth:`AssignmentRunner.local_keys`: this rank's keys, published at the
  initial barrier (None when no member groups ranks);
* :meth:`AssignmentRunner.decide`: the leader's decision (the restart
  barrier's decide callback);
* :meth:`AssignmentRunner.verify`: on every rank, before it applies a
  decision, its own run of a per-rank hook against its row
  (:class:`~inprocess.rank_assignment.decision.RankAssignmentMismatch`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .. import faults
from ..control.membership import Membership
from ..control.protocol import Decision, FaultRecord
from ..state import FrozenState, State
from .agreed import AgreedInputs, initial_membership
from .base import Topology, key_gathering_leaves
from .composition import uses_per_rank_hooks
from .decision import decide, verify_own_row

# What every rank published at the initial barrier: table[initial_rank][owner] is its list of keys.
TopologyTable = Sequence[Sequence[Sequence[str]]]


class AssignmentRunner:
    """The rank assignment of one wrapped call (see the module docstring)."""

    def __init__(self, rank_assignment: Any):
        self.rank_assignment = rank_assignment
        self.per_rank = uses_per_rank_hooks(rank_assignment)
        self._owners = key_gathering_leaves(rank_assignment)
        self._topology: Topology | None = None
        self._failures: list[BaseException] = []

    def local_keys(self, state: FrozenState) -> list[list[str]] | None:
        """This rank's keys for every member that groups ranks, or None if none does."""
        if not self._owners:
            return None
        return [list(owner.local_keys(state)) for owner in self._owners]

    def forget_topology(self) -> None:
        """Processes joined seats (control/joining.py): the next read takes their keys."""
        self._topology = None

    def topology(self, read_table: Callable[[], TopologyTable]) -> Topology:
        """Everyone's keys, read once per call (they change only when processes join)."""
        if not self._owners:
            return Topology.empty()
        if self._topology is None:
            self._topology = Topology.from_table(self._owners, read_table())
        return self._topology

    def decide(
        self,
        previous: Membership | None,
        dead: set[int],
        records: list[FaultRecord],
        leader: int,
        *,
        state: State,
        read_topology: Callable[[], TopologyTable],
        takeover: bool = False,
    ) -> Decision:
        """The decision of the barrier that follows the leader's current iteration (``state``).

        ``takeover``: this rank took the lead over from a leader lost before
        its decision was out (:mod:`inprocess.control.leadership`).
        """
        iteration = 0 if previous is None else state.iteration + 1
        table = initial_membership(state.initial_world_size) if previous is None else previous
        # A deposed leader's failed hook is not this decision's.
        self._failures.clear()

        def enter_reassignment() -> None:  # INPROCESS_FAULTS: phase=reassignment (or takeover), on the leader only
            faults.enter_phase("takeover" if takeover else "reassignment", state.initial_rank,
                               state.initial_world_size, state.iteration, state.mode)

        return decide(
            self.rank_assignment, table, dead, records, iteration, leader, self.topology(read_topology),
            hook_iteration=state.iteration, failures=self._failures, before_assignment=enter_reassignment,
        )

    def take_failure(self) -> BaseException | None:
        """The exception of the hook that failed in this process's last :meth:`decide`, if any."""
        failure = self._failures[-1] if self._failures else None
        self._failures.clear()
        return failure

    def verify(
        self,
        decision: Decision,
        previous: Membership | None,
        before: FrozenState,
        read_topology: Callable[[], TopologyTable],
    ) -> None:
        """For a per-rank assignment: this rank's own run against its row of ``decision``.

        ``previous`` is the decision this rank applied last (None before the
        first), ``before`` its state until now.
        """
        if not self.per_rank or decision.abort is not None:
            return
        table = initial_membership(before.initial_world_size) if previous is None else previous
        inputs = AgreedInputs(table, decision.iteration, before.iteration, lambda: self.topology(read_topology))
        verify_own_row(self.rank_assignment, inputs, before, decision)
