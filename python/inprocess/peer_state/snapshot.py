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
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from . import rng as rng_states
from .encoding import decode, encode, parts
from .objects import Objects


@dataclasses.dataclass
class Snapshot:
    """One committed state in host memory: its JSON skeleton (tensors replaced
    by their index) and its tensors."""

    step: int
    skeleton: str
    tensors: List[torch.Tensor]
    shard: int = -1  # ShardedState: the rank whose shard it is (its rank when it committed)
    world: int = 0  # ShardedState: how many shards the state had then
    checksum: int = 0  # ShardedState: of the tensors' bytes, as the committing rank computed it
    group: int = 0  # the lowest global rank of the group it was committed in (0: the default group)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layout(self) -> Tuple[str, List[Tuple[Tuple[int, ...], torch.dtype]]]:
        return self.skeleton, [(tuple(t.shape), t.dtype) for t in self.tensors]


def state_of(objects: Objects, values: Mapping[str, Any], rng: bool) -> Dict[str, Any]:
    """What a snapshot holds, live: the objects' state dicts, the plain values, the RNG states."""
    return {"objects": objects.read(), "values": dict(values), "rng": rng_states.capture() if rng else None}


def take(objects: Objects, values: Mapping[str, Any], rng: bool, step: int,
         spare: Optional[Snapshot]) -> Snapshot:
    """The objects' state, `values` and the RNG states, copied into `spare` (reused
    when its layout fits, else a new buffer)."""
    live: List[torch.Tensor] = []
    skeleton = json.dumps(encode(state_of(objects, values, rng), live), separators=(",", ":"))
    layout = (skeleton, [(tuple(t.shape), t.dtype) for t in live])
    if spare is None or spare.layout() != layout:
        pin = torch.cuda.is_available() and any(t.is_cuda for t in live)
        spare = Snapshot(-1, skeleton, [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in live])
    spare.step = -1  # being written
    for held, source in zip(spare.tensors, live, strict=True):
        held.copy_(source.detach(), non_blocking=source.is_cuda)
    if any(t.is_cuda for t in live):
        torch.cuda.current_stream().synchronize()
    spare.step = step
    return spare


def load(objects: Objects, snapshot: Snapshot, rng: bool) -> Dict[str, Any]:
    """`snapshot` into the live objects (and the RNG states); its plain values."""
    by_key = parts(json.loads(snapshot.skeleton))
    objects.write(parts(by_key["objects"]), snapshot.tensors)
    states = decode(by_key["rng"], snapshot.tensors, clone=True)
    if rng and states is not None:
        rng_states.restore(states)
    values: Dict[str, Any] = decode(by_key["values"], snapshot.tensors, clone=True)
    return values


def checksum(snapshot: Snapshot) -> int:
    """CRC-32 of the skeleton and of every tensor's bytes in order (zlib releases the GIL
    for large buffers)."""
    crc = zlib.crc32(snapshot.skeleton.encode())
    for t in snapshot.tensors:
        n = t.numel() * t.element_size()
        if n:
            crc = zlib.crc32((ctypes.c_char * n).from_address(t.data_ptr()), crc)
    return crc
