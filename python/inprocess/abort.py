"""``abort`` hooks: release a rank from whatever the failed iteration blocked it in."""

from __future__ import annotations

import abc
import datetime
import importlib
import logging
from types import ModuleType
from typing import Any

from .engine import pg_tracker
from .gpu import flight_recorder, nccl_abort, nccl_reaper
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
    def __call__(self, state: FrozenState) -> FrozenState | None:
        raise NotImplementedError


class AbortTorchDistributed(Abort):
    """Aborts and destroys every torch.distributed process group.

    NCCL (and any non-gloo) backends are aborted (see below). Gloo
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

    NCCL backends are released within ``nccl_timeout`` (see
    :mod:`inprocess.gpu.nccl_abort`): torch's ``abort()`` of every backend
    starts at once, each on a thread of its own. With ``overlap_teardown``
    (the default) the hook returns once every abort has started, and the
    aborts finish while the restart goes on (finalize, health check, barrier):
    the restart waits for them before the function runs again
    (:mod:`inprocess.gpu.nccl_reaper`). ``overlap_teardown=False`` waits for
    them here, as a restart did before (for a finalize or health-check hook
    that calls NCCL itself, which must not run beside an abort). An abort
    still running at the deadline raises
    :class:`~inprocess.gpu.NcclAbortTimeout`; the rank then leaves the job
    (exit status 75, without touching torch's groups again: the abandoned
    abort holds their locks).

    ``overlap_next_iteration=True`` (opt-in, with ``overlap_teardown``) lets
    the teardown go on beside the next iteration (its ``init_process_group``
    and first steps) where the rank's device has room for the new
    communicators beside the old ones: ``overlap_memory_bytes`` free, or (None)
    what the old communicators freed at an earlier restart, whose gate waited
    to measure it (see :mod:`inprocess.gpu.nccl_reaper`, Stage 2). It goes
    beyond what NCCL's documentation promises (docs/gpu.md).

    ``revoke=True`` revokes the blocking communicators first
    (``ncclCommRevoke``, NCCL 2.28.7 and later). It is off by default: no
    measurement shows it shortening a release, and a point-to-point kernel
    stuck ahead of a collective on the same stream (torch's ``send``/``recv``
    use communicators the revoke cannot reach) holds the revoke until the
    deadline (exit 75), where torch's abort alone releases it.

    ``torch_fr_trace_path`` (as in NVRx 0.5+): before aborting, torch's NCCL
    flight recorder is written there (``{rank}`` and ``{iteration}`` are filled
    in), bounded by ``fr_timeout``; a dump that fails or hangs is logged and
    the abort goes on.
    """

    def __init__(
        self,
        torch_fr_trace_path: str | None = None,
        nccl_timeout: datetime.timedelta = datetime.timedelta(seconds=30),
        fr_timeout: datetime.timedelta = datetime.timedelta(seconds=10),
        revoke: bool = False,
        overlap_teardown: bool = True,
        overlap_next_iteration: bool = False,
        overlap_memory_bytes: int | None = None,
    ):
        if overlap_next_iteration and not overlap_teardown:
            raise ValueError("overlap_next_iteration=True needs overlap_teardown=True: the teardown can go on "
                             "beside the next iteration only if it left the abort")
        if overlap_memory_bytes is not None and not (type(overlap_memory_bytes) is int and overlap_memory_bytes >= 0):
            raise ValueError(f"overlap_memory_bytes={overlap_memory_bytes!r}: expected an int >= 0 or None")
        values: dict[str, object] = {"nccl_timeout": nccl_timeout, "fr_timeout": fr_timeout}
        for name, value in values.items():
            if not isinstance(value, datetime.timedelta) or value.total_seconds() <= 0:
                raise ValueError(f"{name}={value!r}: expected a positive datetime.timedelta")
        if torch_fr_trace_path is not None:
            path: object = torch_fr_trace_path
            if not isinstance(path, str) or not path:
                raise ValueError(f"torch_fr_trace_path={torch_fr_trace_path!r}: expected a non-empty str or None")
            flight_recorder.trace_path(torch_fr_trace_path, 0, 0)  # a bad template fails here, not mid-restart
        self.torch_fr_trace_path = torch_fr_trace_path
        self.nccl_timeout = nccl_timeout
        self.fr_timeout = fr_timeout
        self.revoke = revoke
        self.overlap_teardown = overlap_teardown
        self.overlap_next_iteration = overlap_next_iteration
        self.overlap_memory_bytes = overlap_memory_bytes

    def __call__(self, state: FrozenState) -> FrozenState:
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            return state
        if not dist.is_available():
            return state
        backends = nccl_backends(torch, dist)
        if self.torch_fr_trace_path is not None:
            path = flight_recorder.trace_path(self.torch_fr_trace_path, state.initial_rank, state.iteration)
            # On the rank's device: the dump reads the state of CUDA events, and on a thread with no
            # device the CUDA runtime would make a context on GPU 0 for it.
            flight_recorder.dump(path, self.fr_timeout.total_seconds(),
                                 bind=lambda: nccl_abort.bind_rank_device(backends))
        released = pg_tracker.release_connections()
        if backends:
            timeout = self.nccl_timeout.total_seconds()
            if self.overlap_teardown:
                report = nccl_reaper.REAPER.hand_over(backends, timeout, self.revoke,
                                                      beside_next=self.overlap_next_iteration,
                                                      memory_bytes=self.overlap_memory_bytes)
            else:
                report = nccl_abort.release(backends, timeout, self.revoke)
            for error in report.errors:  # a communicator already broken by the fault
                log.debug("NCCL release: %s", error)
        log.debug("aborted torch.distributed (%d gloo connections shut down)", released)
        return state


def nccl_backends(torch: Any, dist: Any) -> list[Any]:
    """The backends of every registered process group that torch's NCCL abort must reach."""
    if not dist.is_initialized():
        return []
    from torch.distributed import distributed_c10d as c10d

    return [b for g in list(c10d._world.pg_map.keys()) for b in _non_gloo_backends(g, torch)]


def _non_gloo_backends(group: object, torch: Any) -> list[Any]:
    """The backend of `group` that must be aborted: its CUDA backend
    (ProcessGroupNCCL, whose ``_comm_ptr()`` the revoke needs), else the
    group itself; nothing for a gloo-only group."""
    try:
        import torch.distributed as dist

        names = str(dist.get_backend(group)).lower()  # type: ignore[arg-type]
    except Exception:
        names = ""
    if "gloo" in names and "nccl" not in names:
        return []
    try:
        # Mixed "cpu:gloo,cuda:nccl" too: the NCCL side only.
        return [group._get_backend(torch.device("cuda"))]  # type: ignore[attr-defined]
    except Exception as e:
        if "gloo" in names:
            log.debug("no NCCL backend in %s: %s", group, e)
            return []
        return [group]


def _optional_module(name: str) -> ModuleType | None:
    """``name`` imported, or None where it cannot be: an optional library absent,
    or present but failing to import (TransformerEngine without its CUDA libraries)."""
    try:
        return importlib.import_module(name)
    except Exception as e:  # any import failure means "not usable here", as in NVRx
        log.debug("%s not importable: %s: %s", name, type(e).__name__, e)
        return None


class AbortTransformerEngine(Abort):
    """Releases what TransformerEngine holds across an iteration, as NVRx's hook of the same name:
    its userbuffers (``transformer_engine.pytorch.module.base.destroy_ub()``, which
    hold communicators of the failed process groups) and its FP8 global state
    (``FP8GlobalStateManager.reset()``, which holds a process group).

    Where TransformerEngine cannot be imported it does nothing: a job without
    it can keep this hook in its ``Compose`` chain, as Megatron-LM does. An
    exception raised by TransformerEngine itself terminates the rank, as any
    abort hook's does.
    """

    def __call__(self, state: FrozenState) -> FrozenState:
        te = _optional_module("transformer_engine.pytorch")
        if te is not None:
            te.module.base.destroy_ub()
        fp8 = _optional_module("transformer_engine.pytorch.fp8")
        if fp8 is not None:
            fp8.FP8GlobalStateManager.reset()
        return state


class AbortPersistentCheckpointProcesses(Abort):
    """Stops the asynchronous checkpoint workers of ``nvidia_resiliency_ext.checkpointing``
    (its ``abort_nvrx_checkpoint()``: every ``AsyncCallsQueue`` closed with
    ``abort=True``), so that the next iteration starts fresh ones, as NVRx 0.5+'s
    hook of the same name.

    That checkpointing package is separate from NVRx's deprecated in-process
    restart and may stay installed beside this library; where it is not
    installed there are no such workers, and the hook does nothing.
    """

    def __call__(self, state: FrozenState) -> FrozenState:
        core = _optional_module("nvidia_resiliency_ext.checkpointing.async_ckpt.core")
        if core is not None:
            core.abort_nvrx_checkpoint()
        return state
