"""peer_state's transfer over an NCCL group, on a recording fake of torch.distributed and of the
CUDA calls (tests/fakes/recording_dist.py, which cites the torch sources it follows): the chunks
are staged on the device the group is bound to, not on the current device, and every send and
receive is posted in a batch, which torch runs on the group's own communicator (a single
send/recv would make a two-rank communicator per pair of ranks beside it).

The same staged path runs for real over gloo, with CPU staging, in tests/test_peer_state_transfer.py
(a chain ending bitwise equal; a source killed mid-transfer). What a CPU machine cannot show: on
NCCL a receive from a dead source does not fail, it waits until the restart's abort releases it.
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable

import pytest
import torch

from fakes.recording_dist import FakeCuda, FakeGroup, RecordingDist
from inprocess.peer_state import ProcessGroupTransport, Snapshot

Ranks = tuple[FakeCuda, Callable[[int, FakeGroup], RecordingDist]]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Ranks:
    """The fake CUDA calls, and a function that makes this process a given global rank of a job."""
    cuda = FakeCuda(current=0)
    monkeypatch.setattr(torch.cuda, "current_device", cuda.current_device)
    monkeypatch.setattr(torch.cuda, "device", cuda.device)
    monkeypatch.setattr(torch, "empty", cuda.empty)
    monkeypatch.setattr(torch, "zeros", cuda.zeros)
    mailbox: dict[tuple[int, int], collections.deque] = collections.defaultdict(collections.deque)

    def as_rank(rank: int, world: FakeGroup) -> RecordingDist:
        dist = RecordingDist(rank, world, mailbox, cuda)
        monkeypatch.setattr(torch, "distributed", dist)
        monkeypatch.setitem(sys.modules, "torch.distributed", dist)
        return dist

    return cuda, as_rank


CUDA1, CUDA2 = torch.device("cuda", 1), torch.device("cuda", 2)


@pytest.mark.parametrize("case", ["bound", "a subgroup of a bound job", "not bound"])
def test_the_chunks_are_staged_on_the_device_the_group_is_bound_to(fake: Ranks, case: str) -> None:
    """init_process_group(device_id=cuda:1) without torch.cuda.set_device: the current device is
    cuda:0, the staging buffers are on cuda:1. A subgroup not bound itself stages on the default
    group's device; a job bound nowhere, on the current device (set to 3 here). An unbound
    group's communicator is made by a collective of the whole group before any batch."""
    cuda, as_rank = fake
    world = FakeGroup(list(range(4)), bound={"bound": CUDA1, "a subgroup of a bound job": CUDA2}.get(case))
    group = FakeGroup([1, 3]) if case == "a subgroup of a bound job" else None
    if case == "not bound":
        cuda.current = 3
    dist = as_rank(1, world)
    ProcessGroupTransport(group, 1024)
    expected = {"bound": CUDA1, "a subgroup of a bound job": CUDA2, "not bound": torch.device("cuda", 3)}[case]
    assert cuda.allocated and set(cuda.allocated) == {expected}, cuda.allocated
    made = [call[1] for call in dist.calls if call[0] == "all_reduce"]
    assert made == ([] if case == "bound" else [group or world]), dist.calls


def _snapshot() -> Snapshot:
    tensors = [torch.arange(3000, dtype=torch.float32), torch.randn(100, 7, dtype=torch.float64),
               torch.arange(10, dtype=torch.int64), torch.empty(0)]
    return Snapshot(7, '{"objects": {"model": 0}}', tensors, group=2)


@pytest.mark.parametrize("bound", [True, False], ids=["bound", "initialised lazily"])
def test_a_chain_over_nccl_batches_every_point_to_point_on_the_groups_communicator(fake: Ranks, bound: bool) -> None:
    """Global ranks 2, 5, 7 (a subgroup of 8): rank 2 sends a 22 kB snapshot in 1 KiB chunks to 5,
    which passes each on to 7. Every send and receive of the three is in a batch (none alone:
    none makes a communicator of its own), posted with the staging device current, and a relay
    receives chunk i + 1 in the batch that passes chunk i on. Both receivers end with the
    snapshot, bitwise."""
    cuda, as_rank = fake
    world = FakeGroup(list(range(8)), bound=CUDA1 if bound else None)
    group = FakeGroup([2, 5, 7], bound=CUDA1 if bound else None)
    cuda.current = 0 if bound else 1
    sent = _snapshot()
    source = as_rank(2, world)
    assert ProcessGroupTransport(group, 1024).send(sent, [1, 2])() == sent.nbytes
    ranks: dict[int, tuple[RecordingDist, Snapshot]] = {2: (source, sent)}
    for rank in (5, 7):
        dist = as_rank(rank, world)
        ranks[rank] = (dist, ProcessGroupTransport(group, 1024).receive(0, [1, 2]))
    peers = {2: {5}, 5: {2, 7}, 7: {5}}
    for rank, (dist, got) in ranks.items():
        ops = dist.point_to_point()
        assert ops and all(in_batch and comm == "group" for *_, comm, in_batch in ops), (rank, ops)
        assert {peer for _, peer, *_ in ops} == peers[rank] and max(size for _, _, size, *_ in ops) <= 1024
        assert {call[1] for call in dist.calls if call[0] == "batch"} == {1}, dist.calls  # cuda:1 current
        assert (got.step, got.skeleton, got.group) == (7, sent.skeleton, 2)
        assert all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                   for a, b in zip(got.tensors, sent.tensors, strict=True)), rank
    relay = [call[2] for call in ranks[5][0].calls if call[0] == "batch"]
    both = [ops for ops in relay if {kind for kind, *_ in ops} == {"send", "recv"}]
    # 21 chunks (the header's length, the header, 12 + 6 + 1 of the tensors): 22 batches, all but the
    # first (a receive) and the last (a send) both
    assert (len(relay), len(both)) == (22, 20), relay
    assert not any(source.mailbox.values()), "every chunk sent was received"
