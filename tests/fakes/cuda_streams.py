"""A recording fake of the CUDA stream calls a snapshot makes (``torch.cuda`` streams and events,
device-to-host copies), with tensors that say they are on a CUDA device, for a CPU build of torch.

It follows torch 2.13 (torch/cuda/__init__.py and torch/cuda/streams.py of the 2.13.0 wheel;
aten/src/ATen/native/cuda/Copy.cu, c10/cuda/CUDAStream.cpp) and the CUDA runtime's documentation
("Asynchronous Concurrent Execution" and "Streams" in the CUDA C++ Programming Guide):

- Work queued on a stream runs in the order queued, asynchronously with the host; it has surely
  run only once the stream (``Stream.synchronize``: ``cudaStreamSynchronize``) or an event recorded
  after it (``Event.synchronize``) was synchronized. The fake runs it then and no earlier: the
  latest schedule the GPU may take, so a missing synchronize leaves a buffer unwritten.
- ``torch.cuda.current_stream(device)``: the calling thread's current stream on `device` (default:
  the current device), the device's default stream until ``torch.cuda.stream`` / ``set_stream``
  selects another (c10/cuda/CUDAStream.cpp keeps the current streams ``thread_local``).
- ``torch.cuda.Stream(device=None)``: a stream on `device`, "If device is None (default) ... this
  will use the current device" (streams.py); the current device is the thread's (:class:`FakeCuda`).
- ``torch.cuda.stream(s)``: ``StreamContext`` makes `s` the current stream of `s`'s device (which
  need not be the current device) for the block, and restores the previous one.
- ``Event.record(stream=None)`` records on ``torch.cuda.current_stream()`` (the current device's)
  when no stream is given; "only streams on the same device may record the event". It captures
  the work queued on that stream so far. ``Stream.wait_event(e)``: "Make all future work submitted
  to the stream wait for an event" (``cudaStreamWaitEvent``); it returns at once.
- ``dst.copy_(src)`` from a CUDA tensor to host memory (Copy.cu ``copy_kernel_cuda``): a device guard
  on the source's device, then the current stream (``getCurrentCUDAStream``) of that device. With
  ``non_blocking=True`` into pinned memory, a ``cudaMemcpyAsync`` queued there, returning at once;
  otherwise (``memcpy_and_sync``, or pageable memory, for which cudaMemcpyAsync "returns only once
  the copy has completed") it returns after the stream's earlier work and the copy ran.

``log`` records each call: (what, the stream's name, the calling thread's name).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .recording_dist import FakeCuda


class FakeStream:
    """A CUDA stream: its queued work (callables, and events to wait for), run when synchronized."""

    def __init__(self, streams: FakeStreams, device: int, name: str) -> None:
        self.streams = streams
        self.device = torch.device("cuda", device)
        self.name = name
        self.queue: list[Callable[[], None] | FakeEvent] = []
        self.ran = 0  # how many of the queued items ran

    def launch(self, work: Callable[[], None], what: str = "kernel") -> None:
        self.streams.note(what, self)
        self.queue.append(work)

    def wait_event(self, event: FakeEvent) -> None:
        self.streams.note("wait_event", self)
        self.queue.append(event)

    def run(self, until: int) -> None:
        while self.ran < until:
            item = self.queue[self.ran]
            self.ran += 1
            if isinstance(item, FakeEvent):
                item.run()
            else:
                item()

    def synchronize(self) -> None:
        self.streams.note("synchronize", self)
        self.run(len(self.queue))


class FakeEvent:
    """A CUDA event: the work its stream had queued when it was recorded."""

    def __init__(self, streams: FakeStreams) -> None:
        self.streams = streams
        self.stream: FakeStream | None = None
        self.position = 0

    def record(self, stream: FakeStream | None = None) -> None:
        stream = self.streams.current_stream() if stream is None else stream
        if self.stream is not None and self.stream.device != stream.device:
            raise RuntimeError(f"an event of {self.stream.device} recorded on a stream of {stream.device}")
        self.streams.note("record", stream)
        self.stream, self.position = stream, len(stream.queue)

    def run(self) -> None:
        if self.stream is not None:  # cudaStreamWaitEvent on an event never recorded waits for nothing
            self.stream.run(self.position)


class FakeStreams:
    """``torch.cuda``'s stream and event calls, on the devices of a :class:`FakeCuda`."""

    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda = cuda
        self.log: list[tuple[str, str, str]] = []
        self.defaults: dict[int, FakeStream] = {}
        self._current = threading.local()  # per thread: {device index: its current stream}
        self._made = 0

    def note(self, what: str, stream: FakeStream) -> None:
        self.log.append((what, stream.name, threading.current_thread().name))

    def is_available(self) -> bool:
        return True

    def _index(self, device: Any) -> int:
        index = device if device is None or isinstance(device, int) else torch.device(device).index
        return self.cuda.current if index is None or index < 0 else index  # None, -1, "cuda": the current device

    def default_stream(self, device: Any = None) -> FakeStream:
        index = self._index(device)
        if index not in self.defaults:
            self.defaults[index] = FakeStream(self, index, f"cuda:{index} default")
        return self.defaults[index]

    def current_stream(self, device: Any = None) -> FakeStream:
        index = self._index(device)
        selected: dict[int, FakeStream] = getattr(self._current, "streams", {})
        return selected.get(index) or self.default_stream(index)

    def Stream(self, device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802
        self._made += 1
        index = self._index(device)
        return FakeStream(self, index, f"cuda:{index} stream {self._made}")

    def Event(self) -> FakeEvent:  # noqa: N802
        return FakeEvent(self)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        selected: dict[int, FakeStream] = getattr(self._current, "streams", {})
        self._current.streams = {**selected, stream.device.index: stream}
        try:
            yield
        finally:
            self._current.streams = selected

    def tensor(self, data: torch.Tensor, device: int) -> OnDevice:
        """`data` as a tensor on cuda:`device` (its memory still host memory)."""
        t = data.clone().as_subclass(OnDevice)
        t.placed = (self, device)
        return t

    def to_host(self, dst: torch.Tensor, src: OnDevice, non_blocking: bool) -> torch.Tensor:
        stream = self.current_stream(src.device)
        data = src.as_subclass(torch.Tensor)
        stream.launch(lambda: dst.copy_(data), "copy")
        if not (non_blocking and self.cuda.is_pinned(dst)):
            stream.synchronize()
        return dst


class OnDevice(torch.Tensor):
    """A tensor that says it is on a CUDA device (``is_cuda``, ``device``); a copy from it to host
    memory goes through :meth:`FakeStreams.to_host`. Its views (``detach()``) are on its device too."""

    placed: tuple[FakeStreams, int]

    @property  # type: ignore[override]
    def is_cuda(self) -> bool:
        return True

    @property  # type: ignore[override]
    def device(self) -> torch.device:
        return torch.device("cuda", self.placed[1])

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.copy_ and not isinstance(args[0], OnDevice):
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            return args[1].placed[0].to_host(args[0], args[1], non_blocking)
        result = super().__torch_function__(func, types, args, kwargs)
        if isinstance(result, OnDevice) and not hasattr(result, "placed"):
            result.placed = next(a for a in args if isinstance(a, OnDevice)).placed
        return result
