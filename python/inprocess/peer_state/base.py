"""What both peer states share: their settings, their objects, the values kept with a commit, and
the snapshot's copy, on the training thread or (``background=True``) beside it.

In the background, a commit copies on the training thread only what the next step's forward
and backward may change (module buffers, other objects, the RNG states: small), and leaves the
parameters of the registered optimizers and their state, which only ``optimizer.step()``
changes, to a thread of its own; each registered optimizer waits for that copy at the start of
its next ``step()`` (a step pre-hook). The snapshot counts as complete only once the copy ends.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Mapping, Optional

from .arguments import check_arguments, check_step
from .objects import Objects
from .record import RestoreRecord
from .snapshot import Snapshot, take

log = logging.getLogger("inprocess")


class PeerState:
    """The settings and objects of a :class:`ReplicatedState` or :class:`ShardedState`."""

    def __init__(self, kind: str, every: int, rng: bool, chunk_bytes: int, background: bool,
                 objects: Mapping[str, Any], required: bool = True) -> None:
        check_arguments(kind, every, chunk_bytes)
        if not isinstance(background, bool):
            raise TypeError(f"{kind}(background={background!r}): expected True or False")
        self.background = background
        self._copying: Optional[threading.Thread] = None
        self._copy_error: Optional[BaseException] = None
        self._hooks: List[Any] = []
        self.kind = kind
        self.every = every
        self.rng = rng
        self.chunk_bytes = chunk_bytes
        if required and not objects:
            raise ValueError(f"{kind}(): name at least one object, e.g. {kind}(model=model)")
        self._objects = Objects(kind, objects)
        self._values: Dict[str, Any] = {}
        self.last_restore: Optional[RestoreRecord] = None
        self._hook_optimizers()

    @property
    def values(self) -> Dict[str, Any]:
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
        self._hooks = [optimizer.register_step_pre_hook(lambda *_: self.wait_copy())
                       for optimizer in (self._objects.optimizers() if self.background else [])]

    def _take(self, values: Mapping[str, Any], step: int, spare: Optional[Snapshot]) -> Snapshot:
        """A snapshot of the objects at `step` into `spare`. In the background, the optimizers'
        tensors are copied on a thread of its own (the snapshot's step stays -1 until they are)."""
        self.wait_copy()
        deferred = self._objects.optimized() if self.background else set()
        snapshot, finish = take(self._objects, values, self.rng, step, spare, deferred)
        if not deferred:
            finish()
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
