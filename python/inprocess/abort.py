"""``abort`` hooks: release a rank from whatever the failed iteration blocked it in."""

from __future__ import annotations

import abc
import logging
from typing import Optional

from . import pg_tracker
from .state import FrozenState

log = logging.getLogger("inprocess")


class Abort(abc.ABC):
    """Runs on every rank as soon as a restart is decided, in the restart
    trigger thread, while the main thread may still be blocked in the failed
    iteration. It must make that main thread return (abort communicators).

    Any exception raised here terminates this rank: a rank that could not be
    released cannot be trusted with the next iteration (design principle 9).
    """

    @abc.abstractmethod
    def __call__(self, state: FrozenState) -> Optional[FrozenState]:
        raise NotImplementedError


class AbortTorchDistributed(Abort):
    """Aborts and destroys every torch.distributed process group.

    NCCL communicators are aborted by ``ProcessGroup.abort()``. Gloo groups
    also have their pair sockets shut down (see :mod:`inprocess.pg_tracker`),
    because gloo's own abort does not release a collective in flight. Then
    every group is destroyed, so the next iteration can create new ones.
    """

    def __call__(self, state: FrozenState) -> FrozenState:
        try:
            import torch.distributed as dist
        except ImportError:
            return state
        if not dist.is_available():
            return state
        released = pg_tracker.release_connections()
        if dist.is_initialized():
            from torch.distributed import distributed_c10d as c10d

            groups = list(c10d._world.pg_map.keys())
            for group in groups:
                try:
                    group.abort()
                except Exception as e:  # a group already broken by the fault
                    log.debug("abort of %s failed: %s", group, e)
            dist.destroy_process_group()
        log.debug("aborted torch.distributed (%d gloo sockets shut down)", released)
        return state
