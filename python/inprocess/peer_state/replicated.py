"""ReplicatedState: the state every data-parallel replica holds alike, from a peer after a restart."""

from __future__ import annotations

import logging
import time
from typing import Any

from .arguments import DEFAULT_CHUNK_BYTES
from .base import PeerState
from .planning import Route, replicated_plan
from .process_group import ProcessGroupTransport
from .record import RestoreRecord, size_text
from .snapshot import Snapshot, destinations, kept_and_spare, load
from .transport import Transport

log = logging.getLogger("inprocess")


class ReplicatedState(PeerState):
    """The training state every data-parallel replica holds alike, kept in host
    memory at commit points and sent from a peer to a rank that lacks it.

    ``ReplicatedState(model=model, optimizer=optimizer, every=10)``: each
    keyword names an object with ``state_dict()`` and ``load_state_dict()``
    (a module, an optimizer, an LR scheduler, a stateful data loader, a
    gradient scaler). ``every``: a snapshot at every ``every``-th step that
    :meth:`commit` is called with. ``rng``: keep the RNG states too.
    ``chunk_bytes``: the most bytes sent in one message (for an NCCL group,
    staged through two buffers of that size on the group's GPU).
    """

    def __init__(self, *, every: int = 1, rng: bool = True, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 snapshots: str = "copy", **objects: Any) -> None:
        super().__init__("ReplicatedState", every, rng, chunk_bytes, snapshots, objects)

    def commit(self, step: int, **values: Any) -> bool:
        """The state after `step` steps is complete: snapshot it if `step` is a
        multiple of ``every``. `values`: plain data to keep with it (the data
        loader's position, a counter). True when a snapshot was taken."""
        if not self._due(step):
            return False
        self.wait_copy()
        kept, spare = kept_and_spare(self._own)
        if self.snapshots == "live":  # one snapshot: it refers to the live tensors (its buffers are reused)
            spare = kept if kept is not None else spare
            kept = None
        snapshot = self._take(values, step, spare)
        snapshot.group = self._key
        self._own = (snapshot, kept)
        self._values = dict(values)
        return True

    def restore(self, group: Any | None = None, **objects: Any) -> int | None:
        """Collective over the default process group, on every rank of the new iteration
        before its first step: the newest step at which every `group` (default: the
        default group; each rank names its own, e.g. its data-parallel group) has a rank
        that holds a snapshot; loaded on every rank, sent within each group to the ranks
        that lack it; None when there is no such step. A snapshot counts only in a group
        whose lowest global rank is that of the group it was committed in. Every rank's
        step after it is checked equal. `objects`: this iteration's, in place of those
        registered (the same names)."""
        self._replace(objects)  # (after the last commit's background copy)
        started = time.monotonic()
        world = ProcessGroupTransport(None, self.chunk_bytes)
        local = world if group is None else ProcessGroupTransport(group, self.chunk_bytes)
        self._key = local.key
        held = {s.step: s for s in self._own if s is not None and s.step >= 0 and s.group == local.key}
        steps = sorted(held, reverse=True)
        plan = replicated_plan(world.rows([local.key, *steps, -1, -1][:3]), local.members)
        if plan is None:
            self.last_restore = RestoreRecord(None, None, (), 0, time.monotonic() - started)
            if world.rank == 0:
                log.info("peer state: no step held in every group (none committed yet, or every holder lost): "
                         "the function loads its own")
            return None
        step, moves = plan
        snapshot, source, received, sent = self._move(local, step, moves, held.get(step))
        low = min(row[0] for row in world.rows([snapshot.step]))
        if low != step:
            raise RuntimeError(f"peer state: ranks resumed at different steps ({low} and {step}) after the transfer")
        receivers = tuple(r for _, share in moves for r in sorted(share))
        self.last_restore = RestoreRecord(step, source, tuple(sorted(receivers)), received,
                                          time.monotonic() - started, sent)
        self._say(local.rank, snapshot.nbytes)
        return step

    def _move(self, transport: Transport, step: int, moves: list[Route],
              mine: Snapshot | None) -> tuple[Snapshot, int | None, int, int]:
        """This rank's part of the routes, and the load: the snapshot of `step`, the source of
        this rank's route (None: no route), and the bytes it received and sent. A source loads
        while its snapshot leaves; a receiver receives in place where it can, and keeps no buffer
        (the received tensors are the objects' now: it holds a snapshot again at its next commit)."""
        route = next(((source, share) for source, share in moves if transport.rank in (source, *share)), None)
        if route is not None and transport.rank != route[0]:
            source, share = route
            received = transport.receive(source, share, destinations=lambda skeleton, shapes: destinations(
                self._objects, skeleton, shapes))
            self._values = load(self._objects, received, self.rng, transient=True)
            self._own, self._live = (None, None), None
            return received, source, received.nbytes, 0
        assert mine is not None and mine.step == step
        finish = transport.send(mine, route[1]) if route is not None else (lambda: 0)
        self._values = load(self._objects, mine, self.rng)
        # The loaded snapshot is the complete one; a newer one (another group lacked its step) is
        # of a future this job no longer takes: dropped, so that no later restore picks it.
        older = [s for s in self._own if s is not None and s is not mine and s.step < step]
        self._own = (mine, older[0] if older else None)
        shown = route[0] if route is not None else (moves[0][0] if moves else None)  # a source, as the record says
        return mine, shown, 0, finish()

    def _say(self, rank: int, nbytes: int) -> None:
        """The restore's line: on the ranks that sent or received, else on group rank 0."""
        done = self.last_restore
        assert done is not None and done.step is not None
        if done.nbytes or done.sent:
            rate = nbytes / 2**20 / max(done.seconds, 1e-9)
            log.info("peer state: step %d from rank %d to rank(s) %s: %s in %.0f ms (%.0f MB/s)", done.step,
                     done.source, ", ".join(map(str, done.receivers)), size_text(nbytes), 1e3 * done.seconds, rate)
        elif not done.receivers and rank == 0:
            log.info("peer state: every rank holds step %d: restored from memory in %.0f ms", done.step,
                     1e3 * done.seconds)
