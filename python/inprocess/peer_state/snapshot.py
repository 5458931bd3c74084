"""A committed state in host memory: taking it from the registered objects, loading it back.

A :class:`Snapshot` is the JSON skeleton of ``{"objects": {name: state_dict}, "values":
{...}, "rng": {...}}`` (:mod:`inprocess.peer_state.encoding`) and its tensors, copied
into buffers of its own. :func:`take` writes into a spare buffer (reused when its layout
fits) and marks it complete only after its last copy, so that a snapshot interrupted
midway never passes for a complete one.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import zlib
from collections.abc import Callable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import torch

from . import rng as rng_states
from .encoding import decode, encode, parts, storage_key
from .objects import Objects


@dataclasses.dataclass
class Snapshot:
    """One committed state in host memory: its JSON skeleton (tensors replaced
    by their index) and its tensors."""

    step: int
    skeleton: str
    tensors: list[torch.Tensor]
    shard: int = -1  # ShardedState: the rank whose shard it is (its rank when it committed)
    world: int = 0  # ShardedState: how many shards the state had then
    checksum: int = 0  # ShardedState: of the tensors' bytes, as the committing rank computed it
    group: int = 0  # the lowest global rank of the group it was committed in (0: the default group)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layout(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Its tensors' shapes and dtypes: a buffer of the same layout takes another snapshot
        (whatever its plain values: a data loader's position changes at every commit)."""
        return [(tuple(t.shape), t.dtype) for t in self.tensors]


Pair = tuple[Snapshot | None, Snapshot | None]  # two buffers: a snapshot, and another (older, or being written)


def kept_and_spare(pair: Pair) -> Pair:
    """Two buffers as (the newest complete snapshot or None, the other one: the next to write into)."""
    a, b = pair
    if b is not None and b.step >= 0 and (a is None or b.step > a.step):
        return b, a
    if a is not None and a.step >= 0:
        return a, b
    return None, a if a is not None else b


def state_of(objects: Objects, values: Mapping[str, Any], rng: bool) -> dict[str, Any]:
    """What a snapshot holds, live: the objects' state dicts, the plain values, the RNG states."""
    return {"objects": objects.read(), "values": dict(values), "rng": rng_states.capture() if rng else None}


def take(objects: Objects, values: Mapping[str, Any], rng: bool, step: int, spare: Snapshot | None,
         deferred: AbstractSet[tuple[int, int, torch.dtype]] = frozenset(),
         refer: bool = False) -> tuple[Snapshot, Callable[[], None]]:
    """The objects' state, `values` and the RNG states, copied into `spare` (reused when its
    layout fits, else a new buffer): every tensor now but those whose :func:`storage_key` is in
    `deferred`; the function returned copies those and only then marks the snapshot complete
    (its step). Call it at once, or on another thread before any of those tensors changes.
    `refer`: those are not copied; the snapshot refers to them (it is the state of its step
    only until they change). A GPU tensor is copied into a pinned buffer: now, on its device's
    current stream, synchronized before this returns; in the function, on a side stream of its
    device that first waits for an event recorded on the current stream now."""
    live: list[torch.Tensor] = []
    skeleton = json.dumps(encode(state_of(objects, values, rng), live), separators=(",", ":"))
    if spare is None or spare.layout() != [(tuple(t.shape), t.dtype) for t in live]:
        spare = Snapshot(-1, skeleton, [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in live])
    snapshot = spare
    snapshot.step = -1  # being written
    snapshot.skeleton = skeleton
    later = []
    queued: set[torch.device] = set()  # the devices whose current (training) stream a copy below was queued on
    for i, (held, source) in enumerate(zip(snapshot.tensors, live, strict=True)):
        if storage_key(source) not in deferred:
            if source.is_cuda:
                queued.add(source.device)
                held.copy_(source.detach(), non_blocking=True)
            else:
                held.copy_(source.detach())
        elif refer:
            snapshot.tensors[i] = source.detach()
        else:
            later.append((held, source.detach()))
    for device in queued:  # done before the next step changes what they copied
        torch.cuda.current_stream(device).synchronize()
    ready = _events({source.device for _, source in later if source.is_cuda})

    def finish() -> None:
        sides = [_copy_on_side_stream(device, event, later) for device, event in ready.items()]
        for held, source in later:
            if not source.is_cuda:
                held.copy_(source)
        for side in sides:
            side.synchronize()
        snapshot.step = step
    return snapshot, finish


def _events(devices: AbstractSet[torch.device]) -> dict[torch.device, Any]:
    """An event recorded now on each device's current (training) stream: what it has queued up to the commit."""
    events = {}
    for device in devices:
        events[device] = torch.cuda.Event()  # type: ignore[no-untyped-call]
        events[device].record(torch.cuda.current_stream(device))
    return events


def _copy_on_side_stream(device: torch.device, ready: Any, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The copies from `device` queued on a side stream of that device (named: `finish` may run on a
    thread whose current device is another) after the `ready` event; the stream (not synchronized)."""
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    side.wait_event(ready)
    with torch.cuda.stream(side):
        for held, source in copies:
            if source.is_cuda and source.device == device:
                held.copy_(source, non_blocking=True)
    return side


def load(objects: Objects, snapshot: Snapshot, rng: bool, transient: bool = False) -> dict[str, Any]:
    """`snapshot` into the live objects (and the RNG states); its plain values. `transient`: its
    tensors are not kept as a buffer (:meth:`Objects.write`)."""
    by_key = parts(json.loads(snapshot.skeleton))
    objects.write(parts(by_key["objects"]), snapshot.tensors, transient)
    states = decode(by_key["rng"], snapshot.tensors, clone=True)
    if rng and states is not None:
        rng_states.restore(states)
    values: dict[str, Any] = decode(by_key["values"], snapshot.tensors, clone=True)
    return values


def destinations(objects: Objects, skeleton: str,
                 shapes: list[tuple[tuple[int, ...], torch.dtype]]) -> dict[int, torch.Tensor]:
    """For a snapshot about to be received (its skeleton, its tensors' shapes and dtypes): the
    objects' own tensors it can be received into, by index, after the objects are checked
    against it (:meth:`Objects.destinations`)."""
    held = parts(parts(json.loads(skeleton))["objects"])
    return objects.destinations(held, [torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in shapes])


def checksum(snapshot: Snapshot) -> int:
    """CRC-32 of the skeleton and of every tensor's bytes in order (zlib releases the GIL
    for large buffers)."""
    crc = zlib.crc32(snapshot.skeleton.encode())
    for t in snapshot.tensors:
        n = t.numel() * t.element_size()
        if n:
            crc = zlib.crc32((ctypes.c_char * n).from_address(t.data_ptr()), crc)
    return crc
