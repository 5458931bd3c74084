"""ReplicatedState: the state every data-parallel replica holds alike, from a peer after a restart."""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Tuple

from .arguments import DEFAULT_CHUNK_BYTES
from .base import PeerState
from .process_group import ProcessGroupTransport
from .record import RestoreRecord, size_text
from .snapshot import Snapshot, load, take

log = logging.getLogger("inprocess")


class ReplicatedState(PeerState):
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
        super().__init__("ReplicatedState", every, rng, chunk_bytes, objects)
        # (complete, spare): one attribute, replaced in one store, so that an exception that
        # interrupts a snapshot can never leave both names on the same, half-written buffer.
        self._buffers: Tuple[Optional[Snapshot], Optional[Snapshot]] = (None, None)

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

    def commit(self, step: int, **values: Any) -> bool:
        """The state after `step` steps is complete: snapshot it if `step` is a
        multiple of ``every``. `values`: plain data to keep with it (the data
        loader's position, a counter). True when a snapshot was taken."""
        if not self._due(step):
            return False
        complete, spare = self._buffers
        self._buffers = (take(self._objects, values, self.rng, step, spare), complete)
        self._values = dict(values)
        return True

    def restore(self, group: Optional[Any] = None, **objects: Any) -> Optional[int]:
        """Collective over `group` (default: the default process group), on every
        rank of the new iteration before its first step: the newest step any
        rank committed, loaded on every rank (sent to those that lack it);
        None when no rank holds one. Every rank's step after it is checked equal.
        `objects`: this iteration's, in place of those registered (the same names)."""
        self._replace(objects)
        started = time.monotonic()
        transport = ProcessGroupTransport(group, self.chunk_bytes)
        rank = transport.rank
        complete = self._buffers[0]
        mine = -1 if complete is None else complete.step
        held = [row[0] for row in transport.rows([mine])]
        newest = max(held)
        if newest < 0:
            self.last_restore = RestoreRecord(None, None, (), 0, time.monotonic() - started)
            if rank == 0:
                log.info("peer state: no rank holds a committed state (none committed yet, or every holder "
                         "lost): the function loads its own")
            return None
        receivers = tuple(r for r, step in enumerate(held) if step != newest)
        source = held.index(newest)
        received = sent = 0
        if receivers:
            if rank == source:
                assert complete is not None
                sent = transport.send(complete, receivers)
            elif rank in receivers:
                complete = transport.receive(source, receivers)
                received = complete.nbytes
                self._buffers = (complete, self._buffers[0])
        assert complete is not None and complete.step == newest
        self._values = load(self._objects, complete, self.rng)
        low = min(row[0] for row in transport.rows([complete.step]))
        if low != newest:
            raise RuntimeError(f"peer state: ranks resumed at different steps ({low} and {newest}) after the transfer")
        seconds = time.monotonic() - started
        self.last_restore = RestoreRecord(newest, source if receivers else None, receivers, received, seconds, sent)
        if receivers and rank in (source, *receivers):
            rate = complete.nbytes / 2**20 / max(seconds, 1e-9)
            log.info("peer state: step %d from rank %d to rank(s) %s: %s in %.0f ms (%.0f MB/s)", newest, source,
                     ", ".join(map(str, receivers)), size_text(complete.nbytes), 1e3 * seconds, rate)
        elif not receivers and rank == 0:
            log.info("peer state: every rank holds step %d: restored from memory in %.0f ms", newest, 1e3 * seconds)
        return newest
