"""The transport interface: how the ranks of one group agree on small numbers and move snapshots.

A peer state (:class:`~inprocess.peer_state.ReplicatedState`,
:class:`~inprocess.peer_state.ShardedState`) decides *what* goes *where* from a
table every rank holds alike; a :class:`Transport` carries it out between the
group's ranks (numbered 0..world-1 within the group). Every method is a collective
among the ranks it names, called by each of them with the same arguments, except
the snapshot, which only a source passes.

:class:`~inprocess.peer_state.process_group.ProcessGroupTransport` is the one
in use: torch.distributed point to point over the user's group (gloo, or NCCL
staged through the GPU), or over a private gloo group. Another transport (shared
memory between the ranks of a node, a plan-named source) is a subclass in a file
of its own.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

from .snapshot import Snapshot
from .wire import Destinations


class Transport(abc.ABC):
    """Snapshots and small integers between the ranks of one group."""

    rank: int  # this process's rank in the group
    world: int  # the group's size
    members: list[int]  # the group's global ranks, by group rank
    key: int  # the lowest of them: names the group in a snapshot (0: the default group)

    @abc.abstractmethod
    def rows(self, row: Sequence[int]) -> list[list[int]]:
        """Every rank's `row` of integers (the same length everywhere), by group rank."""

    @abc.abstractmethod
    def send(self, snapshot: Snapshot, receivers: Sequence[int]) -> Callable[[], int]:
        """Called by the source: starts sending `snapshot` to every rank of `receivers` (in
        the order and shape the transport chooses); the function returned waits until it
        has left and says how many bytes this rank sent. `snapshot` must not change meanwhile."""

    @abc.abstractmethod
    def receive(self, source: int, receivers: Sequence[int], spare: Snapshot | None = None,
                destinations: Destinations | None = None) -> Snapshot:
        """Called by each rank of `receivers` (the same sequence the source sends to): the
        snapshot `source` sends, written into `spare` where its layout fits, or in place
        into the tensors `destinations` names (:func:`inprocess.peer_state.wire.read`)."""

    @abc.abstractmethod
    def exchange(self, snapshot: Snapshot, keeper: int, partner: int, spare: Snapshot | None) -> Snapshot:
        """Every rank at once: sends `snapshot` to `keeper` and receives `partner`'s (a ring:
        each rank is one rank's keeper and another's partner)."""
