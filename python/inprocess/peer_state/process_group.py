"""The transport over a torch.distributed process group: point to point, in chunks.

Snapshots travel as :mod:`inprocess.peer_state.wire` pieces, each in chunks of at
most ``chunk_bytes``; over an NCCL group every chunk is staged through one buffer
on the current GPU (NCCL sends and receives device tensors). The ranks' rows of
integers travel in one all_reduce.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from . import wire
from .snapshot import Snapshot
from .transport import Transport


class ProcessGroupTransport(Transport):
    """torch.distributed point to point over `group` (None: the default group)."""

    def __init__(self, group: Optional[Any], chunk_bytes: int) -> None:
        import torch.distributed as dist

        self.group = group
        self.chunk = chunk_bytes
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        # The group's global ranks by group rank; its key, the lowest, names it in a snapshot.
        self.members = list(range(self.world)) if group is None else dist.get_process_group_ranks(group)
        self.key = min(self.members)
        if dist.get_backend(group) == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")

    def _global(self, rank: int) -> int:
        import torch.distributed as dist

        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def rows(self, row: Sequence[int]) -> List[List[int]]:
        """One all_reduce (a sum) of a matrix that holds zeros but in this rank's row."""
        import torch.distributed as dist

        rows = torch.zeros((self.world, len(row)), dtype=torch.int64, device=self.device)
        rows[self.rank] = torch.tensor(list(row), dtype=torch.int64, device=self.device)
        dist.all_reduce(rows, group=self.group)
        return [[int(x) for x in r] for r in rows.tolist()]

    def _staging(self) -> Optional[torch.Tensor]:
        """A chunk's buffer on the GPU for an NCCL group."""
        return torch.empty(self.chunk, dtype=torch.uint8, device=self.device) if self.device.type == "cuda" else None

    def _send_bytes(self, data: torch.Tensor, peer: int, staging: Optional[torch.Tensor]) -> None:
        import torch.distributed as dist

        for start in range(0, data.numel(), self.chunk):
            piece = data[start:start + self.chunk]
            if staging is not None:
                piece = staging[:piece.numel()].copy_(piece)
            dist.send(piece, self._global(peer), group=self.group)

    def _recv_bytes(self, data: torch.Tensor, peer: int, staging: Optional[torch.Tensor]) -> None:
        import torch.distributed as dist

        for start in range(0, data.numel(), self.chunk):
            piece = data[start:start + self.chunk]
            if staging is None:
                dist.recv(piece, self._global(peer), group=self.group)
            else:
                dist.recv(staging[:piece.numel()], self._global(peer), group=self.group)
                piece.copy_(staging[:piece.numel()])

    def send(self, snapshot: Snapshot, receivers: Sequence[int]) -> int:
        """To each receiver in turn."""
        staging = self._staging()
        for receiver in receivers:
            for piece in wire.pieces(snapshot):
                self._send_bytes(piece, receiver, staging)
        return snapshot.nbytes * len(receivers)

    def receive(self, source: int, receivers: Sequence[int], spare: Optional[Snapshot] = None) -> Snapshot:
        staging = self._staging()
        return wire.read(lambda data: self._recv_bytes(data, source, staging), spare)

    def exchange(self, snapshot: Snapshot, keeper: int, partner: int, spare: Optional[Snapshot]) -> Snapshot:
        """Sends are posted first, non-blocking, so that the ring never waits on itself
        (host memory only: a private gloo group)."""
        import torch.distributed as dist

        works = [dist.isend(piece[start:start + self.chunk], self._global(keeper), group=self.group)
                 for piece in wire.pieces(snapshot) for start in range(0, piece.numel(), self.chunk)]
        received = wire.read(lambda data: self._recv_bytes(data, partner, None), spare)
        for work in works:
            if work is not None:
                work.wait()
        return received
