"""A recording fake of the ``torch.distributed`` calls that peer_state's transport makes over an
NCCL group, for one rank at a time, with CUDA devices a CPU build of torch cannot give.

It stands in for the module (the transport imports ``torch.distributed`` where it calls it), and
follows torch 2.13 (torch/distributed/distributed_c10d.py of the 2.13.0 wheel;
torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp at github.com/cyyever/pytorch commit
0b10febc2dd0, whose declarations match the wheel's ProcessGroupNCCL.hpp):

- ``init_process_group(device_id=d)`` sets the group's ``bound_device_id`` (``_new_process_group_helper``)
  and connects its communicator at once (``eager_connect_single_device``; in C++
  ``ProcessGroupNCCL::eagerConnectSingleDevice`` sets ``eagerInit_``); an unbound group makes
  it at its first operation, which every rank of the group must then take part in (the note of
  ``batch_isend_irecv``). :class:`FakeGroup` holds ``bound_device_id``; an all_reduce makes the
  communicator of an unbound one; a batch on an unbound group without one raises (NCCL would wait
  for ranks that never come).
- ``ProcessGroupNCCL::pointToPoint`` picks the communicator of each send and receive: in a batch
  (``ncclActiveGroupCounter_ > 0``) or on an eagerly initialised group, the group's collective one
  (``getKeyFromDevice``); a single op on a lazily initialised group, a two-rank one per pair
  (``getKeySendRecv``). Every op is recorded with that communicator.
- ``batch_isend_irecv`` takes ``P2POp(isend or irecv, tensor, peer, group)`` and returns the
  works; the peers are global ranks. Its note asks for the current CUDA device to be set: each
  batch records the current device (:class:`FakeCuda`).

Data: what a rank sends is kept, by (sender, receiver), in a shared mailbox; a receive takes the
next message from its peer, which must have the receiving tensor's size (NCCL matches counts).
Ranks run one after the other: a source first, then each receiver of its chain.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch


class FakeGroup:
    def __init__(self, ranks: list[int], bound: torch.device | None = None) -> None:
        self.ranks = ranks
        self.bound_device_id = bound
        self.communicator = bound is not None  # eager: connected when created


class FakeWork:
    def wait(self) -> bool:
        return True


class FakeCuda:
    """``torch.cuda.current_device()`` and ``torch.cuda.device(d)``, and allocations on a CUDA
    device recorded and served from host memory (a CPU build cannot allocate one).

    The current device is the calling thread's (the CUDA runtime's current device is per host
    thread: ``cudaSetDevice``; c10/cuda/CUDAFunctions.cpp ``current_device`` asks
    ``cudaGetDevice``): a thread that never set one is on device 0. ``pin_memory=True``
    allocations (page-locked host memory, which a CPU build refuses to allocate) are served from
    ordinary host memory and recorded in ``pinned``."""

    def __init__(self, current: int = 0) -> None:
        self._thread = threading.local()
        self.current = current
        self.allocated: list[torch.device] = []
        self.pinned: list[torch.Tensor] = []
        self._empty, self._zeros = torch.empty, torch.zeros

    @property
    def current(self) -> int:
        return getattr(self._thread, "current", 0)

    @current.setter
    def current(self, index: int) -> None:
        self._thread.current = index

    def is_pinned(self, t: torch.Tensor) -> bool:
        return any(p.data_ptr() == t.data_ptr() for p in self.pinned)

    def current_device(self) -> int:
        return self.current

    @contextlib.contextmanager
    def device(self, device: torch.device) -> Iterator[None]:
        before, self.current = self.current, torch.device(device).index
        try:
            yield
        finally:
            self.current = before

    def _on_host(self, real: Any, *size: Any, device: Any = None, pin_memory: bool = False,
                 **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            self.allocated.append(torch.device(device))
            device = None
        t = real(*size, device=device, **kwargs)
        if pin_memory:
            self.pinned.append(t)
        return t

    def empty(self, *size: Any, **kwargs: Any) -> torch.Tensor:
        return self._on_host(self._empty, *size, **kwargs)

    def zeros(self, *size: Any, **kwargs: Any) -> torch.Tensor:
        return self._on_host(self._zeros, *size, **kwargs)


class RecordingDist:
    """``torch.distributed`` as the global rank `rank` of `world` sees it (backend "nccl")."""

    def __init__(self, rank: int, world: FakeGroup, mailbox: dict[tuple[int, int], collections.deque],
                 cuda: FakeCuda) -> None:
        self.rank = rank
        self.group = SimpleNamespace(WORLD=world)
        self.mailbox = mailbox
        self.cuda = cuda
        self.calls: list[tuple[Any, ...]] = []  # ("all_reduce", group), ("batch", device, ops), ("single", op)
        self._batch: list[tuple[Any, ...]] | None = None  # the ops of the batch being posted

    def _group(self, group: FakeGroup | None) -> FakeGroup:
        return self.group.WORLD if group is None else group

    def get_rank(self, group: FakeGroup | None = None) -> int:
        return self._group(group).ranks.index(self.rank)

    def get_world_size(self, group: FakeGroup | None = None) -> int:
        return len(self._group(group).ranks)

    def get_process_group_ranks(self, group: FakeGroup) -> list[int]:
        return list(group.ranks)

    def get_backend(self, group: FakeGroup | None = None) -> str:
        return "nccl"

    def all_reduce(self, tensor: torch.Tensor, group: FakeGroup | None = None) -> FakeWork:
        self._group(group).communicator = True
        self.calls.append(("all_reduce", self._group(group)))
        return FakeWork()

    def _p2p(self, kind: str, tensor: torch.Tensor, peer: int, group: FakeGroup | None) -> FakeWork:
        pg = self._group(group)
        if self._batch is not None or pg.bound_device_id is not None:
            if not pg.communicator:
                raise RuntimeError("a batch on a group whose communicator no collective made: NCCL would wait "
                                   "for every rank of the group")
            comm: Any = "group"
        else:
            comm = ("pair", min(self.rank, peer), max(self.rank, peer))
        op = (kind, peer, tensor.numel(), comm)
        if self._batch is not None:
            self._batch.append(op)
        else:
            self.calls.append(("single", op))
        if kind == "send":
            self.mailbox[(self.rank, peer)].append(tensor.clone())
        else:
            message = self.mailbox[(peer, self.rank)].popleft()
            assert message.numel() == tensor.numel(), f"rank {self.rank} receives {tensor.numel()} B, {peer} sent " \
                                                      f"{message.numel()} B"
            tensor.copy_(message)
        return FakeWork()

    def isend(self, tensor: torch.Tensor, dst: int, group: FakeGroup | None = None) -> FakeWork:
        return self._p2p("send", tensor, dst, group)

    def irecv(self, tensor: torch.Tensor, src: int, group: FakeGroup | None = None) -> FakeWork:
        return self._p2p("recv", tensor, src, group)

    def send(self, tensor: torch.Tensor, dst: int, group: FakeGroup | None = None) -> None:
        self._p2p("send", tensor, dst, group)

    def recv(self, tensor: torch.Tensor, src: int, group: FakeGroup | None = None) -> None:
        self._p2p("recv", tensor, src, group)

    def P2POp(self, op: Any, tensor: torch.Tensor, peer: int, group: FakeGroup | None = None) -> Any:  # noqa: N802
        assert op in (self.isend, self.irecv), op
        return SimpleNamespace(op=op, tensor=tensor, peer=peer, group=group)

    def batch_isend_irecv(self, ops: list[Any]) -> list[FakeWork]:
        assert len({id(self._group(op.group)) for op in ops}) == 1, "every op of a batch on one group"
        self._batch = []
        try:
            works = [op.op(op.tensor, op.peer, op.group) for op in ops]
            self.calls.append(("batch", self.cuda.current, self._batch))
        finally:
            self._batch = None
        return works

    def point_to_point(self) -> list[tuple[Any, ...]]:
        """Every send and receive recorded, each as (kind, peer, bytes, communicator, in a batch)."""
        ops = []
        for call in self.calls:
            if call[0] == "batch":
                ops += [(*op, True) for op in call[2]]
            elif call[0] == "single":
                ops.append((*call[1], False))
        return ops
