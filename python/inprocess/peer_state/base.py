"""What both peer states share: their settings, their objects, the values kept with a commit, and
how a commit takes its snapshot (``snapshots=``).

- ``"copy"`` (the default): every tensor is copied on the training thread, in the commit.
- ``"background"``: the commit copies on the training thread only what the next step's forward
  and backward may change (module buffers, other objects, the RNG states: small); the parameters
  of the registered optimizers and their state, which only ``optimizer.step()`` changes, are
  copied on a thread of its own, and each registered optimizer waits for that copy at the start
  of its next ``step()`` (a step pre-hook). The snapshot is complete once the copy ends.
- ``"live"`` (ReplicatedState): those tensors are not copied at all: the snapshot refers to them
  until the next ``optimizer.step()`` begins (the pre-hook then withdraws it). A restart before
  that step finds the state of the commit in place; one after it finds none on this rank, which
  receives the state from a peer. Parameters and the optimizers' state must change only in the
  registered optimizers' ``step()``; ``optimizer.step()`` and ``commit()`` in one
  ``call_wrapper.atomic()`` block keep a restart out of the window between them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any

from .arguments import check_arguments, check_step
from .objects import Objects
from .record import RestoreRecord
from .snapshot import Pair, Snapshot, kept_and_spare, take

log = logging.getLogger("inprocess")

SNAPSHOTS = ("copy", "background", "live")


class PeerState:
    """The settings and objects of a :class:`ReplicatedState` or :class:`ShardedState`."""

    def __init__(self, kind: str, every: int, rng: bool, chunk_bytes: int, snapshots: str,
                 objects: Mapping[str, Any], required: bool = True) -> None:
        check_arguments(kind, every, chunk_bytes)
        if snapshots not in SNAPSHOTS:
            raise ValueError(f"{kind}(snapshots={snapshots!r}): expected one of {', '.join(map(repr, SNAPSHOTS))}")
        self.kind = kind
        self.every = every
        self.rng = rng
        self.chunk_bytes = chunk_bytes
        self.snapshots = snapshots
        self._copying: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        self._live: Snapshot | None = None  # "live": the snapshot that refers to the optimizers' tensors
        self._hooks: list[Any] = []
        # This rank's two snapshots, one attribute, replaced in one store, so that an exception that
        # interrupts a snapshot can never leave both on the same, half-written buffer; a commit writes
        # into the one that is not the newest complete snapshot (kept_and_spare).
        self._own: Pair = (None, None)
        self._key = 0  # the lowest global rank of this iteration's group (restore's `group`)
        if required and not objects:
            raise ValueError(f"{kind}(): name at least one object, e.g. {kind}(model=model)")
        self._objects = Objects(kind, objects)
        self._values: dict[str, Any] = {}
        self.last_restore: RestoreRecord | None = None
        self._hook_optimizers()

    @property
    def step(self) -> int | None:
        """The step of the last complete snapshot this rank holds of its state (None: none)."""
        complete = kept_and_spare(self._own)[0]
        return None if complete is None else complete.step

    @property
    def nbytes(self) -> int:
        """The bytes of that snapshot (host memory holds up to twice that: two buffers)."""
        complete = kept_and_spare(self._own)[0]
        return 0 if complete is None else complete.nbytes

    @property
    def values(self) -> dict[str, Any]:
        """The plain values given to :meth:`commit` with the snapshot last committed or restored."""
        return dict(self._values)

    def _due(self, step: int) -> bool:
        """Whether :meth:`commit` at `step` takes a snapshot (checking `step`)."""
        check_step(self.kind, step)
        return step % self.every == 0

    def _replace(self, objects: Mapping[str, Any]) -> None:
        """The objects given to restore(): this iteration's (a module built anew)."""
        self.wait_copy()
        if objects:
            self._objects.replace(objects)
            self._hook_optimizers()

    def _hook_optimizers(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = [optimizer.register_step_pre_hook(lambda *_: self._before_step())
                       for optimizer in (self._objects.optimizers() if self.snapshots != "copy" else [])]

    def _before_step(self) -> None:
        """A registered optimizer is about to change its parameters and state."""
        self.wait_copy()
        live, self._live = self._live, None
        if live is not None:
            live.step = -1  # it referred to what this step changes: no longer the state of its step

    def _take(self, values: Mapping[str, Any], step: int, spare: Snapshot | None) -> Snapshot:
        """A snapshot of the objects at `step` into `spare`, as ``snapshots`` says (module docstring):
        in the background, its step stays -1 until the copy on the other thread ends."""
        self.wait_copy()
        deferred = self._objects.optimized() if self.snapshots != "copy" else set()
        snapshot, finish = take(self._objects, values, self.rng, step, spare, deferred,
                                refer=self.snapshots == "live")
        if self.snapshots != "background":
            finish()
            self._live = snapshot if self.snapshots == "live" else None
            return snapshot

        def run() -> None:
            try:
                finish()
            except BaseException as e:  # the snapshot stays incomplete (step -1): the previous one counts
                self._copy_error = e

        self._copying = threading.Thread(target=run, name="inprocess-snapshot-copy", daemon=True)
        self._copying.start()
        return snapshot

    def wait_copy(self) -> None:
        """Until the last commit's background copy has ended (at once without one). Any thread may
        wait: the optimizers' step pre-hooks, a commit, a restore, the shard exchange."""
        copying = self._copying
        if copying is not None:
            copying.join()
        error, self._copy_error = self._copy_error, None
        if error is not None:
            log.warning("peer state: a snapshot's background copy failed (%s): the previous snapshot stays", error)
