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

import ctypes
import dataclasses
import json
import logging
import random
import sys
import threading
import time
import zlib
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

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
    shard: int = -1  # ShardedState: the rank whose shard it is (its rank when it committed)
    world: int = 0  # ShardedState: how many shards the state had then
    checksum: int = 0  # ShardedState: of the tensors' bytes, as the committing rank computed it

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


# -- taking and loading a snapshot --------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(kind: str, every: int, chunk_bytes: int, objects: Mapping[str, Any]) -> None:
    if not _is_int(every) or every < 1:
        raise ValueError(f"{kind}(every={every!r}): expected an int >= 1")
    if not _is_int(chunk_bytes) or chunk_bytes < 1 << 10:
        raise ValueError(f"{kind}(chunk_bytes={chunk_bytes!r}): expected an int >= 1024")
    if not objects:
        raise ValueError(f"{kind}(): name at least one object, e.g. {kind}(model=model)")
    for name, obj in objects.items():
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise TypeError(f"{kind}({name}=...): a {type(obj).__qualname__} has no "
                            f"{' and no '.join(missing)}(): expected an object with state_dict() and "
                            "load_state_dict() (a module, an optimizer, a scheduler)")


def _check_step(kind: str, step: int) -> None:
    if not _is_int(step) or step < 0:
        raise ValueError(f"{kind}.commit(step={step!r}): expected an int >= 0")


def _take(objects: Mapping[str, Any], values: Mapping[str, Any], rng: bool, step: int,
          spare: Optional[Snapshot]) -> Snapshot:
    """The objects' state, `values` and the RNG states, copied into `spare` (reused
    when its layout fits, else a new buffer)."""
    whole = {"objects": {name: obj.state_dict() for name, obj in objects.items()},
             "values": dict(values), "rng": _capture_rng() if rng else None}
    live: List[torch.Tensor] = []
    skeleton = json.dumps(_encode(whole, live, ""), separators=(",", ":"))
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


def _load(objects: Mapping[str, Any], snapshot: Snapshot, rng: bool) -> Dict[str, Any]:
    """`snapshot` into the live objects (and the RNG states); its plain values."""
    whole = json.loads(snapshot.skeleton)
    (_, parts), = whole.items()
    by_key = {key: node for key, node in parts}
    held = dict((key, node) for key, node in by_key["objects"]["D"])
    for name, obj in objects.items():
        if name not in held:
            raise RuntimeError(f"peer state: the snapshot holds no {name!r} (it holds {sorted(held)}): "
                               "every rank must register the same objects")
        # A module copies what it loads into its own tensors; anything else (an optimizer)
        # may keep the tensors it is given: it gets copies, never the snapshot's buffers.
        clone = not isinstance(obj, torch.nn.Module)
        obj.load_state_dict(_decode(held[name], snapshot.tensors, clone))
    states = _decode(by_key["rng"], snapshot.tensors, clone=True)
    if rng and states is not None:
        _restore_rng(states)
    values: Dict[str, Any] = _decode(by_key["values"], snapshot.tensors, clone=True)
    return values


def _checksum(snapshot: Snapshot) -> int:
    """CRC-32 of every tensor's bytes in order (zlib releases the GIL for large buffers)."""
    crc = zlib.crc32(snapshot.skeleton.encode())
    for t in snapshot.tensors:
        n = t.numel() * t.element_size()
        if n:
            crc = zlib.crc32((ctypes.c_char * n).from_address(t.data_ptr()), crc)
    return crc


# -- replicated state ------------------------------------------------------------


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
        _check_arguments("ReplicatedState", every, chunk_bytes, objects)
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
        _check_step("ReplicatedState", step)
        if step % self.every:
            return False
        complete, spare = self._buffers
        self._buffers = (_take(self._objects, values, self.rng, step, spare), complete)
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
        lacking = [bool(r[0]) for r in _rows([int(mine != newest)], rank, world, group, device)]
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
        self._values = _load(self._objects, complete, self.rng)
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


# -- sharded state ---------------------------------------------------------------


def node_key() -> str:
    """This process's node, as the launchers say it: torchrun's and inprocess.launch's
    ``GROUP_RANK``, else SLURM's ``SLURM_NODEID``, else the host name."""
    import os
    import socket

    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if os.environ.get(name, "") != "":
            return f"{name}={os.environ[name]}"
    return f"host={socket.gethostname()}"


def partners(nodes: List[int], distance: Optional[int] = None) -> List[int]:
    """The partner of each rank (whose shard it keeps a copy of), from each rank's node.

    Ranks are ordered by node, then rank; each rank's partner is the rank `distance`
    places ahead in that order (default: the size of the largest node), so that no
    rank keeps the copy of a rank of its own node while no node holds more than half
    of the ranks (one node: neighbours). A permutation: every rank keeps one copy."""
    world = len(nodes)
    order = sorted(range(world), key=lambda r: (nodes[r], r))
    if distance is None:
        largest = max(nodes.count(n) for n in set(nodes))
        distance = largest if largest < world else 1
    position = {r: i for i, r in enumerate(order)}
    return [order[(position[r] + distance) % world] for r in range(world)]


class ShardedState:
    """Each rank's own shard of the training state (ZeRO/FSDP style: no two
    ranks hold the same), kept in host memory at commit points, with a copy of
    one partner's last committed shard, so that a rank that takes over gets its
    shard from the partner's copy.

    ``ShardedState(model=shard_module, optimizer=optimizer, every=10)``: each
    keyword names an object with ``state_dict()``/``load_state_dict()`` holding
    this rank's shard. :meth:`commit` snapshots this rank's shard (on the calling
    thread: the next step may change it) and then, on a thread of its own, sends
    it to the rank that keeps its copy and receives its partner's shard, with a
    CRC-32 so that a torn copy is never used; the next :meth:`commit` waits for
    that exchange. A rank's partner is on another node wherever no node holds
    more than half the ranks (:func:`partners`; nodes by :func:`node_key`), or
    ``distance`` places ahead in the ranks ordered by node. :meth:`restore` (a collective, each iteration, before
    the first step and before any commit) finds the newest step at which every
    shard is held, by its rank or a copy, and loads each rank's shard, sent to it
    where it lacks it; None when some shard and its copy are both lost, saying
    which. The number of shards is the active world size: a state committed by
    another number of ranks is not used.
    """

    def __init__(self, *, every: int = 1, rng: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 distance: Optional[int] = None, **objects: Any) -> None:
        _check_arguments("ShardedState", every, chunk_bytes, objects)
        if distance is not None and (not _is_int(distance) or distance < 1):
            raise ValueError(f"ShardedState(distance={distance!r}): expected an int >= 1 or None")
        self.every = every
        self.rng = rng
        self.chunk_bytes = chunk_bytes
        self.distance = distance
        self._objects: Dict[str, Any] = dict(objects)
        self._own: Tuple[Optional[Snapshot], Optional[Snapshot]] = (None, None)  # (complete, spare)
        self._copy: Tuple[Optional[Snapshot], Optional[Snapshot]] = (None, None)  # the partner's
        self._values: Dict[str, Any] = {}
        self._exchange: Optional[Any] = None  # the private gloo group of this iteration
        self._ring: Tuple[int, int, int, int] = (0, 1, 0, 0)  # rank, world, the holder of my copy, my partner
        self._pending: Optional[threading.Thread] = None
        self._exchange_error: Optional[BaseException] = None
        self._one_node_said = False
        self.last_restore: Optional[RestoreRecord] = None

    @property
    def step(self) -> Optional[int]:
        complete = self._own[0]
        return None if complete is None else complete.step

    @property
    def copy_step(self) -> Optional[int]:
        """The step of the partner's shard this rank holds a complete, checked copy of."""
        complete = self._copy[0]
        return None if complete is None else complete.step

    @property
    def values(self) -> Dict[str, Any]:
        return dict(self._values)

    def commit(self, step: int, **values: Any) -> bool:
        """This rank's shard after `step` steps is complete: snapshot it if `step` is
        a multiple of ``every``, and send it to its copy's keeper in the background.
        Every rank commits at the same steps (the exchange pairs them)."""
        _check_step("ShardedState", step)
        if step % self.every:
            return False
        if self._exchange is None:
            raise RuntimeError("ShardedState.commit(): call restore() first in each iteration (it sets up the "
                               "exchange with the partners of this iteration's ranks)")
        self.wait()
        rank, world, _, _ = self._ring
        complete, spare = self._own
        snapshot = _take(self._objects, values, self.rng, step, spare)
        snapshot.shard, snapshot.world = rank, world
        self._own = (snapshot, complete)
        self._values = dict(values)
        self._pending = threading.Thread(target=self._exchange_copies, args=(snapshot,),
                                         name="inprocess-shard-exchange", daemon=True)
        self._pending.start()
        return True

    def wait(self) -> None:
        """Until the last commit's exchange ended (an exchange that failed, a peer
        lost meanwhile, leaves the previous copy in place)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        if self._exchange_error is not None:
            log.info("peer state: the last shard exchange failed (%s): the previous copy stays",
                     self._exchange_error)
            self._exchange_error = None

    def _exchange_copies(self, snapshot: Snapshot) -> None:
        try:
            snapshot.checksum = _checksum(snapshot)
            _, world, keeper, partner = self._ring
            if world == 1:
                return  # no partner: nothing can stand in for this shard
            received = _swap(snapshot, keeper, partner, self._exchange, self.chunk_bytes, self._copy[1])
            if _checksum(received) != received.checksum:
                raise RuntimeError(f"the copy of shard {received.shard} at step {received.step} is torn")
            self._copy = (received, self._copy[0])
        except BaseException as e:  # the restart's abort of the group, a peer's death: kept for wait()
            self._exchange_error = e

    def restore(self, group: Optional[Any] = None) -> Optional[int]:
        """Collective over the default process group, on every rank of the new
        iteration before its first step (and before any commit in it)."""
        import torch.distributed as dist

        if group is not None:
            raise ValueError("ShardedState.restore(group=...): only the default process group is supported")
        started = time.monotonic()
        self.wait()
        rank, world = dist.get_rank(), dist.get_world_size()
        device = _device_of(None)
        table = _held_table(self._own, self._copy, rank, world, device)
        plan = _plan_shards(table, world)
        nodes = _node_ids(rank, world, device)
        ring = partners(nodes, self.distance)
        if len(set(nodes)) == 1 and world > 1 and rank == 0 and not self._one_node_said:
            self._one_node_said = True
            log.info("peer state: every rank is on one node: a shard's copy is on the same node as the shard")
        self._exchange = dist.new_group(backend="gloo")
        self._ring = (rank, world, ring.index(rank), ring[rank])
        if isinstance(plan, str):
            self._own = self._copy = (None, None)
            self.last_restore = RestoreRecord(None, None, (), 0, time.monotonic() - started)
            if rank == 0:
                log.info("peer state: %s: the function loads its own", plan)
            return None
        step, sources = plan
        nbytes = 0
        mine = _held(self._own, self._copy, rank, step)
        for shard, source in enumerate(sources):
            if source == shard:
                continue
            if rank == source:
                held = _held(self._own, self._copy, shard, step)
                assert held is not None
                nbytes += _send(held, shard, None, device, self.chunk_bytes)
            elif rank == shard:
                mine = _receive(source, None, device, self.chunk_bytes)
                nbytes = mine.nbytes
                if _checksum(mine) != mine.checksum:
                    raise RuntimeError(f"peer state: shard {shard} of step {step} from rank {source} is torn")
        assert mine is not None and mine.step == step and mine.shard == rank
        self._values = _load(self._objects, mine, self.rng)
        low = _all_reduce(step, dist.ReduceOp.MIN, None, device)
        if low != step:
            raise RuntimeError(f"peer state: ranks resumed at different steps ({low} and {step}) after the transfer")
        self._own, self._copy = (mine, None), (None, None)
        # The copies under this iteration's partners, before the first step: a loss in it finds them.
        self._pending = threading.Thread(target=self._exchange_copies, args=(mine,), name="inprocess-shard-exchange",
                                         daemon=True)
        self._pending.start()
        self.wait()
        receivers = tuple(shard for shard, source in enumerate(sources) if source != shard)
        seconds = time.monotonic() - started
        self.last_restore = RestoreRecord(step, None, receivers, nbytes, seconds)
        if rank in receivers:
            log.info("peer state: shard %d of step %d from rank %d: %.1f MB in %.0f ms", rank, step, sources[rank],
                     nbytes / 2**20, 1e3 * seconds)
        elif rank == 0:
            log.info("peer state: step %d, every shard held%s", step,
                     f"; sent to rank(s) {', '.join(map(str, receivers))}" if receivers else " by its own rank")
        return step


def _node_ids(rank: int, world: int, device: torch.device) -> List[int]:
    """Every rank's :func:`node_key`, as a number."""
    return [row[0] for row in _rows([zlib.crc32(node_key().encode())], rank, world, None, device)]


def _held(own: Tuple[Optional[Snapshot], Optional[Snapshot]], copy: Tuple[Optional[Snapshot], Optional[Snapshot]],
          shard: int, step: int) -> Optional[Snapshot]:
    """This rank's snapshot of `shard` at `step`: its own or a partner's copy (complete ones only)."""
    for snapshot in (*own, *copy):
        if snapshot is not None and snapshot.shard == shard and snapshot.step == step:
            return snapshot
    return None


def _held_table(own: Tuple[Optional[Snapshot], Optional[Snapshot]],
                copy: Tuple[Optional[Snapshot], Optional[Snapshot]], rank: int, world: int,
                device: torch.device) -> List[List[Tuple[int, int]]]:
    """Every rank's (shard, step) pairs, by rank: its two own snapshots, then its two copies
    ((-1, -1) for none, and for a snapshot of a state with another number of shards)."""
    mine = []
    for snapshot in (*own, *copy):
        usable = snapshot is not None and snapshot.step >= 0 and snapshot.world == world
        mine += [snapshot.shard, snapshot.step] if usable and snapshot is not None else [-1, -1]
    return [[(row[i], row[i + 1]) for i in range(0, 8, 2)] for row in _rows(mine, rank, world, None, device)]


def _plan_shards(table: List[List[Tuple[int, int]]], world: int) -> Tuple[int, List[int]] | str:
    """The newest step at which every shard 0..world-1 is held, and who sends each
    (the shard's own rank where it holds it); else why not, in one line."""
    steps = sorted({step for row in table for shard, step in row if step >= 0}, reverse=True)
    if not steps:
        return "no rank holds a committed shard (none committed yet, or every holder lost)"
    for step in steps:
        sources = []
        for shard in range(world):
            holders = [r for r, row in enumerate(table) if (shard, step) in row]
            if not holders:
                break
            sources.append(shard if shard in holders else holders[0])
        else:
            return step, sources
    newest = steps[0]
    lost = [shard for shard in range(world) if not any((shard, newest) in row for row in table)]
    return (f"shard(s) {', '.join(map(str, lost))} of step {newest} lost with their copies (and no older step "
            "has every shard)")


def _swap(snapshot: Snapshot, keeper: int, partner: int, group: Any, chunk: int,
          spare: Optional[Snapshot]) -> Snapshot:
    """Sends `snapshot` to `keeper` and receives `partner`'s at once (every rank does
    both: sends are posted first, non-blocking, so that the ring never waits on itself)."""
    import torch.distributed as dist

    works = [dist.isend(piece[start:start + chunk], keeper, group=group)
             for piece in _wire(snapshot) for start in range(0, piece.numel(), chunk)]
    received = _read(lambda data: _recv_bytes(data, partner, group, chunk, None), spare)
    for work in works:
        if work is not None:
            work.wait()
    return received


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


def _rows(row: List[int], rank: int, world: int, group: Optional[Any], device: torch.device) -> List[List[int]]:
    """Every rank's `row` of integers (the same length on every rank), by group rank: one
    all_reduce (a sum) of a matrix that holds zeros but in this rank's row."""
    import torch.distributed as dist

    rows = torch.zeros((world, len(row)), dtype=torch.int64, device=device)
    rows[rank] = torch.tensor(row, dtype=torch.int64, device=device)
    dist.all_reduce(rows, group=group)
    return [[int(x) for x in r] for r in rows.tolist()]


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def _send_bytes(data: torch.Tensor, peer: int, group: Optional[Any], chunk: int,
                staging: Optional[torch.Tensor]) -> None:
    import torch.distributed as dist

    for start in range(0, data.numel(), chunk):
        piece = data[start:start + chunk]
        if staging is not None:
            piece = staging[:piece.numel()].copy_(piece)
        dist.send(piece, _global(group, peer), group=group)


def _recv_bytes(data: torch.Tensor, peer: int, group: Optional[Any], chunk: int,
                staging: Optional[torch.Tensor]) -> None:
    import torch.distributed as dist

    for start in range(0, data.numel(), chunk):
        piece = data[start:start + chunk]
        if staging is None:
            dist.recv(piece, _global(group, peer), group=group)
        else:
            dist.recv(staging[:piece.numel()], _global(group, peer), group=group)
            piece.copy_(staging[:piece.numel()])


def _wire(snapshot: Snapshot) -> List[torch.Tensor]:
    """A snapshot as it travels, as byte tensors: its header's length, its header (JSON: the
    step, the skeleton, the shard, the checksum, each tensor's shape and dtype), every tensor."""
    header = json.dumps({"step": snapshot.step, "skeleton": snapshot.skeleton, "shard": snapshot.shard,
                         "world": snapshot.world, "checksum": snapshot.checksum,
                         "tensors": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in snapshot.tensors]})
    encoded = torch.frombuffer(bytearray(header.encode()), dtype=torch.uint8)
    length = torch.tensor([encoded.numel()], dtype=torch.int64)
    return [_byte_view(length), encoded] + [_byte_view(t) for t in snapshot.tensors]


def _read(receive: Callable[[torch.Tensor], None], spare: Optional[Snapshot]) -> Snapshot:
    """What :func:`_wire` sent, filled in by `receive` (into `spare` where its layout fits)."""
    length = torch.zeros(1, dtype=torch.int64)
    receive(_byte_view(length))
    encoded = torch.empty(int(length.item()), dtype=torch.uint8)
    receive(encoded)
    header = json.loads(bytes(encoded.tolist()).decode())
    shapes = [(tuple(shape), getattr(torch, dtype)) for shape, dtype in header["tensors"]]
    if spare is None or spare.layout() != (header["skeleton"], shapes):
        spare = Snapshot(-1, header["skeleton"], [torch.empty(shape, dtype=dtype) for shape, dtype in shapes])
    spare.step = -1  # being written
    for t in spare.tensors:
        receive(_byte_view(t))
    spare.shard, spare.world, spare.checksum = int(header["shard"]), int(header["world"]), int(header["checksum"])
    spare.step = int(header["step"])
    return spare


def _staging(device: torch.device, chunk: int) -> Optional[torch.Tensor]:
    """A chunk's buffer on the GPU for an NCCL group (its sends and receives take device tensors)."""
    return torch.empty(chunk, dtype=torch.uint8, device=device) if device.type == "cuda" else None


def _send(snapshot: Snapshot, peer: int, group: Optional[Any], device: torch.device, chunk: int) -> int:
    """The snapshot to `peer` (:func:`_wire`), staged on the GPU for an NCCL group."""
    staging = _staging(device, chunk)
    for piece in _wire(snapshot):
        _send_bytes(piece, peer, group, chunk, staging)
    return snapshot.nbytes


def _receive(peer: int, group: Optional[Any], device: torch.device, chunk: int) -> Snapshot:
    staging = _staging(device, chunk)
    return _read(lambda data: _recv_bytes(data, peer, group, chunk, staging), None)
