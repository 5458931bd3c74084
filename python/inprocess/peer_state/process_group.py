"""The transport over a torch.distributed process group: point to point, in chunks, as a pipeline.

Snapshots travel as :mod:`inprocess.peer_state.wire` pieces, each in chunks of at most
``chunk_bytes`` (smaller for a long chain). A source sends to the first of its receivers only; each receiver passes
every chunk on to the next receiver as soon as it has it (a chain), so that a source's
time does not grow with its receivers: n receivers wait for the snapshot plus n - 1
chunks. Over gloo every chunk's receive is posted at once and every send is
non-blocking (the transfers run on gloo's threads). Over an NCCL group each chunk is
staged through a device buffer (:mod:`inprocess.peer_state.staged`): NCCL moves device
tensors only. The ranks' rows of integers travel in one all_reduce.

The NCCL path, as torch 2.13 does it (torch/distributed/distributed_c10d.py of the 2.13.0
wheel; torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp at github.com/cyyever/pytorch
commit 0b10febc2dd0, a fork whose ProcessGroupNCCL.hpp matches the wheel's):

- The device. ``init_process_group(device_id=d)`` binds the group to ``d``
  (``_new_process_group_helper`` sets ``pg.bound_device_id``); ``new_group`` passes the
  default group's on (``_new_group_with_tag``). A job may bind without calling
  ``torch.cuda.set_device``: the current device is then cuda:0 on every rank. The buffers
  live on the bound device (:func:`device_of`), else on the current one.
- One communicator. ``ProcessGroupNCCL::pointToPoint`` runs a send or receive posted in a
  batch (``batch_isend_irecv``: ``ncclActiveGroupCounter_ > 0``) on the communicator keyed
  ``getKeyFromDevice``, the group's collective one; a single ``send``/``recv`` on a group
  initialised lazily (no ``device_id``) makes a two-rank communicator per pair
  (``getKeySendRecv``), each with its own proxy threads to tear down at a restart, and on an
  eagerly initialised group is serialised with the group's other work. Every point to point
  of this path is batched. torch's ``batch_isend_irecv`` documents that when a batch is
  the group's first operation, every rank of the group must take part: on a group not bound
  to a device (its communicator made at its first operation) the transport runs a
  one-element all_reduce first, on every rank of the group, so that a batch between a few
  of them finds the communicator made.
- A source that dies. Over gloo a receive from a dead peer fails once its connection closes,
  and the restore raises on every rank. Over NCCL it does not fail: the receive's kernel
  waits for data that never comes until the restart's abort of the group releases it (or
  torch's watchdog times the group out): the restart that the source's death starts anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import wire
from .snapshot import Snapshot
from .staged import Staged
from .transport import Transport


def device_of(group: Any | None) -> torch.device:
    """The CUDA device an NCCL `group` (None: the default group) is bound to: its own
    ``bound_device_id``, else the default group's, else the current device."""
    import torch.distributed as dist

    for pg in (dist.group.WORLD if group is None else group, dist.group.WORLD):
        bound = getattr(pg, "bound_device_id", None)
        if bound is not None:
            return torch.device(bound)
    return torch.device("cuda", torch.cuda.current_device())


class ProcessGroupTransport(Transport):
    """torch.distributed point to point over `group` (None: the default group). `staging`:
    the device each chunk is staged through (every point to point then batched); None: the
    device an NCCL group is bound to (:func:`device_of`), no staging for another backend."""

    def __init__(self, group: Any | None, chunk_bytes: int, staging: torch.device | None = None) -> None:
        import torch.distributed as dist

        self.group = group
        self.chunk = chunk_bytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # The group's global ranks by group rank; its key, the lowest, names it in a snapshot.
        self.members = list(range(self.world)) if group is None else dist.get_process_group_ranks(group)
        self.key = min(self.members)
        if staging is None and dist.get_backend(group) == "nccl":
            staging = device_of(group)
        self.staged = None if staging is None else Staged(group, staging, chunk_bytes)
        if staging is not None and getattr(dist.group.WORLD if group is None else group, "bound_device_id",
                                           None) is None:
            # not bound: an NCCL communicator made at the group's first operation, here, where every
            # rank of the group takes part (see above)
            dist.all_reduce(torch.zeros(1, device=staging), group=group)

    def rows(self, row: Sequence[int]) -> list[list[int]]:
        """One all_reduce (a sum) of a matrix that holds zeros but in this rank's row."""
        import torch.distributed as dist

        device = "cpu" if self.staged is None else self.staged.device
        rows = torch.zeros((self.world, len(row)), dtype=torch.int64, device=device)
        rows[self.rank] = torch.tensor(list(row), dtype=torch.int64, device=device)
        dist.all_reduce(rows, group=self.group)
        return [[int(x) for x in r] for r in rows.tolist()]

    def chunks(self, data: torch.Tensor, receivers: int) -> list[torch.Tensor]:
        """`data` in the chunks it travels in: at most ``chunk_bytes``, and small enough that a
        chain of `receivers` fills in a few percent of the time (a 16th of a receiver's share),
        not below 256 KiB. Sender and receivers compute the same from what both know."""
        size = min(self.chunk, max(256 << 10, data.numel() // (16 * receivers)))
        return [data[start:start + size] for start in range(0, data.numel(), size)]

    def send(self, snapshot: Snapshot, receivers: Sequence[int]) -> Callable[[], int]:
        """To the first receiver (it passes the chunks on to the others)."""
        import torch.distributed as dist

        if not receivers:
            return lambda: 0
        peer = self.members[receivers[0]]
        chunks = [chunk for piece in wire.pieces(snapshot) for chunk in self.chunks(piece, len(receivers))]
        if self.staged is not None:
            works = self.staged.send(chunks, peer)
        else:
            works = [dist.isend(chunk, peer, group=self.group) for chunk in chunks]

        def finish() -> int:
            for work in works:
                if work is not None:
                    work.wait()
            return snapshot.nbytes
        return finish

    def receive(self, source: int, receivers: Sequence[int], spare: Snapshot | None = None,
                destinations: wire.Destinations | None = None) -> Snapshot:
        import torch.distributed as dist

        at = list(receivers).index(self.rank)
        before = self.members[source if at == 0 else receivers[at - 1]]
        after = self.members[receivers[at + 1]] if at + 1 < len(receivers) else None
        passing: list[Any] = []

        def piece(data: torch.Tensor) -> None:
            chunks = self.chunks(data, len(receivers))
            if self.staged is not None:
                self.staged.relay(chunks, before, after)
                return
            works = [dist.irecv(chunk, before, group=self.group) for chunk in chunks]
            for work, chunk in zip(works, chunks, strict=True):
                if work is not None:
                    work.wait()
                if after is not None:
                    passing.append(dist.isend(chunk, after, group=self.group))

        received = wire.read(piece, spare, destinations)
        if self.staged is not None:
            self.staged.flush(after)
        for work in passing:
            if work is not None:
                work.wait()
        return received

    def exchange(self, snapshot: Snapshot, keeper: int, partner: int, spare: Snapshot | None) -> Snapshot:
        """Sends are posted first, non-blocking, so that the ring never waits on itself
        (host memory only: a private gloo group; a staged send waits for its receiver)."""
        finish = self.send(snapshot, [keeper])
        received = self.receive(partner, [self.rank], spare)
        finish()
        return received
