"""Grouping keys of topology-aware assignments (:class:`Layer`, :class:`FilterCountGroupedByKey`).

Each layer groups ranks by a key. ``key_or_fn`` is either

* a ``str``: the key itself, the same on every rank (``"job"`` for the layer
  that spans the whole job). It is *not* the name of an environment
  variable; use :class:`EnvKey` for that;
* a callable ``fn(initial_rank, initial_world_size) -> str`` evaluated once on
  every rank at the initial barrier, e.g. :class:`EnvKey` (an environment
  variable such as ``SLURM_NODEID``), :class:`HostnameKey` (the host name), or
  ``lambda rank, world_size: str(rank // 8)``. An ``int`` result is turned
  into its decimal string; anything else is refused.

The keys are gathered once (``local_keys``) and read by the leader from
``ctx.topology``; the previous decision, not any rank's local view, is the
only other input.
"""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Optional, Sequence, Union

from .base import RankAssignmentCtx

KeyOrFn = Union[str, Callable[[int, int], Any]]


def _is_str(value: object) -> bool:
    return isinstance(value, str)


class EnvKey:
    """Key function: the value of environment variable ``name`` on each rank.

    A rank without the variable uses ``default``; with ``default=None`` it
    raises ``ValueError`` naming the variable and the rank.
    """

    def __init__(self, name: str, default: Optional[str] = None):
        if not _is_str(name) or not name:
            raise ValueError(f"EnvKey name={name!r}: expected a non-empty str")
        if default is not None and not _is_str(default):
            raise ValueError(f"EnvKey default={default!r}: expected a str or None")
        self.name = name
        self.default = default

    def __call__(self, initial_rank: int, initial_world_size: int) -> str:
        value = os.environ.get(self.name, self.default)
        if value is None:
            raise ValueError(
                f"EnvKey: environment variable {self.name} is not set on initial rank {initial_rank} "
                f"and no default was given"
            )
        return value

    def __repr__(self) -> str:
        return f"EnvKey({self.name!r}, default={self.default!r})"


class HostnameKey:
    """Key function: the host name of each rank (``socket.gethostname()``)."""

    def __call__(self, initial_rank: int, initial_world_size: int) -> str:
        return socket.gethostname()

    def __repr__(self) -> str:
        return "HostnameKey()"


def check_key_or_fn(key_or_fn: Any, name: str) -> None:
    if isinstance(key_or_fn, str):
        return
    if not callable(key_or_fn):
        raise ValueError(
            f"{name}={key_or_fn!r} ({type(key_or_fn).__name__}): expected a str (the same key on every rank) "
            f"or a callable (initial_rank, initial_world_size) -> str, e.g. EnvKey('SLURM_NODEID')"
        )


def evaluate_key(key_or_fn: KeyOrFn, initial_rank: int, initial_world_size: int) -> str:
    if isinstance(key_or_fn, str):
        return key_or_fn
    value = key_or_fn(initial_rank, initial_world_size)
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    raise ValueError(
        f"key_or_fn {key_or_fn!r} returned {value!r} ({type(value).__name__}) on initial rank {initial_rank}: "
        f"expected a str (or an int)"
    )


def check_keys(keys: Sequence[Any], width: int, owner: Any, world_size: int) -> None:
    if len(keys) != world_size:
        raise ValueError(f"{owner!r}: keys of {len(keys)} ranks for a job of {world_size} ranks")
    for r, k in enumerate(keys):
        if not isinstance(k, tuple) or len(k) != width or not all(isinstance(x, str) for x in k):
            raise ValueError(f"{owner!r}: initial rank {r} has keys {k!r}, expected a tuple of {width} str")


def topology_keys(ctx: RankAssignmentCtx, owner: Any) -> list[tuple[str, ...]]:
    try:
        return ctx.topology.keys(owner)
    except KeyError:
        raise ValueError(
            f"{owner!r}: ctx.topology has no keys for it; they are gathered at the initial barrier "
            f"by inprocess.Wrapper from local_keys()"
        ) from None
