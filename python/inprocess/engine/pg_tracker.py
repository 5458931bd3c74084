"""The process groups torch creates during a wrapped call: their sockets and their lifetime.

Two facts of torch 2.13 shape this module:

* A gloo collective in flight returns only when one of its pair sockets
  fails (``ProcessGroupGloo.abort()`` returns at once and leaves it blocked
  until its peer process exits). :func:`release_connections` makes every
  pair of the failed iteration fail without ever making a send fail (a
  failed send is stranded until the group's timeout): see
  :mod:`inprocess.engine.connection_release`. Only sockets that appeared
  while torch created a process group are touched, never a listening
  socket (gloo's listener thread aborts the process when accept() fails).
* ``~ProcessGroupGloo`` joins its worker threads while the destroying thread
  holds the GIL, and a worker that destroys a finished work needs the GIL
  (its ThreadLocalState holds a Python object): if the last reference to a
  group dies while a worker finishes a work, the process deadlocks (seen
  here: DDP's Reducer freed during exception unwinding). So every group is
  kept alive here until :func:`release_groups`, which the engine calls at a
  point of the restart where the workers are idle.

Both rely on wrapping torch's private
``distributed_c10d._new_process_group_helper``.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

from . import sockets
from .connection_release import ConnectionRelease

log = logging.getLogger("inprocess")

_lock = threading.Lock()
_sockets: dict[int, str] = {}  # fd -> "socket:[inode]" when it was recorded
_groups: list[Any] = []  # what _new_process_group_helper returned: keeps each group alive
_installed = False
_release = ConnectionRelease()


def install() -> bool:
    """Start tracking the process groups created from now on (idempotent)."""
    global _installed
    with _lock:
        if _installed:
            return True
        try:
            from torch.distributed import distributed_c10d as c10d
        except ImportError:
            return False
        original = getattr(c10d, "_new_process_group_helper", None)
        if original is None:
            log.warning(
                "torch.distributed has no _new_process_group_helper: gloo collectives in flight "
                "are released only by the process group's own timeout"
            )
            return False

        @functools.wraps(original)
        def tracking_helper(*args: Any, **kwargs: Any) -> Any:
            # A new group after a restart: every peer passed the restart barrier, so
            # none still sends on the failed iteration's connections.
            closed = _release.close_all()
            if closed:
                log.debug("closed %d connections held since the last abort", closed)
            before = sockets.socket_fds()
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                _track(before, result)

        tracking_helper.__inprocess_original__ = original  # type: ignore[attr-defined]
        c10d._new_process_group_helper = tracking_helper
        _installed = True
        return True


def _track(before: dict[int, str], result: Any) -> None:
    """Record what a group's creation opened. Runs in the creator's ``finally``: it must
    not raise, or the caller's init_process_group would fail after torch registered the
    group (an OSError here once left a rank unable to create its group again)."""
    try:
        new = sockets.new_since(before)
        for fd in sockets.accepted_by_older_listeners(new, before):
            del new[fd]
    except Exception as e:
        log.warning("the sockets of a new process group could not be listed (%s: %s): a gloo "
                    "collective of it in flight at a restart is released by its own timeout",
                    type(e).__name__, e)
        new = {}
    with _lock:
        _sockets.update(new)
        if result is not None:
            _groups.append(result)
    log.debug("process group created: %d new sockets %s", len(new), sorted(new))


def tracked() -> tuple[int, int]:
    """(sockets, groups) currently tracked."""
    with _lock:
        return len(_sockets), len(_groups)


def release_connections() -> int:
    """Make every tracked connection fail for its owner (see
    :mod:`inprocess.engine.connection_release`); returns how many are released.

    Safe from any thread. The connections stay held (open, and drained once
    gloo closed them) until :func:`close_released_connections` or the next
    process group this rank creates.
    """
    with _lock:
        tracked = dict(_sockets)
        _sockets.clear()
    count = _release.release(tracked)
    log.debug("releasing %d of %d tracked sockets", count, len(tracked))
    return count


def close_released_connections() -> int:
    """Close what :func:`release_connections` still holds; returns how many.

    Call it once no peer can still send on the failed iteration's
    connections: after the restart barrier, or when the wrapped call ends.
    """
    return _release.close_all()


def held_connections() -> int:
    """How many released connections are still held open (one descriptor each)."""
    return _release.held()


def _forget_groups(c10d: Any) -> list[Any]:
    """Unregister every group without calling into its backend, as ``destroy_process_group()`` does
    but for its ``shutdown()`` calls (torch 2.13, distributed_c10d.py); returns what torch held of them.

    Two cases. A restart interrupted an init_process_group between ``_new_process_group_helper``
    (which registers the group's name, ``_update_process_group_state``) and ``_update_default_pg``:
    ``destroy_process_group()`` cannot reach those groups (it needs a default group), and the next
    init_process_group of this rank would fail with "The specified group name has already been
    created". Or NCCL's teardown of the groups still runs (inprocess.gpu.nccl_reaper): a
    ``shutdown()`` would call into NCCL beside the aborts, and wait for them."""
    world = c10d._world
    held: list[Any] = list(world.pg_map.keys()) + list(getattr(world, "comms", []))
    c10d._update_default_pg(None)
    for registry in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag",
                     "tags_to_pg", "pg_coalesce_state", "comms"):
        table = getattr(world, registry, None)
        if table is not None:
            table.clear()
    c10d._unregister_all_process_groups()
    return held


def _forget_orphaned_groups(c10d: Any) -> None:
    """The groups of an interrupted init_process_group (:func:`_forget_groups`), dropped in the
    caller's thread."""
    names = sorted(c10d._world.pg_names.values())
    held = _forget_groups(c10d)
    log.info("forgot %d process group(s) %s left registered by an interrupted init_process_group",
             len(names), names)
    del held


def release_groups(keep: Callable[[list[Any]], bool] | None = None) -> int:
    """Destroy every torch.distributed group and drop the references kept here.

    Call it from the main thread once it is back from the failed iteration
    (no collective in flight, workers idle): destroying a group joins its
    worker threads. Returns how many groups were released.

    `keep` (the NCCL reaper's): offered the groups first; where it keeps them
    (NCCL's teardown of them still runs) they are forgotten by torch instead of
    destroyed, and the keeper drops them once their aborts returned.
    """
    with _lock:
        groups = list(_groups)
        _groups.clear()
        _sockets.clear()
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if keep is not None and keep(groups):
            names = sorted(c10d._world.pg_names.values())
            keep(_forget_groups(c10d))
            log.debug("forgot %d process group(s) %s: NCCL's teardown of them still runs", len(names), names)
        elif dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        elif c10d._world.pg_map:
            _forget_orphaned_groups(c10d)
        # An init_process_group interrupted by the restart has already taken a
        # number from torch's process-local group counter, which names the
        # rendezvous keys; without a group to destroy nothing resets it, and
        # this rank would look for other keys than its peers next time.
        if getattr(c10d._world, "group_count", 0):
            c10d._world.group_count = 0
    except Exception as e:  # a group broken by the fault may refuse a clean destroy
        log.debug("destroy_process_group failed: %s", e)
    count = len(groups)
    del groups  # the last references go here, in the caller's thread
    return count
