"""The transport over a torch.distributed process group: point to point, in chunks, as a pipeline.

Snapshots travel as :mod:`inprocess.peer_state.wire` pieces, each in chunks of at most
``chunk_bytes`` (smaller for a long chain). A source sends to the first of its receivers only; each receiver passes
every chunk on to the next receiver as soon as it has it (a chain), so that a source's
time does not grow with its receivers: n receivers wait for the snapshot plus n - 1
chunks. Over gloo every chunk's receive is posted at once and every send is
non-blocking (the transfers run on gloo's threads); over an NCCL group each chunk is
staged through one buffer on the current GPU (NCCL sends and receives device tensors),
one chunk at a time. The ranks' rows of integers travel in one all_reduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import wire
from .snapshot import Snapshot
from .transport import Transport


class ProcessGroupTransport(Transport):
    """torch.distributed point to point over `group` (None: the default group)."""

    def __init__(self, group: Any | None, chunk_bytes: int) -> None:
        import torch.distributed as dist

        self.group = group
        self.chunk = chunk_bytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # The group's global ranks by group rank; its key, the lowest, names it in a snapshot.
        self.members = list(range(self.world)) if group is None else dist.get_process_group_ranks(group)
        self.key = min(self.members)
        if dist.get_backend(group) == "nccl":
            self.staging: torch.Tensor | None = torch.empty(chunk_bytes, dtype=torch.uint8,
                                                               device=torch.device("cuda", torch.cuda.current_device()))
        else:
            self.staging = None

    def rows(self, row: Sequence[int]) -> list[list[int]]:
        """One all_reduce (a sum) of a matrix that holds zeros but in this rank's row."""
        import torch.distributed as dist

        device = "cpu" if self.staging is None else self.staging.device
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
        if self.staging is not None:
            for piece in wire.pieces(snapshot):
                for chunk in self.chunks(piece, len(receivers)):
                    dist.send(self.staging[:chunk.numel()].copy_(chunk), peer, group=self.group)
            return lambda: snapshot.nbytes
        works = [dist.isend(chunk, peer, group=self.group)
                 for piece in wire.pieces(snapshot) for chunk in self.chunks(piece, len(receivers))]

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
            if self.staging is not None:
                for chunk in chunks:
                    staged = self.staging[:chunk.numel()]
                    dist.recv(staged, before, group=self.group)
                    if after is not None:
                        dist.send(staged, after, group=self.group)
                    chunk.copy_(staged)
                return
            works = [dist.irecv(chunk, before, group=self.group) for chunk in chunks]
            for work, chunk in zip(works, chunks, strict=True):
                if work is not None:
                    work.wait()
                if after is not None:
                    passing.append(dist.isend(chunk, after, group=self.group))

        received = wire.read(piece, spare, destinations)
        for work in passing:
            if work is not None:
                work.wait()
        return received

    def exchange(self, snapshot: Snapshot, keeper: int, partner: int, spare: Snapshot | None) -> Snapshot:
        """Sends are posted first, non-blocking, so that the ring never waits on itself
        (host memory only: a private gloo group)."""
        finish = self.send(snapshot, [keeper])
        received = self.receive(partner, [self.rank], spare)
        finish()
        return received
