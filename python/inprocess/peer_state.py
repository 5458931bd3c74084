"""Training state from a peer: a rank that takes over starts at the last committed step.

After an in-process restart the ranks that were active keep their training
state in memory, but a rank that takes over (a spare, a joiner, a respawned
process) has none: without help it loads the user's last checkpoint, and the
whole job goes back to that step. :class:`ReplicatedState` is for data
parallel training, where every replica holds the same model and optimizer:

- the user registers what makes up the state, once, outside the wrapped
  function (anything with ``state_dict()``/``load_state_dict()``);
- :meth:`ReplicatedState.commit` at the end of a step takes a snapshot into
  host memory (every ``every`` steps), into the one of two buffers that does
  not hold the last complete snapshot, so that a fault during a snapshot
  never spoils the previous one;
- :meth:`ReplicatedState.restore`, called by every rank of the new iteration
  once its process group exists and before its first step, agrees on the
  newest committed step any rank holds, sends that snapshot from one holder
  to every rank that lacks it (point to point, in chunks), and loads it on
  every rank, holders included: the ranks that kept running roll back to the
  same step, so that no two ranks resume at different steps. It returns that
  step, or None when no rank holds one (the function then loads its own
  checkpoint from storage).

What travels is tensors and plain data (numbers, strings, lists, dicts), as a
JSON skeleton and raw tensor bytes: never a pickle (design principle 5). The
RNG states (torch's, Python's, NumPy's when loaded, CUDA's when initialized)
are the source's: right when every replica seeds the same way.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import sys
import time
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

log = logging.getLogger("inprocess")

DEFAULT_CHUNK_BYTES = 64 << 20
_PLAIN = (bool, int, float, str, type(None))


@dataclasses.dataclass
class Snapshot:
    """One committed state in host memory: its JSON skeleton (tensors replaced
    by their index) and its tensors."""

    step: int
    skeleton: str
    tensors: List[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layout(self) -> Tuple[str, List[Tuple[Tuple[int, ...], torch.dtype]]]:
        return self.skeleton, [(tuple(t.shape), t.dtype) for t in self.tensors]


@dataclasses.dataclass(frozen=True)
class RestoreRecord:
    """What the last :meth:`ReplicatedState.restore` did."""

    step: Optional[int]  # the step every rank resumed at; None: no rank held a committed state
    source: Optional[int]  # the group rank that sent it; None when nobody needed it
    receivers: Tuple[int, ...]  # the group ranks that lacked it
    nbytes: int  # bytes sent to each receiver (0 on a rank that neither sent nor received)
    seconds: float  # the whole restore on this rank


# -- tensors and plain data, as a JSON skeleton --------------------------------


def _encode(value: Any, tensors: List[torch.Tensor], path: str) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {"T": len(tensors) - 1}
    if isinstance(value, _PLAIN):
        return {"V": value}
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            if not isinstance(key, _PLAIN):
                raise TypeError(f"peer state: key {key!r} at {path or 'the top'} is a {type(key).__name__}: "
                                "expected a str, int, float, bool or None")
            items.append([key, _encode(item, tensors, f"{path}[{key!r}]")])
        return {"D": items}
    if isinstance(value, (list, tuple)):
        tag = "L" if isinstance(value, list) else "U"
        return {tag: [_encode(item, tensors, f"{path}[{i}]") for i, item in enumerate(value)]}
    raise TypeError(f"peer state: {path or 'the value'} is a {type(value).__module__}.{type(value).__qualname__}: "
                    "expected tensors and plain data (numbers, strings, None, lists, tuples, dicts) only")


def _decode(node: Any, tensors: List[torch.Tensor], clone: bool) -> Any:
    (tag, body), = node.items()
    if tag == "T":
        return tensors[body].clone() if clone else tensors[body]
    if tag == "V":
        return body
    if tag == "D":
        return {key: _decode(item, tensors, clone) for key, item in body}
    items = [_decode(item, tensors, clone) for item in body]
    return items if tag == "L" else tuple(items)


# -- RNG states ----------------------------------------------------------------


def _capture_rng() -> Dict[str, Any]:
    states: Dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        states["numpy"] = [name, torch.from_numpy(keys.copy()), int(pos), int(has_gauss), float(cached)]
    return states


def _restore_rng(states: Mapping[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in states and numpy is not None:
        name, keys, pos, has_gauss, cached = states["numpy"]
        numpy.random.set_state((name, keys.numpy(), pos, has_gauss, cached))


# -- the registered state ------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ReplicatedState:
    """The training state every data-parallel replica holds alike, kept in host
    memory at commit points and sent from a peer to a rank that lacks it.

    ``ReplicatedState(model=model, optimizer=optimizer, every=10)``: each
    keyword names an object with ``state_dict()`` and ``load_state_dict()``
    (a module, an optimizer, an LR scheduler, a stateful data loader, a
    gradient scaler). ``every``: a snapshot at every ``every``-th step that
    :meth:`commit` is called with. ``rng``: keep the RNG states too.
    ``chunk_bytes``: the most bytes sent in one message (and staged on the
    GPU for an NCCL group).
    """

    def __init__(self, *, every: int = 1, rng: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 **objects: Any) -> None:
        if not _is_int(every) or every < 1:
            raise ValueError(f"ReplicatedState(every={every!r}): expected an int >= 1")
        if not _is_int(chunk_bytes) or chunk_bytes < 1 << 10:
            raise ValueError(f"ReplicatedState(chunk_bytes={chunk_bytes!r}): expected an int >= 1024")
        if not objects:
            raise ValueError("ReplicatedState(): name at least one object, e.g. ReplicatedState(model=model)")
        for name, obj in objects.items():
            missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
            if missing:
                raise TypeError(f"ReplicatedState({name}=...): a {type(obj).__qualname__} has no "
                                f"{' and no '.join(missing)}(): expected an object with state_dict() and "
                                "load_state_dict() (a module, an optimizer, a scheduler)")
        self.every = every
        self.rng = rng
        self.chunk_bytes = chunk_bytes
        self._objects: Dict[str, Any] = dict(objects)
        # (complete, spare): one attribute, replaced in one store, so that an exception that
        # interrupts a snapshot can never leave both names on the same, half-written buffer.
        self._buffers: Tuple[Optional[Snapshot], Optional[Snapshot]] = (None, None)
        self._values: Dict[str, Any] = {}
        self.last_restore: Optional[RestoreRecord] = None

    @property
    def step(self) -> Optional[int]:
        """The step of the last complete snapshot this rank holds (None: none)."""
        complete = self._buffers[0]
        return None if complete is None else complete.step

    @property
    def nbytes(self) -> int:
        """The bytes of the last complete snapshot (host memory holds up to twice that: two buffers)."""
        complete = self._buffers[0]
        return 0 if complete is None else complete.nbytes

    @property
    def values(self) -> Dict[str, Any]:
        """The plain values given to :meth:`commit` with the snapshot last
        committed or restored."""
        return dict(self._values)

    def commit(self, step: int, **values: Any) -> bool:
        """The state after `step` steps is complete: snapshot it if `step` is a
        multiple of ``every``. `values`: plain data to keep with it (the data
        loader's position, a counter). True when a snapshot was taken."""
        if not _is_int(step) or step < 0:
            raise ValueError(f"ReplicatedState.commit(step={step!r}): expected an int >= 0")
        if step % self.every:
            return False
        whole = {"objects": {name: obj.state_dict() for name, obj in self._objects.items()},
                 "values": values, "rng": _capture_rng() if self.rng else None}
        live: List[torch.Tensor] = []
        skeleton = json.dumps(_encode(whole, live, ""), separators=(",", ":"))
        complete, spare = self._buffers
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
        self._buffers = (spare, complete)
        self._values = dict(values)
        return True

    def restore(self, group: Optional[Any] = None) -> Optional[int]:
        """Collective over `group` (default: the default process group), on every
        rank of the new iteration before its first step: the newest step any
        rank committed, loaded on every rank (sent to those that lack it);
        None when no rank holds one. Every rank's step after it is checked equal."""
        import torch.distributed as dist

        started = time.monotonic()
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        device = _device_of(group)
        complete = self._buffers[0]
        mine = -1 if complete is None else complete.step
        newest = _all_reduce(mine, dist.ReduceOp.MAX, group, device)
        if newest < 0:
            self.last_restore = RestoreRecord(None, None, (), 0, time.monotonic() - started)
            if rank == 0:
                log.info("peer state: no rank holds a committed state (none committed yet, or every holder "
                         "lost): the function loads its own")
            return None
        lacking = _flags(mine != newest, rank, group, device, world)
        receivers = tuple(r for r, flag in enumerate(lacking) if flag)
        source = _all_reduce(rank if mine == newest else world, dist.ReduceOp.MIN, group, device)
        nbytes = 0
        if receivers:
            if rank == source:
                assert complete is not None
                for receiver in receivers:
                    nbytes = _send(complete, receiver, group, device, self.chunk_bytes)
            elif rank in receivers:
                complete = _receive(source, group, device, self.chunk_bytes)
                nbytes = complete.nbytes
                self._buffers = (complete, self._buffers[0])
        assert complete is not None and complete.step == newest
        self._load(complete)
        low = _all_reduce(complete.step, dist.ReduceOp.MIN, group, device)
        if low != newest:
            raise RuntimeError(f"peer state: ranks resumed at different steps ({low} and {newest}) after the transfer")
        seconds = time.monotonic() - started
        self.last_restore = RestoreRecord(newest, source if receivers else None, receivers, nbytes, seconds)
        if receivers and rank in (source, *receivers):
            rate = nbytes / 2**20 / max(seconds, 1e-9)
            log.info("peer state: step %d from rank %d to rank(s) %s: %.1f MB in %.0f ms (%.0f MB/s)",
                     newest, source, ", ".join(map(str, receivers)), nbytes / 2**20, 1e3 * seconds, rate)
        elif not receivers and rank == 0:
            log.info("peer state: every rank holds step %d: restored from memory in %.0f ms", newest, 1e3 * seconds)
        return newest

    def _load(self, snapshot: Snapshot) -> None:
        whole = json.loads(snapshot.skeleton)
        (_, parts), = whole.items()
        by_key = {key: node for key, node in parts}
        objects = dict((key, node) for key, node in by_key["objects"]["D"])
        for name, obj in self._objects.items():
            if name not in objects:
                raise RuntimeError(f"peer state: the snapshot holds no {name!r} (it holds {sorted(objects)}): "
                                   "every rank must register the same objects")
            # A module copies what it loads into its own tensors; anything else (an optimizer)
            # may keep the tensors it is given: it gets copies, never the snapshot's buffers.
            clone = not isinstance(obj, torch.nn.Module)
            obj.load_state_dict(_decode(objects[name], snapshot.tensors, clone))
        self._values = _decode(by_key["values"], snapshot.tensors, clone=True)
        rng = _decode(by_key["rng"], snapshot.tensors, clone=True)
        if self.rng and rng is not None:
            _restore_rng(rng)


# -- the transfer --------------------------------------------------------------


def _device_of(group: Optional[Any]) -> torch.device:
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(group: Optional[Any], rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _all_reduce(value: int, op: Any, group: Optional[Any], device: torch.device) -> int:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return int(t.item())


def _flags(flag: bool, rank: int, group: Optional[Any], device: torch.device, world: int) -> List[bool]:
    """Every rank's `flag`, by group rank (one all_reduce of a world-sized vector)."""
    import torch.distributed as dist

    out = torch.zeros(world, dtype=torch.int32, device=device)
    out[rank] = int(flag)
    dist.all_reduce(out, group=group)
    return [bool(x) for x in out.tolist()]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _send_bytes(data: torch.Tensor, peer: int, group: Optional[Any], device: torch.device, chunk: int,
                staging: Optional[torch.Tensor]) -> None:
    import torch.distributed as dist

    for start in range(0, data.numel(), chunk):
        piece = data[start:start + chunk]
        if staging is not None:
            piece = staging[:piece.numel()].copy_(piece)
        dist.send(piece, _global(group, peer), group=group)


def _recv_bytes(data: torch.Tensor, peer: int, group: Optional[Any], device: torch.device, chunk: int,
                staging: Optional[torch.Tensor]) -> None:
    import torch.distributed as dist

    for start in range(0, data.numel(), chunk):
        piece = data[start:start + chunk]
        if staging is None:
            dist.recv(piece, _global(group, peer), group=group)
        else:
            dist.recv(staging[:piece.numel()], _global(group, peer), group=group)
            piece.copy_(staging[:piece.numel()])


def _send(snapshot: Snapshot, peer: int, group: Optional[Any], device: torch.device, chunk: int) -> int:
    """The snapshot to `peer`: its step and layout as JSON, then every tensor's bytes."""
    header = json.dumps({"step": snapshot.step, "skeleton": snapshot.skeleton,
                         "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in snapshot.tensors]})
    encoded = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    staging = torch.empty(chunk, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    length = torch.tensor([encoded.numel()], dtype=torch.int64)
    _send_bytes(_byte_view(length), peer, group, device, chunk, staging)
    _send_bytes(encoded, peer, group, device, chunk, staging)
    for t in snapshot.tensors:
        _send_bytes(_byte_view(t), peer, group, device, chunk, staging)
    return snapshot.nbytes


def _receive(peer: int, group: Optional[Any], device: torch.device, chunk: int) -> Snapshot:
    staging = torch.empty(chunk, dtype=torch.uint8, device=device) if device.type == "cuda" else None
    length = torch.zeros(1, dtype=torch.int64)
    _recv_bytes(_byte_view(length), peer, group, device, chunk, staging)
    encoded = torch.empty(int(length.item()), dtype=torch.uint8)
    _recv_bytes(encoded, peer, group, device, chunk, staging)
    header = json.loads(bytes(encoded.tolist()).decode())
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for shape, dtype in header["tensors"]]
    for t in tensors:
        _recv_bytes(_byte_view(t), peer, group, device, chunk, staging)
    return Snapshot(int(header["step"]), header["skeleton"], tensors)
