"""``abort`` hooks: release a rank from whatever the failed iteration blocked it in."""

from __future__ import annotations

import abc
import logging
from typing import Optional

from .engine import pg_tracker
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

    NCCL (and any non-gloo) backends are aborted with their ``abort()``. Gloo
    backends are not: in torch 2.13 ``ProcessGroupGloo.abort()`` stops the
    group's worker threads, so a work still queued never completes and a
    waiter (DDP's ``Reducer::finalize_backward``) blocks forever (seen here).
    Gloo is released instead through its connections (see
    :mod:`inprocess.engine.connection_release`): this rank's side of every
    pair reads end of file and fails, which fails every work in flight or
    queued, while the sockets stay open for the peers' sends (a send whose
    write fails is stranded in gloo until the group's timeout).

    The groups are destroyed afterwards by the engine, in the main thread,
    once it is back from the failed iteration: destroying them here, in the
    restart trigger's thread, while the main thread is still inside DDP's
    backward, left a bucket's future that never completed (seen here about
    once in ten restarts).
    """

    def __call__(self, state: FrozenState) -> FrozenState:
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            return state
        if not dist.is_available():
            return state
        released = pg_tracker.release_connections()
        if dist.is_initialized():
            from torch.distributed import distributed_c10d as c10d

            for group in list(c10d._world.pg_map.keys()):
                _abort_non_gloo_backends(group, torch)
        log.debug("aborted torch.distributed (%d gloo connections shut down)", released)
        return state


def _abort_non_gloo_backends(group: object, torch: object) -> None:
    try:
        import torch.distributed as dist

        names = str(dist.get_backend(group)).lower()  # type: ignore[arg-type]
    except Exception:
        names = ""
    if "gloo" in names and "nccl" not in names:
        return
    try:
        if "gloo" in names:
            # Mixed "cpu:gloo,cuda:nccl": abort the NCCL side only.
            group._get_backend(torch.device("cuda")).abort()  # type: ignore[attr-defined]
        else:
            group.abort()  # type: ignore[attr-defined]
    except Exception as e:  # a communicator already broken by the fault
        log.debug("abort of %s failed: %s", group, e)
