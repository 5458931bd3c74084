"""Point to point staged through a device: what an NCCL group needs (it moves device tensors only).

Every chunk passes through one of two buffers of ``chunk_bytes`` on the staging device, and every
send and receive is posted inside ``torch.distributed.batch_isend_irecv``: on an NCCL group a
batched point-to-point runs on the group's own communicator, where a single ``send``/``recv``
would make a two-rank communicator per pair of ranks beside it (torch's
``ProcessGroupNCCL::pointToPoint``: the notes of :mod:`inprocess.peer_state.process_group`).
Two buffers let a chunk leave while the next one is staged: a source copies chunk i+1 in while
chunk i is sent, and a relay in a chain receives chunk i+1 in the same batch that passes chunk
i on.

Buffer i % 2 holds chunk i. Its reuse is ordered by the batch that last used it: over NCCL,
``work.wait()`` makes the current stream wait for the batch (the copies are queued behind it),
and the batches of one communicator run in order on its stream; over gloo (the CPU staging the
tests use) ``wait()`` returns once the transfer is done.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


@contextlib.contextmanager
def current(device: torch.device) -> Iterator[None]:
    """`device` as the current CUDA device while a batch is posted (torch's batch_isend_irecv
    asks for it on NCCL); nothing for another device."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


class Staged:
    """Sends and relays through two buffers on `device`, over `group`."""

    def __init__(self, group: Any | None, device: torch.device, chunk_bytes: int) -> None:
        self.group = group
        self.device = device
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
        self.count = 0  # chunks a relay has received so far (chunk i in buffer i % 2)
        self.forward: torch.Tensor | None = None  # the last chunk received, not yet passed on

    def batch(self, ops: Sequence[tuple[str, torch.Tensor, int]]) -> list[Any]:
        """("send" or "recv", tensor, global peer) ops, posted as one batch; their works."""
        import torch.distributed as dist

        with current(self.device):
            return dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer,
                                                      group=self.group) for kind, tensor, peer in ops])

    def send(self, chunks: Sequence[torch.Tensor], peer: int) -> list[Any]:
        """Each chunk staged and sent to `peer`, a batch each; the works still running."""
        works: list[list[Any]] = [[], []]
        for i, chunk in enumerate(chunks):
            for work in works[i % 2]:  # the send that last read this buffer
                work.wait()
            staged = self.buffers[i % 2][:chunk.numel()].copy_(chunk)
            works[i % 2] = self.batch([("send", staged, peer)])
        return works[0] + works[1]

    def relay(self, chunks: Sequence[torch.Tensor], before: int, after: int | None) -> None:
        """Each chunk received from `before` into its place; the chunk before it passed on to
        `after` (None: the chain's end) in the same batch."""
        for chunk in chunks:
            staged = self.buffers[self.count % 2][:chunk.numel()]
            ops = [("recv", staged, before)]
            if self.forward is not None and after is not None:
                ops.append(("send", self.forward, after))
            for work in self.batch(ops):
                work.wait()
            chunk.copy_(staged)
            self.forward = staged
            self.count += 1

    def flush(self, after: int | None) -> None:
        """The last chunk received passed on to `after`; ready for the next transfer."""
        if self.forward is not None and after is not None:
            for work in self.batch([("send", self.forward, after)]):
                work.wait()
        self.forward, self.count = None, 0
