"""What both peer states share: their settings, their objects, the values kept with a commit."""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from .arguments import check_arguments, check_step
from .objects import Objects
from .record import RestoreRecord


class PeerState:
    """The settings and objects of a :class:`ReplicatedState` or :class:`ShardedState`."""

    def __init__(self, kind: str, every: int, rng: bool, chunk_bytes: int, objects: Mapping[str, Any],
                 required: bool = True) -> None:
        check_arguments(kind, every, chunk_bytes)
        self.kind = kind
        self.every = every
        self.rng = rng
        self.chunk_bytes = chunk_bytes
        if required and not objects:
            raise ValueError(f"{kind}(): name at least one object, e.g. {kind}(model=model)")
        self._objects = Objects(kind, objects)
        self._values: Dict[str, Any] = {}
        self.last_restore: Optional[RestoreRecord] = None

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
        if objects:
            self._objects.replace(objects)
