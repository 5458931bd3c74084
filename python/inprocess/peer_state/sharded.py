"""ShardedState: each rank's own shard, with a copy of a partner's, so that a lost shard comes back."""

from __future__ import annotations

import logging
import threading
import time
import zlib
from typing import Any, List, Optional, Tuple

from .arguments import DEFAULT_CHUNK_BYTES, is_int
from .base import PeerState
from .planning import held_table, node_key, partners, plan_shards
from .process_group import ProcessGroupTransport
from .record import RestoreRecord, size_text
from .snapshot import Snapshot, checksum, load, take
from .transport import Transport

log = logging.getLogger("inprocess")

Pair = Tuple[Optional[Snapshot], Optional[Snapshot]]  # (complete, spare)


class ShardedState(PeerState):
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
        super().__init__("ShardedState", every, rng, chunk_bytes, objects, required=False)
        if distance is not None and (not is_int(distance) or distance < 1):
            raise ValueError(f"ShardedState(distance={distance!r}): expected an int >= 1 or None")
        self.distance = distance
        self._own: Pair = (None, None)
        self._copy: Pair = (None, None)  # the partner's
        self._exchange: Optional[Transport] = None  # over the private gloo group of this iteration
        self._ring: Tuple[int, int, int, int] = (0, 1, 0, 0)  # rank, world, the holder of my copy, my partner
        self._pending: Optional[threading.Thread] = None
        self._exchange_error: Optional[BaseException] = None
        self._one_node_said = False

    @property
    def step(self) -> Optional[int]:
        complete = self._own[0]
        return None if complete is None else complete.step

    @property
    def nbytes(self) -> int:
        """The bytes of this rank's last complete snapshot of its shard."""
        complete = self._own[0]
        return 0 if complete is None else complete.nbytes

    @property
    def copy_step(self) -> Optional[int]:
        """The step of the partner's shard this rank holds a complete, checked copy of."""
        complete = self._copy[0]
        return None if complete is None else complete.step

    def commit(self, step: int, **values: Any) -> bool:
        """This rank's shard after `step` steps is complete: snapshot it if `step` is
        a multiple of ``every``, and send it to its copy's keeper in the background.
        Every rank commits at the same steps (the exchange pairs them)."""
        if not self._due(step):
            return False
        if self._exchange is None:
            raise RuntimeError("ShardedState.commit(): call restore() first in each iteration (it sets up the "
                               "exchange with the partners of this iteration's ranks)")
        self.wait()
        rank, world, _, _ = self._ring
        complete, spare = self._own
        snapshot = take(self._objects, values, self.rng, step, spare)
        snapshot.shard, snapshot.world = rank, world
        self._own = (snapshot, complete)
        self._values = dict(values)
        self._start_exchange(snapshot)
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

    def _start_exchange(self, snapshot: Snapshot) -> None:
        self._pending = threading.Thread(target=self._exchange_copies, args=(snapshot,),
                                         name="inprocess-shard-exchange", daemon=True)
        self._pending.start()

    def _exchange_copies(self, snapshot: Snapshot) -> None:
        try:
            snapshot.checksum = checksum(snapshot)
            _, world, keeper, partner = self._ring
            if world == 1 or self._exchange is None:
                return  # no partner: nothing can stand in for this shard
            received = self._exchange.exchange(snapshot, keeper, partner, self._copy[1])
            if checksum(received) != received.checksum:
                raise RuntimeError(f"the copy of shard {received.shard} at step {received.step} is torn")
            self._copy = (received, self._copy[0])
        except BaseException as e:  # the restart's abort of the group, a peer's death: kept for wait()
            self._exchange_error = e

    def restore(self, group: Optional[Any] = None, **objects: Any) -> Optional[int]:
        """Collective over the default process group, on every rank of the new
        iteration before its first step (and before any commit in it). `objects`:
        this iteration's, in place of those registered (an FSDP2 module is built and
        sharded anew in each iteration: it is bound to its process group)."""
        import torch.distributed as dist

        self._replace(objects)
        if group is not None:
            raise ValueError("ShardedState.restore(group=...): only the default process group is supported")
        started = time.monotonic()
        self.wait()
        transport = ProcessGroupTransport(None, self.chunk_bytes)
        rank, world = transport.rank, transport.world
        table = held_table(transport.rows(self._held_row(world)))
        plan = plan_shards(table, world)
        nodes = [row[0] for row in transport.rows([zlib.crc32(node_key().encode())])]
        ring = partners(nodes, self.distance)
        if len(set(nodes)) == 1 and world > 1 and rank == 0 and not self._one_node_said:
            self._one_node_said = True
            log.info("peer state: every rank is on one node: a shard's copy is on the same node as the shard")
        self._exchange = ProcessGroupTransport(dist.new_group(backend="gloo"), self.chunk_bytes)
        self._ring = (rank, world, ring.index(rank), ring[rank])
        if isinstance(plan, str):
            self._own = self._copy = (None, None)
            self.last_restore = RestoreRecord(None, None, (), 0, time.monotonic() - started)
            if rank == 0:
                log.info("peer state: %s: the function loads its own", plan)
            return None
        step, sources = plan
        mine, received, sent = self._move_shards(transport, step, sources)
        self._values = load(self._objects, mine, self.rng)
        low = min(row[0] for row in transport.rows([step]))
        if low != step:
            raise RuntimeError(f"peer state: ranks resumed at different steps ({low} and {step}) after the transfer")
        self._own, self._copy = (mine, None), (None, None)
        # The copies under this iteration's partners, before the first step: a loss in it finds them.
        self._start_exchange(mine)
        self.wait()
        receivers = tuple(shard for shard, source in enumerate(sources) if source != shard)
        seconds = time.monotonic() - started
        self.last_restore = RestoreRecord(step, None, receivers, received, seconds, sent)
        if rank in receivers:
            log.info("peer state: shard %d of step %d from rank %d: %s in %.0f ms", rank, step, sources[rank],
                     size_text(received), 1e3 * seconds)
        elif rank == 0:
            log.info("peer state: step %d, every shard held%s", step,
                     f"; sent to rank(s) {', '.join(map(str, receivers))}" if receivers else " by its own rank")
        return step

    def _held_row(self, world: int) -> List[int]:
        """This rank's (shard, step) pairs, flattened: its two own snapshots, then its two
        copies ((-1, -1) for none, and for a snapshot of a state with another number of shards)."""
        mine = []
        for snapshot in (*self._own, *self._copy):
            usable = snapshot is not None and snapshot.step >= 0 and snapshot.world == world
            mine += [snapshot.shard, snapshot.step] if usable and snapshot is not None else [-1, -1]
        return mine

    def _held(self, shard: int, step: int) -> Optional[Snapshot]:
        """This rank's snapshot of `shard` at `step`: its own or a partner's copy (complete ones only)."""
        for snapshot in (*self._own, *self._copy):
            if snapshot is not None and snapshot.shard == shard and snapshot.step == step:
                return snapshot
        return None

    def _move_shards(self, transport: Transport, step: int, sources: List[int]) -> Tuple[Snapshot, int, int]:
        """Each shard its rank lacks, from the rank that `sources` names, in shard order:
        this rank's shard of `step`, and the bytes it received and sent."""
        rank = transport.rank
        received = sent = 0
        mine = self._held(rank, step)
        for shard, source in enumerate(sources):
            if source == shard:
                continue
            if rank == source:
                held = self._held(shard, step)
                assert held is not None
                sent += transport.send(held, [shard])
            elif rank == shard:
                mine = transport.receive(source, [shard])
                received = mine.nbytes
                if checksum(mine) != mine.checksum:
                    raise RuntimeError(f"peer state: shard {shard} of step {step} from rank {source} is torn")
        assert mine is not None and mine.step == step and mine.shard == rank
        return mine, received, sent
