"""A snapshot as it travels: byte tensors any transport can move.

In order: the header's length (one int64), the header (UTF-8 JSON: the step, the
skeleton, the shard, the number of shards, the checksum, the group, each tensor's
shape and dtype), then every tensor's bytes. A receiver reads the first two, allocates (or
reuses a spare whose layout fits), then reads the tensors into place.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from .snapshot import Snapshot


def byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def header(snapshot: Snapshot) -> torch.Tensor:
    text = json.dumps({"step": snapshot.step, "skeleton": snapshot.skeleton, "shard": snapshot.shard,
                       "world": snapshot.world, "checksum": snapshot.checksum, "group": snapshot.group,
                       "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in snapshot.tensors]})
    return torch.frombuffer(bytearray(text.encode()), dtype=torch.uint8)


def pieces(snapshot: Snapshot) -> list[torch.Tensor]:
    """Every byte tensor of `snapshot` in the order they travel."""
    encoded = header(snapshot)
    length = torch.tensor([encoded.numel()], dtype=torch.int64)
    return [byte_view(length), encoded] + [byte_view(t) for t in snapshot.tensors]


Destinations = Callable[[str, list[tuple[tuple[int, ...], torch.dtype]]], dict[int, torch.Tensor]]


def read(receive: Callable[[torch.Tensor], None], spare: Snapshot | None,
         destinations: Destinations | None = None) -> Snapshot:
    """What :func:`pieces` sent, each piece filled in by `receive`: into `spare` where its
    layout fits, else into new buffers, except the tensors that `destinations` (given the
    skeleton and the tensors' shapes and dtypes, before any tensor is received) maps to a
    tensor of the same shape and dtype: those are received in place."""
    length = torch.zeros(1, dtype=torch.int64)
    receive(byte_view(length))
    encoded = torch.empty(int(length.item()), dtype=torch.uint8)
    receive(encoded)
    fields = json.loads(bytes(encoded.tolist()).decode())
    shapes = [(tuple(shape), getattr(torch, dtype)) for shape, dtype in fields["tensors"]]
    if destinations is not None:
        into = destinations(fields["skeleton"], shapes)
        spare = Snapshot(-1, fields["skeleton"], [into[i] if i in into else torch.empty(shape, dtype=dtype)
                                                  for i, (shape, dtype) in enumerate(shapes)])
    elif spare is None or spare.layout() != shapes:
        spare = Snapshot(-1, fields["skeleton"], [torch.empty(shape, dtype=dtype) for shape, dtype in shapes])
    spare.step = -1  # being written
    spare.skeleton = fields["skeleton"]
    for t in spare.tensors:
        receive(byte_view(t))
    spare.shard, spare.world, spare.checksum = int(fields["shard"]), int(fields["world"]), int(fields["checksum"])
    spare.group = int(fields["group"])
    spare.step = int(fields["step"])
    return spare
