"""A snapshot of GPU tensors (inprocess.peer_state.snapshot.take), on a recording fake of CUDA
streams and events (tests/fakes/cuda_streams.py, which cites the torch sources it follows): the
host buffers of device tensors are pinned, and reused; the copies made in the commit are done
when it returns; the optimizers' tensors, copied after it (snapshots="background", on a thread of
their own), go on a side stream of their device that first waits for what the training stream had
queued at the commit; the snapshot is complete (its step set) only once that stream was
synchronized; the bytes held are those the training stream left in the live tensors.

The fake runs a stream's work only when something synchronizes it (the latest schedule a GPU may
take): a missing synchronize or wait leaves a buffer unwritten or stale, and the bitwise checks
fail. No GPU runs here (a CPU build of torch).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from fakes.cuda_streams import FakeStreams, OnDevice
from fakes.recording_dist import FakeCuda
from inprocess.peer_state.encoding import storage_key
from inprocess.peer_state.objects import Objects
from inprocess.peer_state.snapshot import Snapshot, take


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> FakeStreams:
    """torch.cuda's stream calls and pinned allocations faked; the training thread on cuda:1."""
    streams = FakeStreams(FakeCuda(current=1))
    for name in ("is_available", "current_stream", "Stream", "Event", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(streams, name))
    monkeypatch.setattr(torch.cuda, "current_device", streams.cuda.current_device)
    monkeypatch.setattr(torch, "empty", streams.cuda.empty)
    return streams


class Held:
    """An object whose state is the given tensors."""

    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("not loaded here")


class Job:
    """A rank's state over cuda:1 and cuda:2 (a model split over two GPUs): the parameters and
    their Adam moment (what optimizer.step() changes: copied after the commit in the background),
    a buffer the next forward changes, and a data loader's position on the CPU. Each device's
    training stream still has the step's last kernel queued at the commit (it adds 1 to each
    device tensor); `expected`: the state after it, in the snapshot's order."""

    def __init__(self, streams: FakeStreams, buffers: bool = True) -> None:
        torch.manual_seed(0)

        def on(device: int, *shape: int) -> OnDevice:
            return streams.tensor(torch.randn(*shape), device)

        self.optimized = {"weight": on(1, 64, 32), "head": on(2, 32), "exp_avg": on(1, 64, 32), "exp_head": on(2, 32)}
        model = {"weight": self.optimized["weight"], "head": self.optimized["head"]}
        if buffers:
            model["running_mean"] = on(1, 32)
        objects = {"model": Held(**model), "optimizer": Held(exp_avg=self.optimized["exp_avg"],
                                                             exp_head=self.optimized["exp_head"]),
                   "loader": Held(position=torch.arange(5))}
        self.objects = Objects("ReplicatedState", objects)
        self.live = [t for obj in objects.values() for t in obj.state_dict().values()]
        self.deferred = {storage_key(t) for t in self.optimized.values()}
        for t in self.live:
            if isinstance(t, OnDevice):
                data = t.as_subclass(torch.Tensor)
                streams.default_stream(t.device).launch(lambda data=data: data.add_(1))
        self.expected = [t.as_subclass(torch.Tensor) + (1 if isinstance(t, OnDevice) else 0) for t in self.live]

    def take(self, step: int, spare: Snapshot | None = None) -> tuple[Snapshot, Callable[[], None]]:
        return take(self.objects, {}, False, step, spare, self.deferred)


def _bitwise(held: list[torch.Tensor], expected: list[torch.Tensor]) -> list[int]:
    """The indices of the held tensors that are not `expected`, bit for bit."""
    return [i for i, (a, b) in enumerate(zip(held, expected, strict=True))
            if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a.view(torch.uint8), b.view(torch.uint8))]


def _in_background(finish: Callable[[], None]) -> None:
    """`finish` on a thread of its own, as snapshots="background" runs it (a new thread: its current
    CUDA device is 0)."""
    thread = threading.Thread(target=finish, name="inprocess-snapshot-copy")
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_device_tensors_get_pinned_buffers_reused_by_the_next_snapshot(gpu: FakeStreams) -> None:
    """One pinned host buffer per device tensor, none for the CPU tensor; the next snapshot of the
    same layout writes into the same buffers (no allocation); a CPU-only state allocates no pinned
    memory and makes no CUDA call."""
    job = Job(gpu)
    first, finish = job.take(1)
    finish()
    assert [gpu.cuda.is_pinned(t) for t in first.tensors] == [t.is_cuda for t in job.live]
    allocated = len(gpu.cuda.pinned)
    second, finish = job.take(2, spare=first)
    finish()
    assert second is first and second.step == 2 and len(gpu.cuda.pinned) == allocated
    calls = len(gpu.log)
    cpu = Objects("ReplicatedState", {"loader": Held(position=torch.arange(5), weight=torch.randn(8))})
    snapshot, finish = take(cpu, {}, False, 3, None)
    finish()
    assert snapshot.step == 3 and len(gpu.cuda.pinned) == allocated and gpu.log[calls:] == []


@pytest.mark.parametrize("current", [1, 0], ids=["set_device(1)", "current device 0"])
def test_the_copies_in_the_commit_are_done_when_it_returns(gpu: FakeStreams, current: int) -> None:
    """The buffer the next forward changes is copied in the commit, from the training stream of its
    device, which take() synchronizes before it returns, also when the current device is another
    (a model moved to cuda:1 without torch.cuda.set_device): that buffer is held bitwise then."""
    job = Job(gpu)
    gpu.cuda.current = current
    snapshot, _ = job.take(1)
    assert ("synchronize", "cuda:1 default", "MainThread") in gpu.log
    buffer = [i for i, t in enumerate(job.live) if storage_key(t) not in job.deferred]
    assert _bitwise([snapshot.tensors[i] for i in buffer], [job.expected[i] for i in buffer]) == []
    assert snapshot.step == -1  # not complete before the deferred copies


@pytest.mark.parametrize("buffers", [True, False],
                         ids=["a buffer copied in the commit", "every device tensor deferred"])
def test_the_deferred_copies_run_on_a_side_stream_after_the_commits_event(gpu: FakeStreams, buffers: bool) -> None:
    """At the commit an event is recorded on each device's training stream; the background thread
    (current device 0) makes a side stream on each device, makes it wait for that event, queues
    that device's copies on it and synchronizes it. The optimizers' tensors are held bitwise as the
    step's last kernel left them (without the wait they would be copied before it)."""
    job = Job(gpu, buffers)
    snapshot, finish = job.take(1)
    taken = len(gpu.log)
    assert {("record", f"cuda:{d} default", "MainThread") for d in (1, 2)} <= set(gpu.log[:taken])
    _in_background(finish)
    after = gpu.log[taken:]
    sides = {name for _, name, _ in after}
    assert len(sides) == 2 and all(thread == "inprocess-snapshot-copy" for *_, thread in after), after
    for device, copies in ((1, 2), (2, 2)):
        side, = (name for name in sides if name.startswith(f"cuda:{device} stream"))
        assert [what for what, name, _ in after if name == side] == ["wait_event", *["copy"] * copies,
                                                                     "synchronize"], after
    assert snapshot.step == 1 and _bitwise(snapshot.tensors, job.expected) == []


def test_the_training_thread_does_not_wait_for_the_gpu_when_every_device_tensor_is_deferred(
        gpu: FakeStreams) -> None:
    """Nothing the commit copies is on a GPU: take() returns without synchronizing a training stream
    (the host keeps running ahead of the GPU); the event orders the deferred copies instead."""
    job = Job(gpu, buffers=False)
    snapshot, finish = job.take(1)
    assert [call for call in gpu.log if call[0] == "synchronize"] == []
    _in_background(finish)
    assert snapshot.step == 1 and _bitwise(snapshot.tensors, job.expected) == []


class Watched(Snapshot):
    """A snapshot whose step changes are logged with the fake's calls."""

    log: list[tuple[str, str, str]] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "step" and self.log is not None:
            self.log.append(("step", str(value), threading.current_thread().name))
        super().__setattr__(name, value)


def test_the_snapshot_is_complete_only_after_its_side_streams_were_synchronized(gpu: FakeStreams) -> None:
    """Its step is set (it counts as the state of its step: a restore may send it) after the last
    side stream's synchronize, not while its copies may still be in flight."""
    job = Job(gpu)
    first, finish = job.take(1)
    finish()
    spare = Watched(-1, first.skeleton, first.tensors)
    spare.log = gpu.log
    snapshot, finish = job.take(2, spare)
    assert snapshot is spare and snapshot.step == -1
    _in_background(finish)
    complete = gpu.log.index(("step", "2", "inprocess-snapshot-copy"))
    synchronized = [i for i, (what, name, _) in enumerate(gpu.log) if what == "synchronize" and "stream" in name]
    assert synchronized and max(synchronized) < complete, gpu.log
    assert _bitwise(snapshot.tensors, job.expected) == []
