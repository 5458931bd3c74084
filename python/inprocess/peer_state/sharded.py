"""ShardedState: each rank's own shard, with a copy of a partner's, so that a lost shard comes back."""

from __future__ import annotations

import logging
import threading
import time
import zlib
from typing import Any

from .arguments import DEFAULT_CHUNK_BYTES, is_int
from .base import PeerState
from .planning import node_key, partners, sharded_plan
from .process_group import ProcessGroupTransport
from .record import RestoreRecord, size_text
from .snapshot import Pair, Snapshot, checksum, kept_and_spare, load
from .transport import Transport

log = logging.getLogger("inprocess")



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
                 distance: int | None = None, snapshots: str = "copy", **objects: Any) -> None:
        if snapshots == "live":  # its copy travels to the keeper while the next step runs: it must be a copy
            raise ValueError("ShardedState(snapshots='live'): expected 'copy' or 'background' (a shard's copy is "
                             "sent to its keeper while the next step runs)")
        super().__init__("ShardedState", every, rng, chunk_bytes, snapshots, objects, required=False)
        if distance is not None and (not is_int(distance) or distance < 1):
            raise ValueError(f"ShardedState(distance={distance!r}): expected an int >= 1 or None")
        self.distance = distance
        self._copy: Pair = (None, None)  # the partner's
        self._exchange: Transport | None = None  # over the private gloo group of this iteration
        self._ring: tuple[int, int, int, int] = (0, 1, 0, 0)  # rank, world, the holder of my copy, my partner
        self.keeper: int | None = None  # the global rank that keeps this rank's copy in this iteration
        self._pending: threading.Thread | None = None
        self._exchange_error: BaseException | None = None
        self._one_node_said = False

    @property
    def copy_step(self) -> int | None:
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
        kept, spare = kept_and_spare(self._own)
        snapshot = self._take(values, step, spare)
        snapshot.shard, snapshot.world, snapshot.group = rank, world, self._key
        self._own = (snapshot, kept)
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
            self.wait_copy()
            if snapshot.step < 0:
                raise RuntimeError("the snapshot's background copy failed")
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

    def restore(self, group: Any | None = None, **objects: Any) -> int | None:
        """Collective over the default process group, on every rank of the new iteration
        before its first step (and before any commit in it): the state is sharded within
        `group` (default: the default group; each rank names its own, e.g. its data-parallel
        group), a shard's copy kept by another rank of its group. The newest step at which
        every group holds every one of its shards is loaded everywhere, each shard sent to
        the rank that lacks it; None when there is no such step, saying why. `objects`:
        this iteration's, in place of those registered (an FSDP2 module is built and
        sharded anew in each iteration: it is bound to its process group)."""
        self._replace(objects)
        started = time.monotonic()
        self.wait()
        world = ProcessGroupTransport(None, self.chunk_bytes)
        local = world if group is None else ProcessGroupTransport(group, self.chunk_bytes)
        rows = world.rows([local.key, local.world, *self._held_row(local), zlib.crc32(node_key().encode())])
        plan = sharded_plan([row[:-1] for row in rows], local.members)
        self._pair_up(local, [rows[g][-1] for g in local.members])
        if isinstance(plan, str):
            self._own = self._copy = (None, None)
            self.last_restore = RestoreRecord(None, None, (), 0, time.monotonic() - started)
            if local.rank == 0:
                log.info("peer state: %s%s: the function loads its own", plan,
                         "" if group is None else f" (the group of global ranks {local.members})")
            return None
        step, sources = plan
        mine, received, sent = self._move_shards(local, step, sources)
        self._values = load(self._objects, mine, self.rng)
        low = min(row[0] for row in world.rows([step]))
        if low != step:
            raise RuntimeError(f"peer state: ranks resumed at different steps ({low} and {step}) after the transfer")
        self._own, self._copy = (mine, None), (None, None)
        # The copies under this iteration's partners, before the first step: a loss in it finds them.
        self._start_exchange(mine)
        self.wait()
        receivers = tuple(shard for shard, source in enumerate(sources) if source != shard)
        seconds = time.monotonic() - started
        self.last_restore = RestoreRecord(step, None, receivers, received, seconds, sent)
        if local.rank in receivers:
            log.info("peer state: shard %d of step %d from rank %d: %s in %.0f ms", local.rank, step,
                     sources[local.rank], size_text(received), 1e3 * seconds)
        elif local.rank == 0:
            log.info("peer state: step %d, every shard held%s", step,
                     f"; sent to rank(s) {', '.join(map(str, receivers))}" if receivers else " by its own rank")
        return step

    def _pair_up(self, local: Transport, nodes: list[int]) -> None:
        """This iteration's partners within the group (by the members' nodes) and the private
        gloo group of the copies' exchange."""
        import torch.distributed as dist

        ring = partners(nodes, self.distance)
        if len(set(nodes)) == 1 and local.world > 1 and local.rank == 0 and not self._one_node_said:
            self._one_node_said = True
            log.info("peer state: every rank of the group is on one node: a shard's copy is on the same node as "
                     "the shard")
        if local.world == dist.get_world_size():
            private = dist.new_group(backend="gloo")
        else:  # only the group's ranks take part: groups of other ranks are created at the same time
            private = dist.new_group(local.members, backend="gloo", use_local_synchronization=True)
        self._exchange = ProcessGroupTransport(private, self.chunk_bytes)
        # the keeper of this rank's copy and its partner, in the private group's ranks
        self.keeper = local.members[ring.index(local.rank)]
        keeper, partner = (self._exchange.members.index(local.members[r]) for r in (ring.index(local.rank),
                                                                                     ring[local.rank]))
        self._ring = (local.rank, local.world, keeper, partner)
        self._key = local.key

    def _held_row(self, local: Transport) -> list[int]:
        """This rank's (shard, step) pairs, flattened: its two own snapshots, then its two copies
        ((-1, -1) for none, and for a snapshot committed in another group or number of shards)."""
        mine = []
        for snapshot in (*self._own, *self._copy):
            usable = (snapshot is not None and snapshot.step >= 0 and snapshot.world == local.world
                      and snapshot.group == local.key)
            mine += [snapshot.shard, snapshot.step] if usable and snapshot is not None else [-1, -1]
        return mine

    def _held(self, shard: int, step: int) -> Snapshot | None:
        """This rank's snapshot of `shard` at `step`: its own or a partner's copy (complete ones only)."""
        for snapshot in (*self._own, *self._copy):
            if snapshot is not None and snapshot.shard == shard and snapshot.step == step:
                return snapshot
        return None

    def _move_shards(self, transport: Transport, step: int, sources: list[int]) -> tuple[Snapshot, int, int]:
        """Each shard its rank lacks, from the rank that `sources` names, in shard order:
        this rank's shard of `step`, and the bytes it received and sent."""
        rank = transport.rank
        received = 0
        sending = []
        mine = self._held(rank, step)
        for shard, source in enumerate(sources):
            if source == shard:
                continue
            if rank == source:
                held = self._held(shard, step)
                assert held is not None
                sending.append(transport.send(held, [shard]))
            elif rank == shard:
                mine = transport.receive(source, [shard])
                received = mine.nbytes
                if checksum(mine) != mine.checksum:
                    raise RuntimeError(f"peer state: shard {shard} of step {step} from rank {source} is torn")
        sent = sum(finish() for finish in sending)
        assert mine is not None and mine.step == step and mine.shard == rank
        return mine, received, sent
